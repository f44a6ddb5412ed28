"""Rollout workers that feed the transfer queue (``transfer.enable=true``).

Without the queue every phase's data passes through the driver: the rollout responses arrive
over HTTP, the batch goes out to the engines for log-probs and comes back, goes out again for
the updates. With it:

1. **Rollout workers** (:class:`StoreRolloutWorker`, Ray actors next to the rollout servers) get
   the step's prompt *indices*, generate and score their share through the same
   :class:`~polyrl.trainer.rl.rollout.RolloutProducer` the driver uses, and ``put`` each sample
   (ragged prompt/response tokens, masks, rollout log-probs, score) into the step's partition.
2. The driver asks the queue for the partition's references (:class:`~polyrl.transfer.BatchMeta`)
   and hands each engine worker group a :class:`~polyrl.workers.store.StoredRows`; every
   data-parallel rank fetches its rows straight from the storage units, rebuilds them in the
   step's layout (the same padding widths as the driver-side batch) and computes on them;
   per-token outputs (``old_log_probs``, ``ref_log_probs``, ``values``) go back to the queue.
3. The advantage phase (:func:`~polyrl.trainer.rl.advantage.advantage_phase`, the code the
   driver runs without the queue) runs in rollout worker 0 on the stored rows and writes
   ``advantages`` and ``returns`` back.
4. The critic and actor ranks fetch their shards for the updates; the partition is cleared.

The step itself is :meth:`polyrl.trainer.rl.loop.RLTrainer.step` in both modes; the data plane
(:mod:`polyrl.trainer.rl.dataplane`) decides whether a phase gets a batch or a reference.

The driver sends prompt indices, metas and loss settings and receives metrics: a few KB per
step whatever the batch size. The rows each rank rebuilds equal the driver-side batch's rows,
so a run gives the same metrics with and without the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ACC,
    BASELINE,
    INPUT_IDS,
    LOSS_MASK,
    MULTI_MODAL,
    PROMPT_IDS,
    PROMPT_LENGTH,
    RESPONSE_IDS,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    SCORE,
    UID,
)
from polyrl.trainer.rl.advantage import advantage_phase
from polyrl.trainer.rl.rollout import RolloutProducer, attach_scores, reward_manager
from polyrl.workers.store import StoreClient, StoredRows

__all__ = [
    "ROLLOUT_FIELDS",
    "StoreRolloutWorker",
    "StoreWorkers",
    "merge_rollout_summaries",
    "sample_rows",
]

#: Per-sample fields the rollout workers put (ragged 1-D token tensors and scalars).
ROLLOUT_FIELDS = (PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, SCORE, ACC)
#: Per-row objects kept next to the tokens (the advantage phase needs ``uid``).
ROW_OBJECTS = (UID, "data_source", "ground_truth", "extra_info", "response_text", MULTI_MODAL)


def sample_rows(batch: Batch) -> Batch:
    """Turn a padded, scored rollout batch into per-sample rows for the queue (no padding kept).

    Object columns ``prompt_ids``, ``response_ids``, ``response_mask`` (and
    ``rollout_log_probs`` when the batch has them) hold each row's own 1-D numpy array; the
    tensor columns ``score``, ``acc`` (and ``baseline`` for ReMax; see
    :func:`~polyrl.trainer.rl.rollout.attach_scores`) one number per row; the per-row objects
    of :data:`ROW_OBJECTS` are kept.
    """
    width_p = int(batch[PROMPT_LENGTH].max())
    ids, loss = batch[INPUT_IDS], batch[LOSS_MASK]
    logps = batch[ROLLOUT_LOG_PROBS] if ROLLOUT_LOG_PROBS in batch.tensor_keys else None
    columns: dict[str, list[np.ndarray]] = {
        PROMPT_IDS: [],
        RESPONSE_IDS: [],
        RESPONSE_MASK: [],
    }
    if logps is not None:
        columns[ROLLOUT_LOG_PROBS] = []
    # Rows are numpy arrays: they pickle a hundred times faster than small torch tensors.
    ids_np, loss_np = ids.numpy(), loss.numpy()
    logps_np = logps.numpy() if logps is not None else None
    for i, (p, r) in enumerate(
        zip(batch[PROMPT_LENGTH].tolist(), batch[RESPONSE_LENGTH].tolist(), strict=True)
    ):
        columns[PROMPT_IDS].append(ids_np[i, width_p - p : width_p].copy())
        columns[RESPONSE_IDS].append(ids_np[i, width_p : width_p + r].copy())
        columns[RESPONSE_MASK].append(loss_np[i, width_p : width_p + r].copy())
        if logps_np is not None:
            columns[ROLLOUT_LOG_PROBS].append(logps_np[i, width_p : width_p + r].copy())
    non_tensors: dict[str, np.ndarray] = {}
    for key, values in columns.items():
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        non_tensors[key] = arr
    for key in ROW_OBJECTS:
        if key in batch.non_tensors:
            non_tensors[key] = batch.non_tensors[key]
    tensors = {k: batch[k] for k in (SCORE, ACC, BASELINE) if k in batch.tensor_keys}
    return Batch(tensors=tensors, non_tensors=non_tensors)


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
        if key in ("rows", "reward/errors", "reward/timeouts", "reward/garbage"):
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
        api_key: the rollout servers' key.
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        urls: Sequence[str],
        model_dir: str,
        dataset: Any,
        queue: Any,
        reward_fn: Any = None,
        api_key: str | None = None,
    ) -> None:
        from polyrl.core.plugins import import_plugins
        from polyrl.models.loader import load_tokenizer
        from polyrl.trainer.rl.build import vision_processor

        import_plugins(cfg.trainer.imports)  # a Ray actor: the user's agent loops, tools, ...
        self.cfg = cfg
        self.queue = queue
        self.store = StoreClient(queue)
        self.dataset = dataset
        tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
        self.producer = RolloutProducer.connect(
            cfg, urls, tokenizer, reward_manager(cfg, reward_fn), api_key=api_key
        )
        self.producer.processor = vision_processor(cfg, model_dir, tokenizer)
        # One scoring thread: the reward manager serves one call at a time.
        self._scorer = ThreadPoolExecutor(1, thread_name_prefix="polyrl-score")

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
            parts = self.producer.run(
                _rollout_streamed(self, partition, items, first_index, n, temperature, seed)
            )
        summary = merge_rollout_summaries(parts)
        summary["time_reward"] = sum(p["time_reward"] for p in parts)
        return summary

    def _finish(
        self, batch: Batch, metrics: Mapping[str, float], reward_s: float
    ) -> tuple[Batch, dict[str, float]]:
        """Turn a scored batch into queue rows and this worker's summary of them."""
        rows = sample_rows(batch)
        summary = {k: float(v) for k, v in metrics.items()}
        summary.update(
            {
                "rows": float(len(rows)),
                "width_prompt": float(batch[PROMPT_LENGTH].max()),
                "width_response": float(batch[RESPONSE_LENGTH].max()),
                "time_reward": reward_s,
                "rollout_log_probs": float(ROLLOUT_LOG_PROBS in batch.tensor_keys),
                "multi_modal": float(MULTI_MODAL in batch.non_tensors),
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
        timing: dict[str, float] = {}
        batch, metrics = self.producer.sample_and_score(
            items, n, temperature, seed, timing, first_index
        )
        rows, summary = self._finish(batch, metrics, timing["timing_s/reward"])
        start = first_index * n
        self.queue.put(rows, partition, sample_ids=list(range(start, start + len(rows))))
        return summary

    # ------------------------------------------------------------------ routing
    # The trainer restarts a lost replica while ``rollout`` runs and routes this worker's
    # client as its own (see Replicas.attach): on Ray these calls run in a concurrency group
    # of their own, beside ``rollout``. Each changes one list item or flag, which the client's
    # event loop, in the other thread, reads atomically.

    def replace_replica(self, old_url: str, new_url: str, enabled: bool = True) -> None:
        """Put a restarted replica ``new_url`` in the place of ``old_url`` in the client."""
        self.producer.client.replace_replica(old_url, new_url, enabled=enabled)

    def enable_replica(self, url: str, enabled: bool = True) -> None:
        """Let the client send requests to ``url`` (``enabled=False``: hold it out)."""
        self.producer.client.enable_replica(url, enabled=enabled)

    def set_replica_wait(self, seconds: float) -> None:
        """Make the client's requests wait ``seconds`` for a replica when none is left."""
        self.producer.client.replica_wait = seconds

    def request_retries(self) -> int:
        """Return the requests the client re-sent after a failure, since the start."""
        return int(self.producer.client.retries)

    def advantages(
        self, rows: StoredRows, kl_ctrl: Any, max_response_length: int
    ) -> tuple[StoredRows, dict[str, float], Any]:
        """Run the advantage phase on the stored rows and put its outputs back.

        Returns the reference (now with the advantage columns), the step's data metrics and
        the KL controller (updated when the KL penalty is in the reward), which the driver
        keeps for the next step and its checkpoints.
        """
        batch = self.store.load(rows)
        written, metrics = advantage_phase(batch, self.cfg, kl_ctrl, max_response_length)
        self.store.put(rows, Batch(tensors={k: batch[k] for k in written}))
        return rows.with_fields(*written), metrics, kl_ctrl

    def close(self) -> None:
        """Close the client and the reward workers."""
        try:
            self.producer.close()
        finally:
            self._scorer.shutdown(wait=False)


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
        gen_metrics.update(attach_scores(batch, scored, baseline))
        rows, summary = worker._finish(batch, gen_metrics, time.perf_counter() - tick)
        start = index * n
        await worker.queue.async_put(
            rows, partition, sample_ids=list(range(start, start + len(rows)))
        )
        return summary

    return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))


#: The Ray concurrency group of a rollout worker's routing calls, which run beside ``rollout``.
_ROUTING = "routing"


class _RayWorkerClient:
    """The routing side of a Ray rollout worker's client, as the trainer's replicas drive it.

    :class:`~polyrl.trainer.rl.generation.Replicas` takes a replica out of every client's
    rotation while it restarts and lets it back in once it has the weights; this forwards
    those calls (and the retry count, and the wait for a replica) to the actor.
    """

    def __init__(self, actor: Any, timeout_s: float = 60.0) -> None:
        self._actor = actor
        self._timeout_s = timeout_s
        self._replica_wait = 0.0

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        call = getattr(self._actor, method).options(concurrency_group=_ROUTING)
        return ray.get(call.remote(*args), timeout=self._timeout_s)

    def replace_replica(self, old_url: str, new_url: str, *, enabled: bool = True) -> None:
        """Replace ``old_url`` by ``new_url`` in the worker's client."""
        self._call("replace_replica", old_url, new_url, enabled)

    def enable_replica(self, url: str, enabled: bool = True) -> None:
        """Let ``url`` take the worker's requests (``enabled=False``: hold it out)."""
        self._call("enable_replica", url, enabled)

    @property
    def retries(self) -> int:
        """Requests the worker's client re-sent after a failure."""
        return int(self._call("request_retries"))

    @property
    def replica_wait(self) -> float:
        """Seconds the worker's requests wait for a replica when none is left."""
        return self._replica_wait

    @replica_wait.setter
    def replica_wait(self, seconds: float) -> None:
        self._call("set_replica_wait", float(seconds))
        self._replica_wait = float(seconds)


class StoreWorkers:
    """The transfer queue's rollout workers: Ray actors or, with a local queue, in-process.

    Args:
        count: how many workers.
        backend: ``"ray"`` (actors that take no CPU reservation: they mostly wait on HTTP)
            or ``"local"``.
        args: :class:`StoreRolloutWorker`'s constructor arguments.
    """

    def __init__(self, count: int, backend: str, *args: Any) -> None:
        self.backend = backend
        if backend == "ray":
            import ray

            # Routing calls (a replica restarted meanwhile) run in a thread of their own.
            remote = ray.remote(num_cpus=0, concurrency_groups={_ROUTING: 1})(StoreRolloutWorker)
            self.workers: list[Any] = [remote.remote(*args) for _ in range(count)]
        else:
            self.workers = [StoreRolloutWorker(*args) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.workers)

    def clients(self) -> list[Any]:
        """Each worker's rollout client, or for a Ray worker a proxy of its routing calls.

        What :meth:`~polyrl.trainer.rl.generation.Replicas.attach` needs to route the
        workers' requests like the driver's when a replica is restarted.
        """
        if self.backend == "ray":
            return [_RayWorkerClient(w) for w in self.workers]
        return [w.producer.client for w in self.workers]

    def call(self, index: int, method: str, **kwargs: Any) -> Any:
        """Call ``method`` on worker ``index`` with named arguments; wait for its result."""
        worker = self.workers[index]
        if self.backend == "ray":
            import ray

            return ray.get(getattr(worker, method).remote(**kwargs))
        return getattr(worker, method)(**kwargs)

    def call_each(self, method: str, calls: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Call ``method`` on worker ``i`` with the named arguments ``calls[i]``, all at once."""
        workers = self.workers[: len(calls)]
        if self.backend == "ray":
            import ray

            return ray.get(
                [getattr(w, method).remote(**kw) for w, kw in zip(workers, calls, strict=True)]
            )
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [
                pool.submit(getattr(w, method), **kw) for w, kw in zip(workers, calls, strict=True)
            ]
            return [f.result() for f in futures]

    def close(self) -> None:
        """Close every worker (their clients and reward processes)."""
        for index in range(len(self.workers)):
            with contextlib.suppress(Exception):
                self.call(index, "close")
