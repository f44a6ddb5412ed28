"""The settings of an RL run that the config leaves to ``auto``, resolved once.

:func:`resolve_settings` decides each of them when the run starts, from the config and the
machine (whether CUDA is available), into a frozen :class:`RunSettings`; the trainer and its
builders (:mod:`~polyrl.trainer.rl.build`, the replicas of
:mod:`~polyrl.trainer.rl.generation`) read that record instead of deciding again.
:func:`resolved_config` is the config with those values written in: the run directory's
``rl_config.yaml`` (:func:`save_rl_config`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from polyrl.config import PolyRLConfig
from polyrl.trainer.common import compute_dtype, save_run_config, training_device

__all__ = [
    "RunSettings",
    "resolve_settings",
    "resolved_config",
    "save_rl_config",
    "settings_for",
]


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What an RL run decided for the options left to ``auto``, and the step's shape.

    Attributes:
        training_device: where the engines train, ``cuda`` or ``cpu`` (``trainer.device``;
            auto: CUDA when available).
        compute_dtype: the engines' compute dtype (``model.compute_dtype``; auto: bfloat16 on
            CUDA, ``model.dtype`` on CPU).
        rollout_device: where the replicas serve (``rollout.device``; auto follows the engines).
        placement: ``hybrid`` or ``separate`` (``rollout.placement``; auto: hybrid on CUDA).
        rollout_dtype: the replicas' weights dtype (``rollout.dtype``; auto: bfloat16 on CUDA,
            ``model.dtype`` on CPU); also the dtype of the weights on the wire.
        matmul_dtype: the native replicas' projection-matmul dtype (``rollout.matmul_dtype``;
            auto: the engines' compute dtype, so rollout and training round their matmuls
            alike).
        gpus_per_replica: GPUs one replica holds (``rollout.gpus_per_replica``; 0 means the
            tensor parallel size; 0 on CPU).
        replicas: how many replicas the trainer starts (``rollout.replicas``; 0: in hybrid
            placement on GPUs one per ``gpus_per_replica`` training GPUs, else one).
        sleeps_during_training: whether the replicas free their memory while the engines train
            (``rollout.sleep_during_training``; always in hybrid placement).
        transfer_backend: the transfer queue's backend (``transfer.backend``; auto follows
            ``trainer.worker_backend``).
        reward_model_device: the reward model's device (``reward.model_device``; auto: CUDA
            when available).
        use_critic: the estimator trains a critic (``gae``).
        use_prm: PRIME's implicit process reward model is trained.
        use_ref: a reference model is needed (a KL term, PRIME, or a distillation teacher).
        num_mini_batches: actor updates per pass over a step's batch
            (``data.train_batch_size / actor.ppo_mini_batch_size``).
        prm_mini_batches: PRM updates per pass (``prime.mini_batch_size``).
        need_old_log_probs: old log-probs differ from the update's own (more than one update
            per step, or the KL penalty in the reward needs them).
        off_policy: the rollout's weights lag the actor's and a correction applies
            (``trainer.mode`` other than sync, ``async_rl.correction`` other than none).
    """

    training_device: str
    compute_dtype: str
    rollout_device: str
    placement: str
    rollout_dtype: str
    matmul_dtype: str
    gpus_per_replica: int
    replicas: int
    sleeps_during_training: bool
    transfer_backend: str
    reward_model_device: str
    use_critic: bool
    use_prm: bool
    use_ref: bool
    num_mini_batches: int
    prm_mini_batches: int
    need_old_log_probs: bool
    off_policy: bool

    @property
    def trains_on_gpu(self) -> bool:
        """Whether the training engines run on CUDA."""
        return self.training_device == "cuda"

    @property
    def shares_gpu(self) -> bool:
        """Hybrid placement on GPUs: engines and replicas take turns with the GPU memory."""
        return self.placement == "hybrid" and self.trains_on_gpu


def resolve_settings(cfg: PolyRLConfig) -> RunSettings:
    """Decide every ``auto`` of ``cfg`` for this machine (see :class:`RunSettings`).

    Nothing is checked here (:func:`~polyrl.trainer.rl.checks.check_config` does that): a
    config that names ``cuda`` resolves as it says on any machine.
    """
    import torch

    ro, algo = cfg.rollout, cfg.algorithm
    training = training_device(cfg)
    compute = compute_dtype(cfg, training)
    rollout = training if ro.device == "auto" else ro.device
    placement = ro.placement
    if placement == "auto":
        placement = "hybrid" if rollout == "cuda" else "separate"
    per = (ro.gpus_per_replica or ro.tensor_parallel_size) if rollout == "cuda" else 0
    replicas = ro.replicas
    if not replicas:
        replicas = max(1, cfg.trainer.world_size // per) if placement == "hybrid" and per else 1
    transfer = cfg.transfer.backend
    if transfer == "auto":
        transfer = "ray" if cfg.trainer.worker_backend == "ray" else "local"
    reward_device = cfg.reward.model_device
    if reward_device == "auto":
        reward_device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, mini, prm_mini = (
        cfg.data.train_batch_size,
        cfg.actor.ppo_mini_batch_size,
        cfg.prime.mini_batch_size,
    )
    minis = batch // mini if mini else 1
    use_prm = algo.adv_estimator == "prime"
    distill = algo.distill_coef > 0  # the reverse KL to the teacher needs the old log-probs
    # The teacher is the reference role, unless a rollout server scores for it.
    teacher_role = distill and algo.teacher_source == "engine"
    return RunSettings(
        training_device=training,
        compute_dtype=compute,
        rollout_device=rollout,
        placement=placement,
        rollout_dtype=ro.dtype if ro.dtype != "auto" else _serving_dtype(cfg, rollout),
        matmul_dtype=ro.matmul_dtype if ro.matmul_dtype != "auto" else compute,
        gpus_per_replica=per,
        replicas=replicas,
        sleeps_during_training=ro.sleep_during_training or placement == "hybrid",
        transfer_backend=transfer,
        reward_model_device=reward_device,
        use_critic=algo.adv_estimator == "gae",
        use_prm=use_prm,
        use_ref=algo.use_kl_in_reward or cfg.actor.use_kl_loss or use_prm or teacher_role,
        num_mini_batches=minis,
        prm_mini_batches=batch // prm_mini if prm_mini else 1,
        # Old log-probs equal the current ones when each step makes exactly one optimizer
        # update; they are only computed when the update is off-policy or the KL penalty needs
        # them (the loss then takes the detached current log-probs, ratio 1).
        need_old_log_probs=cfg.actor.ppo_epochs > 1
        or minis > 1
        or algo.use_kl_in_reward
        or distill,
        # Off the sync mode the rollout's weights lag the actor's: the rollout's log-probs weigh
        # the tokens towards the proximal policy, the actor before this step's update. With one
        # update per step its log-probs are the update's own detached forward, so decoupled PPO
        # needs no extra pass then, like the on-policy case above (and equals tis).
        off_policy=cfg.trainer.mode != "sync" and cfg.async_rl.correction != "none",
    )


def settings_for(cfg: PolyRLConfig, settings: RunSettings | None = None) -> RunSettings:
    """Return ``settings``, or ``cfg``'s resolved when ``None`` (a caller outside a run)."""
    return settings if settings is not None else resolve_settings(cfg)


def _serving_dtype(cfg: PolyRLConfig, rollout_device: str) -> str:
    return "bfloat16" if rollout_device == "cuda" else cfg.model.dtype


def resolved_config(
    cfg: PolyRLConfig, settings: RunSettings, transport: str | None = None
) -> PolyRLConfig:
    """Return ``cfg`` with every option :class:`RunSettings` resolved written in.

    ``transport`` is the weight transport the run chose once its servers ran (``auto`` stays
    until then). ``rollout.matmul_dtype`` is written for the native backend only, the one it
    applies to.
    """
    ro = cfg.rollout
    rollout = dataclasses.replace(
        ro,
        device=settings.rollout_device,
        placement=settings.placement,
        dtype=settings.rollout_dtype,
        matmul_dtype=settings.matmul_dtype if ro.backend == "native" else ro.matmul_dtype,
        gpus_per_replica=settings.gpus_per_replica or ro.gpus_per_replica,
        replicas=settings.replicas,
        sleep_during_training=settings.sleeps_during_training,
        weight_transport=transport or ro.weight_transport,
    )
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, device=settings.training_device),
        model=dataclasses.replace(cfg.model, compute_dtype=settings.compute_dtype),
        rollout=rollout,
        transfer=dataclasses.replace(cfg.transfer, backend=settings.transfer_backend),
        reward=dataclasses.replace(cfg.reward, model_device=settings.reward_model_device),
    )


def save_rl_config(
    cfg: PolyRLConfig,
    settings: RunSettings,
    path: str | os.PathLike[str],
    transport: str | None = None,
) -> Path:
    """Write the run's ``rl_config.yaml``: ``cfg`` with its resolved settings, noted in a header."""
    return save_run_config(cfg, resolved_config(cfg, settings, transport), path)
