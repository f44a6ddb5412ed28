"""Futures returned by non-blocking worker-group calls, and the failure-aware wait loop.

A :class:`ControllerFuture` holds one backend *handle* per called rank (a Ray ``ObjectRef`` for
the ``ray`` backend). Passing a future into the next call passes handles, not data:

* a ``DP_COMPUTE`` result (:class:`ShardedFuture`) going into another ``DP_COMPUTE`` call with the
  same data-parallel size hands data-parallel rank ``d``'s output handle to data-parallel rank ``d``
  of the next call -- the data moves worker to worker;
* with a different data-parallel size, a small remote task re-splits the shards (data moves
  through that task, never through the driver);
* a future passed whole (``ONE_TO_ALL``, ``RANK_ZERO``) is collected by a remote task and every
  rank receives a handle to the collected value.

``get()`` waits for every rank while watching health: a rank that raises makes ``get`` raise at
once (the other ranks are not awaited), and a rank whose process died or stopped answering
health checks raises :class:`~polyrl.controller.errors.WorkerDiedError` within the group's
``dead_worker_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.controller.backend import Backend
from polyrl.controller.dispatch import DispatchContext, DispatchMode, resplit_shards, split_batch
from polyrl.controller.errors import DispatchError, WorkerDiedError

__all__ = ["ControllerFuture", "PerRankFuture", "ShardedFuture", "await_handles"]

_MISSING = object()


@dataclass
class Watch:
    """One handle to wait for: the backend that owns it, the rank computing it, a call label."""

    backend: Backend
    rank: int | None
    label: str
    handle: Any


def await_handles(
    watches: Sequence[Watch],
    timeout: float | None = None,
    *,
    health: bool = True,
    hung_after: float | None = None,
) -> list[Any]:
    """Wait for every handle and return their values (in order), failing fast and loudly.

    The first handle that completes with an error raises it (a rank's ``WorkerError``, or a
    ``WorkerDiedError`` for a dead process). While handles are pending, every rank still owing a
    result is pinged each ``health_check_interval_s``; a ping that errors (process gone) or stays
    unanswered for ``dead_worker_timeout_s`` raises ``WorkerDiedError``. ``timeout`` bounds the
    whole wait with ``TimeoutError`` (the calls keep running). ``health=False`` skips the pings
    (for processes still starting, which cannot answer yet). A rank's own result still
    missing ``hung_after`` seconds into the wait raises ``WorkerDiedError`` too: the rank
    answers pings but is stuck in the call.
    """
    if not watches:
        return []
    try:
        return _await_handles(watches, timeout, health, hung_after)
    except WorkerDiedError as exc:
        # Say where the dead rank ran: the backend of the call it was in knows.
        owner = next(
            (w.backend for w in watches if w.rank == exc.rank and w.label == exc.method),
            watches[0].backend,
        )
        raise owner.locate(exc) from exc.__cause__


def _await_handles(
    watches: Sequence[Watch], timeout: float | None, health: bool, hung_after: float | None
) -> list[Any]:
    backend0 = watches[0].backend
    for w in watches:
        if w.backend.kind != backend0.kind:
            raise DispatchError("cannot wait on handles of different backends together")
    start = time.monotonic()
    deadline = None if timeout is None else start + float(timeout)
    interval = min(w.backend.health_check_interval_s for w in watches)
    # Several watches may share a handle (a shard passed to two ranks); wait on each once.
    keys: dict[Any, list[int]] = {}
    for i, w in enumerate(watches):
        keys.setdefault(_key(w.handle), []).append(i)
    pending = dict(keys)
    values: list[Any] = [_MISSING] * len(watches)
    pings: dict[tuple[int, int], tuple[Watch, Any, float]] = {}
    next_round = start + interval
    while pending:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError(
                f"{watches[0].label}: {len(pending)} of {len(keys)} results still pending after "
                f"{timeout}s (the calls keep running)"
            )
        pending_keys = list(pending)
        ping_keys = list(pings)
        handles = [watches[pending[k][0]].handle for k in pending_keys]
        handles += [pings[k][1] for k in ping_keys]
        step = max(0.0, min(next_round - now, interval))
        if deadline is not None:
            step = min(step, max(0.0, deadline - now))
        for j in backend0.wait(handles, step):
            if j < len(pending_keys):
                key = pending_keys[j]
                idxs = pending.pop(key)
                w = watches[idxs[0]]
                value = w.backend.fetch(w.handle, w.rank, w.label)
                for i in idxs:
                    values[i] = value
            else:
                pkey = ping_keys[j - len(pending_keys)]
                pw, ph, _ = pings.pop(pkey)
                pw.backend.check_ping(ph, pw.rank if pw.rank is not None else -1, pw.label)
        now = time.monotonic()
        if hung_after is not None and now - start > hung_after:
            stuck = next(
                (
                    watches[i]
                    for idxs in pending.values()
                    for i in idxs
                    if watches[i].rank is not None
                ),
                None,
            )
            if stuck is not None:
                raise WorkerDiedError(
                    stuck.rank if stuck.rank is not None else -1,
                    stuck.label,
                    f"no result within call_timeout_s={hung_after:g}s although it answers "
                    "health checks (hung in the call)",
                )
        for pw, _, sent in pings.values():
            if now - sent > pw.backend.dead_worker_timeout_s:
                raise WorkerDiedError(
                    pw.rank if pw.rank is not None else -1,
                    pw.label,
                    f"no answer to a health check for {pw.backend.dead_worker_timeout_s:.1f}s "
                    "(process hung or stopped)",
                )
        if health and pending and now >= next_round:
            for idxs in pending.values():
                w = watches[idxs[0]]
                if w.rank is None:
                    continue
                pkey = (id(w.backend), w.rank)
                if pkey not in pings:
                    pings[pkey] = (w, w.backend.ping(w.rank), now)
            next_round = now + interval
    return values


def _key(handle: Any) -> Any:
    try:
        hash(handle)
    except TypeError:
        return ("id", id(handle))
    return handle


def _run_collect(
    mode: DispatchMode, ctx: DispatchContext, keys: list[str], n_state: int, *rest: Any
) -> Any:
    """Remote collect: rebuild the state dict and call the mode's collect (picklable)."""
    state = dict(zip(keys, rest[:n_state], strict=True))
    return mode.collect(ctx, list(rest[n_state:]), state)


class ControllerFuture:
    """The pending result of a non-blocking worker-group call.

    ``get()`` returns what the blocking call would have returned. Pass the future itself (not
    its value) as an argument of the next call to keep the data off the driver.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        label: str,
        ctx: DispatchContext,
        mode: DispatchMode,
        state: dict[str, Any],
        handles: list[Any | None],
        keep: list[bool],
        upstream: list[ControllerFuture],
    ) -> None:
        self._backend = backend
        self._label = label
        self._ctx = DispatchContext(ctx.world_size, ctx.method, ctx.layout)
        self._mode = mode
        self._state = state
        self._handles = handles
        self._keep = keep
        self._upstream = upstream
        self._value: Any = _MISSING
        self._remote_value: Any = _MISSING

    def __repr__(self) -> str:
        status = "done" if self._value is not _MISSING else "pending"
        return f"{type(self).__name__}({self._label!r}, {self._backend.kind}, {status})"

    @property
    def method(self) -> str:
        """The (role-qualified) method this future is the result of."""
        return self._label

    @property
    def backend_kind(self) -> str:
        """``"ray"`` or ``"local"``."""
        return self._backend.kind

    def handles(self) -> list[Any | None]:
        """Raw per-rank handles (``None`` for ranks not called); for inspection and tests."""
        return list(self._handles)

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not); never blocks."""
        if self._value is not _MISSING:
            return True
        live = [h for h in self._handles if h is not None]
        return len(self._backend.wait(live, 0.0)) == len(live)

    def _watches(self) -> tuple[list[Watch], int]:
        """Own handles first (count returned), then state handles and upstream side results."""
        watches = [
            Watch(self._backend, rank, self._label, h)
            for rank, h in enumerate(self._handles)
            if h is not None
        ]
        n_own = len(watches)
        for value in self._state.values():
            if self._backend.is_handle(value):
                watches.append(Watch(self._backend, None, self._label, value))
        seen: set[int] = set()
        stack = list(self._upstream)
        while stack:
            fut = stack.pop()
            if id(fut) in seen or fut._value is not _MISSING:
                continue
            seen.add(id(fut))
            if fut._backend.kind != self._backend.kind:
                continue
            # Results the collect ignores never reach a later call, so an error there would
            # otherwise be lost; they are None on success (dropped on the worker), cheap to read.
            for rank, h in enumerate(fut._handles):
                if h is not None and not fut._keep[rank]:
                    watches.append(Watch(fut._backend, rank, fut._label, h))
            stack.extend(fut._upstream)
        return watches, n_own

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the call and return its collected value (cached after the first call).

        Raises:
            WorkerError: a rank raised; carries rank, method and remote traceback.
            WorkerDiedError: a rank's process died or stopped answering health checks.
            TimeoutError: ``timeout`` seconds passed first (the call keeps running).
        """
        if self._value is not _MISSING:
            return self._value
        watches, n_own = self._watches()
        values = await_handles(watches, timeout, hung_after=self._backend.call_timeout_s)
        own_ranks = [rank for rank, h in enumerate(self._handles) if h is not None]
        results = [values[i] for i, rank in enumerate(own_ranks) if self._keep[rank]]
        state = self._resolved_state(values[n_own:])
        value = self._mode.collect(self._ctx, results, state)
        self._value = value
        self._upstream = []
        return value

    def _resolved_state(self, extra_values: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        j = 0
        for k, v in self._state.items():
            if self._backend.is_handle(v):
                out[k] = extra_values[j]
                j += 1
            else:
                out[k] = v
        return out

    def _kept_handles(self) -> list[Any]:
        return [h for rank, h in enumerate(self._handles) if h is not None and self._keep[rank]]

    def _value_handle(self) -> Any:
        """Return what to pass to a rank in place of the collected value.

        The cached value if the driver already fetched it, else a handle from a remote collect
        (the driver never fetches it for this).
        """
        if self._value is not _MISSING:
            return self._value
        if self._remote_value is _MISSING:
            keys = list(self._state)
            inputs = [self._mode, self._ctx, keys, len(keys)]
            inputs += [self._state[k] for k in keys] + self._kept_handles()
            self._remote_value = self._backend.apply(_run_collect, inputs, 1)[0]
        return self._remote_value


class PerRankFuture(ControllerFuture):
    """Result of a ``ONE_TO_ALL``/``ALL_TO_ALL`` call: one value per rank.

    Passed to an ``ALL_TO_ALL`` call of a group of the same size, rank ``i``'s result goes to rank
    ``i`` directly.
    """

    def _rank_handles(self) -> list[Any]:
        if self._value is not _MISSING:
            return list(self._value)
        if any(h is None for h in self._handles):
            raise DispatchError(f"{self._label}: not every rank was called; no per-rank results")
        return list(self._handles)


class ShardedFuture(ControllerFuture):
    """Result of a ``DP_COMPUTE`` call: one shard per data-parallel rank plus padding info."""

    @property
    def dp_size(self) -> int:
        """Number of shards (data-parallel size of the call that produced it)."""
        return self._ctx.layout.dp_size

    def shard_handles(self) -> list[Any]:
        """Handle of each data-parallel rank's output shard, in data order."""
        return [self._handles[r] for r in self._ctx.layout.collect_rank]

    def _shards_for(self, consumer: DispatchContext, n: int) -> tuple[list[Any], Any]:
        """Per-data-parallel-index inputs for a consumer with ``n`` shards, plus pad info."""
        if self._value is not _MISSING:
            shards, info = split_batch(_require_batch(self._value, consumer.method), n)
            return list(shards), info
        pad_info = self._state["pad_info"]
        if n == self.dp_size:
            return self.shard_handles(), pad_info
        out = consumer.apply_remote(
            resplit_shards, [n, pad_info, self._label, *self.shard_handles()], n + 1
        )
        return out[:n], out[n]


def _require_batch(value: Any, method: str) -> Any:
    from polyrl.core.batch import Batch

    if not isinstance(value, Batch):
        raise DispatchError(
            f"{method}: a DP_COMPUTE future resolved to {type(value).__name__}; only Batch "
            "results can be re-split across data-parallel ranks"
        )
    return value
