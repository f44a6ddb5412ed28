"""Single controller: one driver process drives groups of distributed workers (HybridFlow).

The algorithm stays a readable single-process program; the heavy work runs in worker groups on
Ray. A worker method is decorated with :func:`register`, which says how the group splits the
arguments across ranks and collects the results; the :class:`WorkerGroup` binds it so the driver
calls it like a local method::

    import ray
    from polyrl.core.batch import Batch
    from polyrl.controller import (Dispatch, ResourcePool, Worker, WorkerGroup, WorkerSpec,
                                   register)

    class Scorer(Worker):
        def __init__(self, scale: float) -> None:
            self.scale = scale                    # rank, world_size, device, dist all ready

        @register(dispatch=Dispatch.DP_COMPUTE)
        def score(self, batch: Batch) -> Batch:   # gets this rank's shard
            return Batch({"score": batch["x"].sum(-1) * self.scale})

        @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
        def embed(self, batch: Batch) -> Batch:
            ...

    ray.init()
    group = WorkerGroup(WorkerSpec(Scorer, (2.0,)), pool=ResourcePool("scorer", 2))
    scores = group.score(batch)                   # split, run on 2 ranks, gather, unpad
    emb = group.embed(batch)                      # a future: data stays on the workers
    scores = group.score(emb)                     # rank d's output goes straight to rank d
    group.shutdown()

Pieces:

* :class:`Worker` -- base class; knows rank, world size, local rank, node and device; its group
  initialises ``torch.distributed`` (gloo on CPU, NCCL for GPUs) with a runtime-chosen
  rendezvous before ``__init__``.
* :func:`register` and :class:`Dispatch` -- ``ONE_TO_ALL``, ``ALL_TO_ALL``, ``RANK_ZERO``,
  ``DP_COMPUTE``, ``DP_COMPUTE_METRIC`` and user modes (:func:`register_dispatch_mode`);
  mesh-aware data parallelism via :meth:`Worker.register_mesh` (see
  :mod:`polyrl.controller.dispatch`).
* :class:`ControllerFuture` -- non-blocking results that chain without the driver touching data
  (see :mod:`polyrl.controller.futures`).
* :class:`ResourcePool` / :class:`ResourcePoolManager` -- named bundle sets over placement
  groups, roles mapped to pools, colocation of roles in one process.
* Backends: ``"ray"`` (default) and ``"local"`` (inline for one rank, subprocesses for
  several; see :mod:`polyrl.controller.local_backend`).
* Failures: :class:`WorkerError` (rank, method, remote traceback), :class:`WorkerDiedError`
  (dead or unresponsive process, reported within ``dead_worker_timeout_s``).
* :class:`DriverTrafficMeter` -- bytes the driver received from Ray, to verify the above.
"""

from polyrl.controller.dispatch import (
    DataParallelLayout,
    Dispatch,
    DispatchContext,
    DispatchMode,
    Execute,
    available_dispatch_modes,
    get_dispatch_mode,
    register,
    register_dispatch_mode,
)
from polyrl.controller.errors import (
    ControllerError,
    DispatchError,
    ResourcePoolError,
    WorkerDiedError,
    WorkerError,
)
from polyrl.controller.futures import ControllerFuture, PerRankFuture, ShardedFuture
from polyrl.controller.resource_pool import ResourcePool, ResourcePoolManager
from polyrl.controller.traffic import DriverTrafficMeter
from polyrl.controller.worker import Worker, WorkerInfo, WorkerSpec
from polyrl.controller.worker_group import BoundMethod, RoleView, WorkerGroup

__all__ = [
    "BoundMethod",
    "ControllerError",
    "ControllerFuture",
    "DataParallelLayout",
    "Dispatch",
    "DispatchContext",
    "DispatchError",
    "DispatchMode",
    "DriverTrafficMeter",
    "Execute",
    "PerRankFuture",
    "ResourcePool",
    "ResourcePoolError",
    "ResourcePoolManager",
    "RoleView",
    "ShardedFuture",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerSpec",
    "available_dispatch_modes",
    "get_dispatch_mode",
    "register",
    "register_dispatch_mode",
]
