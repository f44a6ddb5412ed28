"""Newer policy objectives: CISPO, SAPO, GMPO, GPG, Clip-Cov and KL-Cov.

Level: the algorithm layer, like :mod:`polyrl.algo.losses`, whose registry
(:data:`~polyrl.algo.losses.POLICY_LOSSES`) lists these names lazily: this module is imported
the first time one of them is asked for. Each is a pure function of ``(B, T)`` tensors with the
contract of :func:`~polyrl.algo.losses.ppo_clip` (it accepts the same keywords, ignoring those
it has no use for, and returns ``(loss, metrics)`` with ``pg_loss``, ``pg_clipfrac``,
``pg_clipfrac_lower`` and ``ppo_kl``), and reduces its per-token terms with the one aggregator,
:func:`polyrl.core.numerics.agg_loss`. Their own options (``tau_pos``, ``clip_cov_ratio``, ...)
are keywords too; the actor's loss passes each objective only the options it names.

Notation: ``r_t = exp(logp_t - logp_old_t)`` the token ratio, ``A_t`` the advantage, ``sg`` the
stop-gradient, ``eps_low`` / ``eps_high`` the clip ranges (``clip_ratio_low`` /
``clip_ratio_high``).
"""

from __future__ import annotations

import torch

from polyrl.algo.losses import (
    _clipped_surrogate,
    _same_shape,
    clamped_log_ratio,
    pg_metrics,
    register_policy_loss,
)
from polyrl.core.numerics import agg_loss, masked_mean

__all__ = ["cispo", "clip_cov", "gmpo", "gpg", "kl_cov", "sapo", "token_covariance"]


def _reduce(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    horizon: int | float | None,
    num_tokens: float | None,
    num_seqs: float | None,
) -> torch.Tensor:
    return agg_loss(loss_mat, mask, mode, horizon, num_tokens=num_tokens, num_seqs=num_seqs)


@register_policy_loss("cispo")
def cispo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, 2025).

    ``J = E[ sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t ]``, so the per-token loss
    is ``-sg(r_hat_t) A_t logp_t``. The weight is clipped, not the update: every token keeps
    the gradient ``-r_hat_t A_t grad(logp_t)``, where PPO's clip gives the clipped tokens none.
    ``clip_ratio_c`` is ignored (no dual clip). ``pg_clipfrac`` / ``pg_clipfrac_lower``: the
    shares of tokens whose weight was clipped from above / below.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = -weight * advantages * log_prob
    loss = _reduce(loss_mat, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    return loss, pg_metrics(
        loss,
        response_mask,
        log_ratio,
        ratio > 1.0 + clip_ratio_high,
        ratio < 1.0 - clip_ratio_low,
    )


@register_policy_loss("sapo")
def sapo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO, soft adaptive policy optimisation (Gao et al., 2025, arXiv:2511.20347).

    A smooth gate replaces the hard clip:
    ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))`` with ``tau = tau_pos`` where ``A_t > 0`` and
    ``tau_neg`` elsewhere; ``J = E[f(r_t) A_t]``, per-token loss ``-f(r_t) A_t``. At ``r = 1``
    the gate's slope is 1 (the plain policy gradient); away from 1 it decays smoothly, faster
    for the larger temperature (``tau_neg > tau_pos`` damps negative updates more). The clip
    ranges are not used by the loss; ``pg_clipfrac`` / ``pg_clipfrac_lower`` report the shares
    of tokens whose ratio is above ``1 + clip_ratio_high`` / below ``1 - clip_ratio_low``, where
    a PPO clip would have acted.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0, got {tau_pos}, {tau_neg}")
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    loss = _reduce(loss_mat, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    return loss, pg_metrics(
        loss,
        response_mask,
        log_ratio,
        ratio.detach() > 1.0 + clip_ratio_high,
        ratio.detach() < 1.0 - clip_ratio_low,
    )


@register_policy_loss("gmpo")
def gmpo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al., 2025, arXiv:2507.20673).

    Per response ``i`` with tokens ``t`` and ``s = sign(A_i)``, each token log-ratio
    ``l_t = logp_t - logp_old_t`` is clipped in log space, pessimistically for the sign:
    ``l'_t = s * min(s * l_t, s * clip(l_t, -eps_low, eps_high))``; the response's ratio is the
    geometric mean ``R_i = exp(mean_t l'_t)`` and its loss ``-A_i R_i``, with ``A_i`` the mean
    advantage over its tokens. The geometric mean is far less sensitive to one outlier token
    than GRPO's arithmetic mean of token ratios, which allows the wider range (the paper's
    ``(e^-0.4, e^0.4)``: ``clip_ratio_low = clip_ratio_high = 0.4``, in log space).

    Each response's loss is given to each of its tokens before aggregation, so
    ``seq-mean-token-mean`` (the default, and the paper's) averages over responses.
    ``pg_clipfrac`` / ``pg_clipfrac_lower``: tokens whose log-ratio was clipped with a positive /
    negative advantage.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    on = response_mask != 0
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(pessimistic, on, dim=-1))
    seq_adv = masked_mean(advantages, on, dim=-1)
    loss_mat = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_prob)
    loss = _reduce(loss_mat, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    clipped = (log_ratio.detach() != clamped.detach()) & on
    return loss, pg_metrics(
        loss, response_mask, log_ratio, clipped & (advantages > 0), clipped & (advantages < 0)
    )


@register_policy_loss("gpg")
def gpg(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG, group policy gradient (Chu et al., 2025): the plain policy gradient, no ratio.

    Per-token loss ``-A_t logp_t``; ``old_log_prob`` only feeds the ``ppo_kl`` metric. Nothing
    is clipped, so both clip fractions are 0.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    loss_mat = -advantages * log_prob
    loss = _reduce(loss_mat, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    return loss, pg_metrics(loss, response_mask, clamped_log_ratio(log_prob, old_log_prob))


def token_covariance(
    log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token centred product ``(logp_t - mean logp) * (A_t - mean A)`` (detached).

    The means are over the masked tokens of the batch given; the mean of this product over
    them is the covariance of log-prob and advantage that drives the entropy change (Cui et
    al., 2025). Off the mask it is 0.
    """
    on = mask != 0
    lp = log_prob.detach()
    adv = advantages.detach().to(lp.dtype)
    cov = (lp - masked_mean(lp, on)) * (adv - masked_mean(adv, on))
    return torch.where(on, cov, torch.zeros_like(cov))


@register_policy_loss("clip_cov")
def clip_cov(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    The PPO clipped surrogate (:func:`~polyrl.algo.losses.ppo_clip`, dual clip included), with
    the gradient of a few high-covariance tokens removed: with
    ``Cov_t = (logp_t - mean logp)(A_t - mean A)`` (:func:`token_covariance`), the candidates
    are the masked tokens with ``clip_cov_lb <= Cov_t <= clip_cov_ub``; ``floor(clip_cov_ratio
    * N)`` of them (``N`` masked tokens), drawn uniformly by a generator seeded with ``seed``,
    are detached (their loss term is multiplied by 0). Those tokens, confident and rewarded (or
    unlikely and punished), are what collapses the entropy.

    The draw never touches the global torch RNG, so a run and its resume detach the same
    tokens: the RL trainer gives each step its own ``seed`` (from the run's ``seed`` and the
    step number).

    The covariance is over the batch given: a micro-batch, when the engine splits one. Metric
    ``clip_cov_frac``: the share of masked tokens detached.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    if not 0.0 <= clip_cov_ratio <= 1.0:
        raise ValueError(f"clip_cov_ratio must be in [0, 1], got {clip_cov_ratio}")
    on = response_mask != 0
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    loss_mat, hit, lower = _clipped_surrogate(
        torch.exp(log_ratio),
        advantages,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
    )
    cov = token_covariance(log_prob, advantages, on)
    candidates = torch.nonzero((on & (cov >= clip_cov_lb) & (cov <= clip_cov_ub)).flatten())
    count = min(int(clip_cov_ratio * int(on.sum())), candidates.numel())
    keep = torch.ones(on.numel(), dtype=loss_mat.dtype, device=loss_mat.device)
    if count > 0:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(candidates.numel(), generator=generator)[:count]
        keep[candidates.flatten()[order.to(candidates.device)]] = 0.0
    keep = keep.view_as(loss_mat)
    loss = _reduce(loss_mat * keep, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    metrics = pg_metrics(loss, response_mask, log_ratio, hit, lower)
    metrics["clip_cov_frac"] = float(agg_loss(1.0 - keep, response_mask))
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 0.1,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    The unclipped surrogate ``-A_t r_t`` on every token, plus a KL penalty on the
    ``k = floor(kl_cov_ratio * N)`` masked tokens of largest covariance
    ``Cov_t = (logp_t - mean logp)(A_t - mean A)`` (:func:`token_covariance`):
    ``L_t = -A_t r_t + kl_cov_coef * |logp_t - logp_old_t|`` for those, ``-A_t r_t`` for the
    rest. The penalty holds back exactly the tokens whose updates lower the entropy most.
    (verl names the coefficient ``ppo_kl_coef``.) The clip ranges are not used.

    The covariance is over the batch given (a micro-batch, when the engine splits one). Metric
    ``kl_cov_frac``: the share of masked tokens penalised.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    if not 0.0 <= kl_cov_ratio <= 1.0:
        raise ValueError(f"kl_cov_ratio must be in [0, 1], got {kl_cov_ratio}")
    on = response_mask != 0
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    loss_mat = -advantages * torch.exp(log_ratio)
    cov = token_covariance(log_prob, advantages, on)
    k = int(kl_cov_ratio * int(on.sum()))
    chosen = torch.zeros(on.numel(), dtype=loss_mat.dtype, device=loss_mat.device)
    if k > 0:
        # Off-mask tokens must never be chosen: give them -inf before ranking.
        ranked = torch.where(on, cov, torch.full_like(cov, -torch.inf)).flatten()
        chosen[torch.topk(ranked, k).indices] = 1.0
    chosen = chosen.view_as(loss_mat)
    loss_mat = loss_mat + chosen * kl_cov_coef * log_ratio.abs()
    loss = _reduce(loss_mat, response_mask, loss_agg_mode, horizon, num_tokens, num_seqs)
    metrics = pg_metrics(loss, response_mask, log_ratio)
    metrics["kl_cov_frac"] = float(agg_loss(chosen, response_mask))
    return loss, metrics
