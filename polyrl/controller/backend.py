"""The interface both execution backends (``ray`` and ``local``) implement.

A backend owns the rank processes of one worker group and moves calls and results. Results are
*handles* (a Ray ``ObjectRef``, or a ``concurrent.futures.Future`` for the local backend) that
the driver can pass on to the next call without looking inside.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from polyrl.controller.errors import WorkerDiedError
from polyrl.controller.resource_pool import ResourcePool
from polyrl.controller.worker import WorkerInfo, WorkerSpec

__all__ = ["Backend"]


class Backend(ABC):
    """Processes of one worker group plus the primitives the controller builds calls from."""

    kind: ClassVar[str]

    def __init__(
        self,
        group_name: str,
        *,
        dead_worker_timeout_s: float,
        health_check_interval_s: float,
        call_timeout_s: float | None = None,
    ) -> None:
        if dead_worker_timeout_s <= 0 or health_check_interval_s <= 0:
            raise ValueError(
                "dead_worker_timeout_s and health_check_interval_s must be > 0, got "
                f"{dead_worker_timeout_s} and {health_check_interval_s}"
            )
        if call_timeout_s is not None and call_timeout_s < 0:
            raise ValueError(f"call_timeout_s must be >= 0 or None, got {call_timeout_s}")
        self.group_name = group_name
        self.dead_worker_timeout_s = float(dead_worker_timeout_s)
        self.health_check_interval_s = float(health_check_interval_s)
        #: A call whose result is not in this long after the driver started waiting for it is
        #: taken to be hung (``None``: no limit).
        self.call_timeout_s = float(call_timeout_s) if call_timeout_s else None
        self.infos: list[WorkerInfo] = []
        self.alive = False

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.infos)

    @abstractmethod
    def start(
        self,
        roles: dict[str, WorkerSpec],
        pool: ResourcePool,
        *,
        init_distributed: bool,
        dist_timeout_s: float,
        start_timeout_s: float,
    ) -> list[WorkerInfo]:
        """Create the rank processes, join them into a process group and build the roles."""

    @abstractmethod
    def submit(
        self,
        rank: int,
        role: str,
        method: str,
        label: str,
        discard: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Start ``role.method`` on ``rank`` and return a handle to the result.

        Handles among the top-level arguments are resolved on the worker.
        """

    @abstractmethod
    def host_call(self, rank: int, name: str, *args: Any) -> Any:
        """Call a method of the rank's host (not a user method); returns a handle."""

    @abstractmethod
    def put(self, value: Any) -> Any:
        """Store a value once so several ranks can receive it; returns what to pass instead."""

    @abstractmethod
    def apply(self, fn: Callable[..., Any], inputs: Sequence[Any], num_returns: int) -> list[Any]:
        """Run ``fn(*inputs)`` off the driver and return ``num_returns`` handles.

        Handles in ``inputs`` are resolved first; ``fn`` returns a list of ``num_returns`` values
        when that is more than one.
        """

    @abstractmethod
    def is_handle(self, value: Any) -> bool:
        """Whether ``value`` is one of this backend's result handles."""

    @abstractmethod
    def wait(self, handles: Sequence[Any], timeout: float) -> list[int]:
        """Return the indices of ``handles`` complete (success or error) within ``timeout``.

        Never fetches data into the driver.
        """

    @abstractmethod
    def fetch(self, handle: Any, rank: int | None, label: str) -> Any:
        """Return the value behind a complete handle.

        Worker failures raise :class:`~polyrl.controller.errors.WorkerError` or
        :class:`~polyrl.controller.errors.WorkerDiedError`.
        """

    @abstractmethod
    def ping(self, rank: int) -> Any:
        """Send a health check to ``rank``; returns a handle."""

    @abstractmethod
    def check_ping(self, handle: Any, rank: int, label: str | None) -> None:
        """Raise :class:`~polyrl.controller.errors.WorkerDiedError` if a completed ping failed."""

    @abstractmethod
    def pids(self) -> list[int]:
        """Process ids of the ranks."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank process (idempotent)."""

    def log_tail(self, rank: int, max_lines: int = 5) -> str:
        """Return the last lines ``rank``'s process wrote to its own log (``""``: none known).

        Only the ``ray`` backend keeps one per rank; local ranks write to the driver's streams.
        """
        return ""

    def locate(self, error: WorkerDiedError) -> WorkerDiedError:
        """Add where ``error``'s rank ran (pid, node) and its log's last lines, if not known."""
        if error.pid is None and 0 <= error.rank < len(self.infos):
            info = self.infos[error.rank]
            error.pid, error.node_id, error.node_ip = info.pid, info.node_id, info.node_ip
            if not error.log_tail:
                try:
                    error.log_tail = self.log_tail(error.rank)
                except Exception:  # noqa: BLE001 - the message goes out without the tail
                    error.log_tail = ""
        return error

    def replace_rank(self, rank: int, start_timeout_s: float) -> WorkerInfo:
        """Start a fresh process for ``rank`` in its place, built as at the start; return it.

        Only the ``ray`` backend can (a rank of its own in the same bundle).

        Raises:
            ControllerError: the backend cannot replace ranks.
        """
        from polyrl.controller.errors import ControllerError

        raise ControllerError(
            f"group {self.group_name!r}: the {self.kind} backend cannot replace a rank"
        )
