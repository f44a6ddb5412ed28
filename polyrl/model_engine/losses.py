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
  (:data:`GLOBAL_TOKENS_KEY`, :data:`GLOBAL_SEQS_KEY`): pass :func:`global_counts` to
  :func:`polyrl.core.numerics.agg_loss`;
* ``metrics`` maps names to floats / 0-d tensors describing this micro-batch; the engine
  averages each over micro-batches and ranks, weighted by the micro-batch's loss-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core.numerics import agg_loss

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.model_engine.engine import ModelOutput

__all__ = [
    "GLOBAL_SEQS_KEY",
    "GLOBAL_TOKENS_KEY",
    "LossFn",
    "global_counts",
    "sft_loss",
]

#: ``batch.meta`` key: loss tokens (non-zero ``loss_mask``) in the whole mini-batch, all ranks.
GLOBAL_TOKENS_KEY = "global_token_count"
#: ``batch.meta`` key: rows with at least one loss token in the whole mini-batch, all ranks.
GLOBAL_SEQS_KEY = "global_seq_count"

LossFn = Callable[["ModelOutput", "Batch"], tuple[torch.Tensor, Mapping[str, Any]]]


def global_counts(batch: Batch) -> dict[str, Any]:
    """``num_tokens`` / ``num_seqs`` of the whole mini-batch, for :func:`agg_loss`'s keywords.

    They come from ``batch.meta`` (set by the engine); without them (``None``) the micro-batch
    is taken to be the whole mini-batch.
    """
    return {
        "num_tokens": batch.meta.get(GLOBAL_TOKENS_KEY),
        "num_seqs": batch.meta.get(GLOBAL_SEQS_KEY),
    }


def sft_loss(output: ModelOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the ``loss_mask`` tokens, averaged over all mini-batch tokens.

    ``loss_mask`` may hold 0/1 or per-token weights.  Metric ``sft/nll``: this micro-batch's mean
    NLL per loss token (the engine's ``loss`` is the exact mini-batch mean).
    """
    if "loss_mask" not in batch:
        raise KeyError("sft_loss needs a 'loss_mask' column marking the tokens to learn")
    mask = batch["loss_mask"]
    nll = -output.log_probs
    loss = agg_loss(nll, mask, "token-mean", **global_counts(batch))
    local = agg_loss(nll.detach(), mask, "token-mean")
    return loss, {"sft/nll": float(local)}
