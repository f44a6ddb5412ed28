"""On-policy distillation: the teacher's per-token reverse KL as a dense training signal.

Level: the algorithm layer (pure functions of ``(B, T)`` tensors).

The student samples a response; a teacher scores each sampled token. With ``y_t`` the sampled
token, ``logp_s`` the student's (old) log-prob and ``logp_T`` the teacher's, the single-sample
estimate of the per-token reverse KL, ``KL(pi_s || pi_T)`` at that position, is

``k_t = logp_s(y_t) - logp_T(y_t)``

and on-policy distillation (Agarwal et al., 2024, GKD with student samples; Lu et al., 2025,
"On-Policy Distillation") trains the student with the per-token advantage ``-k_t``: tokens the
teacher finds likelier than the student are pushed up, the others down. Added to an outcome
advantage ``A_t`` with weight ``c``, the advantage is ``A_t - c * k_t`` (``c`` alone, with the
outcome reward's advantage 0, is pure distillation).

With the teacher's top-k distribution (its ``k`` most likely tokens ``S_t`` at each position and
their log-probs), the signal is instead the reverse KL over that support, both distributions
renormalised on it (:func:`topk_reverse_kl`):

``KL_t = sum_{v in S_t} q_s(v) (log q_s(v) - log q_T(v))``, ``q(v) = p(v) / sum_{u in S_t} p(u)``

a loss term (weight ``c``) whose gradient reaches every token of ``S_t``, not only the sampled
one.
"""

from __future__ import annotations

import torch

from polyrl.core.numerics import masked_mean

__all__ = ["distill_advantages", "topk_reverse_kl"]


def distill_advantages(
    advantages: torch.Tensor,
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return ``advantages - coef * (logp_student - logp_teacher)`` on ``mask`` and metrics.

    Off the mask the advantages are returned unchanged. Metrics: ``opd/reverse_kl`` (token
    mean of ``k_t`` over the mask) and ``opd/reverse_kl_seq`` (mean over responses of their
    summed ``k_t``, the sequence-level reverse KL estimate).

    Raises:
        ValueError: mismatched shapes or a negative ``coef``.
    """
    shapes = {tuple(t.shape) for t in (advantages, student_log_prob, teacher_log_prob, mask)}
    if len(shapes) != 1 or mask.dim() != 2:
        raise ValueError(f"distill_advantages needs four (B, T) tensors of one shape, got {shapes}")
    if coef < 0:
        raise ValueError(f"the distillation coefficient must be >= 0, got {coef}")
    on = mask != 0
    k = torch.where(on, (student_log_prob - teacher_log_prob).detach().float(), 0.0)
    rows = on.any(dim=-1)
    metrics = {
        "opd/reverse_kl": float(masked_mean(k, on)),
        "opd/reverse_kl_seq": float(k.sum(-1)[rows].mean()) if bool(rows.any()) else 0.0,
    }
    out = advantages - coef * k.to(advantages.dtype)
    return out, metrics


def topk_reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor
) -> torch.Tensor:
    """Reverse KL ``KL(q_s || q_T)`` over the teacher's top-k support, per position.

    Args:
        student_log_probs: ``(..., k)`` the student's log-probs of the teacher's ``k`` tokens
            (differentiable).
        teacher_log_probs: ``(..., k)`` the teacher's log-probs of them.

    Returns:
        ``(...)``: ``sum_v q_s(v) (log q_s(v) - log q_T(v))`` with both renormalised over the
        ``k`` tokens (so it is >= 0, and 0 where the two agree on the support's shape).

    Raises:
        ValueError: mismatched shapes.
    """
    if student_log_probs.shape != teacher_log_probs.shape or student_log_probs.dim() < 1:
        raise ValueError(
            "topk_reverse_kl needs two (..., k) tensors of one shape, got "
            f"{tuple(student_log_probs.shape)} and {tuple(teacher_log_probs.shape)}"
        )
    qs = torch.log_softmax(student_log_probs.float(), dim=-1)
    qt = torch.log_softmax(teacher_log_probs.detach().float(), dim=-1)
    return (qs.exp() * (qs - qt)).sum(-1)
