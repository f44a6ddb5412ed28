"""The RL step over the transfer queue (``transfer.enable=true``): the driver passes references.

Without the queue every phase's data passes through the driver: the rollout responses arrive
over HTTP, the batch goes out to the engines for log-probs and comes back, goes out again for
the updates. With it:

1. **Rollout workers** (:class:`StoreRolloutWorker`, Ray actors next to the rollout servers) get
   the step's prompt *indices*, generate and score their share through the same
   :class:`~polyrl.trainer.rl_rollout.RolloutProducer` the driver uses, and ``put`` each sample
   (ragged prompt/response tokens, masks, rollout log-probs, score) into the step's partition.
2. The driver asks the queue for the partition's references (:class:`~polyrl.transfer.BatchMeta`)
   and hands each engine worker group the meta; ``__dp_chunks__`` gives every data-parallel rank
   its rows, which the rank fetches straight from the storage units, rebuilds in the step's
   layout (:class:`StepLayout`: the same padding widths as the driver-side batch) and computes
   on; per-token outputs (``old_log_probs``, ``ref_log_probs``, ``values``) go back to the queue.
3. The advantage phase runs in rollout worker 0 on the stored fields (the driver's estimator
   code, :func:`~polyrl.trainer.rl_rollout.compute_advantages`), writes ``advantages`` and
   ``returns`` back and returns the step's data metrics.
4. The critic and actor ranks fetch their shards for the updates; the partition is cleared.

The driver sends prompt indices, metas and loss settings and receives metrics: a few KB per
step whatever the batch size. The rows each rank rebuilds equal the driver-side batch's rows,
so a run gives the same metrics with and without the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from polyrl.config import PolyRLConfig
from polyrl.controller import Dispatch, register
from polyrl.core.batch import Batch
from polyrl.trainer.rl_rollout import (
    RolloutProducer,
    batch_metrics,
    build_rollout_batch,
    compute_advantages,
    place_on_last_token,
)
from polyrl.workers.engine import EngineWorker
from polyrl.workers.weight_sync import WeightSyncWorker

__all__ = [
    "ROLLOUT_FIELDS",
    "StepLayout",
    "StoreActorWorker",
    "StoreEngineMixin",
    "StoreEngineWorker",
    "StoreRolloutWorker",
    "merge_rollout_summaries",
    "sample_rows",
]

#: Per-sample fields the rollout workers put (ragged 1-D token tensors and scalars).
ROLLOUT_FIELDS = ("prompt_ids", "response_ids", "response_mask", "score", "acc")
#: Per-row objects kept next to the tokens (the advantage phase needs ``uid``).
ROW_OBJECTS = ("uid", "data_source", "ground_truth", "extra_info", "response_text")


def sample_rows(
    batch: Batch,
    scores: torch.Tensor,
    acc: torch.Tensor,
    baseline: torch.Tensor | None = None,
) -> Batch:
    """Turn a padded rollout batch into per-sample rows for the queue (no padding kept).

    Object columns ``prompt_ids``, ``response_ids``, ``response_mask`` (and
    ``rollout_log_probs`` when the batch has them) hold each row's own 1-D numpy array; tensor
    columns ``score``, ``acc`` (and ``baseline`` for ReMax) one number per row; the per-row
    objects of :data:`ROW_OBJECTS` are kept.
    """
    width_p = int(batch["prompt_length"].max())
    ids, loss = batch["input_ids"], batch["loss_mask"]
    logps = batch["rollout_log_probs"] if "rollout_log_probs" in batch.tensor_keys else None
    columns: dict[str, list[np.ndarray]] = {
        "prompt_ids": [],
        "response_ids": [],
        "response_mask": [],
    }
    if logps is not None:
        columns["rollout_log_probs"] = []
    # Rows are numpy arrays: they pickle a hundred times faster than small torch tensors.
    ids_np, loss_np = ids.numpy(), loss.numpy()
    logps_np = logps.numpy() if logps is not None else None
    for i, (p, r) in enumerate(
        zip(batch["prompt_length"].tolist(), batch["response_length"].tolist(), strict=True)
    ):
        columns["prompt_ids"].append(ids_np[i, width_p - p : width_p].copy())
        columns["response_ids"].append(ids_np[i, width_p : width_p + r].copy())
        columns["response_mask"].append(loss_np[i, width_p : width_p + r].copy())
        if logps_np is not None:
            columns["rollout_log_probs"].append(logps_np[i, width_p : width_p + r].copy())
    non_tensors: dict[str, np.ndarray] = {}
    for key, values in columns.items():
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        non_tensors[key] = arr
    for key in ROW_OBJECTS:
        if key in batch.non_tensors:
            non_tensors[key] = batch.non_tensors[key]
    tensors = {"score": scores.float(), "acc": acc.float()}
    if baseline is not None:
        tensors["baseline"] = baseline.float()
    return Batch(tensors=tensors, non_tensors=non_tensors)


def _rows_of(batch: Batch, key: str) -> list[list[Any]]:
    """Return a ragged column as lists (the queue stacks it when all rows are as long)."""
    if key in batch.tensor_keys:
        return [row.tolist() for row in batch[key]]
    return [np.asarray(row).tolist() for row in batch.non_tensors[key]]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a step's samples are packed for the engines: the driver-side batch's widths.

    Args:
        width_prompt: the longest prompt of the step (prompts are left-padded to it).
        width_response: the longest response of the step (responses are right-padded to it).
        pad_id: the padding token id.
        rollout_log_probs: whether the samples carry the servers' log-probs.
    """

    width_prompt: int
    width_response: int
    pad_id: int
    rollout_log_probs: bool = True

    def rebuild(self, rows: Batch) -> Batch:
        """Pack fetched rows into the engine batch the driver would have built for them.

        Fixed-width tensor columns fetched with the rows (per-token outputs of earlier phases,
        per-row scalars) are carried over as they are; the per-row objects too.
        """
        batch = build_rollout_batch(
            _rows_of(rows, "prompt_ids"),
            _rows_of(rows, "response_ids"),
            self.pad_id,
            _rows_of(rows, "rollout_log_probs") if self.rollout_log_probs else None,
            _rows_of(rows, "response_mask"),
            width_prompt=self.width_prompt,
            width_response=self.width_response,
        )
        ragged = {"prompt_ids", "response_ids", "response_mask", "rollout_log_probs"}
        for key in rows.tensor_keys:
            if key not in ragged:
                batch[key] = rows[key]
        for key in rows.non_tensor_keys:
            if key not in ragged:
                batch.non_tensors[key] = rows.non_tensors[key]
        return batch

    def fields(self, extra: Sequence[str] = ()) -> list[str]:
        """Return the queue fields :meth:`rebuild` needs, plus ``extra``."""
        base = ["prompt_ids", "response_ids", "response_mask"]
        if self.rollout_log_probs:
            base.append("rollout_log_probs")
        return base + [f for f in extra if f not in base]

    def load(self, queue: Any, meta: Any, extra: Sequence[str] = ()) -> Batch:
        """Fetch ``meta``'s rows (layout fields + ``extra``) from the queue and rebuild them."""
        return self.rebuild(queue.get_data(meta, fields=self.fields(extra)))


class StoreEngineMixin:
    """Engine-worker methods that read their shard from the transfer queue and write back.

    Mixed into the RL trainer's engine workers (:class:`~polyrl.workers.engine.EngineWorker`
    and :class:`~polyrl.workers.weight_sync.WeightSyncWorker`). ``meta`` is split across the
    data-parallel ranks by its ``__dp_chunks__``; the layout is broadcast. The queue client is
    attached once (:meth:`attach_transfer_queue`), so a call carries only references.
    """

    _transfer_queue: Any = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def attach_transfer_queue(self, queue: Any) -> None:
        """Keep the transfer queue client the ``*_store`` methods read from and write to."""
        self._transfer_queue = queue

    def _queue(self) -> Any:
        if self._transfer_queue is None:
            raise RuntimeError("no transfer queue attached: call attach_transfer_queue first")
        return self._transfer_queue

    @register(dispatch=Dispatch.DP_COMPUTE)
    def infer_to_store(
        self,
        meta: Any,
        layout: StepLayout,
        method: str,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Run the inference method ``method`` on this rank's rows and put its outputs back."""
        if method not in ("compute_log_prob", "compute_ref_log_prob", "compute_values"):
            raise ValueError(
                f"infer_to_store: method must be compute_log_prob, compute_ref_log_prob or "
                f"compute_values, got {method!r}"
            )
        if len(meta) == 0:
            raise ValueError("infer_to_store: this rank was given no rows")
        queue = self._queue()
        out = getattr(self, method)(layout.load(queue, meta), **dict(kwargs or {}))
        queue.put(out, meta.partition, sample_ids=list(meta.sample_ids))

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def update_from_store(
        self,
        meta: Any,
        layout: StepLayout,
        fields: Sequence[str],
        update: str,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
    ) -> dict[str, Any]:
        """Run ``update`` (``update_actor`` or ``update_critic``) on this rank's rows."""
        if update not in ("update_actor", "update_critic"):
            raise ValueError(
                f"update_from_store: update must be update_actor or update_critic, got {update!r}"
            )
        batch = layout.load(self._queue(), meta, fields)
        return getattr(self, update)(batch, loss, loss_kwargs, num_mini_batches, epochs)


def merge_rollout_summaries(summaries: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine the rollout workers' summaries into one.

    Counts add up, widths and versions take the max, per-sample means are weighted by each
    worker's rows.
    """
    rows = [float(s["rows"]) for s in summaries]
    total = sum(rows) or 1.0
    out: dict[str, float] = {}
    keys = {k for s in summaries for k in s}
    for key in sorted(keys):
        values = [(float(s[key]), w) for s, w in zip(summaries, rows, strict=True) if key in s]
        if key in ("rows", "reward/errors", "reward/timeouts"):
            out[key] = sum(v for v, _ in values)
        elif key.startswith("width_") or key.endswith("/max") or key.endswith("weight_version"):
            out[key] = max(v for v, _ in values)
        elif key.endswith("/min"):
            out[key] = min(v for v, _ in values)
        elif key.startswith("time_"):
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / total
    return out


class StoreRolloutWorker:
    """Generates and scores a share of each step's prompts and puts the samples in the queue.

    Runs as a Ray actor (``trainer.worker_backend=ray``) or in the driver's process (``local``).
    It keeps its own rollout client, tokenizer, reward manager and copy of the training prompts,
    so a step costs the driver only the prompt indices.

    Args:
        cfg: the run's configuration.
        urls: the rollout servers.
        model_dir: the policy's directory (for the tokenizer).
        dataset: the training prompts (an :class:`~polyrl.data.dataset.RLDataset`).
        queue: the transfer queue client.
        reward_fn: the trainer's reward function override (``None``: ``reward.*`` settings).
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        urls: Sequence[str],
        model_dir: str,
        dataset: Any,
        queue: Any,
        reward_fn: Any = None,
    ) -> None:
        from polyrl.models.loader import load_tokenizer
        from polyrl.reward.manager import RewardManager
        from polyrl.rollout.client import RolloutClient

        self.cfg = cfg
        self.queue = queue
        self.dataset = dataset
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        fn = reward_fn if reward_fn is not None else cfg.reward.custom_function
        self.rewards = RewardManager(
            custom_function=fn or None,
            num_workers=cfg.reward.num_workers,
            timeout_s=cfg.reward.timeout_s,
            error_reward=cfg.reward.error_reward,
        )
        self._loop = asyncio.new_event_loop()
        # One scoring thread: the reward manager serves one call at a time.
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="polyrl-score")
        self.client = RolloutClient(list(urls), max_concurrency=512)
        self._run(self.client.start())
        self.producer = RolloutProducer(
            cfg, self.client, self.tokenizer, self.pad_id, self.rewards, self._run
        )

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def rollout(
        self,
        partition: str,
        indices: Sequence[int],
        first_index: int,
        n: int,
        temperature: float,
        seed: int,
    ) -> dict[str, float]:
        """Generate, score and put ``n`` samples for each prompt index; return a summary.

        ``first_index`` is the position of ``indices[0]`` in the step's prompt list: it fixes
        the seeds and the sample ids (``first_index * n`` onwards), so the rows land where the
        driver-side batch would have them.
        """
        items = [self.dataset[int(i)] for i in indices]
        if self.cfg.agent.enable:
            parts = [self._rollout_batch(partition, items, first_index, n, temperature, seed)]
        else:
            # (A module-level coroutine: an async method would make Ray run this actor on an
            # event loop, and the worker drives its own.)
            parts = self._run(
                _rollout_streamed(self, partition, items, first_index, n, temperature, seed)
            )
        summary = merge_rollout_summaries(parts)
        summary["time_reward"] = sum(p["time_reward"] for p in parts)
        return summary

    def _finish(
        self,
        batch: Batch,
        gen_metrics: Mapping[str, float],
        baseline: torch.Tensor | None,
        scored: tuple[torch.Tensor, torch.Tensor, Mapping[str, float]],
        reward_s: float,
    ) -> tuple[Batch, dict[str, float]]:
        scores, acc, reward_metrics = scored
        rows = sample_rows(batch, scores, acc, baseline)
        summary = {k: float(v) for k, v in gen_metrics.items()}
        for key in ("reward/errors", "reward/timeouts"):
            if key in reward_metrics:
                summary[key] = float(reward_metrics[key])
        summary.update(
            {
                "rows": float(len(rows)),
                "width_prompt": float(batch["prompt_length"].max()),
                "width_response": float(batch["response_length"].max()),
                "time_reward": reward_s,
                "rollout_log_probs": float("rollout_log_probs" in batch.tensor_keys),
            }
        )
        return rows, summary

    def _rollout_batch(
        self,
        partition: str,
        items: Sequence[Mapping[str, Any]],
        first_index: int,
        n: int,
        temperature: float,
        seed: int,
    ) -> dict[str, float]:
        """All items at once (agent loops): generate, then score, then put."""
        batch, gen_metrics = self.producer.generate(items, n, temperature, seed, first_index)
        tick = time.perf_counter()
        scored = self.producer.score(batch)
        baseline = None
        if self.cfg.algorithm.adv_estimator == "remax":
            greedy, _ = self.producer.generate(items, 1, 0.0, seed, first_index)
            baseline = self.producer.score(greedy)[0].repeat_interleave(n)
        rows, summary = self._finish(
            batch,
            gen_metrics,
            baseline,
            scored,
            time.perf_counter() - tick,
        )
        start = first_index * n
        self.queue.put(rows, partition, sample_ids=list(range(start, start + len(rows))))
        return summary

    def advantages(
        self,
        meta: Any,
        layout: StepLayout,
        kl_ctrl: Any,
        fields: Sequence[str],
        max_response_length: int,
    ) -> tuple[dict[str, float], Any]:
        """Run the advantage phase on the stored step: put advantages back, return the metrics.

        Returns the step's data metrics and the KL controller (updated when the KL penalty is
        in the reward), which the driver keeps for the next step and its checkpoints.
        """
        from polyrl.trainer.rl_losses import state_values

        batch = layout.load(self.queue, meta, list(fields))
        mask = batch["loss_mask"]
        scores, acc = batch["score"], batch["acc"]
        batch["token_level_scores"] = place_on_last_token(scores, mask)
        out_keys = ["token_level_rewards", "advantages", "returns"]
        if "values" in batch.tensor_keys:
            batch["values"] = state_values(batch["values"]) * mask
            out_keys.append("values")
        baseline = batch["baseline"] if "baseline" in batch.tensor_keys else None
        metrics = compute_advantages(batch, self.cfg, kl_ctrl, baseline)
        self.queue.put(
            Batch(tensors={k: batch[k] for k in out_keys}),
            meta.partition,
            sample_ids=list(meta.sample_ids),
        )
        metrics.update(batch_metrics(batch, scores, acc, max_response_length))
        return metrics, kl_ctrl

    def close(self) -> None:
        """Close the client and the reward workers."""
        try:
            self._run(self.client.close())
        finally:
            self._loop.close()
            self._scorer.shutdown(wait=False)
            self.rewards.close()


async def _rollout_streamed(
    worker: StoreRolloutWorker,
    partition: str,
    items: Sequence[Mapping[str, Any]],
    first_index: int,
    n: int,
    temperature: float,
    seed: int,
) -> list[dict[str, float]]:
    """One turn per item: each prompt's group is scored and put as soon as it is sampled.

    Scoring runs on one helper thread, so the responses of other prompts keep arriving
    while a group is scored (a slow reward overlaps with generation).
    """
    loop = asyncio.get_running_loop()
    producer = worker.producer

    async def one(offset: int, item: Mapping[str, Any]) -> dict[str, float]:
        index = first_index + offset
        result = await producer.sample_prompt(item, n, temperature, seed, index)
        batch, gen_metrics = producer.pack_single_turn([item], [result])
        producer.add_row_info(batch, [item], n)
        tick = time.perf_counter()
        scored = await loop.run_in_executor(worker._scorer, producer.score, batch)
        baseline = None
        if worker.cfg.algorithm.adv_estimator == "remax":
            greedy_result = await producer.sample_prompt(item, 1, 0.0, seed, index)
            greedy, _ = producer.pack_single_turn([item], [greedy_result])
            producer.add_row_info(greedy, [item], 1)
            greedy_scores = await loop.run_in_executor(worker._scorer, producer.score, greedy)
            baseline = greedy_scores[0].repeat_interleave(n)
        rows, summary = worker._finish(
            batch,
            gen_metrics,
            baseline,
            scored,
            time.perf_counter() - tick,
        )
        start = index * n
        await worker.queue.async_put(
            rows, partition, sample_ids=list(range(start, start + len(rows)))
        )
        return summary

    return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))


class StoreActorWorker(StoreEngineMixin, WeightSyncWorker):
    """The actor's worker (weight sync included) with the transfer-queue methods."""


class StoreEngineWorker(StoreEngineMixin, EngineWorker):
    """A reference or critic worker with the transfer-queue methods."""
