"""Mixture-of-experts routers of Hugging Face models: finding them and forcing their choices.

Hugging Face (v5) MoE blocks hold a ``gate`` (the router: a module with ``top_k`` and a
``weight`` of shape ``(experts, hidden)``) and ``experts``; the router maps ``(N, hidden)``
tokens to ``(router_logits, top_k_weights, top_k_index)`` and the experts consume the last two.
This module is shared by the rollout engine (which records the chosen experts) and the training
engine (which replays them, "R3": rollout routing replay), so both agree on what a route is.

Replay assumes the softmax-then-top-k routers of Qwen2/Qwen3-MoE, Mixtral and OLMoE: the
weights of the forced experts are re-read from ``softmax(router_logits)`` (renormalised over the
``k`` chosen when the router has ``norm_topk_prob``), so gradients still reach the router.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["MoEGeometry", "force_routes", "moe_geometry", "moe_routers"]


@dataclasses.dataclass(frozen=True)
class MoEGeometry:
    """Shape of a model's routing.

    ``layers`` MoE layers, each routing a token to ``top_k`` of ``experts`` experts.
    """

    layers: int
    top_k: int
    experts: int


def _is_router(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(getattr(module, "top_k", None), int) and isinstance(weight, torch.Tensor)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """Return the router (``gate``) module of every MoE block of ``model``, in layer order.

    A block is a module with both ``gate`` and ``experts`` children whose gate has an int
    ``top_k`` and a ``weight``; dense models give ``[]``.
    """
    routers = []
    for module in model.modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, nn.Module) and hasattr(module, "experts") and _is_router(gate):
            routers.append(gate)
    return routers


def moe_geometry(model: nn.Module) -> MoEGeometry | None:
    """Return the routing shape of ``model`` (``None`` for a dense model)."""
    routers = moe_routers(model)
    if not routers:
        return None
    first = routers[0]
    experts = getattr(first, "num_experts", None) or int(first.weight.shape[0])
    return MoEGeometry(layers=len(routers), top_k=int(first.top_k), experts=int(experts))


def force_routes(
    router: nn.Module,
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    forced: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace a router's top-k choice by ``forced`` expert ids (a forward-hook's new output).

    Args:
        router: the router module (its ``norm_topk_prob`` is honoured).
        output: what the router returned, ``(logits (N, E), weights (N, k), index (N, k))``.
        forced: ``(N, k)`` expert ids; a row with any negative id keeps the router's own choice
            (tokens the rollout did not record, e.g. prompt tokens from a prefix cache).

    Returns:
        ``(logits, weights, index)`` with the forced rows' weights read from the router's
        softmax at the forced experts, so they stay differentiable in the router weight.
    """
    logits, weights, index = output
    if forced.shape != index.shape:
        raise ValueError(
            f"forced routes have shape {tuple(forced.shape)}, the router chose {tuple(index.shape)}"
        )
    forced = forced.to(device=index.device, dtype=index.dtype)
    keep = (forced < 0).any(dim=-1, keepdim=True)
    chosen = torch.where(keep, index, forced)
    # The same operations as the router (softmax in fp32, gather, renormalise, cast back), so
    # forcing the router's own choice reproduces its weights bit for bit.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(weights.dtype), chosen
