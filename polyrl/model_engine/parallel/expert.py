"""Expert parallelism: each MoE layer's experts sharded over the ranks of an ``ep`` mesh.

:func:`apply_expert_parallel` replaces the ``experts`` module of every MoE block (a module with
``gate`` and ``experts``; Hugging Face v5 stores the experts as fused 3-D parameters
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``) by :class:`ShardedExperts`, which keeps
the ``E / ep`` experts of its rank under the same parameter names. Its forward sends each
(token, chosen expert) pair to the rank owning the expert with an all-to-all, runs the local
experts there, and sends the outputs back with a second all-to-all; both are autograd
functions, so the backward pass exchanges gradients the same way.

Integration with data parallelism: the experts' parameters stay plain tensors outside FSDP
(pass :attr:`ExpertParallel.params` as FSDP's ``ignored_params``); every rank still runs its
own data shard. Ranks holding the same experts in different ``ep`` groups (the ``replicate``
mesh) sum their expert gradients in :meth:`ExpertParallel.reduce_grads`, which the engine calls
after backward; :meth:`ExpertParallel.grad_norm` adds the expert gradients to FSDP's norm;
:meth:`ExpertParallel.full_tensors` gathers whole HF expert tensors for weight sync and export;
:meth:`ExpertParallel.to_checkpoint` shows the shards to ``torch.distributed.checkpoint`` as
DTensors of the whole expert tensors.

The mesh comes from whoever builds the device mesh: any 1-D mesh of the ranks that share one
set of experts (e.g. the ``ep`` dimension of a ``("dp", "ep")`` mesh, consecutive ranks), and
optionally the orthogonal 1-D ``replicate`` mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "ExpertParallel",
    "ShardedExperts",
    "all_to_all",
    "apply_expert_parallel",
    "expert_meshes",
]

# The fused expert parameters of Hugging Face v5 MoE blocks that this module shards.
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x`` (splits in rows per rank)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ShardedExperts(nn.Module):
    """The experts of one MoE block that one ``ep`` rank owns, called like the full module.

    Args:
        experts: the block's Hugging Face experts module (``gate_up_proj``, ``down_proj``,
            ``act_fn``); its parameters are sliced, not kept.
        mesh: the 1-D ``ep`` mesh.
    """

    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        names = {n for n, _ in experts.named_parameters(recurse=False)}
        if names != set(_EXPERT_PARAMS):
            raise ValueError(
                f"expert parallelism shards fused experts with {_EXPERT_PARAMS}; "
                f"{type(experts).__name__} has {sorted(names)}"
            )
        total = int(experts.gate_up_proj.shape[0])
        size = mesh.size()
        if total % size:
            raise ValueError(f"{total} experts do not split over expert_parallel_size={size}")
        self.group = mesh.get_group()
        self.ep_size = size
        self.num_experts = total
        self.num_local = total // size
        first = mesh.get_local_rank() * self.num_local
        device = _mesh_device(mesh)
        for name in _EXPERT_PARAMS:
            full = getattr(experts, name)
            local = full.detach()[first : first + self.num_local].to(device).clone()
            self.register_parameter(name, nn.Parameter(local, requires_grad=full.requires_grad))
        self.act_fn = experts.act_fn

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Route ``(N, H)`` tokens to their ``(N, k)`` experts; return their weighted sum."""
        n, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        token = torch.arange(n, device=hidden_states.device).repeat_interleave(k)
        dest = torch.div(expert, self.num_local, rounding_mode="floor")
        # Rows for rank 0 first, then rank 1, ...: all_to_all_single sends contiguous blocks.
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        in_splits, out_splits = send.tolist(), recv.tolist()
        token, expert = token[order], expert[order]
        local_ids = torch.empty(sum(out_splits), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(
            local_ids, expert - dest[order] * self.num_local, out_splits, in_splits, self.group
        )
        rows = all_to_all(hidden_states[token], out_splits, in_splits, self.group)
        out = all_to_all(self._run_local(rows, local_ids), in_splits, out_splits, self.group)
        weights = top_k_weights.reshape(-1)[order]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token, (out * weights[:, None]).to(final.dtype))

    def _run_local(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # The parameters sit outside FSDP's mixed precision: compute in the activations' dtype.
        gate_up = self.gate_up_proj.to(rows.dtype)
        down = self.down_proj.to(rows.dtype)
        out = torch.zeros_like(rows)
        for e in range(self.num_local):
            hit = (ids == e).nonzero().squeeze(1)
            if hit.numel() == 0:
                continue
            gate, up = F.linear(rows[hit], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, hit, F.linear(self.act_fn(gate) * up, down[e]))
        return out


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class ExpertParallel:
    """What :func:`apply_expert_parallel` did to a model, and the engine's hooks for it.

    Attributes:
        names: the Hugging Face names of the sharded expert parameters.
        params: those parameters (this rank's experts), for FSDP's ``ignored_params`` and the
            optimizer's own parameter group.
    """

    def __init__(
        self,
        modules: dict[str, ShardedExperts],
        ep_mesh: DeviceMesh,
        replicate_mesh: DeviceMesh | None,
    ):
        self.modules = modules
        self.ep_mesh = ep_mesh
        self.replicate_mesh = (
            replicate_mesh if replicate_mesh and replicate_mesh.size() > 1 else None
        )
        self.names: dict[str, nn.Parameter] = {
            f"{prefix}.{name}": getattr(m, name)
            for prefix, m in modules.items()
            for name in _EXPERT_PARAMS
        }
        self.params: list[nn.Parameter] = list(self.names.values())

    def reduce_grads(self) -> None:
        """Give every expert parameter a gradient summed over the ``replicate`` ranks; collective.

        A rank whose experts got no token has no gradient: it gets zeros, so every rank steps
        the same parameters (as the unsharded model, whose fused expert tensor always has one).
        """
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.replicate_mesh is not None:
                dist.all_reduce(p.grad, group=self.replicate_mesh.get_group())

    def grad_norm(self, other: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """Return the 2-norm of all gradients: ``other`` (FSDP's, maybe DTensors) and the experts'.

        Collective over the ``ep`` group (the expert gradients of its ranks are disjoint; the
        replicate ranks hold the same ones after :meth:`reduce_grads`).
        """
        if norm_type != 2.0:
            raise ValueError("expert parallelism computes the 2-norm of gradients")
        from torch.distributed.tensor import DTensor

        grads = [g for g in other if g is not None]
        dense = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(dense, DTensor):
            dense = dense.full_tensor()
        local = [p.grad for p in self.params if p.grad is not None]
        sq = sum((g.detach().float().pow(2).sum() for g in local), torch.zeros(()))
        sq = sq.to(dense.device)
        dist.all_reduce(sq, group=self.ep_mesh.get_group())
        return (dense.float().pow(2) + sq).sqrt()

    def to_checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return ``state`` with this rank's expert shards as DTensors sharded over ``ep``.

        ``state`` maps fully qualified parameter names to tensors (a model state dict) or to
        dicts of tensors (an optimizer's per-parameter state): the expert entries shaped like
        the local shard become ``Shard(0)`` DTensors of the whole ``(E, ...)`` tensor, so
        ``torch.distributed.checkpoint`` writes each expert once (replicas deduplicated) and
        reads back this rank's experts. Other entries (scalars such as Adam's ``step``) pass.
        """
        from torch.distributed.tensor import DTensor, Shard

        def wrap(value: Any, local_shape: torch.Size) -> Any:
            if not isinstance(value, torch.Tensor) or value.shape != local_shape:
                return value
            shape = torch.Size((local_shape[0] * self.ep_mesh.size(), *local_shape[1:]))
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(
                value, self.ep_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
            )

        out = dict(state)
        for name, param in self.names.items():
            if name not in out:
                continue
            value = out[name]
            if isinstance(value, dict):
                out[name] = {k: wrap(v, param.shape) for k, v in value.items()}
            else:
                out[name] = wrap(value, param.shape)
        return out

    def from_checkpoint(self, state: dict[str, Any]) -> dict[str, Any]:
        """Undo :meth:`to_checkpoint`: the expert DTensors back to this rank's local shards."""
        from torch.distributed.tensor import DTensor

        def unwrap(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value

        out = dict(state)
        for name in self.names:
            if name not in out:
                continue
            value = out[name]
            if isinstance(value, dict):
                out[name] = {k: unwrap(v) for k, v in value.items()}
            else:
                out[name] = unwrap(value)
        return out

    def full_tensors(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``(hf_name, tensor)`` pairs on, expert shards gathered whole; collective.

        All ranks must exhaust it in the same order (one all-gather per expert tensor).
        """
        group = self.ep_mesh.get_group()
        for name, tensor in named:
            if name in self.names:
                parts = [torch.empty_like(tensor) for _ in range(self.ep_mesh.size())]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                tensor = torch.cat(parts, dim=0)
            yield name, tensor


def expert_meshes(device_type: str, world: int, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """Build ``(ep mesh, replicate mesh)``: ``ep`` groups of consecutive ranks; collective.

    The 1-D views of a ``("ep_replicate", "ep")`` mesh over all ``world`` ranks, for an engine
    that builds no other mesh with an ``ep`` dimension.
    """
    if ep < 1 or world % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide the world size {world}")
    mesh = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("ep_replicate", "ep"))
    return mesh["ep"], mesh["ep_replicate"]


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, replicate_mesh: DeviceMesh | None = None
) -> ExpertParallel:
    """Shard the experts of every MoE block of ``model`` over ``ep_mesh``, in place.

    Call before FSDP sharding, and pass the returned :attr:`ExpertParallel.params` to
    ``fully_shard(..., ignored_params=...)``.

    Args:
        model: a Hugging Face MoE model (on CPU or its device).
        ep_mesh: 1-D mesh of the ranks that split one set of experts (all-to-all group).
        replicate_mesh: 1-D mesh of the ranks holding the same experts in other ``ep`` groups
            (their expert gradients are summed); ``None`` when there is one ``ep`` group.

    Returns:
        The :class:`ExpertParallel` handle; raises ``ValueError`` for a model without MoE blocks.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel takes a 1-D mesh, got {ep_mesh.ndim} dimensions")
    modules: dict[str, ShardedExperts] = {}
    for name, block in list(model.named_modules()):
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module) and isinstance(getattr(block, "gate", None), nn.Module):
            sharded = ShardedExperts(experts, ep_mesh)
            block.experts = sharded
            modules[f"{name}.experts" if name else "experts"] = sharded
    if not modules:
        raise ValueError(f"{type(model).__name__} has no MoE blocks to shard over experts")
    return ExpertParallel(modules, ep_mesh, replicate_mesh)
