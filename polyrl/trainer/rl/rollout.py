"""Sampling and scoring, shared by the driver and the transfer queue's rollout workers.

:class:`RolloutProducer` samples ``n`` responses per prompt through a rollout client (single
turn or agent loops) and scores them; :func:`attach_scores` puts the scores on the batch as
the columns the advantage phase reads. The same code runs in the driver
(``transfer.enable=false``) and in the workers that feed the transfer queue, so both paths give
the same numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from polyrl.config import PolyRLConfig, response_cap
from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ACC,
    ATTENTION_MASK,
    BASELINE,
    EPISODE,
    FINISH_REASON,
    INPUT_IDS,
    MULTI_MODAL,
    PROMPT_LENGTH,
    RESPONSE_LENGTH,
    SCORE,
    UID,
    WEIGHT_VERSION_FIRST,
    WEIGHT_VERSION_LAST,
)
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.reward.base import Scorer
from polyrl.reward.shaping import overlong_penalty
from polyrl.trainer.rl.metrics import PER_FUNCTION_PREFIX, REWARD_METRICS

__all__ = [
    "RolloutProducer",
    "accuracy",
    "add_weight_versions",
    "attach_scores",
    "completion_ids",
    "derive_seed",
    "group_varies",
    "has_custom_reward",
    "pad_id_of",
    "response_cap",
    "reward_manager",
    "select_groups",
    "timer",
]

_SEED_MOD = 2**63


@contextlib.contextmanager
def timer(timing: dict[str, float], name: str) -> Iterator[None]:
    """Add the time the block takes to ``timing["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        timing[key] = timing.get(key, 0.0) + (time.perf_counter() - start)


def attach_scores(
    batch: Batch,
    scored: tuple[torch.Tensor, torch.Tensor, Mapping[str, float]],
    baseline: torch.Tensor | None = None,
) -> dict[str, float]:
    """Put a :meth:`RolloutProducer.score` result on ``batch``; return the reward metrics.

    Adds the per-row columns ``score``, ``acc`` and, for ReMax, ``baseline`` (the greedy
    response's score), which the advantage phase reads.
    """
    scores, acc, reward_metrics = scored
    batch[SCORE] = scores.float()
    batch[ACC] = acc.float()
    if baseline is not None:
        batch[BASELINE] = baseline.float()
    return {
        k: float(v)
        for k, v in reward_metrics.items()
        if k in REWARD_METRICS or k.startswith(PER_FUNCTION_PREFIX)
    }


def _episode_heads(batch: Batch) -> list[int]:
    """Return the first row of each episode, in order (every row when none are linked)."""
    episodes = batch.non_tensors.get(EPISODE)
    if episodes is None:
        return list(range(len(batch)))
    seen: set[int] = set()
    heads = []
    for row, episode in enumerate(episodes):
        if int(episode) not in seen:
            seen.add(int(episode))
            heads.append(row)
    return heads


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


def accuracy(scores: torch.Tensor, extras: Mapping[str, np.ndarray]) -> torch.Tensor:
    """Per-sample correctness: the scorer's ``acc`` extra when it reports one, else score >= 1."""
    acc = extras.get("acc")
    if acc is not None and not np.isnan(acc.astype(float)).any():
        return torch.as_tensor(acc.astype(float), dtype=torch.float32)
    return (scores >= 1.0 - 1e-6).float()


def pad_id_of(tokenizer: Any) -> int:
    """Return the tokenizer's padding id (its end-of-sequence id when it has no pad token)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def derive_seed(base: int, *parts: int) -> int:
    """Derive a seed for ``parts`` (step, prompt index, copy) from ``base``, stable across runs."""
    value = base
    for part in parts:
        value = (value * 1_000_003 + part + 1) % _SEED_MOD
    return value


def reward_manager(cfg: PolyRLConfig, reward_fn: Any = None) -> Scorer:
    """Return the run's reward scorer (``reward.*``; ``reward_fn`` overrides the function).

    With ``reward.model_path``, ``reward.judge_template`` or a ``reward.rule_weight`` other than
    1, the rule-based manager (none when that weight is 0) is wrapped in a
    :class:`~polyrl.trainer.rl.reward_mix.MixedRewards` that adds the reward model's and the
    judge's weighted scores.

    ``reward_fn`` is a ``"file.py:function"`` spec, a callable, or a list of resolved
    :class:`~polyrl.reward.functions.RewardFunction` (the Python API's ``reward_funcs``). A list,
    or a single batched (TRL-style) function, is scored by a
    :class:`~polyrl.reward.functions.RewardFunctionsManager`; a single per-sample function or
    the registered scorers by a :class:`~polyrl.reward.manager.RewardManager`.

    Its worker processes start booting at once: build it before slow set-up work (starting
    the replicas) so that they are ready by the first step.
    """
    from polyrl.reward.functions import (
        RewardFunctionsManager,
        is_batched,
        resolve_reward_functions,
    )
    from polyrl.reward.manager import RewardManager
    from polyrl.reward.user_fn import load_user_function

    fn = reward_fn if reward_fn is not None else cfg.reward.custom_function
    if isinstance(fn, str) and fn and is_batched(load_user_function(fn)):
        fn = resolve_reward_functions(fn)
    elif callable(fn) and is_batched(fn):
        fn = resolve_reward_functions(fn)
    options = {
        "num_workers": cfg.reward.num_workers,
        "timeout_s": cfg.reward.timeout_s,
        "error_reward": cfg.reward.error_reward,
        "max_failure_fraction": cfg.reward.max_failure_fraction,
        # A run that recovers from no worker death (trainer.max_restarts=0) stops at a reward
        # worker's too, in the same one line, rather than scoring its sample again.
        "rescore_after_death": cfg.trainer.max_restarts > 0,
    }
    reward = cfg.reward
    mixed = bool(reward.model_path or reward.judge_template or reward.rule_weight != 1.0)
    rule: Scorer | None = None
    if not mixed or reward.rule_weight != 0.0:
        if isinstance(fn, list | tuple):
            rule = RewardFunctionsManager(fn, prompt_key=cfg.data.prompt_key, **options)
        else:
            rule = RewardManager(custom_function=fn or None, **options)
    if not mixed:
        assert rule is not None  # not mixed: the rule weight is 1
        return rule
    from polyrl.trainer.rl.reward_mix import MixedRewards

    try:
        return MixedRewards(cfg, rule)
    except BaseException:
        if rule is not None:
            rule.close()
        raise


def add_weight_versions(batch: Batch, firsts: Sequence[int], lasts: Sequence[int]) -> None:
    """Add each row's oldest and newest weight version to ``batch``.

    The columns are ``weight_version_first`` and ``weight_version_last``; the asynchronous
    trainer measures staleness from the oldest.
    """
    batch.non_tensors[WEIGHT_VERSION_FIRST] = np.array([int(v) for v in firsts], dtype=object)
    batch.non_tensors[WEIGHT_VERSION_LAST] = np.array([int(v) for v in lasts], dtype=object)


def has_custom_reward(cfg: PolyRLConfig, reward_fn: Any = None) -> bool:
    """Whether rows need only a prompt: a user function scores every row, or no rule does."""
    no_rules = cfg.reward.rule_weight == 0.0
    return reward_fn is not None or bool(cfg.reward.custom_function) or no_rules


def completion_ids(batch: Batch) -> list[list[int]]:
    """Each row's response token ids, without padding."""
    ids, attention = batch[INPUT_IDS], batch[ATTENTION_MASK]
    if len(batch) == 0:
        return []
    # Prompts are left-padded up to one column, where every response starts.
    start = int(attention[0].argmax()) + int(batch[PROMPT_LENGTH][0])
    lengths = batch[RESPONSE_LENGTH].tolist()
    return [ids[i, start : start + n].tolist() for i, n in enumerate(lengths)]


#: Fields :class:`~polyrl.data.dataset.RLDataset` adds to a row; not dataset columns.
_ITEM_FIELDS = frozenset({"input_ids", "raw_prompt", "uid", "source_row"})


def _source_row(item: Mapping[str, Any]) -> dict[str, Any]:
    row = item.get("source_row")
    if row is None:  # an item not from an RLDataset
        row = {k: v for k, v in item.items() if k not in _ITEM_FIELDS}
    return row


class RolloutProducer:
    """Samples and scores responses for RL: the generate and reward phases of a step.

    Build one with :meth:`connect`; it owns its reward workers, its event loop and its client,
    and :meth:`close` releases them.

    Args:
        cfg: the run's configuration (``rollout``, ``data``, ``agent`` groups are read).
        client: a :class:`~polyrl.rollout.client.RolloutClient` (started on ``loop``).
        tokenizer: the policy's tokenizer (decodes responses for the reward).
        rewards: the :class:`~polyrl.reward.base.Scorer` that scores the samples (see
            :func:`reward_manager`).
        loop: the event loop the client runs on.

    Attributes:
        resume_aborted / stopping / resumed_samples: see :meth:`sample_prompt`.
        watch: an optional coroutine function run beside every generation on the client's
            loop, cancelled when the generation ends; an error it raises ends the generation
            (the trainer's restart of lost replicas, see
            :meth:`~polyrl.trainer.rl.generation.Replicas.watch`).
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        client: Any,
        tokenizer: Any,
        rewards: Scorer,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.pad_id = pad_id_of(tokenizer)
        self.rewards = rewards
        self._loop = loop
        self.watch: Callable[[], Awaitable[None]] | None = None
        #: A vision model's :class:`~polyrl.models.processor.VisionProcessor`: agent loops
        #: render the media of observations and tool results with it.
        self.processor: Any = None
        #: Continue samples aborted by a weight update from their partial tokens.
        self.resume_aborted = False
        #: Set when the run ends: aborted samples are then not continued.
        self.stopping = False
        #: Samples continued after an abort, since the start.
        self.resumed_samples = 0
        # A generative judge asks the policy's own replicas by default: it learns where they
        # are from this client.
        rewards.attach_rollout(client)

    @classmethod
    def connect(
        cls,
        cfg: PolyRLConfig,
        urls: Sequence[str],
        tokenizer: Any,
        rewards: Scorer,
        api_key: str | None = None,
    ) -> RolloutProducer:
        """Build a producer with its own event loop and client to ``urls``.

        It scores with ``rewards`` (see :func:`reward_manager`) and closes them; ``api_key`` is
        the servers' key. The driver and every transfer-queue rollout worker build theirs this
        way.
        """
        from polyrl.rollout.client import RolloutClient

        producer = cls(
            cfg,
            RolloutClient(list(urls), api_key=api_key, max_concurrency=512),
            tokenizer,
            rewards,
            asyncio.new_event_loop(),
        )
        producer.run(producer.client.start())
        return producer

    def run(self, coro: Any) -> Any:
        """Run ``coro`` to completion on the client's event loop, from any thread.

        While the loop runs in another thread (a generation whose watch restarts a replica in
        a thread of its own), the coroutine is handed to it and this thread waits.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop.is_running() and running is not self._loop:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        return self._loop.run_until_complete(coro)

    def run_watched(self, coro: Any) -> Any:
        """:meth:`run` ``coro`` with :attr:`watch` beside it (just ``coro`` without one)."""
        watch = self.watch
        if watch is None:
            return self.run(coro)

        async def both() -> Any:
            main = asyncio.ensure_future(coro)
            guard = asyncio.ensure_future(watch())
            try:
                await asyncio.wait({main, guard}, return_when=asyncio.FIRST_COMPLETED)
                if guard.done() and not main.done():
                    guard.result()  # the watch failed (or ended): its error ends the generation
                return await main
            finally:
                for task in (main, guard):
                    task.cancel()
                await asyncio.gather(main, guard, return_exceptions=True)

        return self.run(both())

    def close(self) -> None:
        """Close the client, its event loop and the reward workers."""
        try:
            if not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self.run(self.client.close())
                self._loop.close()
        finally:
            self.rewards.close()

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
            **({"return_routed_experts": True} if self.cfg.actor.router_replay else {}),
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
        ``extra_info``, ``response_text``, ``finish_reason``, and ``weight_version_first`` /
        ``weight_version_last`` (the oldest and newest weight version of each row's tokens).
        """
        return self.run_watched(self.generate_async(items, n, temperature, seed, first_index))

    async def generate_async(
        self,
        items: Sequence[Mapping[str, Any]],
        n: int,
        temperature: float,
        seed: int,
        first_index: int = 0,
    ) -> tuple[Batch, dict[str, float]]:
        """:meth:`generate` as a coroutine on the client's loop (the asynchronous rollout's)."""
        if self.cfg.agent.enable:
            batch, metrics = await self._generate_with_agents(
                items, n, temperature, seed, first_index
            )
        else:
            results = await asyncio.gather(
                *(
                    self.sample_prompt(item, n, temperature, seed, first_index + i)
                    for i, item in enumerate(items)
                )
            )
            batch, metrics = self.pack_single_turn(items, results)
        self.add_row_info(batch, items, n)
        return batch, metrics

    def add_row_info(self, batch: Batch, items: Sequence[Mapping[str, Any]], n: int) -> None:
        """Add each row's ``uid``, ``data_source``, ``ground_truth`` and ``extra_info``.

        Rows are ``n`` per item, in item order; an agent batch says each row's episode
        (:data:`~polyrl.core.columns.EPISODE`, item ``episode // n``), since an episode split
        into linked samples is several rows.
        """
        from polyrl.data.dataset import ground_truth_of

        if EPISODE in batch.non_tensors:
            owner = [int(e) // n for e in batch.non_tensors[EPISODE]]
        else:
            owner = [i for i in range(len(items)) for _ in range(n)]

        def per_row(values: Sequence[Any]) -> np.ndarray:
            out = np.empty(len(owner), dtype=object)
            for row, i in enumerate(owner):
                out[row] = values[i]
            return out

        batch.non_tensors.update(
            {
                UID: per_row([str(item["uid"]) for item in items]),
                "data_source": per_row([item["data_source"] for item in items]),
                "ground_truth": per_row([ground_truth_of(item) for item in items]),
                "extra_info": per_row([item.get("extra_info") or {} for item in items]),
            }
        )
        if any(item.get(MULTI_MODAL) is not None for item in items):
            # One object per prompt, shared by its n rows: a pickled batch holds it once.
            batch.non_tensors[MULTI_MODAL] = per_row([item.get(MULTI_MODAL) for item in items])
        if self.rewards.wants_rows:
            # Batched reward functions get the dataset's columns (one dict per row, shared
            # by the row's n responses: they are read, not changed).
            batch.non_tensors["source_row"] = per_row([_source_row(item) for item in items])
        if self.rewards.wants_prompts:
            # A reward model or judge reads the prompt's chat messages.
            prompt_key = self.cfg.data.prompt_key
            batch.non_tensors["raw_prompt"] = per_row(
                [item.get("raw_prompt", item.get(prompt_key)) for item in items]
            )

    async def sample_prompt(
        self, item: Mapping[str, Any], n: int, temperature: float, seed: int, index: int
    ) -> Any:
        """Sample ``n`` responses to one item (the step's prompt number ``index``), one turn.

        With :attr:`resume_aborted` set, a sample the server aborted (a weight update with
        ``inflight=abort``) is continued from its partial tokens, as a new request whose prompt
        is the old prompt plus those tokens; its tokens and log-probs are joined, so nothing
        generated is lost or generated twice (``first_weight_version`` stays the oldest).
        """
        params = self.sampling_params(n, temperature, derive_seed(seed, index))
        prompt = item["input_ids"].tolist()
        # A vision prompt's media go with every request for it (the server caches their
        # encodings by content, so the continuation below does not encode them again).
        media = item.get(MULTI_MODAL)
        extra = {"multi_modal": media} if media is not None else {}
        result = await self.client.generate(prompt, params, **extra)
        if not self.resume_aborted:
            return result
        budget = params["max_new_tokens"]
        for j, out in enumerate(result.outputs):
            while out.finish_reason == "abort" and len(out.output_ids) < budget:
                if self.stopping:
                    break
                more = dict(params, n=1, max_new_tokens=budget - len(out.output_ids))
                more["seed"] = derive_seed(params["seed"], j, len(out.output_ids))
                rest = (
                    await self.client.generate(prompt + list(out.output_ids), more, **extra)
                ).outputs[0]
                self.resumed_samples += 1
                first = out.first_weight_version
                out.output_ids = list(out.output_ids) + list(rest.output_ids)
                if out.logprobs is not None and rest.logprobs is not None:
                    out.logprobs = list(out.logprobs) + list(rest.logprobs)
                # The continuation's routes cover the whole sequence (its prompt holds the
                # partial output), recomputed where it had to prefill.
                out.routed_experts = rest.routed_experts
                out.finish_reason, out.stop_reason = rest.finish_reason, rest.stop_reason
                out.weight_version = rest.weight_version
                if first is None and out.output_ids:
                    first = rest.first_weight_version
                out.first_weight_version = first
        return result

    def pack_single_turn(
        self, items: Sequence[Mapping[str, Any]], results: Sequence[Any]
    ) -> tuple[Batch, dict[str, float]]:
        """Pack the items' :meth:`sample_prompt` results into an engine batch (no row info)."""
        rows_p, rows_r, rows_lp, rows_finish, firsts, lasts = [], [], [], [], [], []
        rows_routes = []
        for item, result in zip(items, results, strict=True):
            prompt = item["input_ids"].tolist()
            for out in result.outputs:
                rows_p.append(prompt)
                rows_r.append(list(out.output_ids))
                rows_lp.append(out.logprobs)
                rows_routes.append(out.routed_experts)
                rows_finish.append(out.finish_reason)
                last = int(out.weight_version)
                first = out.first_weight_version
                firsts.append(last if first is None else int(first))
                lasts.append(last)
        have_lp = all(lp is not None for lp in rows_lp)
        routes = None
        if self.cfg.actor.router_replay:
            if any(r is None for r in rows_routes):
                raise RuntimeError(
                    "actor.router_replay is on but the rollout returned no routed experts; it "
                    "needs a MoE model served by the native rollout backend"
                )
            routes = rows_routes
        batch = build_rollout_batch(
            rows_p, rows_r, self.pad_id, rows_lp if have_lp else None, routed_experts=routes
        )
        texts = self.tokenizer.batch_decode(rows_r, skip_special_tokens=True)
        batch.non_tensors["response_text"] = np.array(texts, dtype=object)
        batch.non_tensors[FINISH_REASON] = np.array(rows_finish, dtype=object)
        add_weight_versions(batch, firsts, lasts)
        return batch, {"rollout/weight_version": float(max(lasts))}

    async def _generate_with_agents(
        self,
        items: Sequence[Mapping[str, Any]],
        n: int,
        temperature: float,
        seed: int,
        first_index: int,
    ) -> tuple[Batch, dict[str, float]]:
        """Roll every item out ``n`` times through its agent loop (multi-turn, tools, envs)."""
        from polyrl.agent.base import collate_trajectories, run_agent_loops
        from polyrl.agent.tools import load_tool_config

        agent = self.cfg.agent
        params = self.sampling_params(1, temperature, 0)
        params.pop("seed")
        common = {
            "sampling_params": params,
            "max_response_length": self.cfg.data.max_response_length,
            "max_turns": agent.max_turns,
            # The dataset's prompt-length rule, applied again to the prompt each loop sends.
            "max_prompt_length": self.cfg.data.max_prompt_length,
            "truncation": self.cfg.data.truncation,
            # The dataset's template arguments, so a loop renders its prompt as the dataset did.
            "apply_chat_template_kwargs": self.cfg.data.apply_chat_template_kwargs,
        }
        # Built once per rollout call: a tool keeps no state between trajectories.
        tool_config_tools = load_tool_config(agent.tool_config) if agent.tool_config else []
        loop_kwargs = {
            "single_turn": common,
            "env": common,
            "tool": {
                **common,
                "tools": [*agent.tools, *tool_config_tools],
                "parser": agent.tool_parser,
                "tool_timeout": agent.tool_timeout_s,
                "max_tool_response_tokens": agent.max_tool_response_tokens,
            },
            "openai_agent": {
                **common,
                "entrypoint": agent.entrypoint,
                "timeout_s": agent.timeout_s,
                "non_extending": agent.non_extending,
            },
        }
        samples = []
        for i, item in enumerate(items):
            for j in range(n):
                # Each copy samples with its own seed; turn k of a copy uses seed + k.
                samples.append({**item, "seed": derive_seed(seed, first_index + i, j)})
        trajectories = await run_agent_loops(
            samples,
            self.client,
            self.tokenizer,
            default_agent=agent.default_loop,
            loop_kwargs=loop_kwargs,
            max_concurrency=agent.max_concurrency,
            processor=self.processor,
        )
        batch = collate_trajectories(trajectories, self.pad_id)
        texts = [t.response_text(self.tokenizer) for t in trajectories]
        batch.non_tensors["response_text"] = np.array(texts, dtype=object)
        metrics = {k: float(v) for k, v in batch.meta.pop("agent_metrics", {}).items()}
        firsts = [min(t.weight_versions, default=0) for t in trajectories]
        lasts = [max(t.weight_versions, default=0) for t in trajectories]
        add_weight_versions(batch, firsts, lasts)
        metrics["rollout/weight_version"] = float(max(lasts, default=0))
        return batch, metrics

    def sample_and_score(
        self,
        items: Sequence[Mapping[str, Any]],
        n: int,
        temperature: float,
        seed: int,
        timing: dict[str, float],
        first_index: int = 0,
    ) -> tuple[Batch, dict[str, float]]:
        """:meth:`generate`, then :meth:`score`, and :func:`attach_scores` the result.

        For ReMax the greedy response of each item is sampled and scored too, as the rows'
        ``baseline``. The times go to ``timing`` (``gen``; ``reward``, which includes the
        greedy sample); the metrics are the generation's plus the reward manager's.
        """
        with timer(timing, "gen"):
            batch, metrics = self.generate(items, n, temperature, seed, first_index)
        with timer(timing, "reward"):
            scored = self.score(batch)
            baseline = None
            if self.cfg.algorithm.adv_estimator == "remax":
                greedy, _ = self.generate(items, 1, 0.0, seed, first_index)
                baseline = self.score(greedy)[0].repeat_interleave(n)
        metrics.update(attach_scores(batch, scored, baseline))
        return batch, metrics

    async def produce_group(
        self,
        item: Mapping[str, Any],
        n: int,
        temperature: float,
        seed: int,
        greedy_baseline: bool = False,
    ) -> tuple[Batch, dict[str, float]]:
        """Generate and score one prompt group, as the asynchronous modes' rollout thread does.

        Returns the scored batch of ``item``'s ``n`` responses and its generation and reward
        metrics; with ``greedy_baseline`` (ReMax) the greedy response's score is the rows'
        ``baseline``. Scoring runs in a helper thread, so other groups keep generating.
        """
        batch, metrics = await self.generate_async([item], n, temperature, seed)
        scored = await asyncio.to_thread(self.score, batch)
        baseline = None
        if greedy_baseline:
            greedy, _ = await self.generate_async([item], 1, 0.0, seed)
            baseline = (await asyncio.to_thread(self.score, greedy))[0].repeat_interleave(n)
        metrics.update(attach_scores(batch, scored, baseline))
        return batch, metrics

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """mean@k and pass@k (``k = rollout.val_n``) of ``dataset``'s prompts, per data source.

        Samples at ``rollout.val_temperature`` in batches of ``data.val_batch_size`` prompts,
        with seeds of their own (they never collide with a training step's).
        """
        cfg = self.cfg
        k = cfg.rollout.val_n
        scores, accs, sources, lengths = [], [], [], []
        for start in range(0, len(dataset), cfg.data.val_batch_size):
            stop = min(start + cfg.data.val_batch_size, len(dataset))
            items = [dataset[i] for i in range(start, stop)]
            seed = derive_seed(cfg.seed_for("rollout"), -1, start)
            batch, _ = self.generate(items, k, cfg.rollout.val_temperature, seed)
            s, a, _ = self.score(batch)
            # An agent episode split into linked samples counts once (they share its reward).
            heads = _episode_heads(batch)
            scores.append(s[heads])
            accs.append(a[heads])
            lengths.append(batch[RESPONSE_LENGTH].float())
            sources += [batch.non_tensors["data_source"][i] for i in heads]
        score = torch.cat(scores).view(-1, k)
        acc = torch.cat(accs).view(-1, k)
        out = {
            f"val/score/mean@{k}": float(score.mean()),
            f"val/acc/mean@{k}": float(acc.mean()),
            f"val/pass@{k}": float((acc.max(dim=1).values > 0).float().mean()),
            "val/response_length/mean": float(torch.cat(lengths).mean()),
        }
        names = np.array(sources[::k], dtype=object)
        for source in sorted(set(names)):
            rows = torch.as_tensor(names == source)
            out[f"val/{source}/acc/mean@{k}"] = float(acc[rows].mean())
            out[f"val/{source}/pass@{k}"] = float((acc[rows].max(dim=1).values > 0).float().mean())
        return out

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score every row: ``(scores (B,), accuracy (B,), reward metrics)``."""
        keys = ["data_source", "ground_truth", "extra_info", "response_text"]
        if self.rewards.wants_rows:
            keys.append("source_row")
        if self.rewards.wants_prompts:
            keys.append("raw_prompt")
        scoring = Batch(non_tensors={k: batch.non_tensors[k] for k in keys})
        if self.rewards.wants_rows:
            ids = np.empty(len(batch), dtype=object)
            for i, row in enumerate(completion_ids(batch)):
                ids[i] = row
            scoring.non_tensors["completion_ids"] = ids
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
                batch[RESPONSE_LENGTH],
                response_cap(self.cfg),
                reward_cfg.overlong_buffer_len,
                reward_cfg.overlong_penalty_factor,
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
            metrics["reward/overlong_fraction"] = float((penalty < 0).float().mean())
        return scores, acc, metrics
