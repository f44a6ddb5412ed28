"""What an RL step reports: verl's metric names, computed from the step's data and timings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
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

__all__ = [
    "CONSOLE_METRICS",
    "DEFAULT_PLOT_METRICS",
    "PER_FUNCTION_PREFIX",
    "REWARD_METRICS",
    "batch_metrics",
    "masked_stats",
    "stats",
    "step_metrics",
    "write_summary",
]

PLOT_FILE = "learning_curves.png"
SUMMARY_FILE = "rl_summary.json"

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


def write_summary(
    cfg: Any, out_dir: Path, metrics_file: Path, run: Mapping[str, Any]
) -> dict[str, Any]:
    """Draw the learning curves and write ``rl_summary.json``; return the summary.

    ``run`` holds what only the run knows (steps, checkpoint, elapsed time); the first and
    last validation accuracy and score come from ``metrics_file``.
    """
    from polyrl.trainer.plotting import plot_learning_curves
    from polyrl.trainer.tracking import read_metrics

    k = cfg.rollout.val_n
    keys = list(cfg.trainer.plot_metrics) or [m.format(k=k) for m in DEFAULT_PLOT_METRICS]
    plot = plot_learning_curves(metrics_file, out_dir / PLOT_FILE, keys, title="polyrl rl")
    records = read_metrics(metrics_file)

    def series(key: str) -> list[float]:
        return [r[key] for r in records if r.get(key) is not None]

    val_acc = series(f"val/acc/mean@{k}")
    scores = series("critic/score/mean")
    summary = {
        "steps": run.get("steps"),
        "resumed_from": run.get("resumed_from"),
        "first_val_acc": val_acc[0] if val_acc else None,
        "last_val_acc": val_acc[-1] if val_acc else None,
        "first_score": scores[0] if scores else None,
        "last_score": scores[-1] if scores else None,
        "checkpoint": run.get("checkpoint"),
        "hf_model": run.get("hf_model"),
        "metrics": str(metrics_file),
        "plot": str(plot) if plot else None,
        "elapsed_s": run.get("elapsed_s"),
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
