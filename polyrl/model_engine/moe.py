"""Mixture-of-experts hooks of the training engine: routing replay, router statistics, aux loss.

Routing replay ("R3", rollout routing replay): the rollout records which experts each token
went to (:mod:`polyrl.rollout.native`), the trainer carries them as the
:data:`~polyrl.core.columns.ROUTED_EXPERTS` column, and the engine's forward forces the same
experts in every MoE layer (:func:`polyrl.models.moe.force_routes`). Small numeric differences
between the inference and training paths otherwise flip near-tied top-k choices, and a flipped
expert changes a token's log-prob by far more than rounding does.

:class:`RouterHooks` holds one forward hook per router. The engine opens a micro-batch with
:meth:`RouterHooks.begin` (the routes, in the compute layout, and which tokens are real) and
closes it with :meth:`RouterHooks.end` after backward: under activation checkpointing the
routers run again inside backward and must see the same routes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyrl.models.moe import MoEGeometry, force_routes, moe_geometry, moe_routers

__all__ = ["RouterHooks", "load_balancing_loss"]


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


def load_balancing_loss(probs: torch.Tensor, index: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss of one layer: ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the ``N * k`` routing slots that went to expert ``e`` (no
    gradient) and ``P_e`` the mean router probability of ``e``; the loss is 1 when the load is
    uniform and grows as the router concentrates tokens on few experts.

    Args:
        probs: ``(N, E)`` router softmax probabilities (fp32).
        index: ``(N, k)`` chosen experts.
        experts: ``E``.
    """
    if probs.shape[0] == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(index.reshape(-1), minlength=experts).to(probs.dtype)
    frac = counts / index.numel()
    return experts * (frac * probs.mean(dim=0)).sum()


class RouterHooks:
    """Forward hooks on every router of a MoE model.

    Per micro-batch (between :meth:`begin` and :meth:`end`) they:

    * force the given routes (``routes``: ``(N, layers, k)`` ints over the flattened compute
      layout; rows with a negative id route normally);
    * count the experts chosen for the real tokens (:meth:`take_metrics`);
    * when grad is on, sum each layer's :func:`load_balancing_loss`; :attr:`aux_loss` is their
      mean over layers (``None`` outside a micro-batch or without grad).

    Args:
        model: the (unsharded or FSDP-sharded) model; its routers are found by
            :func:`~polyrl.models.moe.moe_routers`.
    """

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        geometry = moe_geometry(model)
        if geometry is None:
            raise ValueError(f"{type(model).__name__} has no MoE routers")
        self.geometry: MoEGeometry = geometry
        self._routes: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._aux: list[torch.Tensor] = []
        # (layers, experts) routing slots counted since the last take_metrics, on the routers'
        # device (copied to the host once per take_metrics, not once per layer).
        self._counts: torch.Tensor | None = None
        self._handles = [
            r.register_forward_hook(functools.partial(self._hook, i))
            for i, r in enumerate(self.routers)
        ]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin(self, routes: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
        """Open a micro-batch.

        ``routes`` are forced (``None``: route normally); ``valid`` ``(N,)`` marks the real
        tokens for the statistics and the aux loss (``None``: all).
        """
        if routes is not None:
            routes = routes.reshape(-1, *routes.shape[-2:])
            if tuple(routes.shape[1:]) != (self.geometry.layers, self.geometry.top_k):
                raise ValueError(
                    f"routed experts have shape {tuple(routes.shape)}; this model routes "
                    f"(tokens, {self.geometry.layers}, {self.geometry.top_k})"
                )
        self._routes = routes
        self._valid = None if valid is None else valid.reshape(-1).bool()
        self._aux = []

    def end(self) -> None:
        """Close the micro-batch (after its backward)."""
        self._routes = None
        self._valid = None
        self._aux = []

    @property
    def replaying(self) -> bool:
        """Whether the open micro-batch forces routes."""
        return self._routes is not None

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Mean over layers of the load-balancing loss of the micro-batch's forward."""
        if not self._aux:
            return None
        return torch.stack(self._aux).mean()

    def _hook(self, layer: int, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, tuple) or len(output) != 3:
            return None
        if self._routes is not None:
            forced = self._routes[:, layer]
            if forced.shape[0] != output[2].shape[0]:
                raise ValueError(
                    f"routed experts cover {forced.shape[0]} tokens, the router saw "
                    f"{output[2].shape[0]}"
                )
            output = force_routes(module, output, forced)
        if _in_backward():
            # Activation checkpointing's recompute: counted and added in the forward already.
            return output
        logits, _, index = output
        valid = self._valid
        if valid is not None and valid.shape[0] == index.shape[0]:
            logits, index = logits[valid], index[valid]
        with torch.no_grad():
            counts = torch.bincount(index.reshape(-1), minlength=self.geometry.experts)
            if self._counts is None or self._counts.device != counts.device:
                shape = (self.geometry.layers, self.geometry.experts)
                self._counts = torch.zeros(shape, dtype=torch.float64, device=counts.device)
            self._counts[layer] += counts
        if torch.is_grad_enabled():
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            self._aux.append(load_balancing_loss(probs, index, self.geometry.experts))
        return output

    def take_metrics(self, world_size: int = 1) -> dict[str, float]:
        """Router statistics since the last call, summed over ranks (collective if > 1 rank).

        ``moe/load_max`` / ``moe/load_min`` / ``moe/load_mean``: the largest, smallest and mean
        share of a layer's routing slots that one expert took (over all layers; uniform load is
        ``1 / experts``); ``moe/load_imbalance``: ``load_max * experts``; ``moe/drop_rate``: the
        share of slots dropped for capacity (0: these MoE layers are dropless).
        """
        shape = (self.geometry.layers, self.geometry.experts)
        counts = torch.zeros(shape, dtype=torch.float64)
        if self._counts is not None:
            counts = self._counts.to("cpu")
            self._counts = None
        if world_size > 1:
            dist.all_reduce(counts)
        totals = counts.sum(dim=1, keepdim=True)
        if float(totals.sum()) == 0:
            return {}
        frac = counts[totals[:, 0] > 0] / totals[totals[:, 0] > 0]
        load_max = float(frac.max())
        return {
            "moe/load_max": load_max,
            "moe/load_min": float(frac.min()),
            "moe/load_mean": float(frac.mean()),
            "moe/load_imbalance": load_max * self.geometry.experts,
            "moe/drop_rate": 0.0,
        }
