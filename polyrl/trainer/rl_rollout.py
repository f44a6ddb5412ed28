"""Rollout side of an RL step, shared by the driver and the transfer queue's rollout workers.

:class:`RolloutProducer` samples ``n`` responses per prompt through a rollout client (single
turn or agent loops) and scores them; :func:`build_rollout_batch` packs prompt/response pairs into
the engines' layout; :func:`compute_advantages` and :func:`batch_metrics` are the pure parts of
the advantage phase and of the per-step metrics. The same code runs in the driver
(``transfer.enable=false``) and in the workers that feed the transfer queue, so both paths give
the same numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.numerics import masked_mean
from polyrl.core.rollout_batch import build_rollout_batch, rollout_widths, widen_rollout_batch
from polyrl.reward.shaping import overlong_penalty

__all__ = [
    "RolloutProducer",
    "accuracy",
    "batch_metrics",
    "build_rollout_batch",
    "compute_advantages",
    "derive_seed",
    "group_varies",
    "masked_stats",
    "place_on_last_token",
    "response_cap",
    "rollout_widths",
    "select_groups",
    "stats",
    "widen_rollout_batch",
]

_SEED_MOD = 2**63


def response_cap(cfg: PolyRLConfig) -> int:
    """Return the most tokens one response may hold.

    With the agent loop that is a whole multi-turn trajectory (``data.max_response_length``);
    otherwise one turn (``rollout.max_new_tokens``, capped by ``data.max_response_length``).
    """
    data = cfg.data.max_response_length
    return data if cfg.agent.enable else min(cfg.rollout.max_new_tokens, data)


def group_varies(values: torch.Tensor, n: int) -> torch.Tensor:
    """Per group of ``n`` consecutive rows: whether its values are not all equal.

    DAPO's dynamic sampling keeps only such groups: in a group whose responses all got the
    same reward, group-relative advantages are zero and the prompt teaches nothing.
    """
    if values.numel() % n:
        raise ValueError(f"{values.numel()} rows do not form groups of {n}")
    groups = values.reshape(-1, n).float()
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 1e-6


def select_groups(varies: torch.Tensor, needed: int) -> np.ndarray:
    """Pick ``needed`` group indices, informative groups first, in their original order.

    When fewer than ``needed`` groups vary, the earliest uninformative ones fill the rest, so
    the step keeps its batch size (they add nothing to a group-relative policy gradient).
    """
    flags = varies.cpu().numpy().astype(bool)
    order = np.concatenate([np.flatnonzero(flags), np.flatnonzero(~flags)])
    if len(order) < needed:
        raise ValueError(f"{len(order)} groups available, {needed} needed")
    return np.sort(order[:needed])


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` zeros with each row's score on its last masked token (rows without one: 0)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask != 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] = scores[rows].float()
    return out


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


def accuracy(scores: torch.Tensor, extras: Mapping[str, np.ndarray]) -> torch.Tensor:
    """Per-sample correctness: the scorer's ``acc`` extra when it reports one, else score >= 1."""
    acc = extras.get("acc")
    if acc is not None and not np.isnan(acc.astype(float)).any():
        return torch.as_tensor(acc.astype(float), dtype=torch.float32)
    return (scores >= 1.0 - 1e-6).float()


def derive_seed(base: int, *parts: int) -> int:
    """Derive a seed for ``parts`` (step, prompt index, copy) from ``base``, stable across runs."""
    value = base
    for part in parts:
        value = (value * 1_000_003 + part + 1) % _SEED_MOD
    return value


class RolloutProducer:
    """Samples and scores responses for RL: the generate and reward phases of a step.

    Args:
        cfg: the run's configuration (``rollout``, ``data``, ``agent`` groups are read).
        client: a started :class:`~polyrl.rollout.client.RolloutClient`.
        tokenizer: the policy's tokenizer (decodes responses for the reward).
        pad_id: the token id used for padding.
        rewards: a :class:`~polyrl.reward.RewardManager`.
        run: runs a coroutine to completion on the client's event loop.
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        client: Any,
        tokenizer: Any,
        pad_id: int,
        rewards: Any,
        run: Any,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.pad_id = int(pad_id)
        self.rewards = rewards
        self._run = run

    def sampling_params(self, n: int, temperature: float, seed: int) -> dict[str, Any]:
        """Build the rollout servers' sampling parameters for ``n`` copies at ``temperature``."""
        ro = self.cfg.rollout
        greedy = temperature == 0.0
        return {
            "n": n,
            "temperature": temperature,
            "top_p": 1.0 if greedy else ro.top_p,
            "top_k": -1 if greedy else ro.top_k,
            "min_p": 0.0 if greedy else ro.min_p,
            "repetition_penalty": ro.repetition_penalty,
            "max_new_tokens": min(ro.max_new_tokens, self.cfg.data.max_response_length),
            "seed": seed,
            "logprobs": True,
            **({"stop_token_ids": list(ro.stop_token_ids)} if ro.stop_token_ids else {}),
        }

    def generate(
        self,
        items: Sequence[Mapping[str, Any]],
        n: int,
        temperature: float,
        seed: int,
        first_index: int = 0,
    ) -> tuple[Batch, dict[str, float]]:
        """Sample ``n`` responses per item and return the engine batch (prompt-major rows).

        ``first_index`` is the position of ``items[0]`` in the step's prompt list: seeds derive
        from it, so a worker given a slice of the prompts samples what the driver would.
        Non-tensor columns: ``uid`` (the prompt's group), ``data_source``, ``ground_truth``,
        ``extra_info``, ``response_text``, ``finish_reason``.
        """
        if self.cfg.agent.enable:
            batch, metrics = self._generate_with_agents(items, n, temperature, seed, first_index)
        else:

            async def run() -> list[Any]:
                return list(
                    await asyncio.gather(
                        *(
                            self.sample_prompt(item, n, temperature, seed, first_index + i)
                            for i, item in enumerate(items)
                        )
                    )
                )

            batch, metrics = self.pack_single_turn(items, self._run(run()))
        self.add_row_info(batch, items, n)
        return batch, metrics

    def add_row_info(self, batch: Batch, items: Sequence[Mapping[str, Any]], n: int) -> None:
        """Add each row's ``uid``, ``data_source``, ``ground_truth`` and ``extra_info``."""
        from polyrl.data.dataset import ground_truth_of

        def per_row(values: Sequence[Any]) -> np.ndarray:
            out = np.empty(len(values) * n, dtype=object)
            for i, value in enumerate(values):
                for j in range(n):
                    out[i * n + j] = value
            return out

        batch.non_tensors.update(
            {
                "uid": per_row([str(item["uid"]) for item in items]),
                "data_source": per_row([item["data_source"] for item in items]),
                "ground_truth": per_row([ground_truth_of(item) for item in items]),
                "extra_info": per_row([item.get("extra_info") or {} for item in items]),
            }
        )

    async def sample_prompt(
        self, item: Mapping[str, Any], n: int, temperature: float, seed: int, index: int
    ) -> Any:
        """Sample ``n`` responses to one item (the step's prompt number ``index``), one turn."""
        params = self.sampling_params(n, temperature, derive_seed(seed, index))
        return await self.client.generate(item["input_ids"].tolist(), params)

    def pack_single_turn(
        self, items: Sequence[Mapping[str, Any]], results: Sequence[Any]
    ) -> tuple[Batch, dict[str, float]]:
        """Pack the items' :meth:`sample_prompt` results into an engine batch (no row info)."""
        rows_p, rows_r, rows_lp, rows_finish, versions = [], [], [], [], set()
        for item, result in zip(items, results, strict=True):
            prompt = item["input_ids"].tolist()
            for out in result.outputs:
                rows_p.append(prompt)
                rows_r.append(list(out.output_ids))
                rows_lp.append(out.logprobs)
                rows_finish.append(out.finish_reason)
                versions.add(int(out.weight_version))
        have_lp = all(lp is not None for lp in rows_lp)
        batch = build_rollout_batch(rows_p, rows_r, self.pad_id, rows_lp if have_lp else None)
        texts = self.tokenizer.batch_decode(rows_r, skip_special_tokens=True)
        batch.non_tensors["response_text"] = np.array(texts, dtype=object)
        batch.non_tensors["finish_reason"] = np.array(rows_finish, dtype=object)
        return batch, {"rollout/weight_version": float(max(versions))}

    def _generate_with_agents(
        self,
        items: Sequence[Mapping[str, Any]],
        n: int,
        temperature: float,
        seed: int,
        first_index: int,
    ) -> tuple[Batch, dict[str, float]]:
        """Roll every item out ``n`` times through its agent loop (multi-turn, tools, envs)."""
        from polyrl.agent.base import collate_trajectories, run_agent_loops

        agent = self.cfg.agent
        params = self.sampling_params(1, temperature, 0)
        params.pop("seed")
        common = {
            "sampling_params": params,
            "max_response_length": self.cfg.data.max_response_length,
            "max_turns": agent.max_turns,
        }
        loop_kwargs = {
            "single_turn": common,
            "env": common,
            "tool": {
                **common,
                "tools": list(agent.tools),
                "parser": agent.tool_parser,
                "tool_timeout": agent.tool_timeout_s,
                "max_tool_response_tokens": agent.max_tool_response_tokens,
            },
        }
        samples = []
        for i, item in enumerate(items):
            for j in range(n):
                # Each copy samples with its own seed; turn k of a copy uses seed + k.
                samples.append({**item, "seed": derive_seed(seed, first_index + i, j)})
        trajectories = self._run(
            run_agent_loops(
                samples,
                self.client,
                self.tokenizer,
                default_agent=agent.default_loop,
                loop_kwargs=loop_kwargs,
                max_concurrency=agent.max_concurrency,
            )
        )
        batch = collate_trajectories(trajectories, self.pad_id)
        texts = [t.response_text(self.tokenizer) for t in trajectories]
        batch.non_tensors["response_text"] = np.array(texts, dtype=object)
        metrics = {k: float(v) for k, v in batch.meta.pop("agent_metrics", {}).items()}
        versions = [v for t in trajectories for v in t.weight_versions]
        metrics["rollout/weight_version"] = float(max(versions)) if versions else 0.0
        return batch, metrics

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score every row: ``(scores (B,), accuracy (B,), reward metrics)``."""
        scoring = Batch(
            non_tensors={
                k: batch.non_tensors[k]
                for k in ("data_source", "ground_truth", "extra_info", "response_text")
            }
        )
        result = self.rewards.score(scoring)
        scores = result.scores.float()
        if "reward" in batch.non_tensors:
            # Environment loops report their own reward; the scorer decides the rest (NaN).
            own = torch.as_tensor(batch.non_tensors["reward"].astype(float), dtype=torch.float32)
            scores = torch.where(torch.isnan(own), scores, own)
        acc = accuracy(scores, result.extras)  # of the answers, before any length shaping
        metrics = dict(result.metrics)
        reward_cfg = self.cfg.reward
        if reward_cfg.overlong_buffer_len > 0:
            penalty = overlong_penalty(
                batch["response_length"],
                response_cap(self.cfg),
                reward_cfg.overlong_buffer_len,
                reward_cfg.overlong_penalty_factor,
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
            metrics["reward/overlong_fraction"] = float((penalty < 0).float().mean())
        return scores, acc, metrics


def compute_advantages(
    batch: Batch, cfg: PolyRLConfig, kl_ctrl: Any, baseline: torch.Tensor | None
) -> dict[str, float]:
    """Fill ``token_level_rewards``, ``advantages`` and ``returns`` (KL penalty first).

    Reads ``token_level_scores``, ``loss_mask``, the ``uid`` groups and, as the estimator needs,
    ``values``, ``old_log_probs``/``ref_log_probs`` (KL in the reward, which also updates
    ``kl_ctrl``) and ``baseline`` (ReMax: the greedy response's score per row).
    """
    from polyrl.algo import apply_kl_penalty, get_advantage_estimator

    algo = cfg.algorithm
    mask = batch["loss_mask"]
    metrics: dict[str, float] = {}
    rewards = batch["token_level_scores"]
    if algo.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            rewards,
            batch["old_log_probs"],
            batch["ref_log_probs"],
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
    elif algo.adv_estimator == "reinforce_plus_plus":
        kwargs = {"gamma": algo.gamma}
    estimator = get_advantage_estimator(algo.adv_estimator)
    advantages, returns = estimator(
        rewards,
        mask,
        index=list(batch.non_tensors["uid"]),
        values=batch["values"] if "values" in batch.tensor_keys else None,
        baseline_rewards=baseline,
        **kwargs,
    )
    batch["token_level_rewards"] = rewards
    batch["advantages"] = advantages.float()
    batch["returns"] = returns.float()
    return metrics


def batch_metrics(
    batch: Batch, scores: torch.Tensor, acc: torch.Tensor, max_response_length: int
) -> dict[str, float]:
    """Compute the step metrics that depend on the step's data only (verl names).

    Scores, accuracy, rewards, advantages, returns, values, lengths, the rollout/engine
    log-prob gap and token counts (``perf/total_num_tokens``, ``perf/response_tokens``).
    """
    mask = batch["loss_mask"]
    resp_len = batch["response_length"].float()
    out: dict[str, float] = {}
    out.update(stats("critic/score", scores))
    out["critic/acc/mean"] = float(acc.mean())
    out.update(stats("critic/rewards", batch["token_level_rewards"].sum(1)))
    out.update(masked_stats("critic/advantages", batch["advantages"], mask))
    out.update(masked_stats("critic/returns", batch["returns"], mask))
    if "values" in batch.tensor_keys:
        out.update(masked_stats("critic/values", batch["values"], mask))
    out.update(stats("response_length", resp_len))
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    out.update(stats("prompt_length", batch["prompt_length"].float()))
    if "old_log_probs" in batch.tensor_keys and "rollout_log_probs" in batch.tensor_keys:
        gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs()
        out["rollout/log_prob_gap"] = float(masked_mean(gap, mask))
    out["perf/total_num_tokens"] = float(batch["attention_mask"].sum())
    out["perf/response_tokens"] = float(resp_len.sum())
    return out
