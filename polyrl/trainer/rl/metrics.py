"""What an RL step reports: verl's metric names, computed from the step's data and timings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ACC,
    ADVANTAGES,
    ATTENTION_MASK,
    LOSS_MASK,
    OLD_LOG_PROBS,
    PROMPT_LENGTH,
    RESPONSE_LENGTH,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    SCORE,
    TOKEN_LEVEL_REWARDS,
    VALUES,
)
from polyrl.core.numerics import masked_mean
from polyrl.trainer.run_loop import first_and_last

__all__ = [
    "CONSOLE_METRICS",
    "DEFAULT_PLOT_METRICS",
    "PER_FUNCTION_PREFIX",
    "REWARD_METRICS",
    "batch_metrics",
    "masked_stats",
    "stats",
    "step_metrics",
    "summary_fields",
]

#: Prefix of the per-function reward metrics (TRL's names): ``rewards/<name>/mean``.
PER_FUNCTION_PREFIX = "rewards/"

#: Metrics drawn in ``learning_curves.png`` when ``trainer.plot_metrics`` is empty.
DEFAULT_PLOT_METRICS = (
    "critic/score/mean",
    "val/acc/mean@{k}",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "response_length/mean",
)
#: What the console line shows per step (all ``val/`` metrics are shown too).
CONSOLE_METRICS = (
    "critic/score/mean",
    "critic/acc/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "response_length/mean",
    "num_turns/mean",
    "timing_s/step",
    "perf/throughput",
)
#: The reward manager's metrics a step reports (failure counts, length shaping, the reward
#: model's and the judge's scores and the judge's failures), besides
#: those of each of several reward functions (``rewards/<name>/mean`` and ``/std``).
REWARD_METRICS = (
    "reward/errors",
    "reward/timeouts",
    "reward/garbage",
    "reward/unscored",
    "reward/overlong_penalty/mean",
    "reward/overlong_fraction",
    "reward/rule/mean",
    "reward/model/mean",
    "reward/model/std",
    "reward/judge/mean",
    "reward/judge_parse_failures",
    "reward/judge_errors",
    "recovery/reward_worker_deaths",
)


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean``, ``/max`` and ``/min`` of ``values`` (nothing when it is empty)."""
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/min": float(v.min()),
    }


def masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """:func:`stats` of the entries of ``values`` where ``mask`` is non-zero."""
    return stats(prefix, values[mask != 0])


def batch_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Compute the step metrics that depend on the step's data only (verl names).

    Scores, accuracy, rewards, advantages, returns, values, lengths, the rollout/engine
    log-prob gap and token counts (``perf/total_num_tokens``, ``perf/response_tokens``).
    """
    mask = batch[LOSS_MASK]
    resp_len = batch[RESPONSE_LENGTH].float()
    out: dict[str, float] = {}
    out.update(stats("critic/score", batch[SCORE]))
    out["critic/acc/mean"] = float(batch[ACC].mean())
    out.update(stats("critic/rewards", batch[TOKEN_LEVEL_REWARDS].sum(1)))
    out.update(masked_stats("critic/advantages", batch[ADVANTAGES], mask))
    out.update(masked_stats("critic/returns", batch[RETURNS], mask))
    if VALUES in batch.tensor_keys:
        out.update(masked_stats("critic/values", batch[VALUES], mask))
    out.update(stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    out.update(stats("prompt_length", batch[PROMPT_LENGTH].float()))
    if OLD_LOG_PROBS in batch.tensor_keys and ROLLOUT_LOG_PROBS in batch.tensor_keys:
        gap = (batch[OLD_LOG_PROBS] - batch[ROLLOUT_LOG_PROBS]).abs()
        out["rollout/log_prob_gap"] = float(masked_mean(gap, mask))
    out["perf/total_num_tokens"] = float(batch[ATTENTION_MASK].sum())
    out["perf/response_tokens"] = float(resp_len.sum())
    return out


def step_metrics(
    data: Mapping[str, float], timing: Mapping[str, float], sampler: Any, world_size: int
) -> dict[str, float]:
    """Add throughput (tokens per second per rank) and the epoch to the data metrics."""
    out = dict(data)
    step_s = timing.get("timing_s/step", 0.0)
    tokens = out["perf/total_num_tokens"]
    out["perf/throughput"] = tokens / step_s / world_size if step_s else 0.0
    out["training/epoch"] = sampler.epoch + sampler.position / max(sampler.batches_per_epoch, 1)
    return out


def summary_fields(records: Sequence[Mapping[str, Any]], k: int) -> dict[str, Any]:
    """Return the RL fields of ``rl_summary.json`` from the run's metric ``records``.

    They are the first and last validation accuracy (``val/acc/mean@k``) and training score.
    """
    return {
        **first_and_last(records, f"val/acc/mean@{k}", "val_acc"),
        **first_and_last(records, "critic/score/mean", "score"),
    }
