"""The RL trainer behind ``polyrl train PRESET key=value ...`` and :class:`polyrl.GRPOTrainer`.

One step, driven from this (controller) process and readable top to bottom in
:meth:`RLTrainer.step`:

1. **generate** -- ``rollout.n`` responses per prompt from the rollout servers (HTTP,
   token-in/token-out, per-prompt seeds derived from the step);
2. **reward** -- the reward manager scores the decoded responses (sandboxed worker processes);
3. **old log-probs** (actor), **reference log-probs** (when a KL term or PRIME is used),
   **values** (critic, for ``gae``) and, for PRIME, the **PRM** phase (its update on the
   step's outcome labels, before or after its log-probs, ``prime.update``) -- data-parallel
   calls on the engine worker groups;
4. **advantages** on the driver with the estimator registered under
   ``algorithm.adv_estimator`` (KL penalty folded into the rewards first when configured);
5. **update** the critic, then the actor (``actor.ppo_epochs`` passes over mini-batches of
   ``actor.ppo_mini_batch_size`` prompts);
6. **sync** the actor's weights to every rollout replica (bucketed transfer; the replicas
   report the new version);
7. **validate** (mean@k / pass@k on the held-out split), **log** (verl metric names),
   **checkpoint** (actor, critic, sampler, KL controller; atomic).

At the end of the run the policy is written as a Hugging Face model directory,
``<output_dir>/hf_model`` (``trainer.export_hf``, on by default; ``polyrl export`` turns any saved
actor checkpoint into one too).

The data of a step lives with the driver or, with ``transfer.enable``, in the transfer queue;
the step is the same code either way: it asks its generation phase
(:mod:`~polyrl.trainer.rl.generation`) for a reference to scored rows and hands that reference
to the data plane (:mod:`~polyrl.trainer.rl.dataplane`) for every later phase.

Placement: ``trainer.placement=colocated`` runs the actor, reference, critic and PRM engines in
one process per rank (and, with ``rollout.sleep_during_training``, the rollout servers release
their KV cache while the engines train); ``separate`` gives each engine its own worker group. Engine
workers are Ray actors (``trainer.worker_backend=ray``) or local processes (``local``; at world
size 1 the engines then run inside this process).

Resuming (``trainer.resume_mode=auto``) restores the engines, the data sampler and the KL
controller from the newest checkpoint, pushes the restored weights to the replicas, and drops
the metric records logged after that checkpoint, so a resumed run logs what an uninterrupted
one would have.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.controller import WorkerDiedError
from polyrl.core.batch import Batch
from polyrl.core.columns import OLD_LOG_PROBS, PRM_LOG_PROBS, REF_LOG_PROBS, VALUES
from polyrl.model_engine.checkpoint import prune_checkpoints, step_dir_name
from polyrl.reward.base import Scorer
from polyrl.reward.pool import RewardWorkerDiedError
from polyrl.trainer.rl.asynchronous import AheadRollout, SerialRewards
from polyrl.trainer.rl.build import (
    RolloutServers,
    engine_specs,
    load_datasets,
    replica_supervisor,
    start_engines,
    start_replicas,
    start_transfer_queue,
    vision_processor,
    weight_transport,
)
from polyrl.trainer.rl.checks import check_config
from polyrl.trainer.rl.dataplane import DataPlane, InlinePlane, QueuePlane
from polyrl.trainer.rl.generation import (
    DriverRollout,
    GenerationPhase,
    QueueRollout,
    Replicas,
    at_sampling_temperature,
    log_prob_temperature,
    prompts_per_round,
)
from polyrl.trainer.rl.metrics import (
    CONSOLE_METRICS,
    DEFAULT_PLOT_METRICS,
    step_metrics,
    summary_fields,
)
from polyrl.trainer.rl.producer_process import ProducerProcess
from polyrl.trainer.rl.rollout import (
    RolloutProducer,
    derive_seed,
    has_custom_reward,
    pad_id_of,
    response_cap,
    reward_manager,
    timer,
)
from polyrl.trainer.rl.settings import RunSettings, resolve_settings, save_rl_config
from polyrl.trainer.rl.supervisor import ReplicaLostError, describe_failure
from polyrl.workers.handles import (
    ActorHandle,
    CriticHandle,
    EngineHandle,
    PRMHandle,
    ReferenceHandle,
)
from polyrl.workers.losses import ACTOR_LOSS, CRITIC_LOSS, PRM_LOSS

__all__ = ["RLTrainer", "run_rl"]

HF_DIR = "hf_model"
#: The run's config in its output directory, with every auto setting resolved.
CONFIG_FILE = "rl_config.yaml"


def _log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[rl] {message}", file=sys.stdout)
    sys.stdout.flush()


class RLTrainer:
    """Runs RL post-training as configured by a :class:`~polyrl.config.PolyRLConfig`.

    Args:
        cfg: the run's configuration (``algorithm``, ``actor``, ``critic``, ``rollout``, ``data``,
            ``reward``, ``trainer`` groups).
        reward_fn: overrides ``reward.custom_function``: a ``"file.py:function"`` string, a
            picklable module-level callable (see :class:`~polyrl.reward.RewardManager`), or a
            list of :class:`~polyrl.reward.functions.RewardFunction` (weighted, per-sample or
            batched; see :func:`~polyrl.reward.functions.resolve_reward_functions`). With one,
            rows need only a prompt.
        train_rows / val_rows: prompt rows (dicts with ``prompt``, ``data_source``,
            ``reward_model.ground_truth``) used instead of ``data.*`` files or tasks.
        model_dir: a Hugging Face model directory used instead of ``model.path``.

    :meth:`fit` runs the whole job and returns its summary; :meth:`step` is one training step,
    for users composing their own loop after :meth:`setup`.
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        *,
        reward_fn: str | Callable[..., Any] | None = None,
        train_rows: Sequence[Mapping[str, Any]] | None = None,
        val_rows: Sequence[Mapping[str, Any]] | None = None,
        model_dir: str | Path | None = None,
    ) -> None:
        #: Every setting the config leaves to auto, decided once for this run.
        self.settings: RunSettings = resolve_settings(cfg)
        run = self.settings
        check_config(
            cfg, has_rows=train_rows is not None, has_model=model_dir is not None, settings=run
        )
        self.cfg = cfg
        self.reward_fn = reward_fn
        self._train_rows = train_rows
        self._val_rows = val_rows
        self._model_dir = Path(model_dir) if model_dir is not None else None
        # Absolute: the engine workers (Ray actors, another cwd) write exports and checkpoints
        # under it, and a relative path would land in their working directory.
        self.out_dir = Path(cfg.trainer.output_dir).absolute()
        self._closers: list[Callable[[], None]] = []
        self._groups: list[Any] = []
        self.servers: RolloutServers | None = None
        self.producer: RolloutProducer | None = None
        #: Distillation teachers on rollout servers (algorithm.teacher_source=server).
        self.teachers: Any = None
        # The engine roles, set by setup(): typed handles of their worker groups.
        self.actor: ActorHandle | None = None
        self.ref: ReferenceHandle | ActorHandle | None = None
        self.critic: CriticHandle | None = None
        self.prm: PRMHandle | None = None
        self.use_critic = run.use_critic
        # PRIME's implicit process reward model; its rewards are measured against the reference.
        self.use_prm = run.use_prm
        self.use_ref = run.use_ref
        self.num_mini_batches = run.num_mini_batches
        self.prm_mini_batches = run.prm_mini_batches
        self.need_old_log_probs = run.need_old_log_probs
        #: The generation phase (set up by :meth:`setup`): the same calls in every mode.
        self.rollout: GenerationPhase | None = None
        #: The calls writing a checkpoint while the run goes on (see :meth:`save`).
        self._saving: list[Any] = []
        self.off_policy = run.off_policy
        self._reset()

    def _reset(self) -> None:
        """Set what a run changes as it goes to its state before the first step.

        At construction, and before a rebuild after a worker death (whose checkpoint, if any,
        then restores it as a relaunch's would).
        """
        algo = self.cfg.algorithm
        #: Actor updates so far: the weight version the replicas serve once it is pushed.
        self.updates = 0
        from polyrl.algo.kl import AdaptiveKLController, FixedKLController

        if algo.kl_ctrl == "adaptive":
            self.kl_ctrl: Any = AdaptiveKLController(algo.kl_coef, algo.target_kl, algo.kl_horizon)
        else:
            self.kl_ctrl = FixedKLController(algo.kl_coef)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Build the model (if tiny), data, rollout replicas, engine groups and data plane."""
        from polyrl.models.loader import load_tokenizer
        from polyrl.trainer.common import resolve_model_dir

        cfg, run = self.cfg, self.settings
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_rl_config(cfg, run, self.out_dir / CONFIG_FILE)
        self.model_dir = self._model_dir or resolve_model_dir(cfg, self.out_dir)
        self.tokenizer = load_tokenizer(
            self.model_dir, trust_remote_code=cfg.model.trust_remote_code
        )
        self.pad_id = pad_id_of(self.tokenizer)
        # A vision model's processor: the datasets and the agent loops render media with it.
        self.processor = vision_processor(cfg, self.model_dir, self.tokenizer)
        self.train_ds, self.val_ds = load_datasets(
            cfg,
            self.tokenizer,
            self.out_dir,
            self._train_rows,
            self._val_rows,
            custom_reward=has_custom_reward(cfg, self.reward_fn),
            processor=self.processor,
        )
        per_round = prompts_per_round(cfg)
        for key, size in (
            ("data.train_batch_size", cfg.data.train_batch_size),
            ("algorithm.gen_batch_size", per_round),
        ):
            if len(self.train_ds) < size:
                raise ConfigError(
                    f"{size} exceeds the {len(self.train_ds)} training prompts", key=key
                )
        self.sampler = self._sampler(per_round)
        self.total_steps = (
            cfg.trainer.total_steps or cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        )
        _log(f"data: {self.describe_data()}")
        # The reward workers boot while the engines and the rollout replicas start.
        rewards = reward_manager(cfg, self.reward_fn)
        self._closers.append(rewards.close)
        # Engine worker groups first: in hybrid placement the replicas run beside their ranks.
        specs = engine_specs(
            cfg,
            self.model_dir,
            self.total_steps,
            self.use_ref,
            self.use_critic,
            self.use_prm,
            settings=run,
        )
        engines, self._groups = start_engines(cfg, specs, self._closers, settings=run)
        self.actor, self.ref, self.critic = engines.actor, engines.ref, engines.critic
        self.prm = engines.prm
        if self.use_ref and self.ref is None:
            # LoRA: the reference is the actor's base model (its adapter disabled), so the ref
            # role maps onto the actor engine instead of a second copy of the model.
            self.ref = self.actor
        views = engines.started()
        for view in views.values():
            view.init_model()
        self.servers = start_replicas(
            cfg, self.model_dir, self._closers, self._groups, settings=run
        )
        if cfg.algorithm.distill_coef > 0 and cfg.algorithm.teacher_source == "server":
            from polyrl.trainer.rl.teacher import TeacherServers

            self.teachers = TeacherServers(cfg, self._closers)
            served = [f"{spec} at {', '.join(u)}" for spec, u in self.teachers.urls.items()]
            _log(f"distillation teacher(s) on rollout servers: {'; '.join(served)}")
        urls = self.servers.urls
        self.producer = RolloutProducer.connect(
            cfg, urls, self.tokenizer, rewards, api_key=self.servers.api_key
        )
        self.producer.processor = self.processor
        self._closers.append(self.producer.close)
        self.producer.run(self.producer.client.wait_ready(timeout=300.0))
        _log(
            f"rollout: {len(urls)} {cfg.rollout.backend} replica(s) on {run.rollout_device}, "
            f"{self.servers.placement} placement, at {', '.join(urls)}"
        )
        sender = self._groups[0].worker_info[0]
        transport = weight_transport(cfg, self.servers, trainer_host=sender.node_ip, settings=run)
        # The transport is known now that the servers run: the config file shows it too.
        save_rl_config(cfg, run, self.out_dir / CONFIG_FILE, transport=transport[0])
        self.replicas = Replicas(
            cfg,
            urls,
            self.producer,
            transport,
            supervisor=replica_supervisor(cfg, self.servers),
            actor=self.actor,
            senders=self.servers.senders or None,
            settings=run,
        )
        lora = (
            f"; LoRA rank {cfg.model.lora_rank} (reference = actor without adapter)"
            if cfg.model.lora_rank
            else ""
        )
        _log(
            f"engines: {', '.join(views)} on {cfg.trainer.world_size} rank(s){lora}, "
            f"{cfg.trainer.placement} ({cfg.trainer.worker_backend}); old log-probs "
            f"{'computed' if self.need_old_log_probs else 'skipped'}; weights over "
            f"{transport[0]}"
        )
        # Where the step's rows live, and who generates them.
        self.plane: DataPlane
        if cfg.transfer.enable:
            self._setup_queue(views)
            return
        self.plane = InlinePlane(cfg, cfg.trainer.world_size)
        if cfg.trainer.mode != "sync":
            self._setup_ahead(rewards)
        else:
            self.rollout = DriverRollout(
                cfg,
                self.producer,
                self.replicas,
                self.train_ds,
                self.sampler.next_batch,
                record=self._record_outcomes(),
            )

    def _sampler(self, per_round: int) -> Any:
        """Return the prompt sampler: epoch by epoch, or by file weight and curriculum."""
        from polyrl.data.mixing import WeightedSampler
        from polyrl.data.sampler import StatefulSampler

        data = self.cfg.data
        if not data.train_file_weights and data.curriculum == "none":
            return StatefulSampler(
                len(self.train_ds), per_round, shuffle=data.shuffle, seed=self.cfg.seed_for("data")
            )
        files = list(getattr(self.train_ds, "file_indices", [0] * len(self.train_ds)))
        weights = data.train_file_weights or None
        if weights is not None and len(weights) != max(files) + 1:
            raise ConfigError(
                f"{len(weights)} weight(s) for {max(files) + 1} training file(s); give one each",
                key="data.train_file_weights",
            )
        try:
            return WeightedSampler(
                files,
                per_round,
                weights,
                seed=self.cfg.seed_for("data"),
                curriculum=data.curriculum == "pass_rate",
                window=data.curriculum_window,
                min_weight=data.curriculum_min_weight,
            )
        except ValueError as exc:
            raise ConfigError(str(exc), key="data.train_file_weights") from None

    def _record_outcomes(self) -> Callable[[Sequence[int], Sequence[float]], None] | None:
        """Return the curriculum's outcome recorder (``None`` without a curriculum)."""
        return self.sampler.record if getattr(self.sampler, "curriculum", False) else None

    def _setup_ahead(self, rewards: Scorer) -> None:
        """Set up generation ahead of training: a rollout thread with a producer of its own."""
        cfg = self.cfg
        assert self.servers is not None and self.producer is not None
        producer: RolloutProducer | ProducerProcess
        if cfg.async_rl.producer == "process":
            # Its client, agent loops and scoring off this process's CPU time and GIL; it
            # scores with reward workers of its own.
            producer = ProducerProcess(
                cfg,
                self.servers.urls,
                self.model_dir,
                api_key=self.servers.api_key,
                reward_fn=self.reward_fn,
            )
        else:
            shared = SerialRewards(rewards)
            # The trainer's thread validates while the rollout thread scores: one at a time.
            self.producer.rewards = shared
            producer = RolloutProducer.connect(
                cfg, self.servers.urls, self.tokenizer, shared, api_key=self.servers.api_key
            )
            producer.processor = self.processor
        # close() stops it before the servers; the producer is closed after it.
        self.rollout = ahead = AheadRollout(
            cfg, producer, self.train_ds, self.sampler, self.total_steps, self.out_dir
        )
        self._closers.append(producer.close)
        self.replicas.inflight = ahead.inflight_policy
        self.replicas.attach(producer.client)
        ahead.recover = self.replicas.recover
        opts = cfg.async_rl
        _log(
            f"mode: {cfg.trainer.mode}, staleness <= {ahead.max_staleness}, "
            f"partial rollouts {opts.partial_rollout}, correction {opts.correction}, "
            f"replay {ahead.buffer.sampling} (reuse <= {ahead.buffer.max_reuse})"
        )

    def describe_data(self) -> str:
        """One line: where the prompts come from, how many, and how the step count was set."""
        data, trainer = self.cfg.data, self.cfg.trainer
        if self._train_rows is not None:
            source = "rows passed in Python"
        elif data.task:
            source = f"generated task {data.task!r}"
        else:
            source = "files " + ", ".join(data.train_files)
        if data.val_files and self._train_rows is None:
            source += " | val files " + ", ".join(data.val_files)
        val = len(self.val_ds) if self.val_ds is not None else 0
        per_epoch = self.sampler.batches_per_epoch
        if trainer.total_steps:
            how = f"trainer.total_steps (an epoch is {per_epoch})"
        else:
            how = (
                f"trainer.total_epochs={trainer.total_epochs} x {per_epoch} batches of "
                f"{self.sampler.batch_size} prompts"
            )
        return (
            f"{source} -> {len(self.train_ds)} train / {val} val prompts | "
            f"{self.total_steps} steps from {how}"
        )

    def _setup_queue(self, views: Mapping[str, EngineHandle]) -> None:
        """Start the transfer queue, attach it to the engines and start its rollout workers."""
        from polyrl.trainer.rl.store_worker import StoreWorkers

        cfg = self.cfg
        queue, backend = start_transfer_queue(cfg, self._closers, settings=self.settings)
        here = os.getpid()
        for view in {id(v): v for v in views.values()}.values():
            # Ranks in processes of their own (the local backend's, world size > 1) get a
            # client they can unpickle; an inline rank, the queue itself.
            inline = all(info.pid == here for info in view.view.group.worker_info)
            view.attach_transfer_queue(queue if inline else queue.for_processes())
        count = cfg.transfer.num_rollout_workers
        workers = StoreWorkers(
            count,
            backend,
            cfg,
            self.replicas.urls,
            str(self.model_dir),
            self.train_ds,
            queue,
            self.reward_fn,
            self.servers.api_key if self.servers else None,
        )
        self._closers.append(workers.close)
        self.plane = QueuePlane(queue, workers)
        self.rollout = QueueRollout(
            cfg, queue, workers, self.replicas, self.pad_id, self.sampler.next_batch
        )
        _log(f"transfer: {backend} queue, {count} rollout worker(s)")

    # ------------------------------------------------------------------ phases
    def generate(
        self, items: Sequence[Mapping[str, Any]], n: int, temperature: float, seed: int
    ) -> tuple[Batch, dict[str, float]]:
        """Sample ``n`` responses per item (see :meth:`RolloutProducer.generate`)."""
        assert self.producer is not None, "call setup() first"
        return self.producer.generate(items, n, temperature, seed)

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score every row: ``(scores (B,), accuracy (B,), reward metrics)``."""
        assert self.producer is not None, "call setup() first"
        return self.producer.score(batch)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights to every replica as ``version``; returns timing metrics."""
        return self.replicas.sync_weights(self.actor, version)

    def _actor_loss_kwargs(self, step: int) -> dict[str, Any]:
        """Return the actor loss's options at ``step`` (its random draws are seeded from it)."""
        actor = self.cfg.actor
        return {
            "policy_loss": actor.policy_loss,
            "clip_ratio_low": actor.clip_ratio_low,
            "clip_ratio_high": actor.clip_ratio_high,
            "clip_ratio_c": actor.clip_ratio_c or None,
            "loss_agg_mode": actor.loss_agg_mode,
            "horizon": self.cfg.rollout.max_new_tokens,
            "entropy_coeff": actor.entropy_coeff,
            "use_kl_loss": actor.use_kl_loss,
            "kl_loss_coef": actor.kl_loss_coef,
            "kl_loss_type": actor.kl_loss_type,
            "rollout_is": self._rollout_is(),
            "rollout_is_threshold": self.cfg.algorithm.rollout_is_threshold,
            "rollout_rs": self.cfg.algorithm.rollout_rs,
            "rollout_rs_threshold": self.cfg.algorithm.rollout_rs_threshold,
            "rollout_rs_threshold_lower": self.cfg.algorithm.rollout_rs_threshold_lower or None,
            "rollout_token_veto_threshold": self.cfg.algorithm.rollout_token_veto_threshold or None,
            # Every objective's options; the actor's loss gives each loss those it names.
            "policy_loss_options": {
                "tau_pos": actor.tau_pos,
                "tau_neg": actor.tau_neg,
                "clip_cov_ratio": actor.clip_cov_ratio,
                "clip_cov_lb": actor.clip_cov_lb,
                "clip_cov_ub": actor.clip_cov_ub,
                "kl_cov_ratio": actor.kl_cov_ratio,
                "kl_cov_coef": actor.kl_cov_coef,
                # A stochastic objective's (clip_cov's) draws: from the step, not the global
                # RNG, so a resumed run draws what the uninterrupted one did.
                "seed": derive_seed(self.cfg.seed, step),
            },
            "router_aux_loss_coef": actor.router_aux_loss_coef,
            # On-policy distillation against the teacher's top-k distribution: a loss term.
            "distill_topk_coef": self.cfg.algorithm.distill_coef
            if self.cfg.algorithm.teacher_topk
            else 0.0,
        }

    def _rollout_is(self) -> str:
        """``algorithm.rollout_is``, or per token when an off-policy mode corrects by it."""
        chosen = self.cfg.algorithm.rollout_is
        return "token" if chosen == "none" and self.off_policy else chosen

    def _prm_phase(self, rows: Any, timing: dict[str, float], metrics: dict[str, float]) -> Any:
        """PRIME: train the PRM on the step's outcome labels and score the responses with it.

        ``prime.update=before`` (the paper's order) updates first, so the rewards come from the
        PRM that has seen this step's labels; ``after`` scores first; ``none`` only scores.
        """
        update = self.cfg.prime.update

        def train() -> None:
            with timer(timing, "update_prm"):
                metrics.update(
                    self.plane.update(
                        self.prm.update_prm,
                        rows,
                        loss=PRM_LOSS,
                        loss_kwargs={"beta": self.cfg.prime.beta},
                        num_mini_batches=self.prm_mini_batches,
                        epochs=self.cfg.prime.epochs,
                    )
                )

        if update == "before":
            train()
        with timer(timing, "prm"):
            rows = self.plane.infer(
                self.prm.compute_prm_log_prob, rows, PRM_LOG_PROBS, share_prefix=True
            )
        if update == "after":
            train()
        return rows

    def _critic_loss_kwargs(self) -> dict[str, Any]:
        critic = self.cfg.critic
        return {"cliprange_value": critic.cliprange_value, "loss_agg_mode": critic.loss_agg_mode}

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        """Run training step ``step`` (1-based) and return its metrics."""
        cfg, plane, rollout = self.cfg, self.plane, self.rollout
        assert rollout is not None, "call setup() first"
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer(timing, "step"):
            # 1-2. generate and score (the replicas may sleep from here until the sync); off
            # the sync mode, take a batch the rollout thread generated ahead
            rows, generated = rollout.generate(step, timing)
            # Every engine (and teacher) computes this step's log-probs at the temperature the
            # rollout sampled at: the importance ratio starts at 1.
            temperature = log_prob_temperature(cfg)
            rows = at_sampling_temperature(rows, temperature)
            metrics.update(generated)
            # The previous step's checkpoint was written while this one generated; the engines
            # are needed now (their calls queue behind the save anyway): surface its errors.
            with timer(timing, "save_wait"):
                self.finish_save()
            # 3. old log-probs, reference log-probs, values
            if self.teachers is not None:
                with timer(timing, "teacher"):
                    rows = self.teachers.score(rows, temperature)
            if self.need_old_log_probs:
                with timer(timing, "old_log_prob"):
                    rows = plane.infer(
                        self.actor.compute_log_prob, rows, OLD_LOG_PROBS, share_prefix=True
                    )
            if self.use_ref:
                with timer(timing, "ref"):
                    rows = plane.infer(
                        self.ref.compute_ref_log_prob, rows, REF_LOG_PROBS, share_prefix=True
                    )
            if self.use_critic:
                with timer(timing, "values"):
                    rows = plane.infer(self.critic.compute_values, rows, VALUES)
            if self.use_prm:
                rows = self._prm_phase(rows, timing, metrics)
            # 4. advantages (KL penalty in the reward first)
            with timer(timing, "adv"):
                rows, data, self.kl_ctrl = plane.advantages(rows, self.kl_ctrl, response_cap(cfg))
            # 5. updates
            if self.use_critic:
                with timer(timing, "update_critic"):
                    metrics.update(
                        plane.update(
                            self.critic.update_critic,
                            rows,
                            loss=CRITIC_LOSS,
                            loss_kwargs=self._critic_loss_kwargs(),
                            num_mini_batches=self.num_mini_batches,
                            epochs=cfg.critic.ppo_epochs,
                        )
                    )
            if step > cfg.trainer.critic_warmup:
                with timer(timing, "update_actor"):
                    metrics.update(
                        plane.update(
                            self.actor.update_actor,
                            rows,
                            loss=ACTOR_LOSS,
                            loss_kwargs=self._actor_loss_kwargs(step),
                            num_mini_batches=self.num_mini_batches,
                            epochs=cfg.actor.ppo_epochs,
                        )
                    )
                self.updates += 1
                # 6. weight sync (off the sync mode, versions count updates)
                with timer(timing, "update_weights"):
                    version = self._version(step)
                    rollout.before_sync(version)
                    metrics.update(self.sync_weights(version))
            else:
                self.replicas.wake()
            rollout.after_step(self.replicas.version)
            metrics.update(plane.release(rows))
        metrics.update(self.replicas.metrics())
        metrics.update(step_metrics(data, timing, self.sampler, cfg.trainer.world_size))
        metrics.update(timing)
        return metrics

    def _version(self, step: int) -> int:
        """Return the actor's weight version after ``step`` (the generation phase numbers it)."""
        assert self.rollout is not None, "call setup() first"
        return self.rollout.weight_version(step, self.updates)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """mean@k and pass@k of the held-out prompts (``k = rollout.val_n``)."""
        if self.val_ds is None:
            return {}
        assert self.producer is not None, "call setup() first"
        return self.producer.evaluate(self.val_ds)

    # ------------------------------------------------------------------ checkpoints
    def _roots(self) -> tuple[Path, Path, Path]:
        from polyrl.trainer.checkpointing import checkpoint_root

        root = checkpoint_root(self.out_dir)
        return root / "actor", root / "critic", root / "prm"

    def _side_engines(self) -> list[tuple[str, EngineHandle, Path]]:
        """Return the trained engines checkpointed beside the actor: (name, view, root)."""
        _, critic_root, prm_root = self._roots()
        pairs = [("critic", self.critic, critic_root), ("prm", self.prm, prm_root)]
        return [(name, view, root) for name, view, root in pairs if view is not None]

    def save(self, step: int) -> str:
        """Start checkpointing the actor (with the trainer state), critic and PRM at ``step``.

        Asynchronous where the engines run in processes of their own (Ray, local
        subprocesses): the calls are sent and the run goes on -- the next step generates on
        the replicas while the engines write; their later calls run after the save, in order.
        :meth:`finish_save` waits for it (the next step does, before its engine work; so do
        :meth:`load`, :meth:`finish` and the next save). The checkpoint is atomic (written to
        a hidden folder, published by one rename; the actor's last), so a run that dies
        mid-save resumes from the one before. Returns the actor checkpoint's path.
        """
        self.finish_save()
        actor_root = self._roots()[0]
        colocated = self.cfg.trainer.placement == "colocated"
        for _, view, root in self._side_engines():
            save = view.view.save_checkpoint
            if colocated:  # the actor's process: its save runs after this one
                self._saving.append(save.submit(str(root), step, {}))
            else:  # a group of its own: written before the actor's marks the step complete
                save(str(root), step, {})
        state: dict[str, Any] = {
            "sampler": self.sampler.state_dict(),
            "kl_coef": float(self.kl_ctrl.value),
            "step": step,
            "updates": self.updates,
        }
        # Off the sync mode: the generated groups not trained yet, and the sampler position
        # they belong to (taken together: the rollout thread draws prompts as the trainer saves).
        assert self.rollout is not None, "call setup() first"
        state.update(self.rollout.state_dict())
        # The actor goes last: its checkpoint marks the step as complete for resume.
        self._saving.append(self.actor.view.save_checkpoint.submit(str(actor_root), step, state))
        return str(actor_root / step_dir_name(step))

    def finish_save(self) -> None:
        """Wait for the checkpoint :meth:`save` started, if any, and prune the old ones.

        Raises:
            WorkerDiedError: a worker died while writing (the checkpoint is not published).
        """
        saving, self._saving = self._saving, []
        if not saving:
            return
        for future in saving:
            future.get()
        # The side engines are pruned only now (they do not prune themselves, see
        # build.engine_specs): before, their oldest kept step may be the one to resume from.
        for _, _, root in self._side_engines():
            prune_checkpoints(str(root), self.cfg.trainer.max_ckpt_to_keep)

    def load(self, path: str) -> int:
        """Restore the engines (actor, critic, PRM) and trainer state from the actor checkpoint."""
        self.finish_save()
        info = self.actor.load_checkpoint(path)[0]
        step = int(info["step"])
        state = info["extra_state"]
        for name, view, root in self._side_engines():
            side_path = root / Path(path).name
            if not side_path.is_dir():
                raise ConfigError(
                    f"checkpoint {path} has no {name} counterpart {side_path}",
                    key="trainer.resume_mode",
                )
            view.load_checkpoint(str(side_path))
        try:
            self.sampler.load_state_dict(state["sampler"])
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"cannot resume from {path}: {exc}; resume with the original data settings",
                key="trainer.resume_mode",
            ) from None
        self.kl_ctrl.value = float(state.get("kl_coef", self.kl_ctrl.value))
        self.updates = int(state.get("updates", step))
        assert self.rollout is not None, "call setup() first"
        # fit() pushes the restored weights as this version before the first step.
        self.rollout.load_state_dict(state, step, self._version(step))
        return step

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        """Run the configured job; return the summary written to ``rl_summary.json``."""
        from polyrl.trainer.run_loop import RunLoop

        started = time.perf_counter()
        k = self.cfg.rollout.val_n
        loop = RunLoop(
            self.cfg,
            "rl",
            self.out_dir,
            self._roots()[0],
            plot_keys=list(self.cfg.trainer.plot_metrics)
            or [m.format(k=k) for m in DEFAULT_PLOT_METRICS],
            console_keys=CONSOLE_METRICS,
            step_key="training/global_step",
            summary_metrics=True,
            started=started,
        )
        return loop.run(_RLRun(self))

    def export_hf(self, directory: str | Path) -> str:
        """Write the actor as a Hugging Face model directory (call before the run closes)."""
        return self.actor.export_hf(str(directory))[0]

    def rebuild(self) -> None:
        """Close everything and set the run up again, as a relaunch of it would.

        After a worker died: the engine groups (whose ``torch.distributed`` group cannot take
        a new rank), the replicas and the reward workers all start anew, on what the cluster
        still has. The caller then loads the last checkpoint (:meth:`load`).
        """
        self.close()
        self.servers = self.producer = self.rollout = None
        self.actor = self.ref = self.critic = self.prm = None
        self._reset()
        self.setup()

    def close(self) -> None:
        """Stop the worker groups, the rollout client and replicas, and the reward workers."""
        # A checkpoint still being written is finished first (after a failure too: it is the
        # one a relaunch resumes from); one whose writer died stays unpublished.
        with contextlib.suppress(Exception):
            self.finish_save()
        if self.rollout is not None:
            # The generation phase first: a rollout thread generating ahead of training would
            # take the servers' shutdown for a failure.
            with contextlib.suppress(Exception):
                self.rollout.close()
        if self.servers is not None:
            # Replicas on Ray may run in the engines' bundles: they go first.
            with contextlib.suppress(Exception):
                self.servers.close()
        for group in self._groups:
            with contextlib.suppress(Exception):
                if group.is_alive:
                    group.shutdown()
            if group.backend == "ray":
                # The trainer made these pools: give their reservations back to the cluster.
                with contextlib.suppress(Exception):
                    group.pool.release()
        self._groups.clear()
        while self._closers:
            closer = self._closers.pop()
            with contextlib.suppress(Exception):
                closer()


class _RLRun:
    """:class:`RLTrainer` as the run loop's :class:`~polyrl.trainer.run_loop.RecoverableTrainer`.

    Recoverable: a worker of any group that died or stopped answering, a rollout replica that
    could not be restarted in place, and a reward worker that died while scoring (raised only
    with ``trainer.max_restarts=0``: otherwise its sample is scored again, without a rebuild).
    """

    recoverable: tuple[type[BaseException], ...] = (
        WorkerDiedError,
        ReplicaLostError,
        RewardWorkerDiedError,
    )

    def __init__(self, trainer: RLTrainer) -> None:
        self.trainer = trainer

    def rebuild(self) -> None:
        self.trainer.rebuild()

    def describe_failure(self, error: BaseException) -> str:
        return describe_failure(error)

    @property
    def total_steps(self) -> int:
        return self.trainer.total_steps

    @property
    def has_validation(self) -> bool:
        return self.trainer.val_ds is not None

    def setup(self) -> None:
        trainer = self.trainer
        trainer.setup()
        cfg = trainer.cfg
        _log(
            f"model {trainer.model_dir} | {len(trainer.train_ds)} train / "
            f"{len(trainer.val_ds) if trainer.val_ds else 0} val prompts | "
            f"{trainer.total_steps} steps of {cfg.data.train_batch_size} prompts x "
            f"{cfg.rollout.n} | {cfg.algorithm.adv_estimator} / {cfg.actor.policy_loss}"
        )

    def load(self, path: str) -> int:
        trainer = self.trainer
        step = trainer.load(path)
        trainer.sync_weights(trainer._version(step))
        return step

    def step(self, step: int) -> dict[str, float]:
        return self.trainer.step(step)

    def validate(self) -> dict[str, float]:
        tick = time.perf_counter()
        metrics = self.trainer.validate()
        metrics["timing_s/testing"] = time.perf_counter() - tick
        return metrics

    def save(self, step: int) -> str:
        return self.trainer.save(step)

    def progress(self, metrics: Mapping[str, float]) -> dict[str, str]:
        return {"score": f"{metrics.get('critic/score/mean', math.nan):.3f}"}

    def finish(self) -> str | None:
        trainer = self.trainer
        trainer.finish_save()
        if not trainer.cfg.trainer.export_hf:
            return None
        tick = time.perf_counter()
        hf_dir = trainer.export_hf(trainer.out_dir / HF_DIR)
        _log(f"policy exported to {hf_dir} in {time.perf_counter() - tick:.2f}s")
        return hf_dir

    def close(self) -> None:
        self.trainer.close()

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return summary_fields(records, self.trainer.cfg.rollout.val_n)


def run_rl(cfg: PolyRLConfig, **kwargs: Any) -> dict[str, Any]:
    """Run RL training for ``cfg`` (see :class:`RLTrainer` for ``kwargs``); returns the summary."""
    return RLTrainer(cfg, **kwargs).fit()
