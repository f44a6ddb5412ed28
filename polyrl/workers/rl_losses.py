"""The RL losses as model-engine loss functions: ``fn(model_output, batch, **kwargs)``.

Level: the glue layer, binding the algorithm layer's loss math (:mod:`polyrl.algo.losses`)
to the model engine's loss plug-in signature (:data:`polyrl.model_engine.engine.LossFn`, where
the SFT loss is); both are services, so only a layer above them may join the two. The engine
calls a loss once per micro-batch; these adapters read the RL columns of the batch, call the
pure functions of :mod:`polyrl.algo`, and normalise by the mini-batch-wide counts the engine
puts in ``batch.meta`` so that the micro-batch losses add up to the mini-batch loss whatever
the split. They are registered as ``"rl_actor"``, ``"rl_critic"`` and ``"rl_prm"`` in
:data:`polyrl.workers.losses.LOSSES` when the engine worker's module is imported, so the
trainer sends them to the workers by those names (:data:`~polyrl.workers.losses.ACTOR_LOSS`,
...).

Batch columns, all ``(B, T)`` over the whole sequence (prompt and response), zero off the
response: ``loss_mask`` (1 on response tokens), ``advantages``, ``old_log_probs`` (optional:
without it the update is taken as exactly on-policy and the ratio is 1), ``ref_log_probs`` (KL
loss), ``returns`` and ``values`` (critic, state-aligned: see :func:`state_values`); the PRIME
PRM's loss reads ``ref_log_probs`` and the per-row outcome label ``acc`` ``(B,)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from polyrl.algo.distill import topk_reverse_kl
from polyrl.algo.kl import kl_loss as _kl_loss
from polyrl.algo.losses import (
    get_policy_loss,
    rollout_importance_weights,
    rollout_rejection_mask,
    value_loss,
)
from polyrl.algo.prime import implicit_prm_loss
from polyrl.core.columns import TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS
from polyrl.core.numerics import agg_loss, masked_mean
from polyrl.model_engine.engine import global_counts

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.model_engine.engine import ModelOutput

__all__ = ["actor_loss", "critic_loss", "prm_loss", "state_values"]


def state_values(token_values: torch.Tensor) -> torch.Tensor:
    """Shift a value head's per-token outputs to the state *before* each token.

    A value model's output at position ``t`` has read tokens ``0..t``; the value of the state in
    which token ``t`` is chosen is its output at ``t - 1``. Column 0 gets 0 (no state precedes
    it; it is never a response token).
    """
    out = torch.zeros_like(token_values)
    out[:, 1:] = token_values[:, :-1]
    return out


def _local_scale(mode: str, mask: torch.Tensor, counts: dict[str, Any]) -> float:
    """Factor turning a loss normalised by global counts into this micro-batch's own mean."""
    tokens, seqs = counts["num_tokens"], counts["num_seqs"]
    if mode == "token-mean":
        local = float((mask != 0).sum())
        return 1.0 if tokens is None or local == 0 else max(tokens, 1.0) / local
    local = float((mask != 0).any(dim=1).sum())
    if mode == "seq-mean-token-sum-norm":
        local = float(mask.shape[0])
    return 1.0 if seqs is None or local == 0 else max(seqs, 1.0) / local


def _counts_of(mask: torch.Tensor, counts: dict[str, Any], mode: str) -> dict[str, Any]:
    """Return ``counts``, those missing (a whole mini-batch) taken from ``mask``.

    A rejection narrows the loss's mask; the normalisation must still be that of the mask
    before it, as the engine's mini-batch-wide counts are, so that the rejected tokens weigh 0
    rather than raise the others' weight.
    """
    on = mask != 0
    seqs = mask.shape[0] if mode == "seq-mean-token-sum-norm" else on.any(dim=1).sum()
    return {
        "num_tokens": float(on.sum()) if counts["num_tokens"] is None else counts["num_tokens"],
        "num_seqs": float(seqs) if counts["num_seqs"] is None else counts["num_seqs"],
    }


def _require(batch: Batch, *keys: str, loss: str) -> None:
    missing = [k for k in keys if k not in batch.tensor_keys]
    if missing:
        raise KeyError(f"{loss} needs batch columns {missing}; got {sorted(batch.tensor_keys)}")


def _options_for(fn: Callable[..., Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """Return the ``options`` that ``fn`` names as parameters.

    The trainer sends every objective's options (``tau_pos``, ``clip_cov_ratio``, ...); each
    policy loss, a user's registered one included, gets only those it declares by name. A loss
    that takes ``**kwargs`` gets none of them: such a loss usually forwards its keywords to a
    built-in one (``ppo_clip(..., **kwargs)``), which would refuse options it does not take.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: pass nothing extra
        return {}
    return {
        k: v
        for k, v in options.items()
        if k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD
    }


def actor_loss(
    output: ModelOutput,
    batch: Batch,
    *,
    policy_loss: str = "ppo_clip",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    horizon: int | None = None,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "k3",
    rollout_is: str = "none",
    rollout_is_threshold: float = 2.0,
    rollout_rs: str = "none",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
    rollout_token_veto_threshold: float | None = None,
    policy_loss_options: Mapping[str, Any] | None = None,
    router_aux_loss_coef: float = 0.0,
    distill_topk_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Policy-gradient loss of one micro-batch (a registered policy loss, entropy and KL terms).

    Metrics (the engine averages them over micro-batches): ``pg_loss``, ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``, ``entropy`` (token mean of the current policy's entropy),
    and ``entropy_loss`` / ``kl_loss`` when those terms are on.

    ``rollout_is`` (``token`` or ``sequence``; ``none`` is off) weights each token's advantage
    by the truncated importance weight from the rollout's log-probs (``rollout_log_probs``) to
    the old policy's (:func:`~polyrl.algo.losses.rollout_importance_weights`); every policy
    loss here is linear in the advantage, so this weights each token's policy-gradient term.
    Adds ``rollout_is_mean``, ``rollout_is_max`` and ``rollout_is_clipfrac``.

    ``rollout_rs`` (``token``, ``icepop``, ``sequence``, ``geometric``; ``none`` is off) and
    ``rollout_token_veto_threshold`` (``None`` or 0 is off) mask tokens or reject responses
    whose rollout/trainer ratio leaves the band ``[rollout_rs_threshold_lower,
    rollout_rs_threshold]`` (:func:`~polyrl.algo.losses.rollout_rejection_mask`): those tokens
    leave the policy, entropy and KL terms (they still count in the mini-batch's token and
    sequence counts, as zero-weight tokens, so the loss is not rescaled by the rejection).
    Adds ``rollout_rs_masked_frac`` and ``rollout_rs_seq_rejected_frac`` (token-weighted over
    micro-batches by the engine, like every metric here). IcePop's weight by the ratio is
    applied only without ``rollout_is``, whose (truncated) weight is the same ratio.

    ``policy_loss_options``: the objectives' own options; each loss gets those it names.

    ``router_aux_loss_coef`` > 0 (MoE models) adds that weight times the routers' load-balancing
    loss (:attr:`ModelOutput.router_aux_loss`), weighted by the micro-batch's share of the
    mini-batch's tokens so the micro-batches sum to its token mean; metric ``router_aux_loss``.

    ``distill_topk_coef`` > 0 (on-policy distillation against a teacher's top-k distribution)
    adds that weight times the reverse KL over the teacher's top-k tokens at each response
    position (:func:`~polyrl.algo.distill.topk_reverse_kl`, columns ``teacher_topk_ids`` and
    ``teacher_topk_log_probs`` ``(B, T, k)``), aggregated like the policy loss; metric
    ``distill_topk_kl``.
    """
    _require(batch, "loss_mask", "advantages", loss="actor_loss")
    mask = batch["loss_mask"]
    counts = global_counts(batch)
    # One pass over the vocabulary gives both; the entropy is always reported as a metric.
    log_prob, entropy = output.log_probs_and_entropy()
    if "old_log_probs" in batch.tensor_keys:
        old_log_prob = batch["old_log_probs"].to(log_prob.dtype)
    else:
        old_log_prob = log_prob.detach()
    advantages = batch["advantages"].to(log_prob.dtype)
    is_metrics: dict[str, float] = {}
    if rollout_is != "none":
        _require(batch, "rollout_log_probs", loss=f"actor_loss with rollout_is={rollout_is}")
        weights, is_metrics = rollout_importance_weights(
            old_log_prob, batch["rollout_log_probs"], mask, rollout_is, rollout_is_threshold
        )
        advantages = advantages * weights
    loss_mask = mask
    veto = rollout_token_veto_threshold or None
    if rollout_rs != "none" or veto is not None:
        _require(batch, "rollout_log_probs", loss=f"actor_loss with rollout_rs={rollout_rs}")
        keep, rs_weights, rs_metrics = rollout_rejection_mask(
            old_log_prob,
            batch["rollout_log_probs"],
            mask,
            None if rollout_rs == "none" else rollout_rs,
            rollout_rs_threshold,
            rollout_rs_threshold_lower or None,
            veto,
        )
        # The count adds up per micro-batch, but the engine averages metrics by tokens.
        rs_metrics.pop("rollout_rs_seq_rejected")
        is_metrics.update(rs_metrics)
        loss_mask = mask * keep.to(mask.dtype)
        if rollout_is == "none":
            # IcePop's ratio weight; with TIS on (off-policy modes turn it on), its weight is
            # already there: the mask alone then completes IcePop, never a weight squared.
            advantages = advantages * rs_weights
        counts = _counts_of(mask, counts, loss_agg_mode)
    loss_fn = get_policy_loss(policy_loss)
    loss, pg_metrics = loss_fn(
        log_prob,
        old_log_prob,
        advantages,
        loss_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        horizon=horizon,
        **counts,
        **_options_for(loss_fn, policy_loss_options or {}),
    )
    metrics: dict[str, Any] = {**pg_metrics, **is_metrics}
    metrics["pg_loss"] = pg_metrics["pg_loss"] * _local_scale(loss_agg_mode, mask, counts)
    if entropy is not None:
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
    if entropy is not None and entropy_coeff > 0:
        ent = agg_loss(entropy, loss_mask, loss_agg_mode, horizon, **counts)
        loss = loss - entropy_coeff * ent
        metrics["entropy_loss"] = float(ent.detach()) * _local_scale(loss_agg_mode, mask, counts)
    if use_kl_loss:
        _require(batch, "ref_log_probs", loss="actor_loss with use_kl_loss")
        kl = _kl_loss(
            log_prob,
            batch["ref_log_probs"].to(log_prob.dtype),
            loss_mask,
            kl_loss_type,
            loss_agg_mode,
            **counts,
        )
        loss = loss + kl_loss_coef * kl
        metrics["kl_loss"] = float(kl.detach()) * _local_scale(loss_agg_mode, mask, counts)
        metrics["kl_coef"] = kl_loss_coef
    if distill_topk_coef > 0:
        _require(
            batch, TEACHER_TOPK_IDS, TEACHER_TOPK_LOG_PROBS, loss="actor_loss with teacher_topk"
        )
        student = output.log_probs_of(batch[TEACHER_TOPK_IDS])
        topk_kl = topk_reverse_kl(student, batch[TEACHER_TOPK_LOG_PROBS].to(student.dtype))
        kl = agg_loss(topk_kl, loss_mask, loss_agg_mode, horizon, **counts)
        loss = loss + distill_topk_coef * kl
        metrics["distill_topk_kl"] = float(kl.detach()) * _local_scale(loss_agg_mode, mask, counts)
    # Only MoE engines' outputs carry it (a user's or a test's output object need not).
    aux = getattr(output, "router_aux_loss", None) if router_aux_loss_coef > 0 else None
    if aux is not None:
        local = float((mask != 0).sum())
        tokens = counts["num_tokens"]
        share = 1.0 if tokens is None else local / max(tokens, 1.0)
        loss = loss + router_aux_loss_coef * share * aux.to(loss.dtype)
        metrics["router_aux_loss"] = float(aux.detach())
    return loss, metrics


def critic_loss(
    output: ModelOutput,
    batch: Batch,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped value loss of one micro-batch against ``returns``.

    Metrics: ``vf_loss``, ``vf_clipfrac`` and ``vpred_mean``.
    """
    _require(batch, "loss_mask", "returns", "values", loss="critic_loss")
    mask = batch["loss_mask"]
    counts = global_counts(batch)
    values = state_values(output.values)
    loss, metrics = value_loss(
        values,
        batch["values"].to(values.dtype),
        batch["returns"].to(values.dtype),
        mask,
        cliprange_value,
        loss_agg_mode,
        **counts,
    )
    metrics = dict(metrics)
    metrics["vf_loss"] = metrics["vf_loss"] * _local_scale(loss_agg_mode, mask, counts)
    metrics["vpred_mean"] = float(masked_mean(values.detach(), mask))
    return loss, metrics


def prm_loss(
    output: ModelOutput, batch: Batch, *, beta: float = 0.05
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PRIME's implicit PRM loss of one micro-batch (:func:`~polyrl.algo.prime.implicit_prm_loss`).

    Reads ``loss_mask``, ``ref_log_probs`` and the outcome label ``acc``; the loss is the
    cross-entropy averaged over the mini-batch's sequences, so the engine's ``loss`` metric is
    the mini-batch's exact mean. No metrics of its own: the engine would weigh per-sequence
    figures by token counts; the trainer reports the PRM's accuracy where it scores the step.
    """
    _require(batch, "loss_mask", "ref_log_probs", "acc", loss="prm_loss")
    loss, _ = implicit_prm_loss(
        output.log_probs,
        batch["ref_log_probs"],
        batch["loss_mask"],
        batch["acc"],
        beta,
        num_seqs=global_counts(batch)["num_seqs"],
    )
    return loss, {}
