"""The RL trainer behind ``polyrl train PRESET key=value ...`` and :class:`polyrl.GRPOTrainer`.

One step, driven from this (controller) process and readable top to bottom in
:meth:`RLTrainer.step`:

1. **generate** -- ``rollout.n`` responses per prompt from the rollout servers (HTTP,
   token-in/token-out, per-prompt seeds derived from the step);
2. **reward** -- the reward manager scores the decoded responses (sandboxed worker processes);
3. **old log-probs** (actor), **reference log-probs** (when a KL term is used) and **values**
   (critic, for ``gae``) -- data-parallel calls on the engine worker groups;
4. **advantages** on the driver with the estimator registered under
   ``algorithm.adv_estimator`` (KL penalty folded into the rewards first when configured);
5. **update** the critic, then the actor (``actor.ppo_epochs`` passes over mini-batches of
   ``actor.ppo_mini_batch_size`` prompts);
6. **sync** the actor's weights to every rollout replica (bucketed transfer; the replicas
   report the new version);
7. **validate** (mean@k / pass@k on the held-out split), **log** (verl metric names),
   **checkpoint** (actor, critic, sampler, KL controller; atomic).

Placement: ``trainer.placement=colocated`` runs the actor, reference and critic engines in one
process per rank (and, with ``rollout.sleep_during_training``, the rollout servers release their
KV cache while the engines train); ``separate`` gives each engine its own worker group. Engine
workers are Ray actors (``trainer.worker_backend=ray``) or local processes (``local``; at world
size 1 the engines then run inside this process).

Resuming (``trainer.resume_mode=auto``) restores the engines, the data sampler and the KL
controller from the newest checkpoint, pushes the restored weights to the replicas, and drops
the metric records logged after that checkpoint, so a resumed run logs what an uninterrupted
one would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrl.config import ConfigError, PolyRLConfig, save_config, to_dict
from polyrl.core.batch import Batch
from polyrl.trainer.rl_rollout import (
    RolloutProducer,
    batch_metrics,
    build_rollout_batch,
    compute_advantages,
    derive_seed,
    group_varies,
    place_on_last_token,
    response_cap,
    rollout_widths,
    select_groups,
    widen_rollout_batch,
)

__all__ = [
    "DEFAULT_PLOT_METRICS",
    "RLTrainer",
    "build_rollout_batch",
    "place_on_last_token",
    "run_rl",
]

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
PLOT_FILE = "learning_curves.png"
SUMMARY_FILE = "rl_summary.json"
HF_DIR = "hf_model"
ACTOR_LOSS = "polyrl.trainer.rl_losses:actor_loss"
CRITIC_LOSS = "polyrl.trainer.rl_losses:critic_loss"


def _log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[rl] {message}", file=sys.stdout)
    sys.stdout.flush()


@contextlib.contextmanager
def _timer(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + (
            time.perf_counter() - start
        )


def trains_on_gpu(cfg: PolyRLConfig) -> bool:
    """Whether the training engines run on CUDA (``trainer.device``, auto when available)."""
    return cfg.trainer.device == "cuda" or (
        cfg.trainer.device == "auto" and torch.cuda.is_available()
    )


def rollout_matmul_dtype(cfg: PolyRLConfig) -> str:
    """Return the native replicas' projection-matmul dtype (``rollout.matmul_dtype``).

    ``auto`` is the training engines' compute dtype (``model.compute_dtype``, whose own auto is
    bfloat16 on CUDA and ``model.dtype`` on CPU), so rollout and training round their matmuls
    alike.
    """
    from polyrl.model_engine import MixedPrecisionConfig

    if cfg.rollout.matmul_dtype != "auto":
        return cfg.rollout.matmul_dtype
    precision = MixedPrecisionConfig(param_dtype=cfg.model.compute_dtype)
    compute = precision.compute_dtype("cuda" if trains_on_gpu(cfg) else "cpu", cfg.model.dtype)
    return str(compute).removeprefix("torch.")


def _check_config(cfg: PolyRLConfig, has_rows: bool = False) -> None:
    algo, actor = cfg.algorithm, cfg.actor
    if not has_rows and not cfg.data.task and not cfg.data.train_files:
        raise ConfigError(
            "no training data: set data.task (a generated task) or data.train_files",
            key="data.train_files",
        )
    if algo.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and (
        cfg.rollout.n < 2
    ):
        raise ConfigError(
            f"{algo.adv_estimator} compares the responses of one prompt and needs rollout.n >= 2, "
            f"got {cfg.rollout.n}",
            key="rollout.n",
        )
    if algo.filter_groups and (cfg.rollout.n < 2 or algo.adv_estimator == "remax"):
        raise ConfigError(
            "algorithm.filter_groups keeps prompts whose responses differ: it needs rollout.n >= "
            f"2 and an estimator other than remax (got n={cfg.rollout.n}, "
            f"{algo.adv_estimator})",
            key="algorithm.filter_groups",
        )
    if algo.filter_groups and cfg.transfer.enable:
        raise ConfigError(
            "algorithm.filter_groups is not supported with transfer.enable (the rollout workers "
            "stream fixed prompt sets); turn one of them off",
            key="algorithm.filter_groups",
        )
    response = response_cap(cfg)
    if cfg.reward.overlong_buffer_len > response:
        raise ConfigError(
            f"{cfg.reward.overlong_buffer_len} exceeds the maximum response length ({response}); "
            "the buffer is the last part of the allowed length",
            key="reward.overlong_buffer_len",
        )
    batch = cfg.data.train_batch_size
    if actor.ppo_mini_batch_size and batch % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"{actor.ppo_mini_batch_size} must divide data.train_batch_size ({batch})",
            key="actor.ppo_mini_batch_size",
        )
    world = cfg.trainer.world_size
    minis = batch // actor.ppo_mini_batch_size if actor.ppo_mini_batch_size else 1
    if (batch * cfg.rollout.n) // world < minis:
        raise ConfigError(
            f"{batch} prompts x {cfg.rollout.n} responses over {world} ranks leave fewer rows per "
            f"rank than the {minis} mini-batches; raise data.train_batch_size",
            key="actor.ppo_mini_batch_size",
        )
    if cfg.transfer.enable and (batch * cfg.rollout.n) % world:
        raise ConfigError(
            f"with transfer.enable the {batch} prompts x {cfg.rollout.n} responses must split "
            f"evenly over the {world} ranks (each rank fetches its own rows, unpadded)",
            key="data.train_batch_size",
        )
    if actor.max_tokens_per_micro_batch < cfg.data.max_prompt_length + response:
        raise ConfigError(
            f"{actor.max_tokens_per_micro_batch} is below the longest sequence "
            f"({cfg.data.max_prompt_length} prompt + {response} response tokens)",
            key="actor.max_tokens_per_micro_batch",
        )


# ------------------------------------------------------------------------------ the trainer
class RLTrainer:
    """Runs RL post-training as configured by a :class:`~polyrl.config.PolyRLConfig`.

    Args:
        cfg: the run's configuration (``algorithm``, ``actor``, ``critic``, ``rollout``, ``data``,
            ``reward``, ``trainer`` groups).
        reward_fn: overrides ``reward.custom_function``: a ``"file.py:function"`` string or a
            picklable module-level callable (see :class:`~polyrl.reward.RewardManager`).
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
        _check_config(cfg, has_rows=train_rows is not None)
        self.cfg = cfg
        self.reward_fn = reward_fn
        self._train_rows = train_rows
        self._val_rows = val_rows
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self.out_dir = Path(cfg.trainer.output_dir)
        self._closers: list[Callable[[], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self.actor: Any = None
        self.ref: Any = None
        self.critic: Any = None
        self._groups: list[Any] = []
        algo = cfg.algorithm
        self.use_critic = algo.adv_estimator == "gae"
        self.use_ref = algo.use_kl_in_reward or cfg.actor.use_kl_loss
        minis = (
            cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
            if cfg.actor.ppo_mini_batch_size
            else 1
        )
        self.num_mini_batches = minis
        # Old log-probs equal the current ones when each step makes exactly one optimizer
        # update; they are only computed when the update is off-policy or the KL penalty needs
        # them (the loss then takes the detached current log-probs, ratio 1).
        self.need_old_log_probs = cfg.actor.ppo_epochs > 1 or minis > 1 or algo.use_kl_in_reward
        from polyrl.algo.kl import AdaptiveKLController, FixedKLController

        if algo.kl_ctrl == "adaptive":
            self.kl_ctrl: Any = AdaptiveKLController(algo.kl_coef, algo.target_kl, algo.kl_horizon)
        else:
            self.kl_ctrl = FixedKLController(algo.kl_coef)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Build the model (if tiny), data, reward manager, rollout replicas and engine groups."""
        from polyrl.data.sampler import StatefulSampler
        from polyrl.models.loader import load_tokenizer
        from polyrl.reward.manager import RewardManager
        from polyrl.trainer.sft import resolve_model_dir

        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out_dir / "rl_config.yaml")
        self.model_dir = self._model_dir or resolve_model_dir(cfg, self.out_dir)
        self.tokenizer = load_tokenizer(
            self.model_dir, trust_remote_code=cfg.model.trust_remote_code
        )
        self.pad_id = int(
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.train_ds, self.val_ds = self._datasets()
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
        reward_fn = self.reward_fn if self.reward_fn is not None else cfg.reward.custom_function
        self.rewards = RewardManager(
            custom_function=reward_fn or None,
            num_workers=cfg.reward.num_workers,
            timeout_s=cfg.reward.timeout_s,
            error_reward=cfg.reward.error_reward,
        )
        self._closers.append(self.rewards.close)
        self._start_rollout()
        self._start_engines()
        if cfg.transfer.enable:
            self._start_transfer()

    def _datasets(self) -> tuple[Any, Any]:
        from polyrl.data.dataset import RLDataset

        cfg, data = self.cfg, self.cfg.data
        kwargs = {
            "max_prompt_length": data.max_prompt_length,
            "prompt_key": data.prompt_key,
            "truncation": data.truncation,
        }
        if self._train_rows is not None:
            train = RLDataset(list(self._train_rows), self.tokenizer, **kwargs)
            val = (
                RLDataset(list(self._val_rows), self.tokenizer, **kwargs)
                if self._val_rows
                else None
            )
            return train, val
        if data.task:
            from polyrl.data.tasks import write_task_splits

            data_dir = Path(data.data_dir) if data.data_dir else self.out_dir / "data"
            train_path, test_path = write_task_splits(
                data.task,
                data_dir,
                data.num_train,
                data.num_val,
                seed=cfg.seed_for("data"),
                **data.task_options,
            )
            train_files = [str(train_path)]
            val_files = list(data.val_files) or ([str(test_path)] if data.num_val > 0 else [])
        else:
            train_files, val_files = list(data.train_files), list(data.val_files)
        train = RLDataset(train_files, self.tokenizer, **kwargs)
        val = RLDataset(val_files, self.tokenizer, **kwargs) if val_files else None
        return train, val

    def _run(self, coro: Any) -> Any:
        assert self._loop is not None
        return self._loop.run_until_complete(coro)

    def _start_rollout(self) -> None:
        from polyrl.rollout.client import RolloutClient
        from polyrl.rollout.launcher import start_replicas

        cfg = self.cfg
        urls = list(cfg.rollout.urls)
        if not urls:
            options: dict[str, Any] = {"dtype": cfg.model.dtype, "seed": cfg.seed_for("rollout")}
            if cfg.rollout.backend == "native":
                options["max_num_seqs"] = cfg.rollout.max_num_seqs
                if cfg.rollout.num_threads:
                    options["num_threads"] = cfg.rollout.num_threads
                matmul = rollout_matmul_dtype(cfg)
                if matmul != cfg.model.dtype:
                    options["matmul_dtype"] = matmul
            replicas = start_replicas(
                self.model_dir, cfg.rollout.replicas, backend=cfg.rollout.backend, options=options
            )
            for replica in replicas:
                self._closers.append(replica.stop)
            urls = [str(r.url) for r in replicas]
        self.rollout_urls = urls
        self._loop = asyncio.new_event_loop()
        self._client = RolloutClient(urls, max_concurrency=512)
        self._run(self._client.start())
        self._run(self._client.wait_ready(timeout=300.0))
        self.producer = RolloutProducer(
            cfg, self._client, self.tokenizer, self.pad_id, self.rewards, self._run
        )
        _log(f"rollout: {len(urls)} {cfg.rollout.backend} replica(s) at {', '.join(urls)}")

    def _engine_specs(self) -> dict[str, Any]:
        from polyrl.controller import WorkerSpec
        from polyrl.model_engine import (
            CheckpointConfig,
            EngineConfig,
            MixedPrecisionConfig,
            ModelSpec,
            OptimizerConfig,
        )
        from polyrl.workers.engine import EngineWorker
        from polyrl.workers.weight_sync import WeightSyncWorker

        cfg, actor, critic = self.cfg, self.cfg.actor, self.cfg.critic
        if cfg.transfer.enable:
            # The same workers plus the methods that read their rows from the transfer queue.
            from polyrl.trainer.rl_transfer import StoreActorWorker, StoreEngineWorker

            WeightSyncWorker, EngineWorker = StoreActorWorker, StoreEngineWorker  # noqa: N806
        model = ModelSpec(
            path=str(self.model_dir),
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        engine = EngineConfig(
            device=cfg.trainer.device,
            dynamic_batching=True,
            max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch,
            gradient_checkpointing=actor.gradient_checkpointing,
            share_prefix=actor.share_prefix,
            grad_clip=actor.grad_clip,
            mixed_precision=MixedPrecisionConfig(param_dtype=cfg.model.compute_dtype),
            seed=cfg.seed,
        )
        ckpt = CheckpointConfig(max_to_keep=cfg.trainer.max_ckpt_to_keep)
        specs: dict[str, Any] = {
            "actor": WorkerSpec(
                WeightSyncWorker,
                kwargs={
                    "role": "actor",
                    "model": model,
                    "engine": engine,
                    "optimizer": OptimizerConfig(
                        name=actor.optimizer,
                        lr=actor.lr,
                        weight_decay=actor.weight_decay,
                        scheduler=actor.lr_scheduler,
                        warmup_ratio=actor.warmup_ratio,
                        total_steps=max(self.total_steps, 1),
                    ),
                    "checkpoint": ckpt,
                },
            )
        }
        if self.use_ref:
            specs["ref"] = WorkerSpec(
                EngineWorker, kwargs={"role": "reference", "model": model, "engine": engine}
            )
        if self.use_critic:
            critic_model = dataclasses.replace(
                model, path=critic.model_path or str(self.model_dir), kind="value"
            )
            specs["critic"] = WorkerSpec(
                EngineWorker,
                kwargs={
                    "role": "critic",
                    "model": critic_model,
                    "engine": dataclasses.replace(engine, grad_clip=critic.grad_clip),
                    "optimizer": OptimizerConfig(
                        name=critic.optimizer,
                        lr=critic.lr,
                        weight_decay=critic.weight_decay,
                        total_steps=max(self.total_steps, 1),
                    ),
                    "checkpoint": ckpt,
                },
            )
        return specs

    def _start_engines(self) -> None:
        from polyrl.controller import ResourcePool, WorkerGroup

        cfg = self.cfg
        world = cfg.trainer.world_size
        backend = cfg.trainer.worker_backend
        use_gpu = trains_on_gpu(cfg)
        if backend == "ray":
            import ray

            if not ray.is_initialized():
                from polyrl.trainer.sft import ray_init_options

                ray.init(**ray_init_options(cfg))
                self._closers.append(ray.shutdown)
        specs = self._engine_specs()
        layouts = (
            [specs] if cfg.trainer.placement == "colocated" else [{k: v} for k, v in specs.items()]
        )
        views: dict[str, Any] = {}
        for layout in layouts:
            name = "+".join(layout)
            kwargs: dict[str, Any] = {"backend": backend, "name": f"rl-{name}"}
            if backend == "ray":
                # Separate groups on CPU share the cores: each asks for a fraction of one, so a
                # two-core machine can still place actor, reference and critic.
                kwargs["pool"] = ResourcePool(
                    f"rl-{name}",
                    world,
                    cpus_per_worker=1.0 if use_gpu else 1.0 / len(layouts),
                    gpus_per_worker=1.0 if use_gpu else 0.0,
                )
            else:
                kwargs["world_size"] = world
            group = WorkerGroup(layout, **kwargs)
            self._groups.append(group)
            for role in layout:
                views[role] = group.role(role)
        self.actor, self.ref, self.critic = views["actor"], views.get("ref"), views.get("critic")
        for view in views.values():
            view.init_model()
        _log(
            f"engines: {', '.join(views)} on {world} rank(s), {cfg.trainer.placement} "
            f"({backend}); old log-probs {'computed' if self.need_old_log_probs else 'skipped'}"
        )

    def _start_transfer(self) -> None:
        """Start the transfer queue and the rollout workers that feed it."""
        from polyrl.trainer.rl_transfer import StoreRolloutWorker
        from polyrl.transfer import make_transfer_queue

        cfg = self.cfg
        backend = cfg.transfer.backend
        if backend == "auto":
            backend = "ray" if cfg.trainer.worker_backend == "ray" else "local"
        options = {"num_storage_units": cfg.transfer.num_storage_units} if backend == "ray" else {}
        self.queue = make_transfer_queue(backend, **options)
        self._closers.append(self.queue.close)
        for view in {id(v): v for v in (self.actor, self.ref, self.critic) if v}.values():
            view.attach_transfer_queue(self.queue)
        args = (cfg, self.rollout_urls, str(self.model_dir), self.train_ds, self.queue)
        count = cfg.transfer.num_rollout_workers
        if backend == "ray":
            import ray

            # The workers mostly wait on HTTP: they take no CPU reservation from the engines.
            remote = ray.remote(StoreRolloutWorker).options(num_cpus=0)
            self._store_workers = [remote.remote(*args, self.reward_fn) for _ in range(count)]
        else:
            self._store_workers = [StoreRolloutWorker(*args, self.reward_fn) for _ in range(count)]
        self._store_backend = backend
        for worker in self._store_workers:
            self._closers.append(lambda w=worker: self._on_store(w, "close"))
        _log(f"transfer: {backend} queue, {count} rollout worker(s)")

    def _on_store(self, worker: Any, method: str, *args: Any) -> Any:
        if self._store_backend == "ray":
            import ray

            return ray.get(getattr(worker, method).remote(*args))
        return getattr(worker, method)(*args)

    def _on_stores(self, method: str, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call ``method`` on rollout worker ``i`` with ``calls[i]``, all at once."""
        workers = self._store_workers[: len(calls)]
        if self._store_backend == "ray":
            import ray

            return ray.get(
                [getattr(w, method).remote(*a) for w, a in zip(workers, calls, strict=True)]
            )
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(calls)) as pool:
            return list(
                pool.map(
                    lambda wa: getattr(wa[0], method)(*wa[1]), zip(workers, calls, strict=True)
                )
            )

    # ------------------------------------------------------------------ phases
    def generate(
        self, items: Sequence[Mapping[str, Any]], n: int, temperature: float, seed: int
    ) -> tuple[Batch, dict[str, float]]:
        """Sample ``n`` responses per item (see :meth:`RolloutProducer.generate`)."""
        return self.producer.generate(items, n, temperature, seed)

    def score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Score every row: ``(scores (B,), accuracy (B,), reward metrics)``."""
        return self.producer.score(batch)

    def _padded(self, batch: Batch) -> tuple[Batch, int]:
        from polyrl.workers.engine import pad_batch_for_dp

        return pad_batch_for_dp(batch, self.cfg.trainer.world_size)

    def _dp(self, method: Any, batch: Batch, **kwargs: Any) -> Batch:
        """Run a data-parallel call on ``batch`` padded to the world size; drop the padding."""
        padded, extra = self._padded(batch)
        out = method(padded, **kwargs)
        return out[: len(batch)] if extra else out

    def compute_advantages(self, batch: Batch, baseline: torch.Tensor | None) -> dict[str, float]:
        """Fill ``token_level_rewards``, ``advantages`` and ``returns`` (KL penalty first)."""
        return compute_advantages(batch, self.cfg, self.kl_ctrl, baseline)

    def _critic_loss_kwargs(self) -> dict[str, Any]:
        critic = self.cfg.critic
        return {"cliprange_value": critic.cliprange_value, "loss_agg_mode": critic.loss_agg_mode}

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
        }

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights to every replica as ``version``; returns timing metrics."""
        ro = self.cfg.rollout
        if ro.sleep_during_training:
            self._run(self._client.wake_up())
        stats = self.actor.sync_weights(
            ro.weight_transport,
            self.rollout_urls,
            ro.weight_bucket_mb,
            False,
            version,
            ro.weight_sync_mode,
        )
        first = next(s for s in stats if s is not None)
        return {
            "perf/weight_sync_bytes": float(first["bytes"]),
            "perf/weight_sync_buckets": float(first["buckets"]),
        }

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, float]:
        """Run training step ``step`` (1-based) and return its metrics."""
        if self.cfg.transfer.enable:
            return self._step_with_transfer(step)
        cfg, algo = self.cfg, self.cfg.algorithm
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        items = [self.train_ds[i] for i in self.sampler.next_batch()]
        with _timer(timing, "step"):
            # 1. generate
            with _timer(timing, "gen"):
                seed = derive_seed(cfg.seed_for("rollout"), step)
                batch, gen_metrics = self.generate(
                    items, cfg.rollout.n, cfg.rollout.temperature, seed
                )
                metrics.update(gen_metrics)
            # 2. reward (ReMax: also the greedy response's reward, as the baseline)
            with _timer(timing, "reward"):
                scores, acc, reward_metrics = self.score(batch)
                baseline = None
                if algo.adv_estimator == "remax":
                    greedy, _ = self.generate(items, 1, 0.0, seed)
                    greedy_scores = self.score(greedy)[0]
                    baseline = greedy_scores.repeat_interleave(cfg.rollout.n)
            if algo.filter_groups:  # DAPO dynamic sampling: more prompts until enough vary
                batch, scores, acc = self._keep_informative_groups(
                    len(items), batch, scores, acc, seed, timing, metrics
                )
            if cfg.rollout.sleep_during_training:
                self._run(self._client.sleep())
            mask = batch["loss_mask"]
            batch["token_level_scores"] = place_on_last_token(scores, mask)
            # 3. old log-probs, reference log-probs, values
            if self.need_old_log_probs:
                with _timer(timing, "old_log_prob"):
                    batch = batch.union(
                        self._dp(self.actor.compute_log_prob, batch, share_prefix=True)
                    )
            if self.use_ref:
                with _timer(timing, "ref"):
                    batch = batch.union(
                        self._dp(self.ref.compute_ref_log_prob, batch, share_prefix=True)
                    )
            if self.use_critic:
                with _timer(timing, "values"):
                    from polyrl.trainer.rl_losses import state_values

                    values = self._dp(self.critic.compute_values, batch)["values"]
                    batch["values"] = state_values(values) * mask
            # 4. advantages
            with _timer(timing, "adv"):
                metrics.update(self.compute_advantages(batch, baseline))
            # 5. updates
            update_batch, _ = self._padded(batch)
            if self.use_critic:
                with _timer(timing, "update_critic"):
                    metrics.update(
                        self.critic.update_critic(
                            update_batch,
                            CRITIC_LOSS,
                            self._critic_loss_kwargs(),
                            self.num_mini_batches,
                            cfg.critic.ppo_epochs,
                        )
                    )
            if step > cfg.trainer.critic_warmup:
                with _timer(timing, "update_actor"):
                    metrics.update(
                        self.actor.update_actor(
                            update_batch,
                            ACTOR_LOSS,
                            self._actor_loss_kwargs(),
                            self.num_mini_batches,
                            cfg.actor.ppo_epochs,
                        )
                    )
                # 6. weight sync
                with _timer(timing, "update_weights"):
                    metrics.update(self.sync_weights(step))
            elif cfg.rollout.sleep_during_training:
                self._run(self._client.wake_up())
        data = batch_metrics(batch, scores, acc, self._max_response_length())
        metrics.update(self._step_metrics(data, reward_metrics, timing))
        metrics.update(timing)
        return metrics

    def _keep_informative_groups(
        self,
        needed: int,
        batch: Batch,
        scores: torch.Tensor,
        acc: torch.Tensor,
        seed: int,
        timing: dict[str, float],
        metrics: dict[str, float],
    ) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """DAPO dynamic sampling: keep ``needed`` prompt groups whose responses differ.

        Samples further prompt batches (the sampler moves on, seeds derive from the step's)
        until ``needed`` groups vary in ``algorithm.filter_groups_metric`` or
        ``algorithm.max_gen_batches`` rounds were made; uninformative groups fill what is
        still missing, so every step trains on the same number of rows.
        """
        cfg, algo = self.cfg, self.cfg.algorithm
        n = cfg.rollout.n
        batches, all_scores, all_acc = [batch], [scores], [acc]
        judged = all_acc if algo.filter_groups_metric == "acc" else all_scores  # grows below
        first = group_varies(judged[0], n)
        varies = first
        while int(varies.sum()) < needed and len(batches) < algo.max_gen_batches:
            items = [self.train_ds[i] for i in self.sampler.next_batch()]
            with _timer(timing, "gen"):
                more, _ = self.generate(
                    items, n, cfg.rollout.temperature, derive_seed(seed, len(batches))
                )
            with _timer(timing, "reward"):
                more_scores, more_acc, _ = self.score(more)
            # A prompt drawn again (the sampler wrapped an epoch) is a group of its own.
            more.non_tensors["uid"] = np.array(
                [f"{uid}#{len(batches)}" for uid in more.non_tensors["uid"]], dtype=object
            )
            batches.append(more)
            all_scores.append(more_scores)
            all_acc.append(more_acc)
            varies = torch.cat([varies, group_varies(judged[-1], n)])
        chosen = select_groups(varies, needed)
        rows = (chosen[:, None] * n + np.arange(n)).reshape(-1)
        if len(batches) > 1:
            widths = [rollout_widths(b) for b in batches]
            width_p, width_r = max(w[0] for w in widths), max(w[1] for w in widths)
            batch = Batch.concat(
                [widen_rollout_batch(b, width_p, width_r, self.pad_id) for b in batches]
            )
        metrics["filter/gen_batches"] = float(len(batches))
        metrics["filter/informative_groups"] = float(varies[torch.from_numpy(chosen)].sum())
        metrics["filter/first_batch_informative_fraction"] = float(first.float().mean())
        index = torch.from_numpy(rows)
        return batch[rows], torch.cat(all_scores)[index], torch.cat(all_acc)[index]

    def _step_with_transfer(self, step: int) -> dict[str, float]:
        """:meth:`step` with the data in the transfer queue: the driver handles references.

        Same phases and numbers as :meth:`step` (see :mod:`polyrl.trainer.rl_transfer`).
        """
        from polyrl.trainer.rl_transfer import ROLLOUT_FIELDS, StepLayout, merge_rollout_summaries

        cfg = self.cfg
        n, queue = cfg.rollout.n, self.queue
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        indices = [int(i) for i in self.sampler.next_batch()]
        partition = f"step-{step}"
        with _timer(timing, "step"):
            # 1-2. rollout workers generate, score and put their share of the prompts
            with _timer(timing, "gen"):
                seed = derive_seed(cfg.seed_for("rollout"), step)
                shares = np.array_split(np.arange(len(indices)), len(self._store_workers))
                calls = [
                    (
                        partition,
                        [indices[i] for i in share],
                        int(share[0]),
                        n,
                        cfg.rollout.temperature,
                        seed,
                    )
                    for share in shares
                    if len(share)
                ]
                rollout = merge_rollout_summaries(self._on_stores("rollout", calls))
                meta = queue.get_meta(
                    list(ROLLOUT_FIELDS),
                    len(indices) * n,
                    partition,
                    consumer="trainer",
                    timeout=cfg.transfer.timeout_s,
                )
            timing["timing_s/reward"] = rollout.pop("time_reward")
            layout = StepLayout(
                int(rollout.pop("width_prompt")),
                int(rollout.pop("width_response")),
                self.pad_id,
                bool(rollout.pop("rollout_log_probs")),
            )
            rows = int(rollout.pop("rows"))
            metrics.update(rollout)
            if cfg.rollout.sleep_during_training:
                self._run(self._client.sleep())
            # 3. old log-probs, reference log-probs, values: each rank fetches its own rows
            fields = ["score", "acc", "uid"] + (
                ["baseline"] if cfg.algorithm.adv_estimator == "remax" else []
            )
            if self.need_old_log_probs:
                with _timer(timing, "old_log_prob"):
                    self.actor.infer_to_store(
                        meta, layout, "compute_log_prob", {"share_prefix": True}
                    )
                fields.append("old_log_probs")
            if self.use_ref:
                with _timer(timing, "ref"):
                    self.ref.infer_to_store(
                        meta, layout, "compute_ref_log_prob", {"share_prefix": True}
                    )
                fields.append("ref_log_probs")
            if self.use_critic:
                with _timer(timing, "values"):
                    self.critic.infer_to_store(meta, layout, "compute_values")
                fields.append("values")
            # 4. advantages (in rollout worker 0, on the stored rows)
            with _timer(timing, "adv"):
                data_metrics, self.kl_ctrl = self._on_store(
                    self._store_workers[0],
                    "advantages",
                    meta,
                    layout,
                    self.kl_ctrl,
                    fields,
                    self._max_response_length(),
                )
            fields += ["token_level_rewards", "advantages", "returns"]
            # 5. updates: each rank fetches its shard
            if self.use_critic:
                with _timer(timing, "update_critic"):
                    metrics.update(
                        self.critic.update_from_store(
                            meta,
                            layout,
                            fields,
                            "update_critic",
                            CRITIC_LOSS,
                            self._critic_loss_kwargs(),
                            self.num_mini_batches,
                            cfg.critic.ppo_epochs,
                        )
                    )
            if step > cfg.trainer.critic_warmup:
                with _timer(timing, "update_actor"):
                    metrics.update(
                        self.actor.update_from_store(
                            meta,
                            layout,
                            fields,
                            "update_actor",
                            ACTOR_LOSS,
                            self._actor_loss_kwargs(),
                            self.num_mini_batches,
                            cfg.actor.ppo_epochs,
                        )
                    )
                # 6. weight sync
                with _timer(timing, "update_weights"):
                    metrics.update(self.sync_weights(step))
            elif cfg.rollout.sleep_during_training:
                self._run(self._client.wake_up())
            metrics["transfer/storage_bytes"] = float(queue.storage_bytes())
            metrics["transfer/samples"] = float(rows)
            queue.clear(partition)
        # The rollout workers' reward counts are already in ``metrics``.
        metrics.update(self._step_metrics(data_metrics, {}, timing))
        metrics.update(timing)
        return metrics

    def _max_response_length(self) -> int:
        return response_cap(self.cfg)

    def _step_metrics(
        self,
        data: Mapping[str, float],
        reward_metrics: Mapping[str, float],
        timing: Mapping[str, float],
    ) -> dict[str, float]:
        """Add reward failure counts and shaping, throughput and epoch to the data metrics."""
        out = dict(data)
        for key in (
            "reward/errors",
            "reward/timeouts",
            "reward/overlong_penalty/mean",
            "reward/overlong_fraction",
        ):
            if key in reward_metrics:
                out[key] = float(reward_metrics[key])
        step_s = timing.get("timing_s/step", 0.0)
        tokens = out["perf/total_num_tokens"]
        out["perf/throughput"] = tokens / step_s / self.cfg.trainer.world_size if step_s else 0.0
        out["training/epoch"] = self.sampler.epoch + self.sampler.position / max(
            self.sampler.batches_per_epoch, 1
        )
        return out

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """mean@k and pass@k of the held-out prompts (``k = rollout.val_n``)."""
        if self.val_ds is None:
            return {}
        cfg = self.cfg
        k = cfg.rollout.val_n
        scores, accs, sources, lengths = [], [], [], []
        for start in range(0, len(self.val_ds), cfg.data.val_batch_size):
            stop = min(start + cfg.data.val_batch_size, len(self.val_ds))
            items = [self.val_ds[i] for i in range(start, stop)]
            batch, _ = self.generate(
                items,
                k,
                cfg.rollout.val_temperature,
                derive_seed(cfg.seed_for("rollout"), -1, start),
            )
            s, a, _ = self.score(batch)
            scores.append(s)
            accs.append(a)
            lengths.append(batch["response_length"].float())
            sources += list(batch.non_tensors["data_source"])
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

    # ------------------------------------------------------------------ checkpoints
    def _roots(self) -> tuple[Path, Path]:
        from polyrl.trainer.checkpointing import checkpoint_root

        root = checkpoint_root(self.out_dir)
        return root / "actor", root / "critic"

    def save(self, step: int) -> str:
        """Checkpoint the actor (with the trainer state) and the critic at ``step``."""
        actor_root, critic_root = self._roots()
        if self.critic is not None:
            self.critic.save_checkpoint(str(critic_root), step, {})
        state = {
            "sampler": self.sampler.state_dict(),
            "kl_coef": float(self.kl_ctrl.value),
            "step": step,
        }
        # The actor goes last: its checkpoint marks the step as complete for resume.
        return self.actor.save_checkpoint(str(actor_root), step, state)[0]

    def load(self, path: str) -> int:
        """Restore the engines and trainer state from the actor checkpoint ``path``."""
        info = self.actor.load_checkpoint(path)[0]
        step = int(info["step"])
        state = info["extra_state"]
        if self.critic is not None:
            critic_path = self._roots()[1] / Path(path).name
            if not critic_path.is_dir():
                raise ConfigError(
                    f"checkpoint {path} has no critic counterpart {critic_path}",
                    key="trainer.resume_mode",
                )
            self.critic.load_checkpoint(str(critic_path))
        try:
            self.sampler.load_state_dict(state["sampler"])
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"cannot resume from {path}: {exc}; resume with the original data settings",
                key="trainer.resume_mode",
            ) from None
        self.kl_ctrl.value = float(state.get("kl_coef", self.kl_ctrl.value))
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
                self.sync_weights(step)
                _log(f"resumed from {resume_from} at step {step}")
            validate = self.val_ds is not None and trainer.test_freq > 0
            _log(
                f"model {self.model_dir} | {len(self.train_ds)} train / "
                f"{len(self.val_ds) if self.val_ds else 0} val prompts | {self.total_steps} steps "
                f"of {cfg.data.train_batch_size} prompts x {cfg.rollout.n} | "
                f"{cfg.algorithm.adv_estimator} / {cfg.actor.policy_loss}"
            )
            tracker = Tracker(
                trainer.loggers,
                self.out_dir,
                project=trainer.project_name,
                experiment=trainer.experiment_name,
                config=to_dict(cfg),
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
            hf_dir = self.export_hf(self.out_dir / HF_DIR) if trainer.export_hf else None
        finally:
            if tracker is not None:
                tracker.finish()
            self.close()
        return self._summary(tracker, history, step, resume_from, last_ckpt, hf_dir, started)

    def _summary(
        self,
        tracker: Any,
        history: list[dict[str, Any]],
        step: int,
        resume_from: str | None,
        last_ckpt: str | None,
        hf_dir: str | None,
        started: float,
    ) -> dict[str, Any]:
        from polyrl.trainer.plotting import plot_learning_curves
        from polyrl.trainer.tracking import read_metrics

        trainer = self.cfg.trainer
        k = self.cfg.rollout.val_n
        metrics_file = tracker.metrics_path if tracker is not None else None
        if metrics_file is None:
            metrics_file = self.out_dir / ".rl_history.jsonl"
            metrics_file.write_text("".join(json.dumps(r) + "\n" for r in history))
        keys = list(trainer.plot_metrics) or [m.format(k=k) for m in DEFAULT_PLOT_METRICS]
        plot = plot_learning_curves(metrics_file, self.out_dir / PLOT_FILE, keys, title="polyrl rl")
        records = read_metrics(metrics_file)

        def series(key: str) -> list[float]:
            return [r[key] for r in records if r.get(key) is not None]

        val_acc = series(f"val/acc/mean@{k}")
        scores = series("critic/score/mean")
        summary = {
            "steps": step,
            "resumed_from": resume_from,
            "first_val_acc": val_acc[0] if val_acc else None,
            "last_val_acc": val_acc[-1] if val_acc else None,
            "first_score": scores[0] if scores else None,
            "last_score": scores[-1] if scores else None,
            "checkpoint": last_ckpt,
            "hf_model": hf_dir,
            "metrics": str(metrics_file),
            "plot": str(plot) if plot else None,
            "elapsed_s": round(time.perf_counter() - started, 2),
        }
        (self.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        _log("done: " + " ".join(f"{k}={v}" for k, v in summary.items()))
        return summary

    def export_hf(self, directory: str | Path) -> str:
        """Write the actor as a Hugging Face model directory (call before the run closes)."""
        return self.actor.export_hf(str(directory))[0]

    def close(self) -> None:
        """Stop the worker groups, the rollout client and replicas, and the reward workers."""
        for group in self._groups:
            with contextlib.suppress(Exception):
                if group.is_alive:
                    group.shutdown()
            if group.backend == "ray":
                # The trainer made these pools: give their reservations back to the cluster.
                with contextlib.suppress(Exception):
                    group.pool.release()
        self._groups.clear()
        if self._client is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._run(self._client.close())
            self._client = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        while self._closers:
            closer = self._closers.pop()
            with contextlib.suppress(Exception):
                closer()


def run_rl(cfg: PolyRLConfig, **kwargs: Any) -> dict[str, Any]:
    """Run RL training for ``cfg`` (see :class:`RLTrainer` for ``kwargs``); returns the summary."""
    return RLTrainer(cfg, **kwargs).fit()
