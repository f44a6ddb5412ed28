"""RL loss math: policy losses (registry), the entropy of logits and the clipped value loss.

Level: the algorithm layer. These are pure functions of ``(B, T)`` tensors (log-probs,
advantages, values, a response mask) and know nothing of models or engines; the model-engine
loss functions built on them are in :mod:`polyrl.workers.rl_losses`. Each loss reduces its
per-token terms with :func:`polyrl.core.numerics.agg_loss` (modes ``token-mean``,
``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``).

``ppo_clip``: ``r = exp(logp - logp_old)``,
``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` and, for ``A < 0`` only (dual clip),
``L = min(L, -A c)``.
``gspo``: ``s_i = exp(mean_t (logp - logp_old))``, token ratio
``r_{i,t} = sg[s_i] * exp(logp - sg[logp])`` (value ``s_i``, gradient of the token), then the
same clipped surrogate, aggregated by default with ``seq-mean-token-mean``.
Value loss: ``0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))``.
Rollout correction: truncated importance sampling (TIS), :func:`rollout_importance_weights`;
masks and rejections (MIS, IcePop, sequence and geometric-mean rejection, veto),
:func:`rollout_rejection_mask`. The newer objectives (CISPO, SAPO, GMPO, GPG, Clip-Cov,
KL-Cov) are in :mod:`polyrl.algo.objectives`, registered here by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from polyrl.core.numerics import agg_loss, masked_mean
from polyrl.core.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

#: The objectives of :mod:`polyrl.algo.objectives`, imported when one is first asked for.
NEWER_OBJECTIVES = ("cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov")

#: Policy losses by name.
POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", lazy={name: "polyrl.algo.objectives" for name in NEWER_OBJECTIVES}
)
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get
list_policy_losses = POLICY_LOSSES.names


def _same_shape(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must equal mask shape {tuple(mask.shape)}"
            )


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped loss, clip indicator, and lower (dual) clip indicator."""
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(l1, l2)
    clip_hit = (l2 > l1).to(ratio.dtype)
    if clip_ratio_c is None:
        return clipped, clip_hit, torch.zeros_like(clip_hit)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    l3 = -advantages * clip_ratio_c
    lower_hit = ((clipped > l3) & (advantages < 0)).to(ratio.dtype)
    loss = torch.where(advantages < 0, torch.minimum(clipped, l3), clipped)
    return loss, clip_hit, lower_hit


# Log-ratios are clamped before exp() so that policies far apart give finite ratios.
LOG_RATIO_LIMIT = 20.0


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """``log_prob - old_log_prob`` clamped to +-:data:`LOG_RATIO_LIMIT` (finite ``exp``)."""
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def pg_metrics(
    loss: torch.Tensor,
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, float]:
    """Return the policy losses' shared metrics: ``pg_loss``, clip fractions, ``ppo_kl``."""
    zero = torch.zeros_like(mask, dtype=log_ratio.dtype)
    hit = zero if clipped is None else clipped.to(log_ratio.dtype)
    low = zero if clipped_lower is None else clipped_lower.to(log_ratio.dtype)
    return {
        "pg_loss": float(loss.detach()),
        "pg_clipfrac": float(agg_loss(hit, mask)),
        "pg_clipfrac_lower": float(agg_loss(low, mask)),
        "ppo_kl": float(agg_loss(-log_ratio.detach(), mask)),
    }


def _policy_loss_and_metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip: tuple[float, float, float | None],
    loss_agg_mode: str,
    horizon: int | float | None,
    counts: tuple[float | None, float | None] = (None, None),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate of ``ratio`` aggregated to a scalar, with the shared PG metrics."""
    loss_mat, hit, lower = _clipped_surrogate(ratio, advantages, response_mask, *clip)
    loss = agg_loss(
        loss_mat, response_mask, loss_agg_mode, horizon, num_tokens=counts[0], num_seqs=counts[1]
    )
    return loss, pg_metrics(loss, response_mask, log_ratio, hit, lower)


@register_policy_loss("ppo_clip")
def ppo_clip(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher (asymmetric range) and dual clip.

    Returns the scalar loss and metrics ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
    ``ppo_kl`` (token mean of ``logp_old - logp``). ``clip_ratio_c=None`` disables dual clip.
    ``num_tokens`` / ``num_seqs``: mini-batch-wide counts for the aggregation (see
    :func:`agg_loss`).
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    # Clamping the log-ratio keeps exp() finite when policies drift far apart.
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    return _policy_loss_and_metrics(
        ratio,
        log_ratio,
        advantages,
        response_mask,
        (clip_ratio_low, clip_ratio_high, clip_ratio_c),
        loss_agg_mode,
        horizon,
        (num_tokens, num_seqs),
    )


@register_policy_loss("gspo")
def gspo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    horizon: int | float | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: clipped surrogate on the sequence-level geometric-mean importance ratio.

    Same return contract as :func:`ppo_clip`; ``ppo_kl`` is the token mean of the log-ratio.
    """
    _same_shape(response_mask, log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    # Value equals the sequence ratio; gradient flows through each token's log-prob.
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    return _policy_loss_and_metrics(
        ratio,
        log_ratio,
        advantages,
        response_mask,
        (clip_ratio_low, clip_ratio_high, clip_ratio_c),
        loss_agg_mode,
        horizon,
        (num_tokens, num_seqs),
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``-sum_v p log p`` of categorical ``logits (..., V)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss; returns ``(loss, {"vf_loss", "vf_clipfrac"})``.

    ``num_tokens`` / ``num_seqs``: mini-batch-wide counts for the aggregation (see
    :func:`agg_loss`).
    """
    _same_shape(mask, values=values, old_values=old_values, returns=returns)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf1 = (values - returns) ** 2
    vf2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(vf1, vf2), mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs
    )
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(agg_loss((vf2 > vf1).to(values.dtype), mask)),
    }
    return loss, metrics


#: Levels of the rollout importance-sampling correction (``algorithm.rollout_is``).
ROLLOUT_IS_LEVELS = ("token", "sequence")


def rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return truncated importance weights from the rollout's policy to the trainer's (TIS).

    The rollout engine samples with its own numerics (another dtype, kernels, batch shapes),
    so its policy ``pi_rollout`` is not exactly the trainer's ``pi_old``. Weighting each
    token's policy-gradient term by ``w = pi_old / pi_rollout``, truncated at ``threshold``,
    corrects for the gap:

    * ``token``: ``w_t = exp(logp_old_t - logp_rollout_t)``;
    * ``sequence``: one weight per response, ``exp(sum_t (logp_old_t - logp_rollout_t))``
      over its masked tokens, given to each of its tokens.

    Returns the truncated weights (``(B, T)``, detached, 1 off the mask) and the metrics
    ``rollout_is_mean`` / ``rollout_is_max`` (of the weights before truncation, over masked
    tokens or, at the sequence level, over responses) and ``rollout_is_clipfrac`` (the share
    of them truncated).

    Raises:
        ValueError: an unknown ``level``, a ``threshold`` below 1, or mismatched shapes.
    """
    _same_shape(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is level must be one of {ROLLOUT_IS_LEVELS}, got {level!r}")
    if not threshold >= 1.0:
        raise ValueError(f"rollout_is_threshold must be >= 1, got {threshold}")
    on = mask != 0
    log_ratio = torch.where(on, (old_log_prob - rollout_log_prob).detach().float(), 0.0)
    # Clamped in log space so that exp() stays finite; the truncation is far below.
    if level == "token":
        raw = torch.exp(log_ratio.clamp(max=20.0))
        values = raw[on]
    else:
        per_seq = torch.exp(log_ratio.sum(dim=-1).clamp(max=20.0))
        values = per_seq[on.any(dim=-1)]
        raw = per_seq.unsqueeze(-1).expand_as(log_ratio)
    empty = values.numel() == 0
    metrics = {
        "rollout_is_mean": 1.0 if empty else float(values.mean()),
        "rollout_is_max": 1.0 if empty else float(values.max()),
        "rollout_is_clipfrac": 0.0 if empty else float((values > threshold).float().mean()),
    }
    weights = torch.where(on, raw.clamp(max=threshold), 1.0)
    return weights.to(old_log_prob.dtype), metrics


#: Modes of the rollout rejection mask (``algorithm.rollout_rs``).
ROLLOUT_RS_MODES = ("token", "icepop", "sequence", "geometric")


def rollout_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    mode: str | None = "token",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
    veto_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Mask tokens or reject whole responses whose rollout/trainer ratio leaves a band.

    With ``rho_t = exp(logp_old_t - logp_rollout_t)`` (the trainer's old policy over the
    rollout engine's), ``high = threshold`` and ``low = threshold_lower`` (default
    ``1 / high``):

    * ``token`` (masked importance sampling, MIS): a token with ``rho_t`` outside
      ``[low, high]`` gets mask 0; the others keep weight 1;
    * ``icepop`` (IcePop, two-sided masking): the same mask, and each kept token is weighted by
      its ratio ``rho_t`` (an untruncated importance weight, bounded by the band);
    * ``sequence``: a response whose sequence ratio ``prod_t rho_t = exp(sum_t log rho_t)``
      leaves ``[low, high]`` is rejected (all its tokens masked);
    * ``geometric``: a response whose geometric-mean ratio ``exp(mean_t log rho_t)`` leaves
      ``[low, high]`` is rejected (thresholds near 1 then, e.g. 1.001);
    * ``None``: no band (only the veto, if given).

    ``veto_threshold``: besides, a response with any token ratio below it is rejected (a
    catastrophic token: the rollout engine sampled what the trainer finds near impossible).

    Returns ``(keep, weights, metrics)``: ``keep`` ``(B, T)`` bool, false on masked and rejected
    tokens (and off ``mask``); ``weights`` ``(B, T)`` detached, the IcePop ratios on kept tokens,
    1 elsewhere; metrics ``rollout_rs_masked_frac`` (share of the masked tokens of ``mask`` that
    lost their mask), ``rollout_rs_seq_rejected_frac`` (share of the responses rejected whole:
    by ``sequence``, ``geometric`` or the veto) and ``rollout_rs_seq_rejected`` (their number).

    Raises:
        ValueError: an unknown ``mode``, a band that is empty or does not hold 1, a negative
            veto, or mismatched shapes.
    """
    _same_shape(mask, old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob)
    if mode is not None and mode not in ROLLOUT_RS_MODES:
        raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_MODES}, got {mode!r}")
    low = 1.0 / threshold if threshold_lower is None else threshold_lower
    if not (0.0 <= low <= 1.0 <= threshold):
        raise ValueError(
            f"rollout_rs band must hold 1 (low <= 1 <= high), got [{low}, {threshold}]"
        )
    if veto_threshold is not None and veto_threshold < 0:
        raise ValueError(f"rollout_token_veto_threshold must be >= 0, got {veto_threshold}")
    on = mask != 0
    rows = on.any(dim=-1)
    log_rho = torch.where(on, (old_log_prob - rollout_log_prob).detach().float(), 0.0)
    log_low = torch.log(torch.tensor(low)) if low > 0 else torch.tensor(-torch.inf)
    log_high = torch.log(torch.tensor(float(threshold)))

    def outside(x: torch.Tensor) -> torch.Tensor:
        return (x < log_low) | (x > log_high)

    keep = on.clone()
    weights = torch.ones_like(log_rho)
    rejected = torch.zeros_like(rows)
    if mode in ("token", "icepop"):
        keep &= ~outside(log_rho)
        if mode == "icepop":
            weights = torch.where(keep, torch.exp(log_rho), 1.0)
    elif mode == "sequence":
        rejected |= outside(log_rho.sum(dim=-1))
    elif mode == "geometric":
        counts = on.sum(dim=-1).clamp(min=1)
        rejected |= outside(log_rho.sum(dim=-1) / counts)
    if veto_threshold is not None and veto_threshold > 0:
        rejected |= (on & (log_rho < torch.log(torch.tensor(veto_threshold)))).any(dim=-1)
    rejected &= rows
    keep &= ~rejected.unsqueeze(-1)
    n_tokens = int(on.sum())
    n_rows = int(rows.sum())
    metrics = {
        "rollout_rs_masked_frac": float((on & ~keep).sum()) / n_tokens if n_tokens else 0.0,
        "rollout_rs_seq_rejected_frac": float(rejected.sum()) / n_rows if n_rows else 0.0,
        "rollout_rs_seq_rejected": float(rejected.sum()),
    }
    return keep, weights.to(old_log_prob.dtype), metrics
