"""The generation phase of an RL step: one object that hands the step a scored batch.

Whatever produces the step's samples -- the driver itself (:class:`DriverRollout`), the
transfer queue's rollout workers (:class:`QueueRollout`) or, in ``trainer.mode=one_step_off|async``,
a rollout thread generating ahead of training
(:class:`~polyrl.trainer.rl.asynchronous.AheadRollout`) -- the step sees one
:class:`GenerationPhase`: ``generate(step, timing)`` returns a reference to scored rows (a
``Batch`` or :class:`~polyrl.workers.store.StoredRows`) and the generation metrics, and a few
hooks around the weight sync and the checkpoint do what the mode needs (nothing, in
``trainer.mode=sync``: :class:`SyncGeneration`). What differs between algorithms lives here, not
in the step: ReMax's greedy baseline, DAPO's dynamic sampling, and putting the rollout replicas
to sleep while the engines train (:class:`Replicas`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import httpx
import numpy as np
import torch

from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.columns import ACC, BASELINE, SCORE, UID
from polyrl.core.rollout_batch import rollout_widths, widen_rollout_batch
from polyrl.model_engine.engine import TEMPERATURE_KEY
from polyrl.rollout.client import NoReplicaAvailableError
from polyrl.trainer.rl.rollout import (
    RolloutProducer,
    derive_seed,
    group_varies,
    select_groups,
    timer,
)
from polyrl.trainer.rl.settings import RunSettings, settings_for
from polyrl.trainer.rl.store_worker import ROLLOUT_FIELDS, StoreWorkers, merge_rollout_summaries
from polyrl.trainer.rl.supervisor import ReplicaSupervisor
from polyrl.workers.handles import ActorHandle
from polyrl.workers.store import StepLayout, StoredRows

__all__ = [
    "DriverRollout",
    "GenerationPhase",
    "QueueRollout",
    "Replicas",
    "SyncGeneration",
    "at_sampling_temperature",
    "log_prob_temperature",
    "prompts_per_round",
    "wait_recovering",
]

T = TypeVar("T")


class GenerationPhase(Protocol):
    """What an RL step asks of whoever generates its samples, in every ``trainer.mode``.

    The step calls each method unconditionally, in this order: :meth:`generate`, (after the
    actor's update) :meth:`weight_version` and :meth:`before_sync`, the weight sync, then
    :meth:`after_step`. Generation within the step (``sync``) needs none of the hooks
    (:class:`SyncGeneration`); generation ahead of it
    (:class:`~polyrl.trainer.rl.asynchronous.AheadRollout`) uses each.
    """

    def generate(self, step: int, timing: dict[str, float]) -> tuple[Any, dict[str, float]]:
        """Return a reference to step ``step``'s scored rows and the generation metrics."""
        ...

    def weight_version(self, step: int, updates: int) -> int:
        """Return the actor's weight version after ``step``, with ``updates`` updates so far."""
        ...

    def before_sync(self, version: int) -> None:
        """Prepare for the push of the actor's weights to the replicas as ``version``."""
        ...

    def after_step(self, version: int) -> None:
        """Close the step; the replicas now serve ``version``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Entries for the trainer's checkpoint state (they replace its own of one name)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any], step: int, version: int) -> None:
        """Restore from the trainer's checkpoint ``state`` of ``step``; replicas get ``version``."""
        ...

    def close(self) -> None:
        """Stop what the phase runs of its own (before the replicas stop)."""
        ...


class SyncGeneration:
    """The :class:`GenerationPhase` hooks of generation within the step (``trainer.mode=sync``).

    None is needed: the step generates, trains and pushes in turn, so weight versions are step
    numbers, a checkpoint holds no generated rows and nothing runs between steps.
    """

    def weight_version(self, step: int, updates: int) -> int:
        """Return ``step``: each step pushes its weights (or, in a critic warm-up, none)."""
        return step

    def before_sync(self, version: int) -> None:
        """Nothing: no generation runs during the sync."""

    def after_step(self, version: int) -> None:
        """Nothing: the next step generates with the weights pushed."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing to add to the trainer's state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], step: int, version: int) -> None:
        """Nothing to restore (a checkpoint of the async modes resumes here too)."""

    def close(self) -> None:
        """Nothing of its own to stop: the trainer closes the producer and workers."""


def prompts_per_round(cfg: PolyRLConfig) -> int:
    """Prompts the sampler hands out per generation round (its batch size).

    ``data.train_batch_size``, except under DAPO dynamic sampling with
    ``algorithm.gen_batch_size`` set: then each round draws that many (verl's
    ``data.gen_batch_size``) and the step keeps ``data.train_batch_size`` groups of them.
    """
    algo = cfg.algorithm
    if algo.filter_groups and algo.gen_batch_size:
        return algo.gen_batch_size
    return cfg.data.train_batch_size


def log_prob_temperature(cfg: PolyRLConfig) -> float:
    """Return a training step's log-prob temperature: ``rollout.temperature`` (1 when greedy).

    The engines' old, reference and new log-probs (and a teacher's) must be of the distribution
    the rollout sampled from, as the servers' own log-probs are, or the importance ratio is not
    1 before the first update (verl divides the logits by the rollout temperature too). Greedy
    sampling has no such distribution: the servers report temperature-1 log-probs then.
    Validation's ``rollout.val_temperature`` never applies: no step trains on its samples.
    """
    temperature = cfg.rollout.temperature
    return temperature if temperature > 0 else 1.0


def at_sampling_temperature(rows: Any, temperature: float) -> Any:
    """Tag a step's rows (a ``Batch`` or :class:`StoredRows`) with their log-prob temperature.

    A ``Batch`` gets ``meta[TEMPERATURE_KEY]``, which the engines read; a reference to rows in
    the transfer queue carries it in its :class:`StepLayout`, whose rebuild on each rank sets it.
    """
    if isinstance(rows, StoredRows):
        layout = dataclasses.replace(rows.layout, temperature=temperature)
        return dataclasses.replace(rows, layout=layout)
    rows.meta[TEMPERATURE_KEY] = temperature
    return rows


def wait_recovering(
    wait: Callable[[float], T], recover: Callable[[], Any] | None, poll_s: float
) -> T:
    """Call ``wait(poll_s)`` until it returns, restarting lost replicas at each timeout.

    For the trainer's thread while it waits on generation it does not run itself (the rollout
    thread, transfer-queue workers): the engines are idle then, so a restart's push of the
    weights cannot overlap an update, and without it a wait for groups only a restarted
    replica can generate would never end. ``wait`` raises :class:`TimeoutError` after its
    argument's seconds; ``recover`` is :meth:`Replicas.recover` (``None``: nothing to restart).
    """
    while True:
        try:
            return wait(poll_s)
        except TimeoutError:
            if recover is not None:
                recover()


class Replicas:
    """The rollout replicas as a step uses them: sleep while training, wake for new weights.

    With a ``supervisor`` (replicas this run started) a replica that dies is restarted, brought
    to the weights the others serve and put back in rotation: while the step generates
    (:meth:`watch` runs beside the generation; requests wait up to
    ``rollout.restart_timeout_s`` when no replica is left), and during a weight sync (the
    survivors get the new weights, the restarted replica too). The weights pushed to a
    restarted replica are the actor's, which are those of the last sync from the end of a sync
    until the next update.

    Args:
        cfg: the run's configuration (``rollout`` group).
        urls: the replicas' URLs.
        producer: the driver's producer (its client reaches every replica).
        transport: the weight transport's name and options (see
            :func:`~polyrl.trainer.rl.build.weight_transport`).
        supervisor: restarts dead replicas (``None``: replicas the run does not own).
        actor: the actor's handle, which pushes the weights (set by :meth:`sync_weights`
            otherwise).
        senders: the engine rank that sends each replica its weights (``urls`` order; hybrid
            placement on GPUs: the rank on its GPU); ``None``: rank 0 sends to all.
        settings: the run's resolved settings (wire dtype, placement, sleep); resolved from
            ``cfg`` when ``None``.

    In hybrid placement on GPUs a sync frees the GPU for the replicas in this order: the
    engines give their allocator's cache back (and their optimizer state with
    ``actor.offload_optimizer``), the replicas wake their weights, the actor pushes the new
    ones (in the replicas' dtype), the actor's parameters go to host memory with
    ``actor.offload_params``, and only then do the replicas wake their KV cache, which is the
    larger share. :meth:`sleep` brings what was offloaded back once the replicas sleep.
    """

    #: Seconds between two looks for dead replicas while a step generates.
    poll_s = 0.5

    def __init__(
        self,
        cfg: PolyRLConfig,
        urls: Sequence[str],
        producer: RolloutProducer,
        transport: tuple[str, dict[str, Any]],
        supervisor: ReplicaSupervisor | None = None,
        actor: ActorHandle | None = None,
        senders: Sequence[int] | None = None,
        settings: RunSettings | None = None,
    ) -> None:
        self.cfg = cfg
        run = settings_for(cfg, settings)
        self.urls = list(urls)
        if senders and len(senders) != len(self.urls):
            raise ValueError(f"{len(senders)} sending ranks for {len(self.urls)} replicas")
        #: Which engine rank sends to each replica (a restarted replica keeps its sender).
        self._sender_of: dict[str, int] = dict(zip(self.urls, senders or (), strict=False))
        #: The bytes on the wire are the replicas' dtype, not the engine's (fp32 master).
        self.wire_dtype = run.rollout_dtype
        #: Hybrid placement on GPUs: engines and replicas take turns with the GPU memory.
        self.shares_gpu = run.shares_gpu
        #: Whether the replicas free their memory while the engines train.
        self.sleeps = run.sleeps_during_training
        #: What the actor moved to host memory for the replicas (brought back at sleep).
        self._offloaded: dict[str, bool] = {}
        #: Device bytes the replicas' last sleep freed (``None``: not on a GPU).
        self._sleep_freed: float | None = None
        self.producer = producer
        self.transport, self.transport_options = transport
        self.supervisor = supervisor
        self.actor: ActorHandle | None = actor
        #: The weight version every replica serves (0: the model's own weights).
        self.version = 0
        #: What the replicas do with requests in flight during a push (``keep``: they go on
        #: with the new weights; ``abort``: they end with their partial tokens).
        self.inflight = "keep"
        #: Every client that routes requests to the replicas: a restart reaches each.
        self._clients: list[Any] = []
        #: Replicas restarted before a sync and given its version early (see recover): the
        #: sync skips them, a server refuses a version it already serves.
        self._early: dict[str, int] = {}
        self._early_stats: dict[str, Any] = {}
        self.attach(producer.client)
        if supervisor is not None:
            producer.watch = self.watch

    def attach(self, client: Any) -> None:
        """Route ``client`` like the driver's.

        The async modes' rollout thread's, the queue's rollout workers' (in this process or,
        through a proxy, Ray actors), a producer process's (through a proxy). Its requests
        wait for a restarted replica when none is left, and a restart takes the replica out of
        its rotation and puts it back with the weights, as for the driver's.
        """
        self._clients.append(client)
        if self.supervisor is not None:
            # With no replica left, requests wait for a restarted one.
            client.replica_wait = self.cfg.rollout.restart_timeout_s

    def sleep(self) -> None:
        """Free the replicas' memory for training (when ``RunSettings.sleeps_during_training``).

        Then the actor gets back what it offloaded for them (``actor.offload_*``).
        """
        if self.sleeps:
            answers = self._broadcast(self.producer.client.sleep) or []
            freed = [a.get("device_bytes_freed") for a in answers if isinstance(a, dict)]
            if any(f is not None for f in freed):
                self._sleep_freed = float(sum(f for f in freed if f is not None))
        if self._offloaded and self.actor is not None:
            offloaded, self._offloaded = self._offloaded, {}
            self.actor.reload(**offloaded)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` for ``tags`` (``weights``/``kv_cache``; default both).

        Nothing when the replicas do not sleep.
        """
        if self.sleeps:
            self._broadcast(lambda: self.producer.client.wake_up(tags))

    def _offload(self, params: bool, optimizer: bool) -> None:
        """Move the actor's parameters and/or optimizer state to host memory, then free cache."""
        if params or optimizer:
            self.actor.offload(params=params, optimizer=optimizer)
            self._offloaded = {
                "params": params or self._offloaded.get("params", False),
                "optimizer": optimizer or self._offloaded.get("optimizer", False),
            }
        else:
            self.actor.empty_cache()

    def _broadcast(self, call: Callable[[], Any]) -> Any:
        """Run a client broadcast and return its answers (``None``: a replica died).

        A replica found dead meanwhile is left to its restart.
        """
        try:
            return self.producer.run(call())
        except NoReplicaAvailableError:
            if self.supervisor is None or not self.supervisor.dead(grace_s=2.0):
                raise
            return None

    def metrics(self) -> dict[str, float]:
        """Return the replicas' recovery counters, each since the start.

        ``rollout/replica_restarts``, ``rollout/request_retries`` and
        ``recovery/replica_actors_recreated``.
        """
        restarts = self.supervisor.restarts if self.supervisor is not None else 0
        recreated = self.supervisor.recreated if self.supervisor is not None else 0
        metrics = {
            "rollout/replica_restarts": float(restarts),
            # Restarts whose Ray actor had died too, so that a new one had to be placed.
            "recovery/replica_actors_recreated": float(recreated),
            "rollout/request_retries": float(sum(c.retries for c in self._clients)),
        }
        if self._sleep_freed is not None:
            # GPU memory the replicas' last sleep gave back (measured by them; GPU only).
            metrics["rollout/sleep_freed_bytes"] = self._sleep_freed
        return metrics

    def sync_weights(self, actor: ActorHandle, version: int) -> dict[str, float]:
        """Wake the replicas and push the actor's weights as ``version``; return metrics.

        Replicas found dead first are restarted and get this sync; one that dies during it is
        restarted and gets it too, after the survivors.
        """
        self.actor = actor
        self.recover(push=False)
        actor_cfg = self.cfg.actor
        if self.shares_gpu:
            # The optimizer state is not needed for the push: out of the way first.
            self._offload(params=False, optimizer=actor_cfg.offload_optimizer)
            self.wake(["weights"])
        else:
            self.wake()
        early, self._early = self._early, {}
        targets = [u for u in self.urls if early.get(u) != version]
        # With every replica given this version early, that push is the step's sync.
        first = self._push(targets, version) if targets else self._early_stats
        if self.shares_gpu:
            # The KV cache, the replicas' larger share, wakes once the push no longer needs the
            # actor's parameters on the GPU.
            self._offload(params=actor_cfg.offload_params, optimizer=False)
            self.wake(["kv_cache"])
        self.version = version
        metrics = {
            "perf/weight_sync_bytes": float(first["bytes"]),
            "perf/weight_sync_buckets": float(first["buckets"]),
        }
        for kind, buckets in (first.get("received") or {}).items():
            # What the replicas say arrived, by way (cuda_ipc, shm, dist, disk).
            metrics[f"perf/weight_sync_received_{kind}"] = float(buckets)
        return metrics

    # ------------------------------------------------------------------ lost replicas
    def recover(self, push: bool = True, version: int | None = None) -> list[str]:
        """Restart every dead replica, push it the current weights and put it in rotation.

        ``push=False`` leaves the weights, and the return to rotation, to the sync about to
        run. ``version`` labels the pushed weights when the actor is already ahead of the
        replicas' version (updated, before its sync). Returns the new URLs. Runs in the
        trainer's thread, or in a thread of its own while the step generates.
        """
        if self.supervisor is None:
            return []
        restarted = [self._restart(h) for h in self.supervisor.dead()]
        version = self.version if version is None else version
        if push and restarted:
            if version > 0:
                stats = self._push(restarted, version)
                if version != self.version:
                    self._early.update(dict.fromkeys(restarted, version))
                    self._early_stats = stats
            else:  # the model's own weights, which a fresh replica loads
                for url in restarted:
                    self._admit(url)
        return restarted

    def _restart(self, handle: Any) -> str:
        assert self.supervisor is not None
        # Out of rotation from before the new server starts until it has the weights: the new
        # server usually binds the old port, and the client's health probe would otherwise
        # find the old entry healthy again and send it requests the model's own weights
        # answer. Requests meanwhile go elsewhere (or wait). (From the watch's thread too: one
        # list item and one flag change at a time, atomic for the client's event loop.)
        for client in self._clients:
            with contextlib.suppress(KeyError):
                client.enable_replica(handle.url, enabled=False)
        old, new = self.supervisor.restart(handle)
        if old in self._sender_of:  # the same GPU, so the same sending rank
            self._sender_of[new] = self._sender_of.pop(old)
        # A fresh server (often on the old port) has none of the weights pushed early.
        self._early.pop(old, None)
        self._early.pop(new, None)
        self.urls = [new if u == old else u for u in self.urls]
        for client in self._clients:
            client.replace_replica(old, new, enabled=False)
        return new

    def _admit(self, url: str) -> None:
        for client in self._clients:
            client.enable_replica(url)

    async def watch(self) -> None:
        """Restart replicas that die while the step generates; runs until cancelled.

        Cancelled in the middle of a restart, it returns once that restart is done.

        Raises:
            ReplicaLostError: a replica could not be restarted (budget, failure, timeout).
        """
        while True:
            recovery = asyncio.ensure_future(asyncio.to_thread(self.recover))
            try:
                await asyncio.shield(recovery)
            except asyncio.CancelledError:
                # The generation ended: a restart in progress finishes first, so that its push
                # of the weights never overlaps the update that follows.
                await recovery
                raise
            await asyncio.sleep(self.poll_s)

    def _push(self, urls: Sequence[str], version: int) -> dict[str, Any]:
        """Push the actor's weights to ``urls`` as ``version``; return the sender's statistics.

        A replica that dies during the push is restarted, and the push goes on with the
        survivors that do not serve ``version`` yet and the restarted replicas.

        Raises:
            ReplicaLostError: a dead replica could not be restarted.
            RuntimeError: the push failed with no replica dead; the unreachable ones are named.
        """
        ro = self.cfg.rollout
        targets = list(urls)
        while True:
            try:
                stats = self.actor.sync_weights(
                    transport=self.transport,
                    transport_options=self.transport_options,
                    urls=targets,
                    bucket_mb=ro.weight_bucket_mb,
                    version=version,
                    mode=ro.weight_sync_mode,
                    inflight=self.inflight,
                    dtype=self.wire_dtype,
                    senders=[self._sender_of[u] for u in targets] if self._sender_of else None,
                )
                for url in targets:  # restarted ones included: they have the weights now
                    self._admit(url)
                return _merged_push_stats(stats)
            except Exception as exc:
                dead = self.supervisor.dead(grace_s=2.0) if self.supervisor is not None else []
                if not dead:
                    unreachable = [u for u in targets if self._weight_version(u) is None]
                    if unreachable:
                        raise RuntimeError(
                            f"weight sync of version {version} failed: rollout replica(s) "
                            f"{', '.join(unreachable)} unreachable ({type(exc).__name__}: {exc})"
                        ) from exc
                    raise
                lost = {h.url for h in dead}
                restarted = [self._restart(h) for h in dead]
                behind = [
                    u for u in targets if u not in lost and (self._weight_version(u) or 0) < version
                ]
                targets = behind + restarted

    def _weight_version(self, url: str) -> int | None:
        """Return the weight version ``url`` serves (``None``: it does not answer ``/health``).

        Asked through the producer's client, so with the servers' API key.
        """
        try:
            state = self.producer.run(self.producer.client.health(url, timeout=10.0))
            return int(state["weight_version"])
        except (httpx.HTTPError, ValueError, KeyError):
            return None


def _merged_push_stats(stats: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One push's statistics from every sending rank's (``None``: a rank that sent nothing).

    Sizes are one rank's (each sends the whole model); what the replicas received is summed.
    """
    sent = [s for s in stats if s is not None]
    merged = dict(sent[0])
    received: dict[str, int] = {}
    for one in sent:
        for kind, n in (one.get("received") or {}).items():
            received[kind] = received.get(kind, 0) + int(n)
    merged["received"] = received
    return merged


class DriverRollout(SyncGeneration):
    """Generation in the driver: the step's rows are a scored :class:`~polyrl.core.batch.Batch`.

    Args:
        cfg: the run's configuration.
        producer: samples and scores through the driver's rollout client.
        replicas: put to sleep once the step's samples are in.
        dataset: the training prompts, by index.
        next_indices: the sampler's next prompt batch (DAPO asks for more).
        record: given each prompt's index and its group's mean accuracy after the step's first
            round is scored (the curriculum's :meth:`~polyrl.data.mixing.WeightedSampler.record`).
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        producer: RolloutProducer,
        replicas: Replicas,
        dataset: Any,
        next_indices: Callable[[], Sequence[int]],
        record: Callable[[Sequence[int], Sequence[float]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.replicas = replicas
        self.dataset = dataset
        self.next_indices = next_indices
        self.record = record

    def _sample(
        self, items: Sequence[Any], seed: int, timing: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        ro = self.cfg.rollout
        return self.producer.sample_and_score(items, ro.n, ro.temperature, seed, timing)

    def generate(self, step: int, timing: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """Sample and score the step's prompts; the replicas sleep afterwards if configured."""
        indices = [int(i) for i in self.next_indices()]
        items = [self.dataset[i] for i in indices]
        seed = derive_seed(self.cfg.seed_for("rollout"), step)
        batch, metrics = self._sample(items, seed, timing)
        if self.record is not None:
            # Rows come prompt by prompt, rollout.n each.
            per_prompt = batch[ACC].float().view(len(indices), -1).mean(dim=1)
            self.record(indices, per_prompt.tolist())
        if self.cfg.algorithm.filter_groups:
            needed = self.cfg.data.train_batch_size
            batch = self._keep_informative_groups(needed, batch, seed, timing, metrics)
        self.replicas.sleep()
        return batch, metrics

    def _keep_informative_groups(
        self,
        needed: int,
        batch: Batch,
        seed: int,
        timing: dict[str, float],
        metrics: dict[str, float],
    ) -> Batch:
        """DAPO dynamic sampling: keep ``needed`` prompt groups whose responses differ.

        Samples further prompt batches (the sampler moves on, seeds derive from the step's)
        until ``needed`` groups vary in ``algorithm.filter_groups_metric`` or
        ``algorithm.max_gen_batches`` rounds were made; uninformative groups fill what is
        still missing, so every step trains on the same number of rows.
        """
        algo, n = self.cfg.algorithm, self.cfg.rollout.n
        judged = ACC if algo.filter_groups_metric == "acc" else SCORE
        batches = [batch]
        first = group_varies(batch[judged], n)
        varies = first
        while int(varies.sum()) < needed and len(batches) < algo.max_gen_batches:
            items = [self.dataset[i] for i in self.next_indices()]
            more, _ = self._sample(items, derive_seed(seed, len(batches)), timing)
            # A prompt drawn again (the sampler wrapped an epoch) is a group of its own.
            more.non_tensors[UID] = np.array(
                [f"{uid}#{len(batches)}" for uid in more.non_tensors[UID]], dtype=object
            )
            batches.append(more)
            varies = torch.cat([varies, group_varies(more[judged], n)])
        chosen = select_groups(varies, needed)
        rows = (chosen[:, None] * n + np.arange(n)).reshape(-1)
        if len(batches) > 1:
            widths = [rollout_widths(b) for b in batches]
            width_p, width_r = max(w[0] for w in widths), max(w[1] for w in widths)
            pad_id = self.producer.pad_id
            batch = Batch.concat(
                [widen_rollout_batch(b, width_p, width_r, pad_id) for b in batches]
            )
        metrics["filter/gen_batches"] = float(len(batches))
        metrics["filter/informative_groups"] = float(varies[torch.from_numpy(chosen)].sum())
        metrics["filter/first_batch_informative_fraction"] = float(first.float().mean())
        return batch[rows]


class QueueRollout(SyncGeneration):
    """Generation in the transfer queue's rollout workers: the step's rows stay in the queue.

    Each worker gets a share of the step's prompt indices, generates, scores (ReMax: its
    baseline too) and puts its samples; the step gets a :class:`StoredRows` reference.

    Args:
        cfg: the run's configuration.
        queue: the transfer queue client.
        workers: the rollout workers.
        replicas: put to sleep once the step's samples are in.
        pad_id: the padding token id.
        next_indices: the sampler's next prompt batch.
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        queue: Any,
        workers: StoreWorkers,
        replicas: Replicas,
        pad_id: int,
        next_indices: Callable[[], Sequence[int]],
    ) -> None:
        self.cfg = cfg
        self.queue = queue
        self.workers = workers
        self.replicas = replicas
        self.pad_id = pad_id
        self.next_indices = next_indices
        #: Restart lost replicas while the workers generate. Every worker's client is routed
        #: by ``replicas`` (see :meth:`Replicas.attach`; a Ray worker's through its routing
        #: calls), so it holds a restarted replica out until the push of the weights.
        self.watched = replicas.supervisor is not None
        if self.watched:
            for client in workers.clients():
                replicas.attach(client)

    def _rollout(self, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """Run the workers' ``rollout`` calls; restart lost replicas meanwhile when watched."""
        if not self.watched:
            return self.workers.call_each("rollout", calls)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(self.workers.call_each, "rollout", calls)
            return wait_recovering(done.result, self.replicas.recover, self.replicas.poll_s)

    def generate(self, step: int, timing: dict[str, float]) -> tuple[StoredRows, dict[str, float]]:
        """Have the workers sample and store the step's prompts; return the rows' reference."""
        cfg, n = self.cfg, self.cfg.rollout.n
        indices = [int(i) for i in self.next_indices()]
        partition = f"step-{step}"
        with timer(timing, "gen"):
            seed = derive_seed(cfg.seed_for("rollout"), step)
            shares = np.array_split(np.arange(len(indices)), len(self.workers))
            calls = [
                {
                    "partition": partition,
                    "indices": [int(indices[i]) for i in share],
                    "first_index": int(share[0]),
                    "n": n,
                    "temperature": cfg.rollout.temperature,
                    "seed": seed,
                }
                for share in shares
                if len(share)
            ]
            summary = merge_rollout_summaries(self._rollout(calls))
            meta = self.queue.get_meta(
                list(ROLLOUT_FIELDS),
                len(indices) * n,
                partition,
                consumer="trainer",
                timeout=cfg.transfer.timeout_s,
            )
        timing["timing_s/reward"] = summary.pop("time_reward")
        layout = StepLayout(
            int(summary.pop("width_prompt")),
            int(summary.pop("width_response")),
            self.pad_id,
            bool(summary.pop("rollout_log_probs")),
            bool(summary.pop("multi_modal", 0.0)),
        )
        summary.pop("rows")
        fields = (SCORE, ACC, UID) + ((BASELINE,) if cfg.algorithm.adv_estimator == "remax" else ())
        self.replicas.sleep()
        return StoredRows(meta, layout, fields), summary
