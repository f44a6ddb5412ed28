"""The ``ray`` backend: one Ray actor per rank, placed in the bundles of a resource pool.

Each actor hosts a :class:`~polyrl.controller.worker.WorkerHost`. Calls run in the actor's
default concurrency group (one at a time, in submission order); health checks are served by a
separate ``health`` concurrency group so a rank busy in a long call (or blocked in a collective)
still answers. Results stay in Ray's object store as ``ObjectRef`` handles until someone asks.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from polyrl.controller.backend import Backend
from polyrl.controller.errors import ControllerError, WorkerDiedError, WorkerError
from polyrl.controller.resource_pool import ResourcePool
from polyrl.controller.worker import (
    HostSetup,
    WorkerHost,
    WorkerInfo,
    WorkerSpec,
    driver_import_path,
    extend_import_path,
)
from polyrl.core.plugins import plugin_modules
from polyrl.core.process import plain_log_lines

__all__ = ["RayBackend"]


class _RayHost(WorkerHost):
    """WorkerHost as a Ray actor: ``call`` takes user arguments top-level so Ray resolves refs."""

    def call(self, _polyrl_call: tuple[str, str, str, bool], *args: Any, **kwargs: Any) -> Any:
        role, method, label, discard = _polyrl_call
        return self.execute(role, method, label, discard, args, kwargs)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()


_RayHostActor = ray.remote(concurrency_groups={"health": 1})(_RayHost)


class _HandleSlot:
    """Marks where a resolved handle goes back among a remote op's inputs."""


_SLOT = _HandleSlot()


def _apply(sys_path: tuple[str, ...], blob: bytes, *handle_values: Any) -> Any:
    """Run a pickled ``fn(*inputs)``; handle inputs arrive resolved, top-level, in order.

    The function and plain inputs travel pickled and are loaded only after the driver's import
    path is in place, so functions from driver-side modules (e.g. tests) load here too.
    """
    extend_import_path(sys_path)
    fn, inputs = cloudpickle.loads(blob)
    values = iter(handle_values)
    return fn(*[next(values) if isinstance(x, _HandleSlot) else x for x in inputs])


_apply_remote = ray.remote(num_cpus=0, max_retries=0)(_apply)


def _convert(exc: BaseException, rank: int | None, label: str) -> BaseException:
    """Turn a Ray error into the controller's error for the driver."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, ControllerError):
            return cause
        if isinstance(cause, RayActorError):
            return WorkerDiedError(rank if rank is not None else -1, label, str(cause))
        tb = str(exc)
        return WorkerError(
            rank if rank is not None else -1,
            label,
            type(cause).__qualname__ if cause is not None else "RayTaskError",
            str(cause),
            tb,
            getattr(exc, "pid", None),
            None,
        )
    if isinstance(exc, RayActorError):
        return WorkerDiedError(rank if rank is not None else -1, label, _first_line(str(exc)))
    return exc


#: How much of the end of a rank's log :meth:`RayBackend.log_tail` reads.
_LOG_TAIL_BYTES = 64 * 1024


def _logs_dir() -> Path | None:
    """Return this node's Ray session log folder (``None`` when Ray does not run here)."""
    try:
        node = ray._private.worker._global_node  # no public accessor for the folder
        return Path(node.get_logs_dir_path()) if node is not None else None
    except Exception:  # noqa: BLE001 - a message without a log tail, not a failure
        return None


#: Longest wait for the task that reads a log on another node (a lost node never answers).
_REMOTE_LOG_TIMEOUT_S = 20.0


def _read_log_tail(pid: int, max_lines: int) -> str:
    """Return the last lines of the log of this node's Ray worker ``pid`` (stderr, else stdout).

    Ray's own marker lines (``:actor_name:...``) and colour codes are dropped.
    """
    logs = _logs_dir()
    if logs is None:
        return ""
    for suffix in ("err", "out"):
        lines: list[str] = []
        for path in sorted(logs.glob(f"worker-*-{pid}.{suffix}")):
            with path.open("rb") as f:
                # The end is enough, and a long run's log may be large.
                f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                lines += plain_log_lines(f.read().decode(errors="replace"))
        if lines:
            return "\n".join(lines[-max_lines:])
    return ""


def _remote_log_tail(node_id: str, pid: int, max_lines: int) -> str:
    """:func:`_read_log_tail` run by a task on node ``node_id``, where that log is.

    ``""`` when the node does not answer within ``_REMOTE_LOG_TIMEOUT_S`` (it was lost with
    the worker) or the task fails.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    reader = ray.remote(
        num_cpus=0,  # the run's bundles may hold every CPU of the node
        max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )(_read_log_tail)
    ref = reader.remote(pid, max_lines)
    try:
        return str(ray.get(ref, timeout=_REMOTE_LOG_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - a message without a log tail, not a failure
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
        return ""


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "actor died"


class RayBackend(Backend):
    """Ranks as Ray actors in a placement group."""

    kind = "ray"

    def __init__(self, group_name: str, **kwargs: Any) -> None:
        super().__init__(group_name, **kwargs)
        self.actors: list[Any] = []
        self._pool: ResourcePool | None = None
        # What each rank was started with, so that one can be started again (replace_rank).
        self._setups: list[HostSetup] = []
        self._bundles: list[int] = []
        self._options: dict[str, Any] = {}
        self._init_distributed = False

    def start(
        self,
        roles: dict[str, WorkerSpec],
        pool: ResourcePool,
        *,
        init_distributed: bool,
        dist_timeout_s: float,
        start_timeout_s: float,
    ) -> list[WorkerInfo]:
        """Place one actor per bundle, rendezvous, init ``torch.distributed``, build roles."""
        if not ray.is_initialized():
            raise ControllerError(
                "Ray is not initialised: call ray.init(...) before creating a WorkerGroup with "
                "backend='ray' (or use backend='local')"
            )
        self._pool = pool
        order = pool.rank_bundles()
        world = len(order)
        per_node: dict[str, list[int]] = {}
        for rank, (_, node) in enumerate(order):
            per_node.setdefault(node, []).append(rank)
        options = pool.actor_resources()
        roles_blob = cloudpickle.dumps(roles)
        sys_path = driver_import_path()
        self._options = options
        self._init_distributed = init_distributed
        self._bundles = [bundle for bundle, _ in order]
        self._setups = []
        try:
            for rank, (_, node) in enumerate(order):
                setup = HostSetup(
                    group_name=self.group_name,
                    rank=rank,
                    world_size=world,
                    local_rank=per_node[node].index(rank),
                    local_world_size=len(per_node[node]),
                    roles_blob=roles_blob,
                    sys_path=sys_path,
                    init_distributed=init_distributed,
                    dist_timeout_s=dist_timeout_s,
                    use_gpu=pool.pins_gpu,
                    backend_kind="ray",
                    plugins=plugin_modules(),
                )
                self._setups.append(setup)
                self.actors.append(self._place(rank))
            deadline = time.monotonic() + start_timeout_s
            self.infos = self._get_all([a.info.remote() for a in self.actors], "<start>", deadline)
            self.alive = True
            if init_distributed:
                addr, port = self._get_all(
                    [self.actors[0].rendezvous.remote()], "<rendezvous>", deadline
                )[0]
                backends = self._get_all(
                    [a.init_distributed.remote(addr, port) for a in self.actors],
                    "<init_distributed>",
                    time.monotonic() + dist_timeout_s,
                )
                self.infos = [
                    _with_backend(info, b) for info, b in zip(self.infos, backends, strict=True)
                ]
            self._get_all([a.construct.remote() for a in self.actors], "<construct>", None)
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def _place(self, rank: int) -> Any:
        """Create the actor of ``rank`` in its bundle (not waited for)."""
        assert self._pool is not None
        return _RayHostActor.options(
            **self._options,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pool.placement_group(),
                placement_group_bundle_index=self._bundles[rank],
                placement_group_capture_child_tasks=False,
            ),
        ).remote(self._setups[rank])

    def replace_rank(self, rank: int, start_timeout_s: float) -> WorkerInfo:
        """Kill ``rank``'s actor (if it still runs) and start a new one in the same bundle.

        The bundle stays reserved when its actor dies, so the new actor lands on the same node
        (or wherever Ray rescheduled the bundle of a lost node) without asking the cluster for
        anything new. Groups without ``torch.distributed`` only: a new process could not join
        the others' process group.

        Raises:
            ControllerError: the group initialised ``torch.distributed``, or the new actor did
                not start within ``start_timeout_s``.
            WorkerDiedError: the new actor died while starting.
        """
        if not self.alive:
            raise ControllerError(f"group {self.group_name!r} is shut down")
        if self._init_distributed:
            raise ControllerError(
                f"group {self.group_name!r}: a rank of a torch.distributed group cannot be "
                "replaced alone; recreate the whole group"
            )
        try:
            ray.kill(self.actors[rank], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead: the usual case
            pass
        actor = self._place(rank)
        self.actors[rank] = actor
        deadline = time.monotonic() + start_timeout_s
        info = self._get_one(rank, actor.info.remote(), "<start>", deadline)
        self._get_one(rank, actor.construct.remote(), "<construct>", deadline)
        self.infos[rank] = info
        return info

    def _get_one(self, rank: int, ref: Any, label: str, deadline: float) -> Any:
        """Wait for one start-up call of ``rank`` until ``deadline``."""
        ready, _ = ray.wait([ref], timeout=max(0.1, deadline - time.monotonic()))
        if not ready:
            raise ControllerError(
                f"group {self.group_name!r}: {label} of the new rank {rank} did not finish "
                "within the start-up timeout (its bundle's resources are still held, or it is "
                "stuck)"
            )
        return self.fetch(ref, rank, label)

    def _get_all(self, refs: list[Any], label: str, deadline: float | None) -> list[Any]:
        """Start-up waits: fail fast on the first error, bounded by ``deadline``."""
        from polyrl.controller.futures import Watch, await_handles

        timeout = None if deadline is None else max(0.1, deadline - time.monotonic())
        watches = [Watch(self, rank, label, ref) for rank, ref in enumerate(refs)]
        try:
            # A rank still starting (importing, placing) cannot answer pings yet.
            return await_handles(watches, timeout, health=label != "<start>")
        except TimeoutError as exc:
            raise ControllerError(
                f"group {self.group_name!r}: {label} did not finish within the start-up timeout "
                "(not enough free resources for the actors, or a rank is stuck)"
            ) from exc

    # ------------------------------------------------------------------------------- calls
    def submit(self, rank, role, method, label, discard, args, kwargs):  # noqa: D102
        return self.actors[rank].call.remote((role, method, label, discard), *args, **kwargs)

    def host_call(self, rank: int, name: str, *args: Any) -> Any:  # noqa: D102
        return getattr(self.actors[rank], name).remote(*args)

    def put(self, value: Any) -> Any:  # noqa: D102
        return ray.put(value)

    def apply(self, fn, inputs, num_returns):  # noqa: D102
        handles = [x for x in inputs if isinstance(x, ray.ObjectRef)]
        plain = [_SLOT if isinstance(x, ray.ObjectRef) else x for x in inputs]
        blob = cloudpickle.dumps((fn, plain))
        refs = _apply_remote.options(num_returns=num_returns).remote(
            driver_import_path(), blob, *handles
        )
        return list(refs) if num_returns > 1 else [refs]

    def is_handle(self, value: Any) -> bool:  # noqa: D102
        return isinstance(value, ray.ObjectRef)

    def wait(self, handles: Sequence[Any], timeout: float) -> list[int]:  # noqa: D102
        if not handles:
            return []
        handles = list(handles)
        # One wait for everything: returns as soon as all are done, or with what finished by the
        # timeout (the caller's health-check interval bounds how late an error is noticed).
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=timeout, fetch_local=False)
        if not ready:
            return []
        ready_set = set(ready)
        return [i for i, h in enumerate(handles) if h in ready_set]

    def fetch(self, handle: Any, rank: int | None, label: str) -> Any:  # noqa: D102
        try:
            return ray.get(handle)
        except (RayTaskError, RayActorError) as exc:
            raise _convert(exc, rank, label) from None

    def ping(self, rank: int) -> Any:  # noqa: D102
        return self.actors[rank].ping.remote()

    def check_ping(self, handle: Any, rank: int, label: str | None) -> None:  # noqa: D102
        try:
            ray.get(handle, timeout=0)
        except GetTimeoutError:
            return
        except RayActorError as exc:
            raise WorkerDiedError(rank, label, _first_line(str(exc))) from None

    def pids(self) -> list[int]:  # noqa: D102
        return [info.pid for info in self.infos]

    def log_tail(self, rank: int, max_lines: int = 5) -> str:
        """Return the last lines of ``rank``'s actor log (stderr, else stdout) in Ray's session.

        An actor of the driver's node: read from this machine's Ray log folder; of another
        node: by a task Ray runs on that node (``""`` when that node is gone too). Ray's own
        marker lines (``:actor_name:...``) and colour codes are dropped.
        """
        if not 0 <= rank < len(self.infos):
            return ""
        info = self.infos[rank]
        if info.node_id == ray.get_runtime_context().get_node_id():
            return _read_log_tail(info.pid, max_lines)
        return _remote_log_tail(info.node_id, info.pid, max_lines)

    def shutdown(self) -> None:
        """Kill every actor (a rank stuck in a collective cannot exit gracefully)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray already shut down
                pass
        self.actors = []
        self.alive = False


def _with_backend(info: WorkerInfo, backend: str) -> WorkerInfo:
    from dataclasses import replace

    return replace(info, dist_backend=backend)
