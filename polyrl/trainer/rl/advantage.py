"""The advantage phase of an RL step: one function, run where the step's rows are.

:func:`advantage_phase` turns a scored batch (``score`` per row, per-token ``loss_mask``, and as
the estimator needs ``values``, ``old_log_probs``, ``ref_log_probs``, ``baseline``, and for
PRIME ``prm_log_probs``) into ``token_level_rewards``, ``advantages`` and ``returns``, and
measures the step's data. The driver runs it on the batch it holds; with the transfer queue, a
rollout worker runs it on the stored rows. Either way it is this code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from polyrl.algo.prime import implicit_reward_metrics, implicit_rewards
from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ACC,
    ADVANTAGES,
    BASELINE,
    EPISODE,
    FINISH_REASON,
    IMPLICIT_REWARDS,
    LOSS_MASK,
    OLD_LOG_PROBS,
    PRM_LOG_PROBS,
    REF_LOG_PROBS,
    RESPONSE_LENGTH,
    RETURNS,
    SCORE,
    TEACHER_LOG_PROBS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    UID,
    VALUES,
)
from polyrl.trainer.rl.metrics import batch_metrics
from polyrl.workers.rl_losses import state_values

__all__ = [
    "ADVANTAGE_OUTPUTS",
    "advantage_phase",
    "compute_advantages",
    "filter_overlong",
    "place_on_last_token",
    "place_turn_rewards",
]

#: The columns the advantage phase adds to a step's rows.
ADVANTAGE_OUTPUTS = (TOKEN_LEVEL_REWARDS, ADVANTAGES, RETURNS)


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` zeros with each row's score on its last masked token (rows without one: 0)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask != 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = scores[rows].float()
    return out


def place_turn_rewards(
    scores: torch.Tensor, mask: torch.Tensor, turn_rewards: Any
) -> tuple[torch.Tensor, int]:
    """Token scores with each agent turn's reward on that turn's last token.

    ``turn_rewards[i]`` holds row ``i``'s per-turn rewards (the env loop's step rewards, one
    per model turn); the model turns are the contiguous runs of ``mask``. Where they match in
    number, reward ``k`` goes on the last token of run ``k`` and what ``scores[i]`` adds to
    their sum (a scorer's score, the overlong penalty) on the last token, so every row's token
    scores still sum to its score. Other rows (no turn rewards, a truncated trajectory whose
    runs and rewards disagree) get :func:`place_on_last_token`'s layout. Returns the token
    scores and how many rows got per-turn placement.
    """
    from polyrl.algo.advantages import turn_spans

    out = place_on_last_token(scores, mask)
    placed = 0
    for i in range(mask.shape[0]):
        rewards = [] if turn_rewards is None else list(turn_rewards[i] or [])
        spans = turn_spans(mask[i])
        if not rewards or len(rewards) != len(spans):
            continue
        placed += 1
        out[i].zero_()
        for (_, end), r in zip(spans, rewards, strict=True):
            out[i, end - 1] += float(r)
        out[i, spans[-1][1] - 1] += float(scores[i]) - float(sum(rewards))
    return out, placed


def filter_overlong(batch: Batch, max_response_length: int) -> int:
    """DAPO overlong filtering: zero the ``loss_mask`` of responses cut at the length cap.

    A row is truncated when its ``finish_reason`` (a non-tensor column, when the batch has one)
    is ``"length"``, otherwise when its ``response_length`` reached ``max_response_length``.
    Such a response has no ending to judge, so its reward is noise: it is kept in its group
    (the advantages were already computed with it) but adds nothing to the loss. Returns how
    many rows were masked.
    """
    reasons = batch.non_tensors.get(FINISH_REASON)
    if reasons is not None:
        cut = torch.tensor([str(r) == "length" for r in reasons], dtype=torch.bool)
    else:
        cut = batch[RESPONSE_LENGTH] >= max_response_length
    cut = cut.to(batch[LOSS_MASK].device)
    if bool(cut.any()):
        mask = batch[LOSS_MASK].clone()
        mask[cut] = 0
        batch[LOSS_MASK] = mask
    return int(cut.sum())


#: Estimators whose advantage is one number per episode, so linked samples can share it.
EPISODE_ESTIMATORS = ("grpo", "rloo")


def episode_advantages(
    estimator_name: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    uids: Sequence[Any],
    episodes: Sequence[int],
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Advantages of a batch holding linked samples (rows sharing a ``(uid, episode)``).

    An agent's episode split into linked samples is several rows, each carrying the episode's
    reward on its last token. Their advantage is the episode's: the estimator
    (``estimator_name``, with ``kwargs``) sees each episode once -- its first row's score -- so
    the group baseline is over the group's episodes, not weighted by how many samples each
    split into; every row then gets its episode's advantage on its own masked tokens.

    Returns ``None`` when no two rows share an episode (the caller estimates as usual).

    Raises:
        ValueError: the estimator is not an outcome estimator of one number per episode
            (:data:`EPISODE_ESTIMATORS`).
    """
    from polyrl.algo import get_advantage_estimator

    keys = list(zip((str(u) for u in uids), (int(e) for e in episodes), strict=True))
    ordinal: dict[tuple[str, int], int] = {}  # an episode -> its number, in first-row order
    owner = [ordinal.setdefault(key, len(ordinal)) for key in keys]
    if len(ordinal) == len(keys):
        return None
    if estimator_name not in EPISODE_ESTIMATORS:
        raise ValueError(
            f"the batch holds linked samples (an agent episode split into several rows) and "
            f"algorithm.adv_estimator={estimator_name} has no per-episode advantage; use one "
            f"of {', '.join(EPISODE_ESTIMATORS)}, or agent.non_extending=refuse"
        )
    reps = [0] * len(ordinal)  # each episode's first row
    for row in reversed(range(len(keys))):
        reps[owner[row]] = row
    rep_rows = torch.tensor(reps, dtype=torch.long)
    rep_rewards = rewards[rep_rows]
    # A full mask: each episode's advantage as one number, whatever its first row's tokens.
    scalar, _ = get_advantage_estimator(estimator_name)(
        rep_rewards,
        torch.ones_like(rep_rewards),
        index=[keys[r][0] for r in reps],
        **kwargs,
    )
    per_row = scalar[:, 0][torch.tensor(owner, dtype=torch.long)]
    out = per_row.unsqueeze(-1) * mask.to(per_row.dtype)
    return out, out.clone()


def compute_advantages(
    batch: Batch, cfg: PolyRLConfig, kl_ctrl: Any, baseline: torch.Tensor | None
) -> dict[str, float]:
    """Fill ``token_level_rewards``, ``advantages`` and ``returns`` (KL penalty first).

    Reads ``token_level_scores``, ``loss_mask``, the ``uid`` groups and, as the estimator needs,
    ``values``, ``old_log_probs``/``ref_log_probs`` (KL in the reward, which also updates
    ``kl_ctrl``), ``baseline`` (ReMax: the greedy response's score per row) and
    ``implicit_rewards`` (PRIME: the PRM's token rewards, see :func:`advantage_phase`). With
    ``algorithm.distill_coef`` the teacher's per-token reverse KL (``old_log_probs`` against the
    teacher's ``teacher_log_probs`` from its server, or ``ref_log_probs`` from the reference
    role) is subtracted from the advantages (:func:`polyrl.algo.distill.distill_advantages`;
    with ``algorithm.teacher_topk`` the actor's loss takes the signal and this only reports it).
    """
    from polyrl.algo import apply_kl_penalty, get_advantage_estimator

    algo = cfg.algorithm
    mask = batch[LOSS_MASK]
    metrics: dict[str, float] = {}
    rewards = batch[TOKEN_LEVEL_SCORES]
    if algo.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            rewards,
            batch[OLD_LOG_PROBS],
            batch[REF_LOG_PROBS],
            mask,
            kl_ctrl,
            algo.kl_penalty,
        )
        metrics.update(kl_metrics)
    kwargs: dict[str, Any] = {}
    if algo.adv_estimator == "gae":
        kwargs = {"gamma": algo.gamma, "lam": algo.lam}
    elif algo.adv_estimator == "grpo":
        kwargs = {"norm_adv_by_std": algo.norm_adv_by_std}
    elif algo.adv_estimator == "turn_grpo":
        kwargs = {"gamma": algo.gamma, "norm_adv_by_std": algo.norm_adv_by_std}
    elif algo.adv_estimator == "reinforce_plus_plus":
        kwargs = {"gamma": algo.gamma}
    elif algo.adv_estimator == "prime":
        if IMPLICIT_REWARDS not in batch.tensor_keys:
            raise KeyError("the prime estimator needs the PRM's implicit_rewards column")
        kwargs = {
            "process_rewards": batch[IMPLICIT_REWARDS],
            "implicit_coef": cfg.prime.implicit_reward_coef,
            "outcome_coef": cfg.prime.outcome_reward_coef,
            "whiten": cfg.prime.whiten_advantages,
        }
    linked = None
    if EPISODE in batch.non_tensors:
        linked = episode_advantages(
            algo.adv_estimator,
            rewards,
            mask,
            list(batch.non_tensors[UID]),
            list(batch.non_tensors[EPISODE]),
            **kwargs,
        )
    if linked is not None:
        advantages, returns = linked
    else:
        estimator = get_advantage_estimator(algo.adv_estimator)
        advantages, returns = estimator(
            rewards,
            mask,
            index=list(batch.non_tensors[UID]),
            values=batch[VALUES] if VALUES in batch.tensor_keys else None,
            baseline_rewards=baseline,
            **kwargs,
        )
    if algo.distill_coef > 0:
        from polyrl.algo.distill import distill_advantages

        # The teacher's log-probs of the student's own samples: from its rollout server, or
        # from the reference role that holds it. With the top-k loss the advantage keeps the
        # task reward alone; the sampled tokens' reverse KL is still reported.
        teacher = TEACHER_LOG_PROBS if TEACHER_LOG_PROBS in batch.tensor_keys else REF_LOG_PROBS
        coef = 0.0 if algo.teacher_topk else algo.distill_coef
        advantages, opd_metrics = distill_advantages(
            advantages, batch[OLD_LOG_PROBS], batch[teacher], mask, coef
        )
        metrics.update(opd_metrics)
    batch[TOKEN_LEVEL_REWARDS] = rewards
    batch[ADVANTAGES] = advantages.float()
    batch[RETURNS] = returns.float()
    return metrics


def advantage_phase(
    batch: Batch, cfg: PolyRLConfig, kl_ctrl: Any, max_response_length: int
) -> tuple[list[str], dict[str, float]]:
    """Score tokens, fold in the KL penalty, estimate advantages and measure the step.

    Adds :data:`ADVANTAGE_OUTPUTS` (and turns the critic's raw ``values`` into state values
    on response tokens) to ``batch`` in place; updates ``kl_ctrl`` when the KL penalty is in
    the reward. With the PRIME PRM's ``prm_log_probs`` it first turns them and the reference's
    into the token ``implicit_rewards`` and reports ``prime/*`` metrics. Returns the names of
    the columns it wrote and the step's data metrics.
    """
    mask = batch[LOSS_MASK]
    if cfg.algorithm.adv_estimator == "turn_grpo":
        # Per-turn credit: each environment step's reward stays on the turn it answered.
        scores, placed = place_turn_rewards(
            batch[SCORE], mask, batch.non_tensors.get("turn_rewards")
        )
        batch[TOKEN_LEVEL_SCORES] = scores
        per_turn = {"turn_credit/rows_per_turn": placed / max(len(batch), 1)}
    else:
        batch[TOKEN_LEVEL_SCORES] = place_on_last_token(batch[SCORE], mask)
        per_turn = {}
    written = list(ADVANTAGE_OUTPUTS)
    prime_metrics: dict[str, float] = {}
    if PRM_LOG_PROBS in batch.tensor_keys:
        rewards = implicit_rewards(batch[PRM_LOG_PROBS], batch[REF_LOG_PROBS], mask, cfg.prime.beta)
        batch[IMPLICIT_REWARDS] = rewards
        stats = implicit_reward_metrics(rewards.sum(-1), batch[ACC], mask)
        prime_metrics = {f"prime/{k}": v for k, v in stats.items()}
    if VALUES in batch.tensor_keys:
        batch[VALUES] = state_values(batch[VALUES]) * mask
        written.append(VALUES)
    baseline = batch[BASELINE] if BASELINE in batch.tensor_keys else None
    metrics = compute_advantages(batch, cfg, kl_ctrl, baseline)
    metrics.update(prime_metrics)
    metrics.update(per_turn)
    metrics.update(batch_metrics(batch, max_response_length))
    if cfg.algorithm.overlong_filter:
        # After the advantages and the data metrics: the truncated responses still count in
        # their groups' baselines and in the length statistics, only not in the loss.
        filtered = filter_overlong(batch, max_response_length)
        metrics["actor/overlong_filtered"] = float(filtered)
        metrics["actor/overlong_filtered_fraction"] = filtered / max(len(batch), 1)
        written.append(LOSS_MASK)
    return written, metrics
