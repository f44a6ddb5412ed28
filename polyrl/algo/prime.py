"""PRIME: an implicit process reward model (PRM) trained online on outcome labels.

Level: the algorithm layer (pure functions of ``(B, T)`` tensors). PRIME (Cui et al., 2025,
"Process Reinforcement through Implicit Rewards") trains a second causal LM, the PRM
``pi_prm`` (initialised from the policy), against the frozen reference model ``pi_ref``:

- token implicit reward: ``r_t = beta * (log pi_prm(y_t) - log pi_ref(y_t))``;
- sequence implicit reward (a log-likelihood ratio): ``q = sum_t r_t``;
- PRM loss: binary cross-entropy of ``sigmoid(q)`` against the outcome label ``y`` (1 for a
  correct response, 0 otherwise), averaged over sequences.

Training on outcome labels alone makes ``r_t`` a dense, per-token credit assignment (the
paper's implicit PRM); the advantage estimator that combines it with the outcome reward is
``prime`` in :mod:`polyrl.algo.advantages`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrl.core.numerics import agg_loss

__all__ = ["implicit_prm_loss", "implicit_reward_metrics", "implicit_rewards"]


def _log_ratio(
    prm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    for name, t in (("prm_log_probs", prm_log_probs), ("ref_log_probs", ref_log_probs)):
        if t.shape != mask.shape or mask.dim() != 2:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must equal the (B, T) mask shape "
                f"{tuple(mask.shape)}"
            )
    # Off the mask the log-probs may be anything (a shared-prefix pass leaves prompt columns
    # unset): zero them rather than multiply, so a NaN there cannot leak in.
    diff = prm_log_probs - ref_log_probs.to(prm_log_probs.dtype)
    return torch.where(mask != 0, diff * mask.to(diff.dtype), torch.zeros_like(diff))


def implicit_rewards(
    prm_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Token-level implicit process rewards ``beta * (log pi_prm - log pi_ref)``, ``(B, T)``.

    Zero wherever ``mask`` is zero; a weighted mask scales each token's reward.
    """
    with torch.no_grad():
        return beta * _log_ratio(prm_log_probs, ref_log_probs, mask)


def implicit_prm_loss(
    prm_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    beta: float,
    *,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of ``sigmoid(beta * sum_t log(pi_prm / pi_ref))`` against ``labels``.

    Args:
        prm_log_probs: the PRM's token log-probs ``(B, T)`` (with gradients).
        ref_log_probs: the reference model's token log-probs ``(B, T)``.
        mask: the response tokens ``(B, T)``; rows without one are left out.
        labels: outcome labels ``(B,)`` in ``[0, 1]`` (accuracy).
        beta: the implicit reward's scale.
        num_seqs: the number of sequences the loss is averaged over (a model engine passes the
            mini-batch-wide count so micro-batch losses add up); default: this batch's.

    Returns ``(loss, metrics)``; metrics (this batch's, over rows with a response token):
    ``prm_accuracy`` (the sign of ``q`` agrees with the label: ``q > 0`` for label 1,
    ``q <= 0`` for label 0) and ``implicit_reward_mean`` (the mean of ``q``).
    """
    labels = labels.reshape(-1)
    if labels.shape[0] != mask.shape[0]:
        raise ValueError(f"labels has {labels.shape[0]} entries, expected one per row")
    q = beta * _log_ratio(prm_log_probs, ref_log_probs, mask).sum(-1)
    per_row = F.binary_cross_entropy_with_logits(q, labels.to(q.dtype), reduction="none")
    # Spread each row's loss over its tokens and take the token mean per row: agg_loss then
    # averages rows exactly (with the global row count when given).
    loss = agg_loss(
        per_row.unsqueeze(-1).expand_as(mask),
        (mask != 0).to(per_row.dtype),
        "seq-mean-token-mean",
        num_seqs=num_seqs,
    )
    return loss, implicit_reward_metrics(q.detach(), labels, mask)


def implicit_reward_metrics(
    q: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """PRM diagnostics of sequence implicit rewards ``q (B,)`` against outcome ``labels (B,)``.

    Over rows holding a response token: ``prm_accuracy`` (``q > 0`` exactly for label > 0.5),
    ``implicit_reward_mean``, and the mean ``q`` of correct / wrong responses
    (``implicit_reward_correct_mean``, ``implicit_reward_wrong_mean``; left out without such
    rows).
    """
    rows = (mask != 0).any(-1)
    q, labels = q.float()[rows], labels.reshape(-1).float()[rows]
    if q.numel() == 0:
        return {}
    correct = labels > 0.5
    out = {
        "prm_accuracy": float(((q > 0) == correct).float().mean()),
        "implicit_reward_mean": float(q.mean()),
    }
    if correct.any():
        out["implicit_reward_correct_mean"] = float(q[correct].mean())
    if not correct.all():
        out["implicit_reward_wrong_mean"] = float(q[~correct].mean())
    return out
