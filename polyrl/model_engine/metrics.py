"""Accumulate a loss function's per-micro-batch metrics and reduce them over ranks.

:class:`MetricsAccumulator` is the reduction half of
:meth:`~polyrl.model_engine.engine.TrainingEngine.forward_backward`: the engine adds each
micro-batch's loss contribution, compute tokens and metrics, and :meth:`MetricsAccumulator.reduce`
sums them over all data-parallel ranks in one ``all_reduce`` (fp64).  A metric is averaged
weighted by each micro-batch's loss-token count; where no micro-batch had loss tokens, it is the
plain mean over the micro-batches that reported it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["MetricsAccumulator", "metric_to_float"]


def metric_to_float(value: Any, what: str) -> float:
    """Return a metric value (a number or one-element tensor) as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().float().item())
    if isinstance(value, int | float | np.floating | np.integer) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what} must be a number or a 0-d tensor, got {type(value).__name__}")


def _union_keys(keys: set[str], world_size: int, group: Any = None) -> list[str]:
    """Sorted union of every rank's metric names (collective when ``world_size > 1``)."""
    if world_size == 1:
        return sorted(keys)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, sorted(keys), group=group)
    return sorted(set().union(*gathered))


class MetricsAccumulator:
    """Sums over one rank's micro-batches of the loss, compute tokens and metrics."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.compute_tokens = 0
        # name -> [weighted sum, weight, plain sum, count]
        self._acc: dict[str, list[float]] = {}

    def add(
        self, loss: torch.Tensor, compute_tokens: int, weight: float, metrics: Mapping[str, Any]
    ) -> None:
        """Add one micro-batch: its loss contribution, model positions, loss tokens, metrics."""
        self.loss_sum += float(loss.detach().float())
        self.compute_tokens += compute_tokens
        for name, value in metrics.items():
            v = metric_to_float(value, f"metric {name!r}")
            slot = self._acc.setdefault(str(name), [0.0, 0.0, 0.0, 0.0])
            slot[0] += weight * v
            slot[1] += weight
            slot[2] += v
            slot[3] += 1.0

    def reduce(
        self, world_size: int, counts: Mapping[str, float], group: Any = None
    ) -> dict[str, float]:
        """Sum over all ranks (collective when ``world_size > 1``); return the metrics.

        ``group``: the data-parallel process group of ``world_size`` ranks (default: all ranks;
        a backend whose ranks also split the model, e.g. Megatron's tensor parallelism, passes
        its data-parallel group so each replica's loss counts once).

        In order: ``loss`` (the summed contributions), ``counts`` as given, ``compute_tokens``,
        then each metric by name (a name already taken is reported as ``loss_fn/<name>``).
        """
        names = _union_keys(set(self._acc), world_size, group)
        flat = [self.loss_sum, float(self.compute_tokens)]
        for name in names:
            flat.extend(self._acc.get(name, [0.0, 0.0, 0.0, 0.0]))
        reduced = torch.tensor(flat, dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(reduced, group=group)
        values = reduced.tolist()
        out: dict[str, float] = {"loss": values[0], **counts, "compute_tokens": values[1]}
        for i, name in enumerate(names):
            wsum, wtot, psum, cnt = values[2 + 4 * i : 6 + 4 * i]
            if name in out:
                name = f"loss_fn/{name}"
            out[name] = wsum / wtot if wtot > 0 else (psum / cnt if cnt > 0 else float("nan"))
        return out
