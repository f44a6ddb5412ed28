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
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.config import ConfigError, PolyRLConfig, save_config
from polyrl.core.batch import Batch
from polyrl.model_engine.checkpoint import prune_checkpoints
from polyrl.reward.base import Scorer
from polyrl.trainer.rl.asynchronous import AheadRollout, SerialRewards
from polyrl.trainer.rl.build import (
    RolloutServers,
    check_config,
    engine_specs,
    load_datasets,
    replica_supervisor,
    rollout_device,
    start_engines,
    start_replicas,
    start_transfer_queue,
    weight_transport,
)
from polyrl.trainer.rl.dataplane import DataPlane, InlinePlane, QueuePlane
from polyrl.trainer.rl.generation import DriverRollout, QueueRollout, Replicas
from polyrl.trainer.rl.metrics import CONSOLE_METRICS, step_metrics, write_summary
from polyrl.trainer.rl.rollout import (
    RolloutProducer,
    has_custom_reward,
    pad_id_of,
    response_cap,
    reward_manager,
    timer,
)
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
        check_config(cfg, has_rows=train_rows is not None, has_model=model_dir is not None)
        self.cfg = cfg
        self.reward_fn = reward_fn
        self._train_rows = train_rows
        self._val_rows = val_rows
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self.out_dir = Path(cfg.trainer.output_dir)
        self._closers: list[Callable[[], None]] = []
        self._groups: list[Any] = []
        self.servers: RolloutServers | None = None
        self.producer: RolloutProducer | None = None
        # The engine roles, set by setup(): typed handles of their worker groups.
        self.actor: ActorHandle | None = None
        self.ref: ReferenceHandle | ActorHandle | None = None
        self.critic: CriticHandle | None = None
        self.prm: PRMHandle | None = None
        algo = cfg.algorithm
        self.use_critic = algo.adv_estimator == "gae"
        # PRIME's implicit process reward model; its rewards are measured against the reference.
        self.use_prm = algo.adv_estimator == "prime"
        self.use_ref = algo.use_kl_in_reward or cfg.actor.use_kl_loss or self.use_prm
        minis = (
            cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
            if cfg.actor.ppo_mini_batch_size
            else 1
        )
        self.num_mini_batches = minis
        prime_minis = cfg.prime.mini_batch_size
        self.prm_mini_batches = cfg.data.train_batch_size // prime_minis if prime_minis else 1
        # Old log-probs equal the current ones when each step makes exactly one optimizer
        # update; they are only computed when the update is off-policy or the KL penalty needs
        # them (the loss then takes the detached current log-probs, ratio 1).
        self.need_old_log_probs = cfg.actor.ppo_epochs > 1 or minis > 1 or algo.use_kl_in_reward
        # Off the sync mode the rollout's weights lag the actor's: the rollout's log-probs weigh
        # the tokens towards the proximal policy, the actor before this step's update. With one
        # update per step its log-probs are the update's own detached forward, so decoupled PPO
        # needs no extra pass then, like the on-policy case above (and equals tis).
        self.ahead: AheadRollout | None = None
        self.off_policy = cfg.trainer.mode != "sync" and cfg.async_rl.correction != "none"
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
        from polyrl.data.sampler import StatefulSampler
        from polyrl.models.loader import load_tokenizer
        from polyrl.trainer.sft import resolve_model_dir

        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out_dir / "rl_config.yaml")
        self.model_dir = self._model_dir or resolve_model_dir(cfg, self.out_dir)
        self.tokenizer = load_tokenizer(
            self.model_dir, trust_remote_code=cfg.model.trust_remote_code
        )
        self.pad_id = pad_id_of(self.tokenizer)
        self.train_ds, self.val_ds = load_datasets(
            cfg,
            self.tokenizer,
            self.out_dir,
            self._train_rows,
            self._val_rows,
            custom_reward=has_custom_reward(cfg, self.reward_fn),
        )
        if len(self.train_ds) < cfg.data.train_batch_size:
            raise ConfigError(
                f"{cfg.data.train_batch_size} exceeds the {len(self.train_ds)} training prompts",
                key="data.train_batch_size",
            )
        self.sampler = StatefulSampler(
            len(self.train_ds),
            cfg.data.train_batch_size,
            shuffle=cfg.data.shuffle,
            seed=cfg.seed_for("data"),
        )
        self.total_steps = (
            cfg.trainer.total_steps or cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        )
        _log(f"data: {self.describe_data()}")
        # The reward workers boot while the engines and the rollout replicas start.
        rewards = reward_manager(cfg, self.reward_fn)
        self._closers.append(rewards.close)
        # Engine worker groups first: in hybrid placement the replicas run beside their ranks.
        specs = engine_specs(
            cfg, self.model_dir, self.total_steps, self.use_ref, self.use_critic, self.use_prm
        )
        engines, self._groups = start_engines(cfg, specs, self._closers)
        self.actor, self.ref, self.critic = engines.actor, engines.ref, engines.critic
        self.prm = engines.prm
        if self.use_ref and self.ref is None:
            # LoRA: the reference is the actor's base model (its adapter disabled), so the ref
            # role maps onto the actor engine instead of a second copy of the model.
            self.ref = self.actor
        views = engines.started()
        for view in views.values():
            view.init_model()
        self.servers = start_replicas(cfg, self.model_dir, self._closers, self._groups)
        urls = self.servers.urls
        self.producer = RolloutProducer.connect(
            cfg, urls, self.tokenizer, rewards, api_key=self.servers.api_key
        )
        self._closers.append(self.producer.close)
        self.producer.run(self.producer.client.wait_ready(timeout=300.0))
        _log(
            f"rollout: {len(urls)} {cfg.rollout.backend} replica(s) on "
            f"{rollout_device(cfg)}, {self.servers.placement} placement, at {', '.join(urls)}"
        )
        sender = self._groups[0].worker_info[0]
        transport = weight_transport(cfg, self.servers, trainer_host=sender.node_ip)
        self.replicas = Replicas(
            cfg,
            urls,
            self.producer,
            transport,
            supervisor=replica_supervisor(cfg, self.servers),
            actor=self.actor,
            senders=self.servers.senders or None,
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
        self.rollout: DriverRollout | QueueRollout | AheadRollout
        if cfg.transfer.enable:
            self._setup_queue(views)
            return
        self.plane = InlinePlane(cfg, cfg.trainer.world_size)
        if cfg.trainer.mode != "sync":
            self._setup_ahead(rewards)
        else:
            self.rollout = DriverRollout(
                cfg, self.producer, self.replicas, self.train_ds, self.sampler.next_batch
            )

    def _setup_ahead(self, rewards: Scorer) -> None:
        """Set up generation ahead of training: a rollout thread with a producer of its own."""
        cfg = self.cfg
        assert self.servers is not None and self.producer is not None
        shared = SerialRewards(rewards)
        # The trainer's thread validates while the rollout thread scores: one batch at a time.
        self.producer.rewards = shared
        producer = RolloutProducer.connect(
            cfg, self.servers.urls, self.tokenizer, shared, api_key=self.servers.api_key
        )
        self.ahead = AheadRollout(
            cfg, producer, self.train_ds, self.sampler, self.total_steps, self.out_dir
        )
        self._closers.append(producer.close)
        self._closers.append(self.ahead.close)
        self.replicas.inflight = self.ahead.inflight_policy
        self.replicas.attach(producer)
        self.ahead.recover = self.replicas.recover
        self.rollout = self.ahead
        opts = cfg.async_rl
        _log(
            f"mode: {cfg.trainer.mode}, staleness <= {self.ahead.max_staleness}, "
            f"partial rollouts {opts.partial_rollout}, correction {opts.correction}, "
            f"replay {self.ahead.buffer.sampling} (reuse <= {self.ahead.buffer.max_reuse})"
        )

    def describe_data(self) -> str:
        """One line: where the prompts come from, how many, and how the step count was set."""
        cfg, data, trainer = self.cfg, self.cfg.data, self.cfg.trainer
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
                f"{cfg.data.train_batch_size} prompts"
            )
        return (
            f"{source} -> {len(self.train_ds)} train / {val} val prompts | "
            f"{self.total_steps} steps from {how}"
        )

    def _setup_queue(self, views: Mapping[str, EngineHandle]) -> None:
        """Start the transfer queue, attach it to the engines and start its rollout workers."""
        from polyrl.trainer.rl.store_worker import StoreWorkers

        cfg = self.cfg
        queue, backend = start_transfer_queue(cfg, self._closers)
        for view in {id(v): v for v in views.values()}.values():
            view.attach_transfer_queue(queue)
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

    def _actor_loss_kwargs(self) -> dict[str, Any]:
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
                self.prm.compute_prm_log_prob, rows, "prm_log_probs", share_prefix=True
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
        cfg, plane = self.cfg, self.plane
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer(timing, "step"):
            # 1-2. generate and score (the replicas may sleep from here until the sync); off
            # the sync mode, take a batch the rollout thread generated ahead
            rows, generated = self.rollout.generate(step, timing)
            metrics.update(generated)
            # 3. old log-probs, reference log-probs, values
            if self.need_old_log_probs:
                with timer(timing, "old_log_prob"):
                    rows = plane.infer(
                        self.actor.compute_log_prob, rows, "old_log_probs", share_prefix=True
                    )
            if self.use_ref:
                with timer(timing, "ref"):
                    rows = plane.infer(
                        self.ref.compute_ref_log_prob, rows, "ref_log_probs", share_prefix=True
                    )
            if self.use_critic:
                with timer(timing, "values"):
                    rows = plane.infer(self.critic.compute_values, rows, "values")
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
                            loss_kwargs=self._actor_loss_kwargs(),
                            num_mini_batches=self.num_mini_batches,
                            epochs=cfg.actor.ppo_epochs,
                        )
                    )
                self.updates += 1
                # 6. weight sync (off the sync mode, versions count updates)
                with timer(timing, "update_weights"):
                    version = self._version(step)
                    if self.ahead is not None:
                        self.ahead.before_sync(version)
                    metrics.update(self.sync_weights(version))
            else:
                self.replicas.wake()
            if self.ahead is not None:
                self.ahead.after_step(self.replicas.version)
            metrics.update(plane.release(rows))
        metrics.update(self.replicas.metrics())
        metrics.update(step_metrics(data, timing, self.sampler, cfg.trainer.world_size))
        metrics.update(timing)
        return metrics

    def _version(self, step: int) -> int:
        """Return the actor's weight version after ``step``: the step, or (ahead) its updates."""
        return self.updates if self.ahead is not None else step

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
        """Checkpoint the actor (with the trainer state), the critic and the PRM at ``step``."""
        actor_root = self._roots()[0]
        for _, view, root in self._side_engines():
            view.save_checkpoint(str(root), step, {})
        state: dict[str, Any] = {
            "sampler": self.sampler.state_dict(),
            "kl_coef": float(self.kl_ctrl.value),
            "step": step,
            "updates": self.updates,
        }
        if self.ahead is not None:
            # The generated groups not trained yet, and the sampler position they belong to
            # (taken together: the rollout thread draws prompts while the trainer saves).
            state["ahead"] = self.ahead.state_dict()
            state["sampler"] = state["ahead"].pop("sampler")
        # The actor goes last: its checkpoint marks the step as complete for resume.
        path = self.actor.save_checkpoint(str(actor_root), step, state)[0]
        # The side engines are pruned only now (they do not prune themselves, see
        # build.engine_specs): before, their oldest kept step may be the one to resume from.
        for _, _, root in self._side_engines():
            prune_checkpoints(str(root), self.cfg.trainer.max_ckpt_to_keep)
        return path

    def load(self, path: str) -> int:
        """Restore the engines (actor, critic, PRM) and trainer state from the actor checkpoint."""
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
        if self.ahead is not None:
            if "ahead" not in state:
                raise ConfigError(
                    f"checkpoint {path} was saved by a trainer.mode=sync run; resume it with "
                    "trainer.mode=sync",
                    key="trainer.mode",
                )
            # fit() pushes the restored weights as this version before the first step.
            self.ahead.load_state_dict(state["ahead"], step, self._version(step))
        return step

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        """Run the configured job; return the summary written to ``rl_summary.json``."""
        from tqdm import tqdm

        from polyrl.trainer.checkpointing import resolve_resume_path
        from polyrl.trainer.tracking import Tracker

        started = time.perf_counter()
        cfg, trainer = self.cfg, self.cfg.trainer
        # A bad resume path fails before anything is started.
        resume_from = resolve_resume_path(trainer.resume_mode, trainer.resume, self._roots()[0])
        tracker = None
        history: list[dict[str, Any]] = []
        last_ckpt = resume_from
        try:
            self.setup()
            step = 0
            if resume_from is not None:
                step = self.load(resume_from)
                self.sync_weights(self._version(step))
                _log(f"resumed from {resume_from} at step {step}")
            validate = self.val_ds is not None and trainer.test_freq > 0
            _log(
                f"model {self.model_dir} | {len(self.train_ds)} train / "
                f"{len(self.val_ds) if self.val_ds else 0} val prompts | {self.total_steps} steps "
                f"of {cfg.data.train_batch_size} prompts x {cfg.rollout.n} | "
                f"{cfg.algorithm.adv_estimator} / {cfg.actor.policy_loss}"
            )
            tracker = Tracker.for_run(
                cfg,
                self.out_dir,
                resume_step=step if resume_from is not None else None,
                total_steps=self.total_steps,
            )

            console = tracker.backends.get("console")
            if console is not None:
                # One readable line per step; every metric still goes to the other loggers.
                console.keys = CONSOLE_METRICS
                console.prefixes = ("val/",)

            def record(metrics: dict[str, float], at: int) -> None:
                history.append({"step": at, **tracker.log(metrics, at)})

            if validate and trainer.val_before_train and resume_from is None:
                tick = time.perf_counter()
                val = self.validate()
                val["timing_s/testing"] = time.perf_counter() - tick
                record(val, step)
            bar = tqdm(
                total=self.total_steps,
                initial=step,
                desc="rl",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            with bar:
                while step < self.total_steps:
                    step += 1
                    metrics = self.step(step)
                    if validate and (step % trainer.test_freq == 0 or step == self.total_steps):
                        tick = time.perf_counter()
                        metrics.update(self.validate())
                        metrics["timing_s/testing"] = time.perf_counter() - tick
                    metrics["training/global_step"] = float(step)
                    # Log before saving: a crash in between re-runs the step from the previous
                    # checkpoint, and resuming drops the records logged after it.
                    record(metrics, step)
                    bar.update(1)
                    bar.set_postfix(score=f"{metrics.get('critic/score/mean', math.nan):.3f}")
                    if trainer.save_freq and (
                        step % trainer.save_freq == 0 or step == self.total_steps
                    ):
                        last_ckpt = self.save(step)
            hf_dir = None
            if trainer.export_hf:
                tick = time.perf_counter()
                hf_dir = self.export_hf(self.out_dir / HF_DIR)
                _log(f"policy exported to {hf_dir} in {time.perf_counter() - tick:.2f}s")
        finally:
            if tracker is not None:
                tracker.finish()
            self.close()
        metrics_file = tracker.metrics_path if tracker is not None else None
        if metrics_file is None:
            metrics_file = self.out_dir / ".rl_history.jsonl"
            metrics_file.write_text("".join(json.dumps(r) + "\n" for r in history))
        summary = write_summary(
            self.cfg,
            self.out_dir,
            metrics_file,
            {
                "steps": step,
                "resumed_from": resume_from,
                "checkpoint": last_ckpt,
                "hf_model": hf_dir,
                "elapsed_s": round(time.perf_counter() - started, 2),
            },
        )
        _log("done: " + " ".join(f"{k}={v}" for k, v in summary.items()))
        return summary

    def export_hf(self, directory: str | Path) -> str:
        """Write the actor as a Hugging Face model directory (call before the run closes)."""
        return self.actor.export_hf(str(directory))[0]

    def close(self) -> None:
        """Stop the worker groups, the rollout client and replicas, and the reward workers."""
        if self.ahead is not None:
            # The rollout thread first: it would take the servers' shutdown for a failure.
            with contextlib.suppress(Exception):
                self.ahead.close()
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


def run_rl(cfg: PolyRLConfig, **kwargs: Any) -> dict[str, Any]:
    """Run RL training for ``cfg`` (see :class:`RLTrainer` for ``kwargs``); returns the summary."""
    return RLTrainer(cfg, **kwargs).fit()
