"""Loss-function plug-ins for the model engine, and the SFT loss.

A loss function has the signature ``loss_fn(model_output, batch) -> (loss, metrics)``:

* ``model_output`` is a :class:`polyrl.model_engine.engine.ModelOutput` for one micro-batch; its
  per-token tensors (``log_probs``, ``entropy``, ``values``) are ``(b, T)`` and aligned with the
  micro-batch's columns;
* ``batch`` is that micro-batch (a :class:`polyrl.core.batch.Batch` with the caller's columns,
  only the rows of this micro-batch, and ``loss_mask`` already restricted to tokens that have a
  prediction);
* ``loss`` is a scalar tensor: **this micro-batch's contribution** to the mini-batch loss.  The
  engine back-propagates each contribution and reports their sum over micro-batches and ranks as
  ``loss``.  To make that sum independent of how rows were split into micro-batches and ranks,
  normalise by the mini-batch-wide counts the engine puts in ``batch.meta``
  (:data:`GLOBAL_TOKENS_KEY`, :data:`GLOBAL_SEQS_KEY`), which :func:`aggregate_loss` does;
* ``metrics`` maps names to floats / 0-d tensors describing this micro-batch; the engine
  averages each over micro-batches and ranks, weighted by the micro-batch's loss-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core.numerics import masked_sum

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.model_engine.engine import ModelOutput

__all__ = [
    "AGG_MODES",
    "GLOBAL_SEQS_KEY",
    "GLOBAL_TOKENS_KEY",
    "LossFn",
    "aggregate_loss",
    "sft_loss",
]

#: ``batch.meta`` key: loss tokens (non-zero ``loss_mask``) in the whole mini-batch, all ranks.
GLOBAL_TOKENS_KEY = "global_token_count"
#: ``batch.meta`` key: rows with at least one loss token in the whole mini-batch, all ranks.
GLOBAL_SEQS_KEY = "global_seq_count"

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "sum")

LossFn = Callable[["ModelOutput", "Batch"], tuple[torch.Tensor, Mapping[str, Any]]]


def _global_count(batch: Batch, key: str, local: torch.Tensor) -> torch.Tensor | float:
    value = batch.meta.get(key)
    if value is None:
        # Outside the engine (a single, unsplit batch) the local count is the global one.
        return local.clamp(min=1)
    value = float(value)
    if value < 0:
        raise ValueError(f"batch.meta[{key!r}] must be >= 0, got {value}")
    return max(value, 1.0)


def aggregate_loss(
    values: torch.Tensor, mask: torch.Tensor, batch: Batch, mode: str = "token_mean"
) -> torch.Tensor:
    """Reduce per-token ``values`` ``(b, T)`` to this micro-batch's share of a mini-batch loss.

    Modes (``N`` = global loss tokens, ``S`` = global sequences with a loss token):

    * ``token_mean``: ``sum(values * mask) / N`` -- every token weighs the same;
    * ``seq_mean_token_mean``: ``sum_rows(mean over the row's tokens) / S``;
    * ``seq_mean_token_sum``: ``sum_rows(sum over the row's tokens) / S``;
    * ``sum``: ``sum(values * mask)`` (no normalisation).

    The counts come from ``batch.meta`` (set by the engine); without them the micro-batch is taken
    to be the whole mini-batch.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate_loss: mode must be one of {list(AGG_MODES)}, got {mode!r}")
    if values.shape != mask.shape or values.ndim != 2:
        raise ValueError(
            f"aggregate_loss: values and mask must both be (b, T), got {tuple(values.shape)} and "
            f"{tuple(mask.shape)}"
        )
    mask_f = mask.to(values.dtype)
    if mode == "sum":
        return masked_sum(values * mask_f, mask != 0)
    weighted = masked_sum(values * mask_f, mask != 0, dim=1)
    if mode == "token_mean":
        n = _global_count(batch, GLOBAL_TOKENS_KEY, (mask != 0).sum())
        return weighted.sum() / n
    has_tokens = (mask != 0).any(dim=1)
    s = _global_count(batch, GLOBAL_SEQS_KEY, has_tokens.sum())
    if mode == "seq_mean_token_mean":
        per_row = weighted / mask_f.sum(dim=1).clamp(min=1)
        return per_row.sum() / s
    return weighted.sum() / s


def sft_loss(output: ModelOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the ``loss_mask`` tokens, averaged over all mini-batch tokens.

    ``loss_mask`` may hold 0/1 or per-token weights.  Metric ``sft/nll``: this micro-batch's mean
    NLL per loss token (the engine's ``loss`` is the exact mini-batch mean).
    """
    if "loss_mask" not in batch:
        raise KeyError("sft_loss needs a 'loss_mask' column marking the tokens to learn")
    mask = batch["loss_mask"]
    nll = -output.log_probs
    loss = aggregate_loss(nll, mask, batch, "token_mean")
    with torch.no_grad():
        count = (mask != 0).sum().clamp(min=1)
        local = masked_sum(nll.detach() * mask.to(nll.dtype), mask != 0) / count
    return loss, {"sft/nll": float(local)}
