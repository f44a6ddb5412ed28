"""Generation ahead of training: the ``one_step_off`` and ``async`` trainer modes.

In ``trainer.mode=sync`` a step generates, then trains, then pushes the new weights. Here a
rollout thread of its own keeps the rollout servers busy while the engines train, and the step
takes its batch from a :class:`~polyrl.transfer.replay.ReplayBuffer`. The step itself is the
same code as in sync mode (:meth:`~polyrl.trainer.rl.loop.RLTrainer.step`): only its generation
phase is this object.

* The rollout thread draws prompt batches from the sampler and *reserves* one buffer entry per
  prompt group (its prompt index and seed: enough to regenerate it), then *starts* the groups
  one by one as the staleness gate allows, and *fills* each entry when its ``n`` responses are
  generated and scored.
* **The staleness gate.** Group number ``i`` (in reservation order, ``B`` groups per batch)
  starts only once ``i < (K + s + 1) * B``, where ``K`` is the number of steps the trainer has
  completed (weights pushed) and ``s = async.max_staleness``. The buffer hands batches out in
  reservation order (``fifo``), so group ``i`` is trained in step ``i // B + 1`` with weights at
  most ``s`` versions newer than those that generated its oldest token. Generation pauses at the
  gate rather than exceed it. ``one_step_off`` is the gate with ``s = 1`` where, in addition, a
  weight push waits for the batch being generated: step ``k + 1``'s batch is generated entirely
  with the weights of step ``k - 1`` while step ``k`` trains, and step ``k``'s weights reach the
  servers before step ``k + 2``'s generation starts.
* **Partial rollouts** (``async.partial_rollout``): during a push, in-flight requests either
  ``continue`` on the new weights (the servers keep them; each sample records the first and last
  weight version of its tokens), or are aborted and ``resume`` from their partial tokens with
  the new weights (:meth:`~polyrl.trainer.rl.rollout.RolloutProducer.sample_prompt`).
* **Weight versions** count the actor's updates (equal to the step number unless
  ``trainer.critic_warmup`` skips updates).

A checkpoint saves the buffer (generated groups included) and the sampler position together,
so a run killed at any point resumes with every group trained exactly once; each trained group
is recorded in ``<output_dir>/async_samples.jsonl`` (step, serial, prompt index, versions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.columns import ACC, SCORE, UID, WEIGHT_VERSION_FIRST, WEIGHT_VERSION_LAST
from polyrl.core.rollout_batch import rollout_widths, widen_rollout_batch
from polyrl.reward.base import ReplicaEndpoints, Scorer
from polyrl.reward.manager import RewardResult
from polyrl.trainer.rl.generation import wait_recovering
from polyrl.trainer.rl.producer_process import ProducerProcess
from polyrl.trainer.rl.rollout import RolloutProducer, derive_seed
from polyrl.transfer.replay import ReplayBuffer, ReplayEntry

__all__ = ["AheadRollout", "SerialRewards", "gate_limit", "staleness_metrics"]

SAMPLES_LOG = "async_samples.jsonl"


def gate_limit(completed_steps: int, max_staleness: int, batch_size: int) -> int:
    """How many groups (in reservation order) may have started after ``completed_steps``.

    Group ``i`` is trained in step ``i // batch_size + 1``; letting it start only while
    ``i < (completed_steps + max_staleness + 1) * batch_size`` bounds the versions between the
    weights that generate it and those that train on it by ``max_staleness``.
    """
    return (completed_steps + max_staleness + 1) * batch_size


def staleness_metrics(trainer_version: int, firsts: Sequence[int], lasts: Sequence[int]) -> dict:
    """Return the staleness metrics of a batch's rows.

    ``async/staleness_mean|max``: versions the oldest token is behind the trained weights;
    ``async/span_max``: versions spanned within one sample.
    """
    behind = np.array([trainer_version - int(v) for v in firsts], dtype=np.float64)
    span = np.array([int(b) - int(a) for a, b in zip(firsts, lasts, strict=True)], dtype=np.float64)
    return {
        "async/staleness_mean": float(behind.mean()) if len(behind) else 0.0,
        "async/staleness_max": float(behind.max()) if len(behind) else 0.0,
        "async/span_max": float(span.max()) if len(span) else 0.0,
    }


def _mean_metrics(groups: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Average each metric over the groups that report it."""
    keys = {k for m in groups for k in m}
    return {k: float(np.mean([m[k] for m in groups if k in m])) for k in keys}


class SerialRewards:
    """A reward scorer shared by two producers, scoring one batch at a time.

    The rollout thread scores its groups while the trainer's thread may validate; the reward
    workers take one batch at a time. Closing is left to the owner of ``rewards``.
    """

    def __init__(self, rewards: Scorer) -> None:
        self.rewards = rewards
        self.wants_rows = rewards.wants_rows
        self.wants_prompts = rewards.wants_prompts
        self._lock = threading.Lock()

    def attach_rollout(self, client: ReplicaEndpoints) -> None:
        """Pass the producer's ``client`` on to the shared scorer."""
        self.rewards.attach_rollout(client)

    def score(self, batch: Batch) -> RewardResult:
        """Score ``batch`` with the shared scorer (waits for a score in progress)."""
        with self._lock:
            return self.rewards.score(batch)

    def close(self) -> None:
        """Nothing: the shared manager is closed by its owner."""


class AheadRollout:
    """The generation phase of ``trainer.mode=one_step_off|async`` (see the module docstring).

    A :class:`~polyrl.trainer.rl.generation.GenerationPhase`: the step calls it as it calls the
    sync mode's.

    Args:
        cfg: the run's configuration (``trainer.mode``, ``async_rl``, ``rollout``, ``data``).
        producer: a producer of its own (its client and event loop run in the rollout thread),
            or a :class:`~polyrl.trainer.rl.producer_process.ProducerProcess`
            (``async.producer=process``: the requests run in a process of its own).
        dataset: the training prompts, by index.
        sampler: the resumable prompt sampler (drawn from the rollout thread).
        total_steps: the run's steps (no group is reserved beyond them).
        out_dir: where ``async_samples.jsonl`` is written.
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        producer: RolloutProducer | ProducerProcess,
        dataset: Any,
        sampler: Any,
        total_steps: int,
        out_dir: str | Path,
    ) -> None:
        self.cfg = cfg
        self.mode = cfg.trainer.mode
        opts = cfg.async_rl
        self.max_staleness = 1 if self.mode == "one_step_off" else opts.max_staleness
        self.batch_size = cfg.data.train_batch_size
        self.producer = producer
        producer.resume_aborted = self.mode == "async" and opts.partial_rollout == "resume"
        self.dataset = dataset
        self.sampler = sampler
        self.total_groups = total_steps * self.batch_size
        self.buffer = ReplayBuffer(
            max_staleness=self.max_staleness,
            sampling=opts.sampling if self.mode == "async" else "fifo",
            max_reuse=opts.max_reuse if self.mode == "async" else 1,
            # one_step_off holds two batches by construction; a capacity is for async.
            capacity=opts.capacity if self.mode == "async" else 0,
        )
        self._resumed = False
        self.samples_log = Path(out_dir) / SAMPLES_LOG
        self.completed_steps = 0
        self.version = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop = False
        self._paused_s = 0.0
        #: Restarts lost replicas (and gives them the weights); called while the trainer waits.
        self.recover: Any = None

    #: Seconds the trainer waits for its batch before looking for lost replicas.
    recover_every_s = 1.0

    @property
    def inflight_policy(self) -> str:
        """The servers' policy for in-flight requests during a weight push."""
        # Aborted samples are resumed by the producer: abort them, else keep them going.
        return "abort" if self.producer.resume_aborted else "keep"

    # ------------------------------------------------------------------ the rollout thread
    def start(self) -> None:
        """Start the rollout thread (after :meth:`load_state_dict` when resuming)."""
        if self._thread is not None:
            return
        if not self._resumed:
            # A fresh run: a log left by an earlier run in this directory is not this run's.
            self.samples_log.unlink(missing_ok=True)
        self._loop = self.producer._loop
        self._thread = threading.Thread(target=self._run, name="polyrl-ahead-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._produce())
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer through the buffer
            if not self._stop:
                self.buffer.fail(exc)

    def _allowed(self) -> int:
        limit = gate_limit(self.completed_steps, self.max_staleness, self.batch_size)
        return min(limit, self.total_groups)

    async def _produce(self) -> None:
        """Reserve, start (as the gate allows) and fill groups until the run ends."""
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        # Groups reserved by a previous run (resuming) are generated again first.
        queue = [s for s, _ in self.buffer.unfilled()]
        try:
            while not self._stop:
                for task in [t for t in tasks if t.done()]:
                    tasks.discard(task)
                    task.result()  # a failed group ends the rollout (and the run)
                if not queue and self.buffer.next_serial < self.total_groups:
                    if self.buffer.has_room(self.batch_size):
                        queue = self._reserve_batch()
                if queue and queue[0] < self._allowed():
                    serial = queue.pop(0)
                    task = asyncio.ensure_future(self._group(serial))
                    tasks.add(task)
                    continue
                tick = time.perf_counter()
                self._wake.clear()
                waiters = [asyncio.ensure_future(self._wake.wait()), *tasks]
                await asyncio.wait(waiters, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                waiters[0].cancel()
                if queue and not tasks:
                    self._paused_s += time.perf_counter() - tick
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _reserve_batch(self) -> list[int]:
        """Draw the next prompt batch and reserve its groups (atomically with the sampler)."""
        base = self.cfg.seed_for("rollout")
        with self.buffer.lock:
            indices = [int(i) for i in self.sampler.next_batch()]
            first = self.buffer.next_serial
            # ReMax's greedy baseline is part of how a group is generated: decided here, once
            # for the batch, and kept with it (a resumed run regenerates it the same way).
            greedy = self.cfg.algorithm.adv_estimator == "remax"
            payloads = [
                {"index": idx, "seed": derive_seed(base, first + k), "greedy_baseline": greedy}
                for k, idx in enumerate(indices)
            ]
            return self.buffer.reserve(payloads)

    async def _group(self, serial: int) -> None:
        """Generate and score one prompt group, and fill its entry."""
        payload = self.buffer.payload(serial)
        ro = self.cfg.rollout
        item = self.dataset[payload["index"]]
        batch, metrics = await self.producer.produce_group(
            item, ro.n, ro.temperature, payload["seed"], bool(payload.get("greedy_baseline"))
        )
        if getattr(self.sampler, "curriculum", False):
            # The curriculum weighs the next draws by this group's outcome.
            self.sampler.record([payload["index"]], [float(batch[ACC].float().mean())])
        # Groups of one prompt drawn twice (epochs) stay apart in group-relative estimators.
        batch.non_tensors[UID] = np.array(
            [f"{uid}#{serial}" for uid in batch.non_tensors[UID]], dtype=object
        )
        version = min(int(v) for v in batch.non_tensors[WEIGHT_VERSION_FIRST])
        # The group's generation metrics travel with it: a batch reports its own groups'.
        item = {"batch": batch, "metrics": metrics}
        self.buffer.fill(serial, item, version, float(batch[SCORE].float().std(0)))

    # ------------------------------------------------------------------ the trainer's side
    def generate(self, step: int, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Take step ``step``'s batch from the buffer (waiting for it); return it and metrics."""
        self.start()
        tick = time.perf_counter()
        # Lost replicas are restarted from here, not the rollout thread (it would race the
        # update), and must be: the push that restarts them otherwise follows this batch.
        entries = wait_recovering(
            lambda timeout: self.buffer.take(
                self.batch_size, trainer_version=self.version, timeout=timeout
            ),
            self.recover,
            self.recover_every_s,
        )
        waited = time.perf_counter() - tick
        self._nudge()  # room in the buffer again
        timing["timing_s/gen"] = timing.get("timing_s/gen", 0.0) + waited
        batch = self._assemble(entries)
        firsts = list(batch.non_tensors[WEIGHT_VERSION_FIRST])
        lasts = list(batch.non_tensors[WEIGHT_VERSION_LAST])
        metrics = _mean_metrics([e.item["metrics"] for e in entries])
        metrics.update(staleness_metrics(self.version, firsts, lasts))
        counts = self.buffer.counts()
        metrics.update(
            {
                "async/wait_s": waited,
                "async/buffer_ready": float(counts["ready"]),
                "async/buffer_reserved": float(counts["reserved"]),
                "async/dropped_stale": float(counts["dropped_stale"]),
                "async/resumed_samples": float(self.producer.resumed_samples),
                "async/paused_s": self._paused_s,
                "async/reused_groups": float(sum(e.uses > 1 for e in entries)),
                "rollout/weight_version": float(max(int(v) for v in lasts)),
            }
        )
        self._log_samples(step, entries)
        return batch, metrics

    def _assemble(self, entries: Sequence[ReplayEntry]) -> Batch:
        batches = [e.item["batch"] for e in entries]
        widths = [rollout_widths(b) for b in batches]
        width_p, width_r = max(w[0] for w in widths), max(w[1] for w in widths)
        pad_id = self.producer.pad_id
        return Batch.concat([widen_rollout_batch(b, width_p, width_r, pad_id) for b in batches])

    def _log_samples(self, step: int, entries: Sequence[ReplayEntry]) -> None:
        with self.samples_log.open("a") as f:
            for e in entries:
                rows = e.item["batch"].non_tensors
                firsts = [int(v) for v in rows[WEIGHT_VERSION_FIRST]]
                lasts = [int(v) for v in rows[WEIGHT_VERSION_LAST]]
                record = {
                    "step": step,
                    "serial": e.serial,
                    "index": e.payload["index"],
                    "use": e.uses,
                    "trainer_version": self.version,
                    "first_versions": firsts,
                    "last_versions": lasts,
                }
                f.write(json.dumps(record) + "\n")

    def weight_version(self, step: int, updates: int) -> int:
        """Return ``updates``: versions count the actor's updates (a critic warm-up makes none)."""
        return updates

    def before_sync(self, version: int) -> None:
        """``one_step_off``: let the batch being generated finish on the current weights.

        ``version`` is the one the sync after this wait pushes. A replica lost meanwhile is
        restarted from here (the engines are idle, as in :meth:`generate`) and given the
        actor's weights as that version: the weights it had are gone, the actor has just
        been updated.
        """
        if self.mode != "one_step_off":
            return
        # Without a restart here the groups waited for never finish: the sync that would
        # restart their replica comes after this wait.
        recover = self.recover
        wait_recovering(
            lambda timeout: self.buffer.wait_filled(self._allowed(), timeout=timeout),
            None if recover is None else lambda: recover(version=version),
            self.recover_every_s,
        )

    def after_step(self, version: int) -> None:
        """Record a completed step (the servers serve ``version``): the gate opens one batch."""
        self.completed_steps += 1
        self.version = version
        self._nudge()

    def _nudge(self) -> None:
        """Wake the rollout thread to look at the gate and the buffer again."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the trainer-state entries ``ahead`` (the buffer) and ``sampler``.

        The sampler position replaces the trainer's own: it is taken together with the buffer
        (see the module doc), while the rollout thread draws prompts as the trainer saves.
        """
        with self.buffer.lock:
            return {
                "ahead": {"buffer": self.buffer.state_dict()},
                "sampler": self.sampler.state_dict(),
            }

    def load_state_dict(self, state: Mapping[str, Any], step: int, version: int) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`); drop log lines after ``step``.

        ``state`` is the trainer's checkpoint state of ``step``, and ``version`` the weights
        the servers get. The sampler is restored by its owner, from the position
        :meth:`state_dict` gave.

        Raises:
            ConfigError: the checkpoint holds no buffer (a ``trainer.mode=sync`` run saved it).
        """
        if "ahead" not in state:
            raise ConfigError(
                f"the checkpoint of step {step} was saved by a trainer.mode=sync run; resume it "
                "with trainer.mode=sync",
                key="trainer.mode",
            )
        self._resumed = True
        self.buffer.load_state_dict(state["ahead"]["buffer"])
        self.completed_steps = step
        self.version = version
        if self.samples_log.exists():
            kept = [
                line
                for line in self.samples_log.read_text().splitlines()
                if line and json.loads(line)["step"] <= step
            ]
            self.samples_log.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        """Stop the rollout thread (aborting its requests) and wake whoever waits."""
        self._stop = True
        self.producer.stopping = True
        self.buffer.close()
        if self._thread is None:
            return
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self.producer.client.abort(), loop).result(10)
            self._nudge()
        self._thread.join(timeout=30)
        self._thread = None
