"""A replay buffer of generated prompt groups, between asynchronous rollout and training.

In asynchronous RL the rollout runs ahead of the trainer: prompt groups (one prompt and its
``n`` responses) are *reserved* when their prompts are drawn, *filled* when generated and
scored, and *taken* by the trainer in batches. Every entry keeps what its generation needs to
be redone (``payload``: the prompt's index and seed), so the buffer's state is enough to resume
a run killed at any point without losing or repeating a group: filled entries come back as they
were, unfilled ones are generated again from their payload.

Which filled entries a batch takes is the *replay sampler*'s choice (registry
:data:`REPLAY_SAMPLERS`):

* ``fifo`` (default): strictly in reservation order; a batch waits for its oldest entries even
  when younger ones are ready. With the rollout's staleness gate this is what bounds the
  staleness of every trained sample (see :mod:`polyrl.trainer.rl.asynchronous`).
* ``freshest``: the entries generated with the newest weights first.
* ``reward_variance``: the groups whose rewards vary most first (they carry the most signal for
  group-relative estimators).

Whatever the sampler, an entry that would exceed ``max_staleness`` is dropped (counted in
``dropped_stale``, never silently), and one that is at the bound is taken before any other. An
entry is trained ``max_reuse`` times at most; a reused entry goes to the back of the order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polyrl.core.registry import Registry

__all__ = [
    "REPLAY_SAMPLERS",
    "BufferClosedError",
    "ReplayBuffer",
    "ReplayEntry",
    "register_replay_sampler",
]


@dataclasses.dataclass
class ReplayEntry:
    """One prompt group in the buffer.

    Attributes:
        serial: reservation number (0, 1, ...): the order the groups were drawn in.
        payload: what regenerates the group (e.g. ``{"index": prompt index, "seed": seed}``).
        item: the generated group (``None`` until filled).
        version: the oldest weight version any of its tokens was generated with.
        score_std: the standard deviation of its rewards (for ``reward_variance``).
        uses: how many times a batch took it.
        order: its place in the sampling order (the serial, then later when reused).
    """

    serial: int
    payload: dict[str, Any]
    item: Any = None
    version: int | None = None
    score_std: float = 0.0
    uses: int = 0
    order: int = 0

    @property
    def filled(self) -> bool:
        """Whether the group has been generated."""
        return self.version is not None


#: A replay sampler orders the filled, eligible entries: the batch takes the first ``count``.
ReplaySampler = Callable[[list[ReplayEntry]], list[ReplayEntry]]

REPLAY_SAMPLERS: Registry[ReplaySampler] = Registry("replay sampler")


def register_replay_sampler(name: str) -> Callable[[ReplaySampler], ReplaySampler]:
    """Register a replay sampler (a function ordering filled entries) as ``name``."""
    return REPLAY_SAMPLERS.register(name)


@register_replay_sampler("fifo")
def _fifo(entries: list[ReplayEntry]) -> list[ReplayEntry]:
    return sorted(entries, key=lambda e: e.order)


@register_replay_sampler("freshest")
def _freshest(entries: list[ReplayEntry]) -> list[ReplayEntry]:
    return sorted(entries, key=lambda e: (-(e.version or 0), e.order))


@register_replay_sampler("reward_variance")
def _reward_variance(entries: list[ReplayEntry]) -> list[ReplayEntry]:
    return sorted(entries, key=lambda e: (-e.score_std, e.order))


def _fields(entry: ReplayEntry) -> dict[str, Any]:
    return {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}


class BufferClosedError(RuntimeError):
    """The buffer was closed (the run is ending, or its producer failed) while waiting on it."""


class ReplayBuffer:
    """Prompt groups from reservation to training; thread-safe.

    Args:
        max_staleness: the most weight versions a trained group may be behind the trainer
            (``None``: unbounded).
        sampling: a registered replay sampler (``fifo``, ``freshest``, ``reward_variance``).
        max_reuse: how many times one group may be trained (1: once).
        capacity: the most unconsumed groups (reserved or filled) at once; 0 is unbounded.
    """

    def __init__(
        self,
        max_staleness: int | None = None,
        sampling: str = "fifo",
        max_reuse: int = 1,
        capacity: int = 0,
    ) -> None:
        if max_reuse < 1:
            raise ValueError(f"max_reuse must be >= 1, got {max_reuse}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.sampler = REPLAY_SAMPLERS.get(sampling)
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.capacity = capacity
        self._entries: dict[int, ReplayEntry] = {}
        self._next_serial = 0
        self._next_order = 0
        self.dropped_stale = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------ producer side
    @property
    def lock(self) -> threading.Condition:
        """The buffer's lock (hold it to reserve and record a sampler's state atomically)."""
        return self._cond

    @property
    def next_serial(self) -> int:
        """The serial the next reservation gets (= groups reserved so far)."""
        return self._next_serial

    def has_room(self, count: int) -> bool:
        """Whether ``count`` more groups fit under ``capacity``."""
        with self._cond:
            return not self.capacity or len(self._entries) + count <= self.capacity

    def reserve(self, payloads: Sequence[Mapping[str, Any]]) -> list[int]:
        """Reserve one entry per payload, in order; return their serials."""
        with self._cond:
            serials = []
            for payload in payloads:
                serial = self._next_serial
                self._next_serial += 1
                self._entries[serial] = ReplayEntry(serial, dict(payload), order=self._order())
                serials.append(serial)
            return serials

    def _order(self) -> int:
        self._next_order += 1
        return self._next_order - 1

    def fill(self, serial: int, item: Any, version: int, score_std: float = 0.0) -> None:
        """Store the generated group of reservation ``serial``.

        Raises:
            KeyError: ``serial`` is not reserved, or was filled already.
        """
        with self._cond:
            entry = self._entries.get(serial)
            if entry is None or entry.filled:
                state = "filled already" if entry is not None else "not reserved"
                raise KeyError(f"replay entry {serial} is {state}")
            entry.item, entry.version, entry.score_std = item, int(version), float(score_std)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record the producer's failure: every waiter (and later :meth:`take`) raises it."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with :class:`BufferClosedError` (the run is ending)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def payload(self, serial: int) -> dict[str, Any]:
        """Return a copy of the payload of entry ``serial``."""
        with self._cond:
            return dict(self._entries[serial].payload)

    def unfilled(self) -> list[tuple[int, dict[str, Any]]]:
        """Return ``(serial, payload)`` of every entry not filled yet, in serial order."""
        with self._cond:
            return [(s, dict(e.payload)) for s, e in sorted(self._entries.items()) if not e.filled]

    # ------------------------------------------------------------------ consumer side
    def _raise_if_done(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the rollout feeding the replay buffer failed: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._closed:
            raise BufferClosedError("the replay buffer was closed")

    def wait_filled(self, upto_serial: int, timeout: float | None = None) -> None:
        """Block until every entry with a serial below ``upto_serial`` was filled.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def done() -> bool:
            return self._next_serial >= upto_serial and all(
                e.filled for s, e in self._entries.items() if s < upto_serial
            )

        with self._cond:
            while not done():
                self._raise_if_done()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"replay entries below {upto_serial} not filled in time")
                self._cond.wait(left if left is not None else 1.0)

    def _expire(self, trainer_version: int) -> None:
        if self.max_staleness is None:
            return
        for serial, entry in list(self._entries.items()):
            if entry.filled and trainer_version - int(entry.version or 0) > self.max_staleness:
                del self._entries[serial]
                self.dropped_stale += 1

    def _choose(self, count: int, trainer_version: int) -> list[ReplayEntry] | None:
        """Return the entries a batch of ``count`` takes now (``None``: it must wait)."""
        self._expire(trainer_version)
        if self.sampling == "fifo":
            head = sorted(self._entries.values(), key=lambda e: e.order)[:count]
            if len(head) < count or not all(e.filled for e in head):
                return None
            return head
        ready = [e for e in self._entries.values() if e.filled]
        if len(ready) < count:
            return None
        bound = self.max_staleness
        due = [e for e in ready if bound is not None and trainer_version - e.version >= bound]
        rest = [e for e in ready if e not in due]
        return (self.sampler(due) + self.sampler(rest))[:count]

    def take(
        self, count: int, trainer_version: int, timeout: float | None = None
    ) -> list[ReplayEntry]:
        """Take ``count`` filled groups for a batch trained at ``trainer_version``.

        Blocks until the sampler can choose them. A taken entry leaves the buffer, unless it
        may be reused, in which case it goes to the back of the order.

        Raises:
            RuntimeError: the producer failed (its error is the cause).
            BufferClosedError: the buffer was closed.
            TimeoutError: not within ``timeout`` seconds.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_done()
                chosen = self._choose(count, trainer_version)
                if chosen is not None:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{count} replay entries not ready in {timeout} s")
                self._cond.wait(left if left is not None else 1.0)
            taken = [dataclasses.replace(e, uses=e.uses + 1) for e in chosen]
            for entry in chosen:
                entry.uses += 1
                if entry.uses >= self.max_reuse:
                    del self._entries[entry.serial]
                else:
                    entry.order = self._order()
            self._cond.notify_all()
            return taken

    # ------------------------------------------------------------------ inspection and state
    def counts(self) -> dict[str, int]:
        """``reserved`` (not filled), ``ready`` (filled) and ``dropped_stale`` (since the start)."""
        with self._cond:
            ready = sum(e.filled for e in self._entries.values())
            return {
                "reserved": len(self._entries) - ready,
                "ready": ready,
                "dropped_stale": self.dropped_stale,
            }

    def state_dict(self) -> dict[str, Any]:
        """Everything the buffer holds, to save in a checkpoint (items included)."""
        with self._cond:
            return {
                # Field by field, not dataclasses.asdict: that deep-copies every generated
                # group, and the checkpoint's own serialization copies them once already.
                "entries": [_fields(e) for e in self._entries.values()],
                "next_serial": self._next_serial,
                "next_order": self._next_order,
                "dropped_stale": self.dropped_stale,
                "settings": self._settings(),
            }

    def _settings(self) -> dict[str, Any]:
        return {"sampling": self.sampling, "max_reuse": self.max_reuse}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; unfilled entries are to be generated again.

        Raises:
            ValueError: the state is incomplete or was saved with another sampling or reuse.
        """
        missing = [
            k for k in ("entries", "next_serial", "next_order", "settings") if k not in state
        ]
        if missing:
            raise ValueError(f"replay buffer state is missing {missing}")
        if dict(state["settings"]) != self._settings():
            raise ValueError(
                f"replay buffer state saved with {dict(state['settings'])}, "
                f"this run has {self._settings()}"
            )
        with self._cond:
            self._entries = {}
            for raw in state["entries"]:
                entry = ReplayEntry(**raw)
                self._entries[entry.serial] = entry
            self._next_serial = int(state["next_serial"])
            self._next_order = int(state["next_order"])
            self.dropped_stale = int(state.get("dropped_stale", 0))
