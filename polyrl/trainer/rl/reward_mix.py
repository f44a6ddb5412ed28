"""Rewards beyond rules: a scalar reward model and a generative judge, weighted with the rules.

:class:`MixedRewards` is what :func:`~polyrl.trainer.rl.rollout.reward_manager` returns when
``reward.model_path`` or ``reward.judge_template`` is set. Per sample::

    reward = rule_weight * rule_score + model_weight * model_score + judge_weight * judge_score

* the rule score is the usual reward manager's (registered scorers or ``custom_function``;
  skipped, and 0, when ``reward.rule_weight=0``);
* the model score is the reward model's logit (:mod:`polyrl.reward.model`, in a worker process
  of its own) on the prompt and response rendered with its chat template;
* the judge score is a verdict from a rollout server (the policy's own replicas by default, or
  ``reward.judge_url``, through the OpenAI chat endpoint), parsed by
  :func:`polyrl.reward.judge.parse_verdict`. A verdict that does not parse, a late one
  (``reward.judge_timeout_s``) or a failed request scores 0 and is counted:
  ``reward/judge_parse_failures`` and ``reward/judge_errors``.

The judge's requests run on an event loop of its own, in a thread of its own, with a client of
its own (to the policy's replicas' current URLs, or to ``reward.judge_url``): scoring may then be
called from any thread, as the asynchronous trainer's rollout thread does.

The components are reported per sample in :attr:`RewardResult.extras` (``rule_score``,
``model_score``, ``judge_score``, ``judge_parsed``) and as step metrics ``reward/rule/mean``,
``reward/model/mean`` and ``reward/judge/mean``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.reward.base import ReplicaEndpoints, Scorer
from polyrl.reward.manager import RewardResult

__all__ = ["JUDGE_API_KEY_ENV", "MixedRewards"]

logger = logging.getLogger(__name__)

#: Environment variable holding the bearer token sent to ``reward.judge_url`` (if any).
JUDGE_API_KEY_ENV = "POLYRL_JUDGE_API_KEY"


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/std": float(values.std()),
        f"{prefix}/min": float(values.min()),
        f"{prefix}/max": float(values.max()),
    }


class MixedRewards:
    """Weighted rule, reward-model and judge scores (see the module docstring).

    Args:
        cfg: the run's configuration (``reward.*`` is read).
        rule: the rule-based reward manager, or ``None`` when ``reward.rule_weight`` is 0.

    It is a :class:`~polyrl.reward.base.Scorer`: the rollout producer calls
    :meth:`attach_rollout` to tell the judge where the policy's replicas are.
    """

    #: The producer adds ``raw_prompt`` (the prompt's chat messages) to the scored batch.
    wants_prompts = True

    def __init__(self, cfg: PolyRLConfig, rule: Scorer | None) -> None:
        from polyrl.reward.model import RewardModelProcess

        self.cfg = cfg
        self.rule = rule
        #: The rule's batched reward functions read the rows' dataset records.
        self.wants_rows = rule is not None and rule.wants_rows
        reward = cfg.reward
        self.model: RewardModelProcess | None = None
        if reward.model_path:
            self.model = RewardModelProcess(
                reward.model_path,
                device=reward.model_device,
                dtype=reward.model_dtype,
                batch_size=reward.model_batch_size,
                max_length=reward.model_max_length,
                trust_remote_code=cfg.model.trust_remote_code,
            )
        #: The policy's rollout client (where its replicas are); set by attach_rollout.
        self._policy_client: ReplicaEndpoints | None = None
        self._judge_client: Any = None
        self._judge_urls: list[str] = []
        self._judge_loop: asyncio.AbstractEventLoop | None = None
        self._judge_thread: threading.Thread | None = None
        self._judge_lock = threading.Lock()

    # ------------------------------------------------------------------ wiring
    def attach_rollout(self, client: ReplicaEndpoints) -> None:
        """Note the policy's rollout ``client``: the judge asks its replicas (by their URLs)."""
        if self._policy_client is None:
            self._policy_client = client
        if self.rule is not None:
            self.rule.attach_rollout(client)

    def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the judge's loop (started on first use) and wait for its result."""
        if self._judge_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name="polyrl-reward-judge", daemon=True
            )
            thread.start()
            self._judge_loop, self._judge_thread = loop, thread
        return asyncio.run_coroutine_threadsafe(coro, self._judge_loop).result()

    def _client_for_judge(self) -> Any:
        """Return the judge's client, rebuilt when the replicas' URLs changed (a restart)."""
        from polyrl.rollout.client import RolloutClient

        reward = self.cfg.reward
        if reward.judge_url:
            urls, key = [reward.judge_url], os.environ.get(JUDGE_API_KEY_ENV) or None
        elif self._policy_client is not None:
            urls, key = list(self._policy_client.urls), self._policy_client.api_key
        else:
            raise RuntimeError(
                "reward.judge_template is set without reward.judge_url, and no rollout producer "
                "has attached the policy's replicas (attach_rollout)"
            )
        if self._judge_client is None or urls != self._judge_urls:
            if self._judge_client is not None:
                self._call(self._judge_client.close())
            client = RolloutClient(
                urls, api_key=key, timeout=reward.judge_timeout_s + 5.0, health_interval=0.0
            )
            self._call(client.start())
            self._judge_client, self._judge_urls = client, urls
        return self._judge_client

    def close(self) -> None:
        """Stop the judge's client and loop, the reward model's worker and the rule manager."""
        try:
            loop = self._judge_loop
            if loop is not None:
                if self._judge_client is not None:
                    try:
                        self._call(self._judge_client.close())
                    except Exception:  # closing is best effort at shutdown
                        logger.debug("closing the judge client failed", exc_info=True)
                loop.call_soon_threadsafe(loop.stop)
                if self._judge_thread is not None:
                    self._judge_thread.join(timeout=5)
                loop.close()
                self._judge_loop = None
            if self.model is not None:
                self.model.close()
        finally:
            if self.rule is not None:
                self.rule.close()

    # ------------------------------------------------------------------ scoring
    def score(self, batch: Batch) -> RewardResult:
        """Score every row of ``batch``."""
        start = time.perf_counter()
        reward = self.cfg.reward
        nt = batch.non_tensors
        n = len(nt["response_text"])
        texts = [str(t) for t in nt["response_text"]]
        prompts = list(nt["raw_prompt"]) if "raw_prompt" in nt else [None] * n
        total = np.zeros(n, dtype=np.float64)
        metrics: dict[str, float] = {}
        extras: dict[str, np.ndarray] = {}
        statuses, failures = ["ok"] * n, {}
        if self.rule is not None:
            result = self.rule.score(batch)
            rule = result.scores.numpy().astype(np.float64)
            metrics.update(result.metrics)
            extras.update(result.extras)
            statuses, failures = list(result.statuses), dict(result.failures)
            total += reward.rule_weight * rule
            extras["rule_score"] = rule
            if "acc" not in extras:
                # Correctness is the rules' verdict (score >= 1), not the weighted sum's.
                extras["acc"] = (rule >= 1.0 - 1e-6).astype(np.float64)
            metrics.update(_stats("reward/rule", rule))
        if self.model is not None:
            model = np.asarray(self.model.score(prompts, texts), dtype=np.float64)
            total += reward.model_weight * model
            extras["model_score"] = model
            metrics.update(_stats("reward/model", model))
        if reward.judge_template:
            judge, parsed, judge_metrics = self._judge(prompts, texts, nt)
            total += reward.judge_weight * judge
            extras["judge_score"] = judge
            extras["judge_parsed"] = parsed
            metrics.update(judge_metrics)
            metrics.update(_stats("reward/judge", judge))
        metrics.update(_stats("reward/score", total))
        metrics["reward/time_s"] = time.perf_counter() - start
        return RewardResult(
            scores=torch.from_numpy(total.astype(np.float32)),
            extras=extras,
            metrics=metrics,
            statuses=statuses,
            failures=failures,
        )

    def _judge(
        self, prompts: Sequence[Any], texts: Sequence[str], nt: Any
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        """Ask the judge about every row; return scores, whether each parsed, and metrics."""
        from polyrl.reward.judge import format_judge_prompt, parse_verdict

        reward = self.cfg.reward
        truths = list(nt["ground_truth"]) if "ground_truth" in nt else [None] * len(texts)
        body: dict[str, Any] = {
            "max_completion_tokens": reward.judge_max_tokens,
            "temperature": reward.judge_temperature,
        }
        if reward.judge_model:
            body["model"] = reward.judge_model

        async def ask(prompt: Any, text: str, truth: Any) -> str:
            content = format_judge_prompt(reward.judge_template, prompt, text, truth)
            request = {**body, "messages": [{"role": "user", "content": content}]}
            answer, _ = await asyncio.wait_for(
                client.post_json("/v1/chat/completions", request), reward.judge_timeout_s
            )
            return str(answer["choices"][0]["message"].get("content") or "")

        async def ask_all() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(ask(p, t, g) for p, t, g in zip(prompts, texts, truths, strict=True)),
                    return_exceptions=True,
                )
            )

        with self._judge_lock:  # one batch at a time on the judge's client
            client = self._client_for_judge()
            verdicts = self._call(ask_all())
        n = len(texts)
        scores = np.zeros(n, dtype=np.float64)
        parsed = np.zeros(n, dtype=np.float64)
        parse_failures = errors = 0
        first: str | None = None
        for i, verdict in enumerate(verdicts):
            if isinstance(verdict, BaseException):
                errors += 1
                what = "timed out" if isinstance(verdict, TimeoutError) else repr(verdict)
                first = first or f"sample {i}: the judge request failed: {what}"
                continue
            value = parse_verdict(verdict, reward.judge_parse, reward.judge_max_score)
            if value is None or not math.isfinite(value):
                parse_failures += 1
                first = first or f"sample {i}: verdict {verdict[:200]!r} did not parse"
                continue
            scores[i], parsed[i] = value, 1.0
        if first is not None:
            logger.warning(
                "judge: %d of %d verdicts did not parse and %d requests failed (they score 0); "
                "first: %s",
                parse_failures,
                n,
                errors,
                first,
            )
        return (
            scores,
            parsed,
            {
                "reward/judge_parse_failures": float(parse_failures),
                "reward/judge_errors": float(errors),
            },
        )
