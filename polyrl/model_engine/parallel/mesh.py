"""One device mesh for data, Ulysses sequence, tensor and expert parallelism.

Ranks are laid out ``(dp_shard, sp, tp)`` with ``tp`` varying fastest (tensor-parallel peers
exchange the most data, so they sit closest: same host, NVLink).  Sequence-parallel (Ulysses)
ranks hold the same parameters, so FSDP shards parameters over ``dp_shard x sp`` flattened
(mesh dimension ``"dp_sp"``); gradients are summed there, which adds each sequence shard's
contribution.  Data (rows) is split over ``dp_shard`` only: every rank of one ``(sp, tp)``
group sees the same rows.

Expert parallelism borrows ranks from ``dp_shard x sp`` (as torchtitan does): :meth:`ParallelMesh.
expert_mesh` returns a ``("ep_replicate", "ep", "tp")`` view of the same ranks in which ``ep``
groups are consecutive ``dp_sp`` ranks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_DIMS", "ParallelDims", "ParallelMesh", "build_parallel_mesh"]

#: Names of the mesh dimensions, outermost first.
MESH_DIMS = ("dp_shard", "sp", "tp")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel axes; ``dp_shard * sp * tp == world``.

    Attributes:
        world: number of processes.
        dp_shard: data-parallel ranks (each sees different rows).
        sp: Ulysses sequence-parallel ranks (``ulysses_sequence_parallel_size``).
        tp: tensor-parallel ranks (``tensor_parallel_size``).
        ep: expert-parallel ranks (``expert_parallel_size``), taken from ``dp_shard * sp``.
    """

    world: int
    dp_shard: int
    sp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, world: int, tp: int = 1, sp: int = 1, ep: int = 1) -> ParallelDims:
        """Derive ``dp_shard`` from the world size; raise naming the keys when they do not fit.

        Raises:
            ValueError: a size is below 1, ``tp * sp`` does not divide ``world``, or ``ep`` does
                not divide ``dp_shard * sp``.
        """
        sizes = {
            "tensor_parallel_size": tp,
            "ulysses_sequence_parallel_size": sp,
            "expert_parallel_size": ep,
        }
        for key, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig.{key} must be an int >= 1, got {value!r}")
        if world % (tp * sp):
            raise ValueError(
                f"tensor_parallel_size={tp} x ulysses_sequence_parallel_size={sp} must divide the "
                f"world size {world}: the data-parallel size dp_shard = world / (tp * sp) and "
                "dp_shard * ulysses_sequence_parallel_size * tensor_parallel_size must equal the "
                "world size"
            )
        dp = world // (tp * sp)
        if (dp * sp) % ep:
            raise ValueError(
                f"expert_parallel_size={ep} must divide dp_shard * ulysses_sequence_parallel_size "
                f"= {dp} * {sp} (world {world}, tensor_parallel_size={tp})"
            )
        return cls(world=world, dp_shard=dp, sp=sp, tp=tp, ep=ep)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(dp_shard, sp, tp)``: the mesh shape (what a checkpoint records)."""
        return (self.dp_shard, self.sp, self.tp)

    @property
    def trivial(self) -> bool:
        """True when only data parallelism is used (the engine's plain FSDP/HSDP path)."""
        return self.sp == 1 and self.tp == 1 and self.ep == 1


class ParallelMesh:
    """The device mesh and the sub-meshes / groups each part of the engine uses."""

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh) -> None:
        self.dims = dims
        self.mesh = mesh
        names = mesh.mesh_dim_names or ()
        self._has_tp = "tp" in names
        if dims.sp > 1:
            # FSDP shards over dp x sp: Ulysses ranks hold identical parameters.
            self.fsdp_mesh = mesh["dp_shard", "sp"]._flatten("dp_sp")
        else:
            self.fsdp_mesh = mesh["dp_shard"]
        self._expert: DeviceMesh | None = None

    @property
    def tp_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's tensor-parallel peers."""
        return self.mesh["tp"]

    @property
    def sp_mesh(self) -> DeviceMesh:
        """1-D mesh of this rank's sequence-parallel peers."""
        return self.mesh["sp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh of the data-parallel ranks (different rows) this rank belongs to."""
        return self.mesh["dp_shard"]

    def group(self, dim: str) -> dist.ProcessGroup:
        """Process group of mesh dimension ``dim`` (``"dp_shard"``, ``"sp"`` or ``"tp"``)."""
        return self.mesh[dim].get_group()

    @property
    def dp_rank(self) -> int:
        """Data-parallel index of this rank."""
        return self.mesh["dp_shard"].get_local_rank()

    @property
    def sp_rank(self) -> int:
        """Index of this rank among its sequence-parallel peers."""
        return self.mesh["sp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        """Index of this rank among its tensor-parallel peers."""
        return self.mesh["tp"].get_local_rank()

    def expert_mesh(self) -> DeviceMesh:
        """Return a ``("ep_replicate", "ep", "tp")`` mesh over the same ranks (built once).

        ``ep`` groups are ``expert_parallel_size`` consecutive ranks of ``dp_shard x sp``
        (flattened); ``ep_replicate`` indexes the groups holding the same experts.  Use
        ``expert_mesh()["ep"]`` for the all-to-all of routed tokens.
        """
        if self._expert is None:
            d = self.dims
            ranks = self.mesh.mesh.reshape(d.dp_shard * d.sp // d.ep, d.ep, d.tp)
            self._expert = DeviceMesh(
                self.mesh.device_type, ranks, mesh_dim_names=("ep_replicate", "ep", "tp")
            )
        return self._expert


def build_parallel_mesh(device: torch.device, dims: ParallelDims) -> ParallelMesh:
    """Build the ``(dp_shard, sp, tp)`` mesh of ``dims`` on ``device``'s type (gloo on CPU)."""
    if dist.is_initialized() and dist.get_world_size() != dims.world:
        raise ValueError(
            f"ParallelDims is for {dims.world} ranks, the process group has {dist.get_world_size()}"
        )
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=MESH_DIMS)
    return ParallelMesh(dims, mesh)
