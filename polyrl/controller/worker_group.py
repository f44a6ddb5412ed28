"""WorkerGroup: drive a group of distributed workers from one process as if they were local.

::

    ray.init()
    pool = ResourcePool("actor", num_workers=2, cpus_per_worker=1)
    group = WorkerGroup(ActorWorker, pool=pool)            # or world_size=2, backend="local"
    log_probs = group.compute_log_prob(batch)              # DP_COMPUTE: split, run, gather
    fut = group.generate(prompts)                          # registered with blocking=False
    scores = group.score(fut)                              # future in, data moves worker->worker
    group.shutdown()

Colocated roles share one process per rank; their methods carry the role prefix::

    group = WorkerGroup({"actor": ActorWorker, "ref": RefWorker}, pool=pool)
    group.actor_update(batch); group.ref_compute_log_prob(batch)
    group.role("ref").compute_log_prob(batch)              # the same, through a role view
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from polyrl.controller.backend import Backend
from polyrl.controller.dispatch import (
    DataParallelLayout,
    Dispatch,
    DispatchContext,
    DispatchMode,
    Execute,
    MethodSpec,
    get_dispatch_mode,
    registered_methods,
)
from polyrl.controller.errors import ControllerError, DispatchError, WorkerDiedError
from polyrl.controller.futures import (
    ControllerFuture,
    PerRankFuture,
    ShardedFuture,
    Watch,
    await_handles,
)
from polyrl.controller.resource_pool import ResourcePool
from polyrl.controller.worker import Worker, WorkerInfo, WorkerSpec
from polyrl.core.batch import Batch

__all__ = ["BoundMethod", "RoleView", "WorkerGroup"]

_BACKENDS = ("ray", "local")
_names = itertools.count()
_FUTURE_CLASSES: dict[str, type[ControllerFuture]] = {
    "per_rank": PerRankFuture,
    "sharded": ShardedFuture,
}


def _as_spec(value: Any, what: str) -> WorkerSpec:
    if isinstance(value, WorkerSpec):
        return value
    if isinstance(value, type) and issubclass(value, Worker):
        return WorkerSpec(value)
    raise TypeError(f"{what} must be a Worker subclass or a WorkerSpec, got {value!r}")


class BoundMethod:
    """A registered worker method bound to a group: call it like the local method.

    ``method(*args)`` follows the method's registered ``blocking`` flag; ``method.submit(*args)``
    always returns a :class:`~polyrl.controller.futures.ControllerFuture`.
    """

    def __init__(self, group: WorkerGroup, role: str, name: str, spec: MethodSpec, label: str):
        self._group = group
        self.role = role
        self.name = name
        self.spec = spec
        self.label = label
        doc = getattr(getattr(group._roles[role].cls, name), "__doc__", None)
        self.__doc__ = doc

    def __repr__(self) -> str:
        mode = get_dispatch_mode(self.spec.dispatch).name
        return f"<BoundMethod {self.label} dispatch={mode} blocking={self.spec.blocking}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method: the collected value if registered blocking, else a future."""
        future = self.submit(*args, **kwargs)
        return future.get() if self.spec.blocking else future

    def submit(self, *args: Any, **kwargs: Any) -> ControllerFuture:
        """Dispatch the call and return its future without waiting."""
        return self._group._call(self.role, self.name, self.label, self.spec, args, kwargs)


class RoleView:
    """The methods of one role of a (possibly colocated) group, without the role prefix."""

    def __init__(self, group: WorkerGroup, role: str) -> None:
        self.group = group
        self.role = role
        self._methods: dict[str, BoundMethod] = {}
        for name, spec in registered_methods(group._roles[role].cls).items():
            label = f"{role}.{name}" if group._prefixed else name
            self._methods[name] = BoundMethod(group, role, name, spec, label)

    def __getattr__(self, name: str) -> BoundMethod:
        methods = self.__dict__.get("_methods", {})
        if name in methods:
            return methods[name]
        raise AttributeError(
            f"role {self.__dict__.get('role')!r} has no registered method {name!r}; registered: "
            f"{sorted(methods)}"
        )

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))

    @property
    def world_size(self) -> int:
        """Number of ranks of the underlying group."""
        return self.group.world_size


class WorkerGroup:
    """A group of worker processes (one per rank) with every registered method bound.

    Args:
        workers: a :class:`~polyrl.controller.Worker` subclass or :class:`WorkerSpec` (methods
            bound under their own names), or a mapping ``role -> class/spec`` of roles colocated
            in one process per rank (methods bound as ``<role>_<method>``).
        pool: where ranks run; one rank per bundle. Without it, ``world_size`` ranks with one CPU
            each get a pool of their own, released at shutdown.
        world_size: number of ranks when no pool is given (must match the pool when both are).
        backend: ``"ray"`` (default; Ray must be initialised) or ``"local"``.
        name: group name for logs and errors.
        init_distributed: initialise ``torch.distributed`` across the ranks before building them.
        dist_timeout_s: timeout of the process group and its rendezvous.
        dead_worker_timeout_s: a rank that stops answering health checks for this long while a
            call waits on it is reported as dead (:class:`~polyrl.controller.WorkerDiedError`).
        health_check_interval_s: how often waiting calls ping the ranks they wait on.
        call_timeout_s: a call whose result is not in this many seconds after the driver
            started waiting for it is reported as a dead rank (``WorkerDiedError``, "hung"),
            even though the rank still answers health checks: a rank stuck in a call. ``None``
            or 0: no limit. The rank is not stopped here: :meth:`shutdown` (which the
            trainer's rebuild does) kills it.
        start_timeout_s: bound on placing and starting the ranks.
        local_mode: for ``backend="local"``: ``"auto"``, ``"inline"`` or ``"process"``.
    """

    def __init__(
        self,
        workers: type[Worker] | WorkerSpec | Mapping[str, type[Worker] | WorkerSpec],
        *,
        pool: ResourcePool | None = None,
        world_size: int | None = None,
        backend: str = "ray",
        name: str | None = None,
        init_distributed: bool = True,
        dist_timeout_s: float = 600.0,
        dead_worker_timeout_s: float = 30.0,
        health_check_interval_s: float = 1.0,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 180.0,
        local_mode: str = "auto",
    ) -> None:
        if isinstance(workers, Mapping):
            if not workers:
                raise ValueError("WorkerGroup: the role mapping is empty")
            roles: dict[str, WorkerSpec] = {}
            for role, value in workers.items():
                if not isinstance(role, str) or not role.isidentifier():
                    raise ValueError(
                        f"WorkerGroup: role names must be Python identifiers (they prefix method "
                        f"names), got {role!r}"
                    )
                roles[role] = _as_spec(value, f"role {role!r}")
            prefixed = True
        else:
            spec = _as_spec(workers, "workers")
            roles = {spec.cls.__name__: spec}
            prefixed = False
        if backend not in _BACKENDS:
            raise ValueError(f"WorkerGroup: backend must be one of {_BACKENDS}, got {backend!r}")
        self._roles = roles
        self._prefixed = prefixed
        self.name = name or f"{'+'.join(roles)}-{next(_names)}"
        owns_pool = pool is None
        if pool is None:
            if world_size is None:
                raise ValueError("WorkerGroup: give a ResourcePool (pool=) or world_size=")
            pool = ResourcePool(self.name, world_size)
        elif not isinstance(pool, ResourcePool):
            raise TypeError(f"WorkerGroup: pool must be a ResourcePool, got {type(pool).__name__}")
        elif world_size is not None and world_size != pool.world_size:
            raise ValueError(
                f"WorkerGroup: world_size={world_size} but pool {pool.name!r} has "
                f"{pool.world_size} bundles"
            )
        self.pool = pool
        self._owns_pool = owns_pool and backend == "ray"
        common = {
            "dead_worker_timeout_s": dead_worker_timeout_s,
            "health_check_interval_s": health_check_interval_s,
            "call_timeout_s": call_timeout_s,
        }
        if backend == "ray":
            from polyrl.controller.ray_backend import RayBackend

            self._backend: Backend = RayBackend(self.name, **common)
        else:
            from polyrl.controller.local_backend import LocalBackend

            self._backend = LocalBackend(self.name, local_mode=local_mode, **common)
        self._layouts: dict[tuple[str, str | None], DataParallelLayout] = {}
        self._methods: dict[str, BoundMethod] = {}
        self._bind()  # before starting processes: bad registrations fail fast
        try:
            self._backend.start(
                roles,
                pool,
                init_distributed=init_distributed,
                dist_timeout_s=dist_timeout_s,
                start_timeout_s=start_timeout_s,
            )
        except BaseException:
            if self._owns_pool:
                pool.release()
            raise
        self._finalizer = weakref.finalize(
            self, _finalize, self._backend, pool if self._owns_pool else None
        )

    # ---------------------------------------------------------------------------- binding
    def _bind(self) -> None:
        for role, spec in self._roles.items():
            for name, mspec in registered_methods(spec.cls).items():
                try:
                    mode = get_dispatch_mode(mspec.dispatch)
                except ValueError as exc:
                    raise ValueError(f"{spec.cls.__name__}.{name}: {exc}") from None
                if mspec.execute is Execute.RANK_ZERO and not mode.allows_rank_zero_execute():
                    raise ValueError(
                        f"{spec.cls.__name__}.{name}: execute=RANK_ZERO cannot be combined with "
                        f"dispatch mode {mode.name!r}"
                    )
                attr = f"{role}_{name}" if self._prefixed else name
                label = f"{role}.{name}" if self._prefixed else name
                if hasattr(type(self), attr) or attr in self._methods:
                    raise ValueError(
                        f"{spec.cls.__name__}.{name} would be bound as {attr!r}, which clashes "
                        "with a WorkerGroup attribute or another role's method; rename it"
                    )
                bound = BoundMethod(self, role, name, mspec, label)
                self._methods[attr] = bound
                setattr(self, attr, bound)

    # ---------------------------------------------------------------------------- properties
    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.pool.world_size

    @property
    def backend(self) -> str:
        """``"ray"`` or ``"local"``."""
        return self._backend.kind

    @property
    def roles(self) -> tuple[str, ...]:
        """Role names, in construction order."""
        return tuple(self._roles)

    @property
    def worker_info(self) -> list[WorkerInfo]:
        """Where each rank runs (pid, node, device), by rank."""
        return list(self._backend.infos)

    def log_tail(self, rank: int, max_lines: int = 5) -> str:
        """Return the last lines ``rank``'s process wrote to its own log (``""``: none known).

        Only ``ray`` ranks have one (read on their node); local ranks write to this process's
        streams.
        """
        return self._backend.log_tail(rank, max_lines)

    @property
    def methods(self) -> dict[str, BoundMethod]:
        """Every bound method by attribute name."""
        return dict(self._methods)

    @property
    def is_alive(self) -> bool:
        """Whether the group has been started and not shut down."""
        return self._backend.alive

    def role(self, name: str) -> RoleView:
        """Return a view of role ``name``'s methods without the role prefix."""
        if name not in self._roles:
            raise KeyError(f"group {self.name!r} has no role {name!r}; roles: {list(self._roles)}")
        return RoleView(self, name)

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else "shut down"
        return (
            f"WorkerGroup({self.name!r}, roles={list(self._roles)}, world_size={self.world_size}, "
            f"backend={self.backend!r}, {state})"
        )

    # ---------------------------------------------------------------------------- calls
    def invoke(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        role: str | None = None,
        dispatch: Dispatch | str | DispatchMode = Dispatch.ONE_TO_ALL,
        execute: Execute | str = Execute.ALL,
        blocking: bool = True,
        mesh: str | None = None,
    ) -> Any:
        """Call any method of a role (registered or not) with an explicit dispatch mode."""
        if role is None:
            if len(self._roles) != 1:
                raise ValueError(f"invoke: give role= (one of {list(self._roles)})")
            role = next(iter(self._roles))
        if role not in self._roles:
            raise KeyError(f"invoke: no role {role!r}; roles: {list(self._roles)}")
        if not callable(getattr(self._roles[role].cls, method, None)):
            raise AttributeError(
                f"invoke: {self._roles[role].cls.__name__} has no method {method!r}"
            )
        spec = MethodSpec(dispatch, Execute(execute), blocking, mesh)
        mode = get_dispatch_mode(dispatch)
        if spec.execute is Execute.RANK_ZERO and not mode.allows_rank_zero_execute():
            raise ValueError(f"invoke: execute=RANK_ZERO cannot be combined with {mode.name!r}")
        label = f"{role}.{method}" if self._prefixed else method
        future = self._call(role, method, label, spec, tuple(args), dict(kwargs or {}))
        return future.get() if blocking else future

    def _call(
        self,
        role: str,
        method: str,
        label: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> ControllerFuture:
        if not self._backend.alive:
            raise ControllerError(f"group {self.name!r} is shut down; cannot call {label}")
        mode = get_dispatch_mode(spec.dispatch)
        layout = self._layout(role, spec.mesh, label)
        upstream: list[ControllerFuture] = []
        args = tuple(self._incoming(a, upstream) for a in args)
        kwargs = {k: self._incoming(v, upstream) for k, v in kwargs.items()}
        world = self.world_size
        ctx = DispatchContext(world, label, layout, self._backend.apply)
        calls, keep, state = mode.dispatch(ctx, args, kwargs)
        if spec.execute is Execute.RANK_ZERO:
            if calls[0] is None:
                raise DispatchError(f"{label}: execute=RANK_ZERO but the mode skipped rank 0")
            calls = [calls[0]] + [None] * (world - 1)
            keep = [True] + [False] * (world - 1)
        if all(c is None for c in calls):
            raise DispatchError(f"{label}: dispatch mode {mode.name!r} addressed no rank")
        keep = [k and c is not None for k, c in zip(keep, calls, strict=True)]
        shared = self._share(calls)
        handles: list[Any] = []
        for rank, call in enumerate(calls):
            if call is None:
                handles.append(None)
                continue
            rank_args = tuple(self._outgoing(a, shared) for a in call[0])
            rank_kwargs = {k: self._outgoing(v, shared) for k, v in call[1].items()}
            discard = not keep[rank]
            handles.append(
                self._backend.submit(rank, role, method, label, discard, rank_args, rank_kwargs)
            )
        cls = _FUTURE_CLASSES.get(mode.future_kind(), ControllerFuture)
        return cls(
            backend=self._backend,
            label=label,
            ctx=ctx,
            mode=mode,
            state=state,
            handles=handles,
            keep=keep,
            upstream=upstream,
        )

    def _incoming(self, value: Any, upstream: list[ControllerFuture]) -> Any:
        if isinstance(value, ControllerFuture):
            if value.backend_kind != self._backend.kind:
                # Different transports cannot hand each other handles: go through the driver.
                return value.get()
            upstream.append(value)
        return value

    def _outgoing(self, value: Any, shared: dict[int, Any]) -> Any:
        if isinstance(value, ControllerFuture):
            return value._value_handle()
        return shared.get(id(value), value)

    def _share(self, calls: list[Any]) -> dict[int, Any]:
        """Store large values that several ranks receive once (not once per rank)."""
        counts: dict[int, tuple[int, Any]] = {}
        for call in calls:
            if call is None:
                continue
            for value in (*call[0], *call[1].values()):
                if isinstance(value, Batch | torch.Tensor | np.ndarray | bytes):
                    n, _ = counts.get(id(value), (0, value))
                    counts[id(value)] = (n + 1, value)
        return {key: self._backend.put(v) for key, (n, v) in counts.items() if n > 1}

    def _layout(self, role: str, mesh: str | None, call: str) -> DataParallelLayout:
        # ``call``: the call this layout is read for (the first of its kind), which a rank's
        # death while answering is reported as.
        key = (role, mesh)
        if key in self._layouts:
            return self._layouts[key]
        if mesh is None:
            layout = DataParallelLayout.flat(self.world_size)
        else:
            label = call
            watches = [
                Watch(self._backend, r, label, self._backend.host_call(r, "mesh_info", role, mesh))
                for r in range(self.world_size)
            ]
            infos = await_handles(watches)
            layout = DataParallelLayout.from_rank_infos(mesh, [tuple(i) for i in infos])
        self._layouts[key] = layout
        return layout

    # ---------------------------------------------------------------------------- health
    def check_health(self, timeout: float | None = None) -> list[int]:
        """Ping every rank; return their pids or raise ``WorkerDiedError`` for a dead one."""
        if not self._backend.alive:
            raise ControllerError(f"group {self.name!r} is shut down")
        limit = self._backend.dead_worker_timeout_s if timeout is None else timeout
        watches = [
            Watch(self._backend, r, "<health check>", self._backend.ping(r))
            for r in range(self.world_size)
        ]
        try:
            return await_handles(watches, limit, health=False)
        except TimeoutError:
            late = [w.rank for w in watches if not self._backend.wait([w.handle], 0.0)]
            raise WorkerDiedError(
                late[0] if late else -1, None, f"no answer to a health check within {limit:.1f}s"
            ) from None

    def rank_alive(self, rank: int, timeout: float | None = None) -> bool:
        """Whether ``rank``'s process answers a health check within ``timeout`` seconds.

        ``timeout`` defaults to ``dead_worker_timeout_s``. Answered by the rank's health
        channel, so a rank busy in a long call still counts as alive.
        """
        if not self._backend.alive:
            return False
        limit = self._backend.dead_worker_timeout_s if timeout is None else timeout
        handle = self._backend.ping(rank)
        if not self._backend.wait([handle], limit):
            return False
        try:
            self._backend.fetch(handle, rank, "<health check>")
        except ControllerError:
            return False
        return True

    def call_rank(
        self,
        rank: int,
        method: str,
        *args: Any,
        role: str | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call ``method`` on ``rank`` alone and return its result.

        For calls about one rank (a replica's server) that must not depend on the other ranks
        being alive, as a call dispatched to all of them would.

        Raises:
            WorkerDiedError: the rank is dead.
            TimeoutError: no result within ``timeout`` seconds (the call keeps running).
        """
        role = role or next(iter(self._roles))
        if not self._backend.alive:
            raise ControllerError(f"group {self.name!r} is shut down; cannot call {method}")
        label = f"{role}.{method}" if self._prefixed else method
        handle = self._backend.submit(rank, role, method, label, False, args, kwargs)
        watch = Watch(self._backend, rank, label, handle)
        return await_handles([watch], timeout)[0]

    def replace_rank(self, rank: int, start_timeout_s: float | None = None) -> WorkerInfo:
        """Start a new process for ``rank`` (dead or not) in the same bundle; return its info.

        The new process builds its workers with the group's arguments, as at the start. Only
        for ``ray`` groups without ``torch.distributed``: the rollout replicas' ranks.

        Raises:
            ControllerError: the group cannot replace a rank, or the new one did not start.
        """
        limit = 180.0 if start_timeout_s is None else start_timeout_s
        return self._backend.replace_rank(rank, limit)

    # ---------------------------------------------------------------------------- shutdown
    def shutdown(self, wait_s: float = 10.0) -> None:
        """Stop every rank process and release an owned pool; idempotent.

        Rank processes on this host that are still alive one second after the backend stopped
        them (e.g. a stopped process Ray would otherwise wait on) are sent SIGKILL; a warning is
        raised if any survive ``wait_s``.
        """
        host = socket.gethostname()
        # An inline rank is the driver itself: never wait for our own process to exit.
        pids = [i.pid for i in self._backend.infos if i.hostname == host and i.pid != os.getpid()]
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        _finalize(self._backend, self.pool if self._owns_pool else None)
        survivors = _wait_gone(pids, min(1.0, wait_s))
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        survivors = _wait_gone(survivors, wait_s)
        if survivors:
            warnings.warn(
                f"group {self.name!r}: processes {survivors} still alive {wait_s}s after shutdown",
                RuntimeWarning,
                stacklevel=2,
            )

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _finalize(backend: Backend, pool: ResourcePool | None) -> None:
    try:
        backend.shutdown()
    finally:
        if pool is not None:
            pool.release()


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (finished but not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive
