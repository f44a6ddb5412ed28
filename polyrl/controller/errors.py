"""Exceptions raised by the single controller.

Every failure that happens on a worker comes back to the driver as one of these, carrying the
rank, the method name and (for exceptions raised by user code) the remote traceback, so a crash
in any rank of any group reads like a local one.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ControllerError",
    "DispatchError",
    "ResourcePoolError",
    "WorkerDiedError",
    "WorkerError",
]


class ControllerError(RuntimeError):
    """Base class of every error raised by :mod:`polyrl.controller`."""


class DispatchError(ControllerError, ValueError):
    """Arguments of a worker-group call cannot be dispatched or its results cannot be collected."""


class ResourcePoolError(ControllerError):
    """A resource pool could not be created or placed on the cluster."""


class WorkerError(ControllerError):
    """A worker method raised: carries where it happened and the remote traceback.

    Attributes:
        rank: global rank (in its worker group) of the worker that raised.
        method: the method name, role-qualified for colocated groups (``"actor.update"``).
        exc_type: the name of the original exception class (``"ValueError"``).
        exc_message: ``str()`` of the original exception.
        remote_traceback: the formatted traceback from the worker process.
        pid: process id of the worker, ``None`` when unknown.
        node_id: cluster node of the worker, ``None`` when unknown.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        exc_type: str,
        exc_message: str,
        remote_traceback: str,
        pid: int | None = None,
        node_id: str | None = None,
    ) -> None:
        self.rank = rank
        self.method = method
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.pid = pid
        self.node_id = node_id
        where = f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
        text = (
            f"{method} failed on {where}: {exc_type}: {exc_message}\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        )
        super().__init__(text)

    def __reduce__(self) -> tuple[type[WorkerError], tuple[object, ...]]:
        return (
            type(self),
            (
                self.rank,
                self.method,
                self.exc_type,
                self.exc_message,
                self.remote_traceback,
                self.pid,
                self.node_id,
            ),
        )


class WorkerDiedError(ControllerError):
    """A worker process died or stopped answering health checks.

    Attributes:
        rank: global rank of the dead or unresponsive worker.
        method: the call that was waiting on it (``None`` for a health check outside a call).
        reason: what was observed (process exit, no answer within the timeout, ...).
        pid: its process id, ``None`` when unknown.
        node_id: the cluster node it ran on (Ray's node id), ``None`` when unknown.
        node_ip: that node's address, ``None`` when unknown.
        log_tail: the last lines of its own log (``""`` when none could be read).
    """

    def __init__(
        self,
        rank: int,
        method: str | None,
        reason: str,
        *,
        pid: int | None = None,
        node_id: str | None = None,
        node_ip: str | None = None,
        log_tail: str = "",
    ) -> None:
        self.rank = rank
        self.method = method
        self.reason = reason
        self.pid = pid
        self.node_id = node_id
        self.node_ip = node_ip
        self.log_tail = log_tail
        during = f" during {method}" if method else ""
        super().__init__(f"worker rank {rank} is dead or unresponsive{during}: {reason}")

    @property
    def where(self) -> str:
        """``pid P on node IP (id ...)``, as much of it as is known (``""`` for nothing)."""
        parts = [f"pid {self.pid}"] if self.pid is not None else []
        if self.node_ip or self.node_id:
            node = self.node_ip or ""
            if self.node_id:
                node += f" (id {self.node_id[:12]})" if node else f"id {self.node_id[:12]}"
            parts.append(f"node {node}")
        return " on ".join(parts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_died,
            (
                type(self),
                (self.rank, self.method, self.reason),
                {
                    "pid": self.pid,
                    "node_id": self.node_id,
                    "node_ip": self.node_ip,
                    "log_tail": self.log_tail,
                },
            ),
        )


def _rebuild_died(
    cls: type[WorkerDiedError], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> WorkerDiedError:
    return cls(*args, **kwargs)
