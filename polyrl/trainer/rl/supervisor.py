"""Restarting the rollout replicas a run started when one of them dies.

A :class:`ReplicaSupervisor` holds one handle per replica the trainer started: a
:class:`LocalReplica` (a :class:`~polyrl.rollout.launcher.ServerProcess` child of this process)
or a :class:`RayReplica` (the server of one rank of the
:class:`~polyrl.workers.rollout_replica.RolloutReplicaWorker` group, which restarts it on its
node). It only tells which replicas are dead and restarts them, within a budget of restarts per
replica and a time bound per restart; bringing a restarted replica to the current weights and
putting it back in rotation is :class:`~polyrl.trainer.rl.generation.Replicas`' part. Replicas
named by ``rollout.urls`` are not the run's own: nothing restarts them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from polyrl.core.process import plain_log_lines

__all__ = [
    "LocalReplica",
    "RayReplica",
    "ReplicaLostError",
    "ReplicaSupervisor",
    "describe_failure",
]


class ReplicaLostError(RuntimeError):
    """A replica died and could not be brought back (restart budget spent, failed, too slow).

    Attributes:
        url: the replica's URL when it was lost.
        log_tail: the end of its server log.
    """

    def __init__(self, url: str, reason: str, log_tail: str = "") -> None:
        message = f"rollout replica {url} lost: {reason}"
        if log_tail:
            message += f"; its log ends with:\n{log_tail}"
        super().__init__(message)
        self.url = url
        self.reason = reason
        self.log_tail = log_tail

    def __reduce__(self):
        # Rebuilt from its fields: a rollout producer process sends it to the trainer as itself.
        return (type(self), (self.url, self.reason, self.log_tail))


def describe_failure(error: BaseException) -> str:
    """Put a worker's death into one line: which worker, during which call, what was seen.

    For a :class:`~polyrl.controller.WorkerDiedError` (an engine or reward-model rank: its
    call label names the role; its pid, node and last log lines when known) or a
    :class:`ReplicaLostError` (the replica's URL and the last lines of its log, folded into
    the line, colour codes dropped), a :class:`~polyrl.reward.pool.RewardWorkerDiedError` (its
    own line); anything else by its type and first line.
    """
    from polyrl.controller import WorkerDiedError
    from polyrl.reward.pool import RewardWorkerDiedError

    if isinstance(error, WorkerDiedError):
        where = f" ({error.where})" if error.where else ""
        during = f" during {error.method}" if error.method else ""
        reason = " ".join(str(error.reason).split())
        return f"worker rank {error.rank}{where} died{during} ({reason})" + _log_clause(
            error.log_tail
        )
    if isinstance(error, ReplicaLostError):
        reason = " ".join(str(error).split("; its log ends with:")[0].split())
        return reason + _log_clause(error.log_tail)
    text = " ".join(str(error).split())
    if isinstance(error, RewardWorkerDiedError):
        return text
    return f"{type(error).__name__}: {text}"


def _log_clause(log_tail: str) -> str:
    """``; its log ends: a | b | c``: a log's last three lines, on the message's one line."""
    lines = [line.strip()[:200] for line in plain_log_lines(log_tail)[-3:]]
    return f"; its log ends: {' | '.join(lines)}" if lines else "; its log is empty"


class ReplicaHandle(Protocol):
    """What the supervisor needs of one replica."""

    url: str

    def alive(self) -> bool:
        """Whether its server process runs."""

    def restart(self, timeout: float) -> str:
        """Start its server again (same options and environment); return the new URL."""

    def log_tail(self) -> str:
        """Return the end of its server log."""


class LocalReplica:
    """A replica running as a child process of this one."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.url = str(process.url)

    def alive(self) -> bool:
        """Whether the child runs."""
        return bool(self.process.alive)

    def restart(self, timeout: float) -> str:
        """Start the child again (new port); return its URL."""
        self.url = self.process.restart(timeout)
        return self.url

    def log_tail(self) -> str:
        """Return the end of the child's log."""
        return str(self.process.log_tail(2000))


class RayReplica:
    """A replica whose server runs under rank ``rank`` of a Ray rollout worker group.

    Every call goes to that rank alone, so one dead rank leaves the other replicas' handles
    working. A restart of a rank whose actor died (killed, out of memory, its node lost)
    first starts a new actor in the rank's bundle (:meth:`WorkerGroup.replace_rank
    <polyrl.controller.WorkerGroup.replace_rank>`), then its server there.

    Args:
        group: the rollout worker group.
        rank: the rank that runs the server.
        url: the server's URL.
        plan: the :class:`~polyrl.workers.rollout_replica.ReplicaPlan` the server was started
            with (``None``: the rank's actor cannot be recreated).
        ping_s: seconds the rank's actor may take to answer a health check.
        recreate: recreate the rank's actor when it died; ``False`` (``trainer.max_restarts=0``:
            recover no dead worker): its restart raises :class:`ReplicaLostError` instead.
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        url: str,
        plan: Any = None,
        ping_s: float = 10.0,
        recreate: bool = True,
    ) -> None:
        self.group = group
        self.rank = rank
        self.url = url
        self.plan = plan
        self.ping_s = ping_s
        self.recreate = recreate
        #: Times the rank's actor was recreated (a subset of the supervisor's restarts).
        self.recreated = 0

    def _state(self) -> dict[str, Any]:
        state = self.group.call_rank(self.rank, "server_state", timeout=self.ping_s)
        return state or {}

    def alive(self) -> bool:
        """Whether the rank's server runs (a rank that is gone counts as dead too)."""
        try:
            return bool(self._state().get("alive"))
        except Exception:  # noqa: BLE001 - the actor itself is gone, or hangs
            return False

    def restart(self, timeout: float) -> str:
        """Start the rank's server again (in a new actor if the old one died); return its URL.

        Raises:
            ReplicaLostError: the rank's actor died and may not be recreated (``recreate``).
        """
        if self.plan is not None and not self.group.rank_alive(self.rank, self.ping_s):
            if not self.recreate:
                info = self.group.worker_info[self.rank]
                raise ReplicaLostError(
                    self.url,
                    f"its Ray actor (rollout rank {self.rank}, pid {info.pid} on node "
                    f"{info.node_ip}) died, and trainer.max_restarts=0 recreates no dead worker",
                    self.group.log_tail(self.rank),
                )
            url = self._recreate(timeout)
        else:
            url = self.group.call_rank(
                self.rank, "restart_server", [self.rank], timeout, timeout=timeout + 30.0
            )
        if not url:
            raise RuntimeError(f"rank {self.rank} of the rollout group has no server to restart")
        self.url = str(url)
        return self.url

    def _recreate(self, timeout: float) -> str:
        """Replace the rank's dead actor and start the server in the new one; return its URL."""
        import dataclasses

        self.group.replace_rank(self.rank, timeout)
        self.recreated += 1
        # The bundle's node may have changed (Ray moves the bundles of a lost node): bind the
        # new actor's address. A replica of one rank serves on that rank's GPUs, which Ray may
        # have renumbered; one of several ranks keeps its plan's (the other ranks still hold
        # them).
        where = self.group.call_rank(self.rank, "placement", timeout=timeout)
        plan = dataclasses.replace(self.plan, node_id=where["node_id"], host=where["node_ip"])
        if len(self.plan.gpus) == len(where["gpus"]):
            plan = dataclasses.replace(plan, gpus=tuple(where["gpus"]))
        self.plan = plan
        return self.group.call_rank(self.rank, "start_server", [plan], timeout=timeout)

    def log_tail(self) -> str:
        """Return the end of the rank's server log."""
        try:
            return str(self._state().get("log_tail") or "")
        except Exception as exc:  # noqa: BLE001
            return f"(no log: {type(exc).__name__}: {exc})"


class ReplicaSupervisor:
    """Finds dead replicas and restarts them, within a budget.

    A replica is dead when its server process is not running, or when it runs but has not
    answered ``/health`` for ``unresponsive_s`` seconds (hung: its restart kills it first).

    Args:
        handles: one handle per replica (:class:`LocalReplica` or :class:`RayReplica`).
        restart_timeout_s: seconds one restart may take (``rollout.restart_timeout_s``).
        max_restarts: restarts allowed per replica (``rollout.max_replica_restarts``).
        unresponsive_s: seconds without an answer to ``/health`` after which a running
            replica counts as dead.
    """

    def __init__(
        self,
        handles: Sequence[Any],
        restart_timeout_s: float = 300.0,
        max_restarts: int = 3,
        unresponsive_s: float = 120.0,
    ) -> None:
        self.handles = list(handles)
        self.restart_timeout_s = restart_timeout_s
        self.max_restarts = max_restarts
        self.unresponsive_s = unresponsive_s
        self.restarts = 0
        self._counts = [0] * len(self.handles)
        self._silent_since: dict[int, float] = {}  # handle index -> first failed /health

    @property
    def recreated(self) -> int:
        """Replica actors recreated since the start (restarts whose actor had died)."""
        return sum(int(getattr(h, "recreated", 0)) for h in self.handles)

    @property
    def urls(self) -> list[str]:
        """The replicas' current URLs."""
        return [h.url for h in self.handles]

    def dead(self, grace_s: float = 0.0) -> list[Any]:
        """Return the handles whose server is not running; wait up to ``grace_s`` for one to die.

        The grace covers a replica whose connection just failed but whose process has not
        been reaped yet.
        """
        deadline = time.monotonic() + grace_s
        while True:
            found = [h for h in self.handles if not h.alive()]
            if found or time.monotonic() >= deadline:
                return found or self._hung()
            time.sleep(0.05)

    def _hung(self) -> list[Any]:
        """Return the running replicas that have not answered ``/health`` for too long."""
        hung = []
        now = time.monotonic()
        probe = min(5.0, max(self.unresponsive_s / 2, 0.5))
        for index, handle in enumerate(self.handles):
            try:
                httpx.get(f"{handle.url}/health", timeout=probe).raise_for_status()
            except httpx.HTTPError:
                since = self._silent_since.setdefault(index, now)
                if now - since >= self.unresponsive_s:
                    hung.append(handle)
                continue
            self._silent_since.pop(index, None)
        return hung

    def restart(self, handle: Any) -> tuple[str, str]:
        """Restart ``handle``'s replica; return its old and new URL.

        Raises:
            ReplicaLostError: its restarts are spent, or the restart failed or took longer than
                ``restart_timeout_s`` (the message has the URL and the log tail).
        """
        index = self.handles.index(handle)
        old = handle.url
        if self._counts[index] >= self.max_restarts:
            raise ReplicaLostError(
                old,
                f"it died again after {self._counts[index]} restart(s) "
                "(rollout.max_replica_restarts)",
                handle.log_tail(),
            )
        self._counts[index] += 1
        self.restarts += 1
        self._silent_since.pop(index, None)
        try:
            new = handle.restart(self.restart_timeout_s)
        except ReplicaLostError:
            raise  # it says why itself
        except Exception as exc:
            raise ReplicaLostError(
                old,
                f"restart {self._counts[index]} failed within rollout.restart_timeout_s="
                f"{self.restart_timeout_s:g}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                handle.log_tail(),
            ) from exc
        return old, new
