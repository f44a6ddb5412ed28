"""Resource pools: named sets of CPU/GPU bundles, one bundle per rank, over Ray placement groups.

A :class:`ResourcePool` reserves ``num_workers`` identical bundles with a placement strategy
(``PACK`` keeps them on as few nodes as possible, ``SPREAD`` puts them on different nodes when it
can, ``STRICT_*`` make it a requirement). Rank ``i`` of a group built on the pool runs in the
``i``-th bundle after ordering bundles so the ranks of one node are contiguous (so ``local_rank``
is meaningful and rank 0 sits on the first bundle's node).

Several roles map onto pools with a :class:`ResourcePoolManager`: roles that share a pool are
colocated -- fused into one process per bundle -- so their models share the bundle's device::

    manager = ResourcePoolManager(
        [ResourcePool("train", 2, gpus_per_worker=1),
         ResourcePool("rollout", 2, gpus_per_worker=1)],
        {"actor": "train", "ref": "train", "rollout": "rollout"},
    )
    groups = manager.create_worker_groups({"actor": ActorWorker, "ref": RefWorker,
                                           "rollout": RolloutWorker})
    groups["actor"].update(batch)          # a RoleView of the fused actor+ref group
    groups["actor"].group.ref_compute_log_prob(batch)

The ``local`` backend reads only ``num_workers`` and whether bundles ask for GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from polyrl.controller.errors import ResourcePoolError

if TYPE_CHECKING:
    from polyrl.controller.worker import Worker, WorkerSpec
    from polyrl.controller.worker_group import RoleView, WorkerGroup

__all__ = ["ResourcePool", "ResourcePoolManager"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ResourcePool:
    """``num_workers`` identical bundles of resources reserved together on a Ray cluster.

    Args:
        name: pool name (used in placement-group names and error messages).
        num_workers: number of bundles, i.e. ranks of a group built on the pool.
        cpus_per_worker: logical CPUs per bundle (fractions allowed).
        gpus_per_worker: GPUs per bundle (fractions allowed).
        resources_per_worker: extra custom Ray resources per bundle.
        strategy: ``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
        max_colocate_count: how many worker processes may share one bundle (each takes an equal
            fraction of it). Colocated *roles* share one process and need no extra count.
        ready_timeout_s: how long to wait for the cluster to grant the reservation.
        claim_device: whether each rank selects its GPU in its own process
            (``torch.cuda.set_device``). ``False`` for ranks that hand their GPUs to a child
            process (rollout replica servers) and must not hold a CUDA context themselves.
    """

    def __init__(
        self,
        name: str,
        num_workers: int,
        *,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        resources_per_worker: Mapping[str, float] | None = None,
        strategy: str = "PACK",
        max_colocate_count: int = 1,
        ready_timeout_s: float = 60.0,
        claim_device: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"ResourcePool name must be a non-empty str, got {name!r}")
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(
                f"ResourcePool {name!r}: num_workers must be an int >= 1, got {num_workers!r}"
            )
        if cpus_per_worker < 0 or gpus_per_worker < 0:
            raise ValueError(
                f"ResourcePool {name!r}: cpus_per_worker and gpus_per_worker must be >= 0"
            )
        extra = dict(resources_per_worker or {})
        for key, value in extra.items():
            if key in ("CPU", "GPU"):
                raise ValueError(
                    f"ResourcePool {name!r}: set {key} with cpus_per_worker/gpus_per_worker, not "
                    "resources_per_worker"
                )
            if value <= 0:
                raise ValueError(f"ResourcePool {name!r}: resource {key!r} must be > 0")
        if cpus_per_worker == 0 and gpus_per_worker == 0 and not extra:
            raise ValueError(f"ResourcePool {name!r}: each bundle must request some resource")
        strategy = strategy.upper() if isinstance(strategy, str) else strategy
        if strategy not in _STRATEGIES:
            raise ValueError(
                f"ResourcePool {name!r}: strategy must be one of {_STRATEGIES}, got {strategy!r}"
            )
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"ResourcePool {name!r}: max_colocate_count must be an int >= 1")
        self.name = name
        self.num_workers = num_workers
        self.cpus_per_worker = float(cpus_per_worker)
        self.gpus_per_worker = float(gpus_per_worker)
        self.resources_per_worker = extra
        self.strategy = strategy
        self.max_colocate_count = max_colocate_count
        self.ready_timeout_s = float(ready_timeout_s)
        self.claim_device = bool(claim_device)
        self._pg: Any = None
        self._rank_order: list[tuple[int, str]] | None = None
        # Set on a pool made by share(): it places its ranks in this pool's bundles.
        self._owner: ResourcePool | None = None

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.name!r}, num_workers={self.num_workers}, "
            f"cpus={self.cpus_per_worker}, gpus={self.gpus_per_worker}, strategy={self.strategy})"
        )

    @property
    def world_size(self) -> int:
        """Number of bundles (ranks)."""
        return self.num_workers

    @property
    def use_gpu(self) -> bool:
        """Whether bundles request GPUs."""
        return self.gpus_per_worker > 0

    @property
    def pins_gpu(self) -> bool:
        """Whether each rank's process selects its GPU (bundles with GPUs, ``claim_device``)."""
        return self.use_gpu and self.claim_device

    def share(self, name: str, *, claim_device: bool = False) -> ResourcePool:
        """Return a pool whose rank ``i`` runs in this pool's ``i``-th rank bundle, beside it.

        Hybrid placement: rollout replica processes run on the GPUs of the training ranks.
        Each process of the new pool takes the same share of a bundle as this pool's workers
        (``1 / max_colocate_count``; Ray then exposes the bundle's GPU to both), so this pool
        needs ``max_colocate_count >= 2``. The new pool never reserves or releases anything:
        its placement group is this pool's.

        Raises:
            ResourcePoolError: this pool leaves no room in its bundles (``max_colocate_count``
                is 1).
        """
        if self.max_colocate_count < 2:
            raise ResourcePoolError(
                f"ResourcePool {self.name!r}: cannot share bundles with {name!r}: its workers "
                "take whole bundles (create it with max_colocate_count >= 2)"
            )
        view = ResourcePool(
            name,
            self.num_workers,
            cpus_per_worker=self.cpus_per_worker,
            gpus_per_worker=self.gpus_per_worker,
            resources_per_worker=self.resources_per_worker,
            strategy=self.strategy,
            max_colocate_count=self.max_colocate_count,
            ready_timeout_s=self.ready_timeout_s,
            claim_device=claim_device,
        )
        view._owner = self
        return view

    def bundle(self) -> dict[str, float]:
        """Return the resources of one bundle, in Ray's bundle format."""
        out: dict[str, float] = {}
        if self.cpus_per_worker:
            out["CPU"] = self.cpus_per_worker
        if self.gpus_per_worker:
            out["GPU"] = self.gpus_per_worker
        out.update(self.resources_per_worker)
        return out

    def actor_resources(self) -> dict[str, Any]:
        """Ray actor options for one worker process in a bundle (its share of the bundle)."""
        share = 1.0 / self.max_colocate_count
        custom = {k: v * share for k, v in self.resources_per_worker.items()}
        return {
            "num_cpus": self.cpus_per_worker * share,
            "num_gpus": self.gpus_per_worker * share,
            **({"resources": custom} if custom else {}),
        }

    @property
    def is_reserved(self) -> bool:
        """Whether the placement group currently exists."""
        return self._pg is not None

    def placement_group(self) -> Any:
        """Return the pool's Ray placement group, created (and waited for) on first use."""
        import ray
        from ray.util.placement_group import placement_group

        if self._owner is not None:
            return self._owner.placement_group()
        if self._pg is not None:
            return self._pg
        if not ray.is_initialized():
            raise ResourcePoolError(
                f"ResourcePool {self.name!r}: Ray is not initialised; call ray.init() first"
            )
        pg = placement_group(
            [self.bundle() for _ in range(self.num_workers)],
            strategy=self.strategy,
            name=f"polyrl:{self.name}:{id(self):x}",
        )
        ready, _ = ray.wait([pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            from ray.util import remove_placement_group

            remove_placement_group(pg)
            raise ResourcePoolError(
                f"ResourcePool {self.name!r}: the cluster could not reserve {self.num_workers} x "
                f"{self.bundle()} with strategy {self.strategy} within "
                f"{self.ready_timeout_s:.0f}s; "
                f"cluster total {_plain(ray.cluster_resources())}, available now "
                f"{_plain(ray.available_resources())}"
            )
        self._pg = pg
        return pg

    def rank_bundles(self) -> list[tuple[int, str]]:
        """Return ``(bundle_index, node_id)`` for each rank, in rank order.

        Ranks of one node are contiguous and nodes ordered by their lowest bundle index, so rank 0
        is on bundle 0's node.
        """
        if self._owner is not None:
            return self._owner.rank_bundles()
        if self._rank_order is not None:
            return self._rank_order
        from ray.util.placement_group import placement_group_table

        pg = self.placement_group()
        table = placement_group_table(pg)
        to_node = {int(k): str(v) for k, v in table.get("bundles_to_node_id", {}).items()}
        deadline = time.monotonic() + 10.0
        while len(to_node) < self.num_workers and time.monotonic() < deadline:
            time.sleep(0.05)
            table = placement_group_table(pg)
            to_node = {int(k): str(v) for k, v in table.get("bundles_to_node_id", {}).items()}
        if len(to_node) < self.num_workers:
            raise ResourcePoolError(
                f"ResourcePool {self.name!r}: placement group reports nodes for only "
                f"{len(to_node)} of {self.num_workers} bundles"
            )
        first_index: dict[str, int] = {}
        for index in sorted(to_node):
            first_index.setdefault(to_node[index], index)
        order = sorted(to_node, key=lambda i: (first_index[to_node[i]], i))
        self._rank_order = [(i, to_node[i]) for i in order]
        return self._rank_order

    def release(self) -> None:
        """Remove the placement group (its workers must be gone first); idempotent.

        A pool made by :meth:`share` releases nothing: the placement group is its owner's.
        """
        if self._pg is None:
            return
        import ray
        from ray.util import remove_placement_group

        if ray.is_initialized():
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - already removed with the cluster
                pass
        self._pg = None
        self._rank_order = None


def _plain(resources: Mapping[str, float]) -> dict[str, float]:
    """Resources without the per-placement-group bookkeeping entries Ray adds."""
    return {
        k: v
        for k, v in sorted(resources.items())
        if "_group_" not in k and not k.startswith("node:")
    }


class ResourcePoolManager:
    """Maps roles onto named pools; roles sharing a pool become one colocated group.

    Args:
        pools: the pools (a sequence, or a mapping whose keys must equal the pool names).
        role_to_pool: role name -> pool name.
    """

    def __init__(
        self,
        pools: Sequence[ResourcePool] | Mapping[str, ResourcePool],
        role_to_pool: Mapping[str, str],
    ) -> None:
        if isinstance(pools, Mapping):
            for key, pool in pools.items():
                if key != pool.name:
                    raise ValueError(
                        f"pool mapping key {key!r} differs from pool name {pool.name!r}"
                    )
            pool_list = list(pools.values())
        else:
            pool_list = list(pools)
        by_name: dict[str, ResourcePool] = {}
        for pool in pool_list:
            if not isinstance(pool, ResourcePool):
                raise TypeError(f"pools must be ResourcePool objects, got {type(pool).__name__}")
            if pool.name in by_name:
                raise ValueError(f"two pools are named {pool.name!r}")
            by_name[pool.name] = pool
        for role, pool_name in role_to_pool.items():
            if pool_name not in by_name:
                raise ValueError(
                    f"role {role!r} maps to unknown pool {pool_name!r}; pools: {sorted(by_name)}"
                )
        self.pools = by_name
        self.role_to_pool = dict(role_to_pool)
        self.groups: dict[str, WorkerGroup] = {}

    def create_worker_groups(
        self,
        specs: Mapping[str, WorkerSpec | type[Worker]],
        **group_kwargs: Any,
    ) -> dict[str, RoleView]:
        """Start one group per pool holding the roles mapped to it; return a view per role.

        ``group_kwargs`` go to every :class:`~polyrl.controller.WorkerGroup` (backend, timeouts).
        Each view exposes its role's methods without prefix; ``view.group`` is the fused group
        (methods there carry the role prefix: ``group.ref_compute_log_prob``).
        """
        from polyrl.controller.worker_group import WorkerGroup

        unknown = sorted(set(specs) - set(self.role_to_pool))
        if unknown:
            raise ValueError(f"roles {unknown} are not mapped to any pool")
        by_pool: dict[str, dict[str, WorkerSpec | type[Worker]]] = {}
        for role, spec in specs.items():
            by_pool.setdefault(self.role_to_pool[role], {})[role] = spec
        views: dict[str, RoleView] = {}
        try:
            for pool_name, roles in by_pool.items():
                group = WorkerGroup(
                    roles, pool=self.pools[pool_name], name=pool_name, **group_kwargs
                )
                self.groups[pool_name] = group
                for role in roles:
                    views[role] = group.role(role)
        except BaseException:
            self.shutdown()
            raise
        return views

    def shutdown(self) -> None:
        """Shut down every group this manager started and release every pool."""
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        for pool in self.pools.values():
            pool.release()
