"""A pool of reward worker processes that scores items with a time limit on each.

:class:`ScoringPool` keeps ``num_workers`` long-lived processes running
:func:`~polyrl.reward._worker.worker_main` and hands them the items of a batch in chunks. A
worker answers each item as soon as it is done, so every item is timed on its own: one that
takes longer than ``timeout_s`` gets a ``"timeout"`` outcome and its worker is killed (with
the processes its scorer started) and replaced; a worker that dies gives its current item an
``"error"`` outcome and is replaced; the rest of its chunk goes back to the queue. A hang
therefore costs one item, not the batch or the run.

A worker can also die of something that is not its item's fault: killed from outside (the
out-of-memory killer, an operator, a chaos test). So the item a worker died on is scored again,
once, by its replacement; only when that one dies on it too is the outcome ``"error"`` (the
scorer takes its process down). After such a double death the batch's later deaths are not
retried, so a scorer that kills every process it runs in costs one extra start per batch.
:attr:`ScoringPool.deaths` counts the workers that died. With ``rescore_after_death=False`` (an
RL run with ``trainer.max_restarts=0``: recover from nothing) a worker that dies while scoring
raises :class:`RewardWorkerDiedError` instead.

A scorer that hangs on every item would still cost one timeout per item. When the first items
tried in a batch (one per worker, at least two) all time out and none has finished, the scorer
is taken to be hung: the batch's other items are marked as timeouts without being tried, so
such a batch costs about one ``timeout_s``.

The pipe protocol (one duplex pipe per worker). Pool to worker: ``("score", [items])``,
``("scorers", {name: payload})``, ``("stop",)``. Worker to pool: ``("ready",)`` or
``("init_error", message)`` once, then ``("result", index, status, score, extras, message)``
per item, in the chunk's order.
"""

from __future__ import annotations

import ast
import collections
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from polyrl.reward._worker import Item, Outcome, Payload, worker_main

__all__ = ["RewardWorkerDiedError", "ScoringPool"]

#: Start-up failures in a row after which the pool gives up (a scorer that cannot load).
_MAX_BOOT_FAILURES = 3
#: Timed-out items, with none finished, after which a batch's scorer is deemed hung (at
#: least this many, and at least one per worker).
_MIN_HUNG_ITEMS = 2
#: Most items sent to a worker at a time when no chunk size is given.
_MAX_CHUNK = 32


class RewardWorkerDiedError(RuntimeError):
    """A reward worker process died while scoring, and the pool was told not to recover.

    Raised by :meth:`ScoringPool.run` with ``rescore_after_death=False``; its message is one
    line naming the process, how it ended and the sample it was scoring.

    Attributes:
        pid: the dead worker's process id.
        exitcode: its exit code (negative: the signal that ended it).
    """

    def __init__(self, pid: int | None, exitcode: int | None, sample: Any) -> None:
        if exitcode is not None and exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        else:
            how = f"exit code {exitcode}"
        super().__init__(
            f"reward worker process (pid {pid}) died ({how}) while scoring sample {sample}"
        )
        self.pid = pid
        self.exitcode = exitcode
        self.sample = sample

    def __reduce__(self) -> tuple[Any, ...]:
        # The constructor's arguments, not the message, so that it survives pickling.
        return (type(self), (self.pid, self.exitcode, self.sample))


class _Worker:
    """Book-keeping for one worker process."""

    def __init__(self, proc: Any, conn: Connection, boot_deadline: float):
        self.proc = proc
        self.conn = conn
        self.ready = False
        self.boot_deadline = boot_deadline
        #: The items it is scoring (``None`` when idle) and the position of the current one.
        self.chunk: list[Item] | None = None
        self.pos = 0
        #: When the current item's time is up.
        self.deadline = math.inf

    def kill(self) -> None:
        pid = self.proc.pid
        if pid is not None and hasattr(os, "killpg"):
            # The worker leads its own process group (see worker_main): this also ends
            # processes its scorer started. Before it has set that up, no such group exists.
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _stop_workers(workers: list[_Worker | None]) -> None:
    """Ask every worker to stop, then kill the ones that have not (the pool's finalizer)."""
    for w in workers:
        if w is None:
            continue
        try:
            w.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for w in workers:
        if w is None:
            continue
        w.proc.join(timeout=2)
        w.kill()
    workers.clear()


class _Progress:
    """The state of one :meth:`ScoringPool.run`: outcomes so far and the chunks still queued."""

    def __init__(self, items: Sequence[Item], chunk_size: int):
        n = len(items)
        self.outcomes: list[Outcome | None] = [None] * n
        self.position = {item[0]: p for p, item in enumerate(items)}
        self.pending: collections.deque[list[Item]] = collections.deque(
            list(items[i : i + chunk_size]) for i in range(0, n, chunk_size)
        )
        self.remaining = n
        #: Items that timed out, and items that ended any other way, so far.
        self.timed_out = 0
        self.finished = 0
        #: Indices of the items whose worker died on them once and that are being tried again.
        self.retried: set[Any] = set()
        #: A retried item's worker died too: this run's later deaths are the scorer's doing.
        self.scorer_kills = False


def _unguarded_main_line() -> int | None:
    """Return the running line of the ``__main__`` script if it is outside a main guard.

    The guard is an ``if __name__ == "__main__":`` block; ``None`` when the line is inside
    one, or when the pool is not being made from the script's top level.

    ``spawn`` and ``forkserver`` start each worker by importing the parent's ``__main__``
    script again; a script that trains at its top level would train again in every worker,
    whose start then fails. ``None`` too when ``__main__`` is no file (an interactive session,
    ``python -c``) or its source cannot be read: then nothing is re-imported, or nothing is
    known.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or main.__name__ != "__main__":
        return None  # no script, or already the re-imported copy in a worker (``__mp_main__``)
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None:
        return None  # called from a function the script defines, not from its top level
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ):
            return None
    return line


class ScoringPool:
    """Worker processes that score items, each within ``timeout_s`` (see the module docstring).

    Args:
        num_workers: Worker processes (at least one); they start booting at once.
        custom: How workers rebuild the custom reward function
            (:func:`~polyrl.reward._worker.make_payload`), or ``None`` to score each item with
            the scorer registered for its ``data_source``.
        timeout_s: Time limit per item in seconds (``None``: unlimited).
        startup_timeout_s: Longest a new worker may take to start before :meth:`run` raises.
        mp_context: How worker processes are started: ``"spawn"`` or ``"forkserver"``.
        chunk_size: Items sent to a worker at a time (default: adaptive, at most 32).
        rescore_after_death: Score the item of a worker that died again on its replacement
            (``True``); ``False``: :meth:`run` raises :class:`RewardWorkerDiedError` instead.

    Raises:
        RuntimeError: when called from the top level of a ``__main__`` script outside an ``if
            __name__ == "__main__":`` block (each worker would run the script again).

    One :meth:`run` at a time: callers that share a pool between threads serialise their
    calls. Call :meth:`close` to stop the workers (they are also stopped when the pool is
    garbage collected). Workers are daemonic processes, so a scorer cannot start
    ``multiprocessing`` children of its own (``subprocess`` works).
    """

    def __init__(
        self,
        num_workers: int,
        custom: Payload | None = None,
        *,
        timeout_s: float | None = 10.0,
        startup_timeout_s: float = 120.0,
        mp_context: str = "spawn",
        chunk_size: int | None = None,
        rescore_after_death: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"a ScoringPool needs at least one worker, got {num_workers}")
        line = _unguarded_main_line()
        if line is not None:
            raise RuntimeError(
                f"{sys.modules['__main__'].__file__}:{line} starts training at the script's "
                'top level: put it under `if __name__ == "__main__":` (reward worker processes '
                f"are started with {mp_context!r}, which imports the script again in each "
                "worker), or set reward.num_workers=0 to score in this process"
            )
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.chunk_size = chunk_size
        self.rescore_after_death = rescore_after_death
        self._custom = custom
        self._scorers: dict[str, Payload] = {}
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker | None] = []
        self._boot_failures = 0
        #: Workers that died (while scoring or starting; not those it killed for a timeout)
        #: since the pool started (the ``recovery/reward_worker_deaths`` metric).
        self.deaths = 0
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._start_worker())

    # ------------------------------------------------------------------ public API

    @property
    def pids(self) -> list[int]:
        """PIDs of the current worker processes (changes when workers are replaced)."""
        return [w.proc.pid for w in self._workers if w is not None]

    @property
    def scorers(self) -> Mapping[str, Payload]:
        """The registered scorers sent to the workers so far, by ``data_source``."""
        return self._scorers

    def add_scorers(self, payloads: Mapping[str, Payload]) -> None:
        """Send registered scorers to every worker, and to the workers started later."""
        if not payloads:
            return
        self._scorers.update(payloads)
        for w in self._workers:
            if w is not None:
                try:
                    w.conn.send(("scorers", dict(payloads)))
                except (OSError, ValueError):
                    pass  # a dead worker is noticed and replaced by the next run

    def run(self, items: Sequence[Item]) -> list[Outcome]:
        """Score ``items``; return one outcome per item, in the order of ``items``.

        A scorer's failure is an outcome, not an exception: ``"timeout"`` for an item over
        ``timeout_s``, ``"error"`` for one whose worker died on it twice (the first death
        retries it on a new worker).

        Raises:
            RewardWorkerDiedError: A worker died while scoring and ``rescore_after_death`` is
                off.
            RuntimeError: If a worker cannot start (its start-up failed, it took longer than
                ``startup_timeout_s``, or workers died while starting several times in a row).
        """
        self._ensure_workers()
        size = self.chunk_size or max(
            1, min(_MAX_CHUNK, math.ceil(len(items) / (self.num_workers * 4)))
        )
        run = _Progress(items, size)
        hung_after = max(_MIN_HUNG_ITEMS, self.num_workers)
        try:
            while run.remaining:
                self._dispatch(run)
                self._wait(run)
                self._expire(run)
                if run.remaining and run.finished == 0 and run.timed_out >= hung_after:
                    self._skip_rest(run)
        except BaseException:
            # A worker still holding a chunk would send stale results later: discard it.
            for slot, worker in enumerate(self._workers):
                if worker is not None and worker.chunk is not None:
                    worker.kill()
                    self._workers[slot] = None
            raise
        return [o for o in run.outcomes if o is not None]

    def close(self) -> None:
        """Stop the worker processes. Idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------ workers

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child_conn, self._custom, dict(self._scorers)),
            daemon=True,
            name="polyrl-reward-worker",
        )
        proc.start()
        child_conn.close()
        return _Worker(proc, parent_conn, time.monotonic() + self.startup_timeout_s)

    def _ensure_workers(self) -> None:
        for i, w in enumerate(self._workers):
            if w is None:
                self._workers[i] = self._start_worker()

    def _replace(self, slot: int, *, booted: bool) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
        if not booted:
            self._boot_failures += 1
            if self._boot_failures > _MAX_BOOT_FAILURES:
                self._workers[slot] = None
                raise RuntimeError(
                    f"reward worker processes died during start-up {self._boot_failures} "
                    "times in a row; see the worker's stderr above"
                )
        self._workers[slot] = self._start_worker()

    def _live(self) -> list[tuple[int, _Worker]]:
        """Return the workers by slot (every slot holds one while a run is under way)."""
        out = []
        for slot, worker in enumerate(self._workers):
            assert worker is not None
            out.append((slot, worker))
        return out

    # ------------------------------------------------------------------ one run

    def _record(self, run: _Progress, worker: _Worker, outcome: Outcome) -> None:
        """Store the outcome of ``worker``'s current item and move it to its next one."""
        assert worker.chunk is not None
        run.outcomes[run.position[worker.chunk[worker.pos][0]]] = outcome
        run.remaining -= 1
        if outcome[0] == "timeout":
            run.timed_out += 1
        else:
            run.finished += 1
        worker.pos += 1
        if worker.pos == len(worker.chunk):
            worker.chunk = None
            worker.deadline = math.inf
        elif self.timeout_s is not None:
            worker.deadline = time.monotonic() + self.timeout_s

    def _fail_current(
        self, run: _Progress, slot: int, status: str, message: str, *, booted: bool
    ) -> None:
        """Give the worker's current item ``status``, requeue the rest, replace the worker."""
        worker = self._workers[slot]
        assert worker is not None
        if worker.chunk is not None:
            rest = worker.chunk[worker.pos + 1 :]
            self._record(run, worker, (status, 0.0, {}, message))
            if rest:
                run.pending.appendleft(rest)
        worker.chunk = None
        self._replace(slot, booted=booted)

    def _drain(self, run: _Progress, slot: int) -> bool:
        """Handle every message waiting from a worker; False if its pipe is closed."""
        worker = self._workers[slot]
        assert worker is not None
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                kind = message[0]
                if kind == "result":
                    _, index, status, score, extras, text = message
                    expected = worker.chunk[worker.pos][0] if worker.chunk else None
                    if index != expected:
                        raise RuntimeError(
                            f"reward worker protocol error: got a result for sample "
                            f"{index}, expected {expected}"
                        )
                    self._record(run, worker, (status, score, extras, text))
                elif kind == "ready":
                    worker.ready = True
                    self._boot_failures = 0
                elif kind == "init_error":
                    worker.kill()
                    self._workers[slot] = None
                    raise RuntimeError(f"a reward worker failed to start:\n{message[1]}")
        except (EOFError, OSError):
            return False
        return True

    def _dispatch(self, run: _Progress) -> None:
        """Give a queued chunk to every ready, idle worker."""
        now = time.monotonic()
        for worker in self._workers:
            if worker is None or not worker.ready or worker.chunk is not None:
                continue
            if not run.pending:
                return
            chunk = run.pending.popleft()
            worker.chunk, worker.pos = chunk, 0
            worker.deadline = now + self.timeout_s if self.timeout_s is not None else math.inf
            try:
                worker.conn.send(("score", chunk))
            except (OSError, ValueError):
                pass  # dead worker: its sentinel fires in _wait

    def _wait(self, run: _Progress) -> None:
        """Wait for a message, a death or the next deadline; handle what happened."""
        waiting: dict[Any, tuple[int, bool]] = {}
        horizon = math.inf
        for slot, worker in self._live():
            waiting[worker.conn] = (slot, False)
            waiting[worker.proc.sentinel] = (slot, True)
            horizon = min(horizon, worker.deadline if worker.ready else worker.boot_deadline)
        timeout = None if horizon == math.inf else max(0.0, horizon - time.monotonic())
        died: set[int] = set()
        for obj in wait(list(waiting), timeout=timeout):
            slot, is_sentinel = waiting[obj]
            if slot in died:
                continue
            if is_sentinel or not self._drain(run, slot):
                died.add(slot)
        for slot in sorted(died):
            worker = self._workers[slot]
            assert worker is not None
            self._drain(run, slot)  # results sent just before dying still count
            worker.proc.join(timeout=5)
            self.deaths += 1
            if worker.chunk is not None and not self.rescore_after_death:
                raise RewardWorkerDiedError(
                    worker.proc.pid, worker.proc.exitcode, worker.chunk[worker.pos][0]
                )
            if worker.chunk is not None and self._retry_current(run, slot):
                continue
            self._fail_current(
                run,
                slot,
                "error",
                f"reward worker process died (exit code {worker.proc.exitcode}) while scoring"
                + (" (on a new worker too)" if run.scorer_kills else ""),
                booted=worker.ready,
            )

    def _retry_current(self, run: _Progress, slot: int) -> bool:
        """Requeue a dead worker's current item and the rest of its chunk; replace it.

        False (nothing done) when the item was retried already or the batch's scorer is known
        to kill its processes; then the item's outcome is an error.
        """
        worker = self._workers[slot]
        assert worker is not None and worker.chunk is not None
        index = worker.chunk[worker.pos][0]
        if index in run.retried:
            run.scorer_kills = True
        if run.scorer_kills:
            return False
        run.retried.add(index)
        run.pending.appendleft(worker.chunk[worker.pos :])
        worker.chunk = None
        self._replace(slot, booted=True)
        return True

    def _expire(self, run: _Progress) -> None:
        """Fail the items whose time is up; raise if a worker has not started in time."""
        now = time.monotonic()
        for slot, worker in self._live():
            if not worker.ready:
                if now >= worker.boot_deadline:
                    raise RuntimeError(
                        f"a reward worker did not start within {self.startup_timeout_s} s "
                        "(startup_timeout_s)"
                    )
                continue
            if worker.chunk is not None and now >= worker.deadline:
                self._drain(run, slot)  # the result may have arrived in the meantime
                if worker.chunk is not None and time.monotonic() >= worker.deadline:
                    self._fail_current(
                        run,
                        slot,
                        "timeout",
                        f"scoring took longer than timeout_s={self.timeout_s}; the worker "
                        "was killed",
                        booted=True,
                    )

    def _skip_rest(self, run: _Progress) -> None:
        """Mark every item not yet scored as a timeout; replace the busy workers."""
        message = (
            f"not scored: the first {run.timed_out} samples tried in this batch all took longer "
            f"than timeout_s={self.timeout_s} and none finished, so the scorer was taken to "
            "be hung and the batch's other samples were skipped"
        )
        skipped: Outcome = ("timeout", 0.0, {}, message)
        for slot, worker in self._live():
            if worker.chunk is None:
                continue
            self._drain(run, slot)  # results that arrived in the meantime still count
            if worker.chunk is None:
                continue
            while worker.chunk is not None:
                self._record(run, worker, skipped)
            self._replace(slot, booted=True)
        while run.pending:
            for item in run.pending.popleft():
                run.outcomes[run.position[item[0]]] = skipped
                run.remaining -= 1
