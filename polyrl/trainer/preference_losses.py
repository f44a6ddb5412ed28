"""DPO and reward-model losses as model-engine loss functions, and their per-pair metrics.

Level: the trainer layer, binding the pure math of :mod:`polyrl.algo.preference` to the model
engine's loss plug-in signature (:data:`polyrl.model_engine.engine.LossFn`).

Pair batches (built by :func:`polyrl.trainer.preference_data.collate_pairs`) interleave rows:
row ``2i`` is pair ``i``'s chosen sequence and row ``2i + 1`` its rejected one, and
``batch.meta[ROW_GROUP_KEY] = 2`` keeps both rows of a pair in one micro-batch. Columns:

* ``input_ids``, ``attention_mask``; ``loss_mask``: 1 on the completion's tokens (all zero on
  the padding pairs a data-parallel split may add: such pairs count for nothing);
* ``ref_logps`` ``(B,)`` (DPO with a reference): the reference model's log-prob of each row's
  completion, summed over its tokens;
* ``margin`` ``(B,)`` (reward model, optional): the pair's margin, the same on both rows.

Each loss sums its per-pair terms and divides by the number of pairs in the whole mini-batch
(from the engine's global sequence count), so the micro-batch contributions add up to the
mini-batch mean whatever the split. Metrics use TRL's names (``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` for DPO; ``accuracy``, ``margin``, ``rewards/chosen``, ``rewards/rejected``
for reward models) and come out of the engine as exact means over the mini-batch's pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from polyrl.algo.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss
from polyrl.model_engine.engine import GLOBAL_SEQS_KEY, GLOBAL_TOKENS_KEY

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.model_engine.engine import ModelOutput

__all__ = [
    "DPO_METRICS",
    "RM_METRICS",
    "completion_log_probs",
    "dpo_engine_loss",
    "dpo_pair_terms",
    "last_token_scores",
    "reward_model_engine_loss",
    "reward_pair_terms",
]


#: Per-pair metrics of the DPO loss (TRL's names).
DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
#: Per-pair metrics of the reward-model loss.
RM_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


def _pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a per-row tensor ``(2P, ...)`` into its chosen and rejected rows ``(P, ...)``."""
    if values.shape[0] % 2:
        raise ValueError(
            f"a pair batch has an even number of rows (chosen, rejected, ...), got "
            f"{values.shape[0]}"
        )
    return values[0::2], values[1::2]


def completion_log_probs(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function: each row's summed ``loss_mask`` log-probs and token count."""
    mask = batch["loss_mask"].to(output.log_probs.dtype)
    return {"logps": (output.log_probs * mask).sum(dim=1), "num_tokens": mask.sum(dim=1)}


def _last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Return the value at each row's last real token."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def last_token_scores(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function (value model): ``{"scores": (b,)}``, the value at the last token.

    This is the score Hugging Face's ``<Arch>ForSequenceClassification`` reads: the output at
    each row's last non-pad token.
    """
    return {"scores": _last_token_values(output.values, batch["attention_mask"])}


def dpo_pair_terms(
    policy_logps: torch.Tensor,
    num_tokens: torch.Tensor,
    ref_logps: torch.Tensor | None,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO losses ``(P,)`` and metrics, from per-row (interleaved) sums ``(2P,)``.

    ``ref_logps`` are summed like ``policy_logps``; length-normalised loss types divide both by
    ``num_tokens``. Shared by the training loss and by validation on the engine's inferences.
    """
    spec = DPO_LOSSES.get(loss_type)
    policy = policy_logps
    ref = ref_logps
    if spec.length_normalized:
        count = num_tokens.clamp(min=1).to(policy.dtype)
        policy = policy / count
        ref = None if ref is None else ref / count
    pc, pr = _pairs(policy)
    rc, rr = _pairs(ref) if ref is not None and not spec.reference_free else (None, None)
    out = dpo_loss(
        pc,
        pr,
        rc,
        rr,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
    )
    metrics = {
        "rewards/chosen": out.chosen_rewards,
        "rewards/rejected": out.rejected_rewards,
        "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float(),
        "rewards/margins": out.chosen_rewards - out.rejected_rewards,
        "logps/chosen": pc.detach(),
        "logps/rejected": pr.detach(),
    }
    return out.losses, metrics


def reward_pair_terms(
    scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair Bradley-Terry losses ``(P,)`` and metrics, from per-row scores ``(2P,)``."""
    chosen, rejected = _pairs(scores)
    pair_margin = None if margin is None else _pairs(margin)[0]
    losses = bradley_terry_loss(chosen, rejected, pair_margin, center_rewards_coefficient)
    c, r = chosen.detach(), rejected.detach()
    metrics = {
        "accuracy": (c > r).float(),
        "margin": c - r,
        "rewards/chosen": c,
        "rewards/rejected": r,
    }
    return losses, metrics


def _reduce(
    losses: torch.Tensor, metrics: dict[str, torch.Tensor], batch: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return this micro-batch's share of the mini-batch mean loss, and its metrics.

    The engine averages a metric over micro-batches and ranks weighted by each micro-batch's
    loss-token count; scaling each micro-batch's pair sum by ``global tokens / (local tokens *
    global pairs)`` makes that weighted average the exact mean over the mini-batch's pairs.
    """
    active = _pairs(batch["loss_mask"] != 0)[0].any(dim=1)
    local_pairs = float(active.sum())
    local_tokens = float((batch["loss_mask"] != 0).sum())
    global_seqs = batch.meta.get(GLOBAL_SEQS_KEY)
    global_tokens = batch.meta.get(GLOBAL_TOKENS_KEY)
    pairs = local_pairs if global_seqs is None else float(global_seqs) / 2.0
    tokens = local_tokens if global_tokens is None else float(global_tokens)
    weights = active.to(losses.dtype)
    loss = (losses * weights).sum() / max(pairs, 1.0)
    scale = tokens / (local_tokens * max(pairs, 1.0)) if local_tokens else 0.0
    out = {name: float((v * weights).sum()) * scale for name, v in metrics.items()}
    return loss, out


def dpo_engine_loss(
    output: ModelOutput,
    batch: Batch,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Engine loss function of DPO (see the module docstring for the batch layout)."""
    sums = completion_log_probs(output, batch)
    ref = batch["ref_logps"] if "ref_logps" in batch.tensor_keys else None
    if ref is None and not DPO_LOSSES.get(loss_type).reference_free:
        raise KeyError(f"DPO loss_type {loss_type!r} needs a 'ref_logps' column")
    losses, metrics = dpo_pair_terms(
        sums["logps"],
        sums["num_tokens"],
        None if ref is None else ref.to(sums["logps"].dtype),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
    )
    return _reduce(losses, metrics, batch)


def reward_model_engine_loss(
    output: ModelOutput, batch: Batch, *, center_rewards_coefficient: float = 0.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Engine loss function of a reward model: Bradley-Terry on last-token scores."""
    scores = last_token_scores(output, batch)["scores"]
    margin = batch["margin"].to(scores.dtype) if "margin" in batch.tensor_keys else None
    losses, metrics = reward_pair_terms(scores, margin, center_rewards_coefficient)
    return _reduce(losses, metrics, batch)
