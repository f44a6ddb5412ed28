"""KL estimators, KL as a reward penalty or loss term, and KL coefficient controllers.

With ``d = logp - ref_logp`` (per token, samples from the current policy):

- ``k1 = d`` (unbiased, high variance, can be negative)
- ``k2 = d^2 / 2``
- ``k3 = exp(-d) - 1 + d`` (unbiased, low variance, >= 0), clamped to ``[-10, 10]``
- ``abs = |d|`` (verl's ``abs``: >= 0, biased)
- ``full = sum_v p(v) (log p(v) - log p_ref(v))``: the exact KL of the two next-token
  distributions at each position (no sampling noise); it needs each position's whole
  log-distribution, so ``logp`` and ``ref_logp`` are then ``(..., V)`` log-probabilities over
  the vocabulary and the result has one dimension less

Reward penalty: ``r_t = score_t - beta * kl_t * mask_t``. Adaptive controller (Ziegler et al.):
``e = clip(kl / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
"""

from __future__ import annotations

import torch

from polyrl.core.numerics import agg_loss, masked_mean

KL_KINDS = ("k1", "k2", "k3", "abs", "full")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (see the module docstring for each).

    ``kind`` is one of :data:`KL_KINDS` or an alias (``kl``/``mse``/``low_var_kl``). For ``full``
    the inputs are ``(..., V)`` log-distributions (e.g. ``log_softmax`` of the logits) and the
    result is ``(...)``; for the others they are the sampled tokens' log-probs.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp shape {tuple(logp.shape)} must equal ref_logp shape {tuple(ref_logp.shape)}"
        )
    k = _ALIASES.get(kind, kind)
    d = logp - ref_logp
    if k == "k1":
        return d
    if k == "k2":
        return 0.5 * d * d
    if k == "k3":
        # Clamp first so exp() cannot overflow when the policies disagree badly.
        neg = torch.clamp(-d, -20.0, 20.0)
        return torch.clamp(torch.exp(neg) - neg - 1.0, -10.0, 10.0)
    if k == "abs":
        return d.abs()
    if k == "full":
        if logp.dim() < 1 or logp.shape[-1] < 2:
            raise ValueError(
                "the full KL needs whole log-distributions (..., V) over the vocabulary, got "
                f"shape {tuple(logp.shape)}"
            )
        # p * (log p - log q), with 0 * log 0 = 0 where p underflows; a token that the
        # reference rules out (log q = -inf) where p > 0 gives +inf, as the KL is.
        p = logp.exp()
        terms = torch.where(p > 0, p * d, torch.zeros_like(d))
        return terms.sum(dim=-1)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS} or {sorted(_ALIASES)}")


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Return the aggregated per-token KL, to be added to the policy loss times a coefficient.

    ``num_tokens`` / ``num_seqs``: mini-batch-wide counts (see
    :func:`polyrl.core.numerics.agg_loss`).
    """
    return agg_loss(
        kl_penalty(logp, ref_logp, kind),
        mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )


class FixedKLController:
    """Constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        """Store the coefficient (must be >= 0)."""
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""


class AdaptiveKLController:
    """Proportional controller steering the observed KL toward ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        """Start at ``init_kl_coef``; ``horizon`` sets how many samples a full correction takes."""
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by ``1 + clip(kl/target - 1, ±0.2) * n_steps / horizon``."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract ``beta * KL`` from token scores, then update ``kl_ctrl`` with this batch's KL.

    The batch KL is the mean over rows of each row's token-mean KL; the controller is updated
    with ``n_steps = B``. Returns the rewards and ``actor/reward_kl_penalty`` (KL) and
    ``actor/reward_kl_penalty_coeff`` (the beta used).
    """
    if token_level_scores.shape != mask.shape:
        raise ValueError(
            f"token_level_scores shape {tuple(token_level_scores.shape)} must equal mask shape "
            f"{tuple(mask.shape)}"
        )
    kld = kl_penalty(logp, ref_logp, kind) * mask.to(token_level_scores.dtype)
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    per_seq = masked_mean(kld, mask, dim=-1)
    current_kl = float(per_seq.mean()) if per_seq.numel() else 0.0
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
