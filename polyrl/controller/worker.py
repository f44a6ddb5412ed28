"""The :class:`Worker` base class and the per-process host that runs workers for a group.

A worker is an ordinary class deriving from :class:`Worker` whose group-callable methods carry
:func:`~polyrl.controller.dispatch.register`::

    class ActorWorker(Worker):
        def __init__(self, lr: float) -> None:
            self.model = build_model().to(self.device)   # rank, world_size, device ready here

        @register(dispatch=Dispatch.DP_COMPUTE)
        def compute_log_prob(self, batch: Batch) -> Batch:
            ...

The worker never builds its own process group: by the time ``__init__`` runs,
``torch.distributed`` is initialised for the whole group (gloo on CPU; ``cpu:gloo,cuda:nccl`` when
the worker owns a GPU) with a rendezvous the group picked at runtime (rank 0 opens a
``TCPStore`` on a free port of its own node), and the usual ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` variables are set.

Colocation: several roles (``{"actor": ..., "ref": ...}``) can share one process per rank; each
role is its own Worker instance, they share the process group and the device, and
:meth:`Worker.colocated` returns a sibling role's instance so they can share tensors directly.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from polyrl.controller.errors import ControllerError, WorkerDiedError, WorkerError
from polyrl.core.cpu import cores_per_process
from polyrl.core.cuda import process_group_backend
from polyrl.core.plugins import import_plugins

__all__ = ["Worker", "WorkerInfo", "WorkerSpec"]


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker instance runs (filled in by its host before ``__init__``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: str
    node_ip: str
    group_name: str
    role: str
    device: torch.device
    dist_backend: str | None
    colocated: dict[str, Worker] = field(default_factory=dict, compare=False, repr=False)


_construction = threading.local()


def _standalone_context(cls_name: str) -> WorkerContext:
    """Context for a Worker built outside any group (plain unit tests of worker logic)."""
    return WorkerContext(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_id="standalone",
        node_ip="127.0.0.1",
        group_name="standalone",
        role=cls_name,
        device=torch.device("cpu"),
        dist_backend=dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
    )


class Worker:
    """Base class of everything a :class:`~polyrl.controller.WorkerGroup` runs.

    Subclasses need not call ``super().__init__()``: the rank information is attached when the
    instance is created, before the subclass ``__init__`` runs. A Worker built outside a group
    (e.g. to unit-test its logic) sees rank 0 of a world of 1 on CPU.
    """

    _polyrl_ctx: WorkerContext
    _polyrl_meshes: dict[str, tuple[int, int, bool]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:  # noqa: D102 - internal hook
        obj = super().__new__(cls)
        ctx = getattr(_construction, "ctx", None) or _standalone_context(cls.__name__)
        object.__setattr__(obj, "_polyrl_ctx", ctx)
        object.__setattr__(obj, "_polyrl_meshes", {})
        return obj

    # ------------------------------------------------------------------------------ placement
    @property
    def rank(self) -> int:
        """Global rank in the worker group."""
        return self._polyrl_ctx.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the worker group."""
        return self._polyrl_ctx.world_size

    @property
    def local_rank(self) -> int:
        """Rank among the group's workers on the same node."""
        return self._polyrl_ctx.local_rank

    @property
    def local_world_size(self) -> int:
        """Number of the group's workers on this node."""
        return self._polyrl_ctx.local_world_size

    @property
    def node_id(self) -> str:
        """Cluster node id (Ray node id; ``"local"`` for the local backend)."""
        return self._polyrl_ctx.node_id

    @property
    def node_ip(self) -> str:
        """IP address of this worker's node."""
        return self._polyrl_ctx.node_ip

    @property
    def device(self) -> torch.device:
        """The device this worker computes on (``cuda:N`` when it owns a GPU, else ``cpu``)."""
        return self._polyrl_ctx.device

    @property
    def dist_backend(self) -> str | None:
        """The ``torch.distributed`` backend of the group, ``None`` when not initialised."""
        return self._polyrl_ctx.dist_backend

    @property
    def role(self) -> str:
        """The role name of this worker in its group (the class name for single-role groups)."""
        return self._polyrl_ctx.role

    @property
    def group_name(self) -> str:
        """Name of the worker group."""
        return self._polyrl_ctx.group_name

    def colocated(self, role: str) -> Worker:
        """Return the instance of another role living in this same process (colocation)."""
        peers = self._polyrl_ctx.colocated
        if role not in peers:
            raise KeyError(
                f"no role {role!r} is colocated with {self.role!r}; colocated roles: "
                f"{sorted(peers)} (roles are constructed in the order given to the group)"
            )
        return peers[role]

    # ---------------------------------------------------------------------------------- meshes
    def register_mesh(self, name: str, shape: Mapping[str, int], dp_dim: str = "dp") -> None:
        """Declare a named mesh so data-parallel dispatch knows which ranks share a shard.

        Ranks are laid out row-major over ``shape`` (like ``init_device_mesh``). This rank's
        data-parallel index is its coordinate along ``dp_dim``; it is the collect rank of its
        data-parallel group when every other coordinate is 0.

        Example: ``self.register_mesh("train", {"dp": 2, "tp": 2})`` on 4 ranks puts ranks 0, 1
        in dp group 0 (rank 0 returns results) and ranks 2, 3 in dp group 1 (rank 2 returns).
        """
        if not isinstance(shape, Mapping) or not shape:
            raise TypeError(f"register_mesh({name!r}): shape must be a non-empty mapping")
        dims = list(shape.items())
        for dim, size in dims:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"register_mesh({name!r}): dimension {dim!r} must be a positive int, got "
                    f"{size!r}"
                )
        if dp_dim not in shape:
            raise ValueError(
                f"register_mesh({name!r}): dp_dim {dp_dim!r} is not one of {list(shape)}"
            )
        total = 1
        for _, size in dims:
            total *= size
        if total != self.world_size:
            raise ValueError(
                f"register_mesh({name!r}): shape {dict(shape)} has {total} ranks but the group has "
                f"world_size {self.world_size}"
            )
        coords: dict[str, int] = {}
        rest = self.rank
        for dim, size in reversed(dims):
            coords[dim] = rest % size
            rest //= size
        is_collect = all(c == 0 for d, c in coords.items() if d != dp_dim)
        self.set_dispatch_info(
            name, dp_rank=coords[dp_dim], dp_size=shape[dp_dim], is_collect=is_collect
        )

    def set_dispatch_info(self, name: str, *, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this rank's place in mesh ``name`` directly (for layouts not row-major)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"mesh name must be a non-empty str, got {name!r}")
        if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int)):
            raise ValueError(f"mesh {name!r}: dp_size must be >= 1 and dp_rank an int")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"mesh {name!r}: dp_rank {dp_rank} outside 0..{dp_size - 1}")
        self._polyrl_meshes[name] = (dp_rank, dp_size, bool(is_collect))

    def dispatch_info(self, name: str) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, is_collect)`` of this rank in mesh ``name``."""
        try:
            return self._polyrl_meshes[name]
        except KeyError:
            raise KeyError(
                f"worker {type(self).__name__} (role {self.role!r}) declared no mesh {name!r}; "
                f"declared meshes: {sorted(self._polyrl_meshes)}. Call self.register_mesh(...) in "
                "__init__"
            ) from None


@dataclass(frozen=True)
class WorkerSpec:
    """A worker class plus the arguments its ``__init__`` receives on every rank."""

    cls: type[Worker]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.cls, type) and issubclass(self.cls, Worker)):
            raise TypeError(f"WorkerSpec.cls must be a subclass of Worker, got {self.cls!r}")
        if not isinstance(self.args, tuple):
            raise TypeError(f"WorkerSpec.args must be a tuple, got {type(self.args).__name__}")
        if not isinstance(self.kwargs, Mapping):
            raise TypeError(
                f"WorkerSpec.kwargs must be a mapping, got {type(self.kwargs).__name__}"
            )


@dataclass(frozen=True)
class WorkerInfo:
    """Where one rank of a group runs."""

    rank: int
    pid: int
    node_id: str
    node_ip: str
    hostname: str
    local_rank: int
    local_world_size: int
    device: str
    dist_backend: str | None


@dataclass(frozen=True)
class HostSetup:
    """Everything a host process needs to build its rank (sent by the group at creation)."""

    group_name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    # Roles travel pickled and are unpickled only after the driver's import path is in place, so
    # worker classes importable in the driver (e.g. from a test folder) import on the worker.
    roles_blob: bytes
    sys_path: tuple[str, ...]
    init_distributed: bool
    dist_timeout_s: float
    use_gpu: bool
    backend_kind: str  # "ray" | "local" (subprocess) | "inline" (in the driver process)
    # User modules the driver imported with import_plugins (trainer.imports): imported on the
    # worker before the roles, so names they register resolve there too.
    plugins: tuple[str, ...] = ()


def driver_import_path() -> tuple[str, ...]:
    """Return the driver's ``sys.path`` entries that are directories (sent to every worker)."""
    return tuple(p for p in sys.path if p and os.path.isdir(p))


def extend_import_path(paths: Sequence[str]) -> None:
    """Append the driver's import directories that exist here and are not yet on the path."""
    for path in paths:
        if path not in sys.path and os.path.isdir(path):
            sys.path.append(path)


def _format_error(
    exc: BaseException, rank: int, method: str, pid: int, node_id: str
) -> ControllerError:
    if isinstance(exc, WorkerError | WorkerDiedError):
        return exc
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return WorkerError(rank, method, type(exc).__qualname__, str(exc), tb, pid, node_id)


class WorkerHost:
    """Runs one rank of a group in its own process: distributed init, roles, method calls.

    Shared by both backends: the Ray backend wraps it in an actor, the local backend runs it in a
    spawned subprocess (or inline in the driver for a world of one). Every public method turns
    exceptions into :class:`WorkerError` so they pickle and carry rank and traceback.
    """

    def __init__(self, setup: HostSetup) -> None:
        self.setup = setup
        self.pid = os.getpid()
        # An inline rank shares the driver process: leave the driver's environment alone.
        self._set_env = setup.backend_kind != "inline"
        if self._set_env:
            for key, value in {
                "RANK": setup.rank,
                "WORLD_SIZE": setup.world_size,
                "LOCAL_RANK": setup.local_rank,
                "LOCAL_WORLD_SIZE": setup.local_world_size,
            }.items():
                os.environ[key] = str(value)
        omp_threads = os.environ.get("OMP_NUM_THREADS", "")
        if setup.backend_kind == "local" and "OMP_NUM_THREADS" not in os.environ:
            # Each spawned rank would otherwise start one intra-op thread per core, so N ranks
            # on a node run N times as many threads as cores (torchrun and Ray set the count
            # per process; an explicit OMP_NUM_THREADS is the user's choice and stays).
            torch.set_num_threads(cores_per_process(setup.local_world_size))
        elif setup.backend_kind == "local" and omp_threads.isdigit() and int(omp_threads) > 0:
            # A rank forked from the fork server (local_backend._rank_context) has torch's
            # OpenMP runtime set up from the server's environment: apply the driver's choice.
            torch.set_num_threads(int(omp_threads))
        if setup.backend_kind == "ray":
            import ray

            self.node_id = ray.get_runtime_context().get_node_id()
            self.node_ip = ray.util.get_node_ip_address()
        else:
            self.node_id = "local"
            self.node_ip = "127.0.0.1"
        self.device = self._pick_device()
        self.dist_backend: str | None = None
        self._owns_process_group = False
        self._store: Any = None
        self.workers: dict[str, Worker] = {}
        self.roles: dict[str, WorkerSpec] = {}
        self._init_error: ControllerError | None = None
        try:
            extend_import_path(setup.sys_path)
            import_plugins(setup.plugins)
            self.roles = pickle.loads(setup.roles_blob)
        except BaseException as exc:  # noqa: BLE001 - reported by info(), the first call
            self._init_error = self._error(exc, "<load worker classes>")

    def _pick_device(self) -> torch.device:
        if not (self.setup.use_gpu and torch.cuda.is_available()):
            return torch.device("cpu")
        if self.setup.backend_kind == "ray":
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPUs, so ours is index 0.
            index = 0
        else:
            index = self.setup.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _error(self, exc: BaseException, method: str) -> ControllerError:
        return _format_error(exc, self.setup.rank, method, self.pid, self.node_id)

    # ------------------------------------------------------------------------- lifecycle steps
    def info(self) -> WorkerInfo:
        """Describe this rank (pid, node, device); raises if the worker classes failed to load."""
        if self._init_error is not None:
            raise self._init_error
        return WorkerInfo(
            rank=self.setup.rank,
            pid=self.pid,
            node_id=self.node_id,
            node_ip=self.node_ip,
            hostname=socket.gethostname(),
            local_rank=self.setup.local_rank,
            local_world_size=self.setup.local_world_size,
            device=str(self.device),
            dist_backend=self.dist_backend,
        )

    def rendezvous(self) -> tuple[str, int]:
        """On rank 0: open the group's TCPStore on a free port of this node; return its address.

        Port 0 lets the OS pick a free port atomically, so concurrent groups never collide.
        """
        try:
            if self.setup.rank != 0:
                raise ControllerError("rendezvous must run on rank 0")
            timeout = datetime.timedelta(seconds=self.setup.dist_timeout_s)
            self._store = dist.TCPStore(
                self.node_ip,
                0,
                self.setup.world_size,
                True,
                timeout=timeout,
                wait_for_workers=False,  # the others connect in init_distributed
            )
            return self.node_ip, int(self._store.port)
        except BaseException as exc:
            raise self._error(exc, "<rendezvous>") from None

    def init_distributed(self, master_addr: str, master_port: int) -> str:
        """Join the group's process group through the TCPStore opened by rank 0."""
        try:
            if self._set_env:
                os.environ["MASTER_ADDR"] = master_addr
                os.environ["MASTER_PORT"] = str(master_port)
            timeout = datetime.timedelta(seconds=self.setup.dist_timeout_s)
            if self._store is None:
                self._store = dist.TCPStore(
                    master_addr, master_port, self.setup.world_size, False, timeout=timeout
                )
            backend = process_group_backend(self.device)
            dist.init_process_group(
                backend,
                store=self._store,
                rank=self.setup.rank,
                world_size=self.setup.world_size,
                timeout=timeout,
            )
            self._owns_process_group = True
            self.dist_backend = backend
            return backend
        except BaseException as exc:
            raise self._error(exc, "<init_distributed>") from None

    def init_distributed_inline(self) -> str | None:
        """World of one in the driver process: reuse an existing 1-rank group or make one."""
        try:
            if dist.is_initialized():
                if dist.get_world_size() != 1:
                    raise ControllerError(
                        "the driver process already belongs to a torch.distributed group of "
                        f"{dist.get_world_size()} ranks; an inline local worker needs a world of 1"
                    )
                self.dist_backend = str(dist.get_backend())
                return self.dist_backend
            # On a GPU too: FSDP2's collectives on CUDA tensors need NCCL even for one rank.
            backend = process_group_backend(self.device)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._owns_process_group = True
            self.dist_backend = backend
            return self.dist_backend
        except BaseException as exc:
            raise self._error(exc, "<init_distributed>") from None

    def construct(self) -> list[str]:
        """Build every role's worker instance (in order), sharing one colocation registry."""
        shared: dict[str, Worker] = {}
        for role, spec in self.roles.items():
            ctx = WorkerContext(
                rank=self.setup.rank,
                world_size=self.setup.world_size,
                local_rank=self.setup.local_rank,
                local_world_size=self.setup.local_world_size,
                node_id=self.node_id,
                node_ip=self.node_ip,
                group_name=self.setup.group_name,
                role=role,
                device=self.device,
                dist_backend=self.dist_backend,
                colocated=shared,
            )
            _construction.ctx = ctx
            try:
                instance = spec.cls(*spec.args, **dict(spec.kwargs))
            except BaseException as exc:
                raise self._error(exc, f"{role}.__init__ ({spec.cls.__name__})") from None
            finally:
                _construction.ctx = None
            if not isinstance(instance, Worker):
                raise self._error(
                    TypeError(f"{spec.cls.__name__}() returned {type(instance).__name__}"),
                    f"{role}.__init__",
                )
            # Keep the shared registry but make sure the context is this role's own.
            object.__setattr__(instance, "_polyrl_ctx", replace(ctx, colocated=shared))
            shared[role] = instance
        self.workers = shared
        return list(shared)

    # ----------------------------------------------------------------------------------- calls
    def execute(
        self,
        role: str,
        method: str,
        label: str,
        discard: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``role.method(*args, **kwargs)``; return ``None`` instead when ``discard``."""
        try:
            worker = self.workers[role]
            fn = getattr(worker, method)
            if self.device.type == "cuda":
                # The current CUDA device is per thread and Ray may run calls on another thread.
                torch.cuda.set_device(self.device)
            result = fn(*args, **kwargs)
        except BaseException as exc:
            raise self._error(exc, label) from None
        return None if discard else result

    def mesh_info(self, role: str, mesh: str) -> tuple[int, int, bool]:
        """Return ``(dp_rank, dp_size, is_collect)`` of this rank in ``role``'s mesh ``mesh``."""
        try:
            return self.workers[role].dispatch_info(mesh)
        except BaseException as exc:
            raise self._error(exc, f"<mesh_info {role}:{mesh}>") from None

    def ping(self) -> int:
        """Answer a health check (served on its own thread so busy ranks still answer)."""
        return self.pid

    def teardown(self) -> None:
        """Leave the process group (best effort: a peer may already be gone)."""
        if self._owns_process_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer must not block shutdown
                pass
        self._owns_process_group = False
        self.workers = {}
