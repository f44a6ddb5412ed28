"""Wiring of an RL run: load data, start replicas, engines and the queue.

Every function here runs once, at :meth:`~polyrl.trainer.rl.loop.RLTrainer.setup`, from the
run's resolved settings (:mod:`polyrl.trainer.rl.settings`; the config's checks are in
:mod:`polyrl.trainer.rl.checks`); the step itself lives in :mod:`polyrl.trainer.rl.loop`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.config.schema import constructor_kwargs
from polyrl.trainer.common import data_files, ray_init_options
from polyrl.trainer.rl.settings import RunSettings, resolve_settings, settings_for

if TYPE_CHECKING:
    from polyrl.controller import RoleView
    from polyrl.workers.handles import EngineHandles

__all__ = [
    "RolloutServers",
    "choose_transport",
    "engine_pool",
    "engine_specs",
    "gpus_per_replica",
    "hybrid_senders",
    "load_datasets",
    "local_replica_gpus",
    "replica_count",
    "replica_env",
    "replica_options",
    "replica_processes",
    "replica_supervisor",
    "rollout_device",
    "rollout_dtype",
    "rollout_matmul_dtype",
    "rollout_placement",
    "run_api_key",
    "sleeps_during_training",
    "start_engines",
    "start_ray_replicas",
    "start_replicas",
    "start_transfer_queue",
    "trains_on_gpu",
    "visible_gpus",
    "weight_transport",
]


# Each of these reads one field of the run's settings (see RunSettings for what auto means).
def trains_on_gpu(cfg: PolyRLConfig) -> bool:
    """Whether the training engines run on CUDA (``trainer.device``, auto when available)."""
    return resolve_settings(cfg).trains_on_gpu


def rollout_device(cfg: PolyRLConfig) -> str:
    """Where the replicas serve (``rollout.device``; auto follows the training engines)."""
    return resolve_settings(cfg).rollout_device


def rollout_placement(cfg: PolyRLConfig) -> str:
    """``hybrid`` or ``separate`` (``rollout.placement``; auto is hybrid on CUDA)."""
    return resolve_settings(cfg).placement


def rollout_dtype(cfg: PolyRLConfig) -> str:
    """Return the replicas' weights dtype (``rollout.dtype``; auto: bf16 on CUDA, else model's)."""
    return resolve_settings(cfg).rollout_dtype


def gpus_per_replica(cfg: PolyRLConfig) -> int:
    """GPUs one replica holds (0 on CPU)."""
    return resolve_settings(cfg).gpus_per_replica


def replica_count(cfg: PolyRLConfig) -> int:
    """How many replicas the trainer starts (``rollout.replicas``; 0 = auto).

    Auto: in hybrid placement on GPUs, one replica per ``gpus_per_replica`` of the training
    GPUs (every training GPU also serves), else one.
    """
    return resolve_settings(cfg).replicas


def sleeps_during_training(cfg: PolyRLConfig) -> bool:
    """Whether the replicas free their memory while the engines train (always in hybrid)."""
    return resolve_settings(cfg).sleeps_during_training


def rollout_matmul_dtype(cfg: PolyRLConfig) -> str:
    """Return the native replicas' projection-matmul dtype (``rollout.matmul_dtype``).

    ``auto`` is the training engines' compute dtype (``model.compute_dtype``, whose own auto is
    bfloat16 on CUDA and ``model.dtype`` on CPU), so rollout and training round their matmuls
    alike.
    """
    return resolve_settings(cfg).matmul_dtype


def _vision_freeze(model: Any, path: str) -> dict[str, bool]:
    """Return ``freeze_vision_tower`` for another role's model at ``path``.

    The policy's setting when that model has a vision tower too, else off: a text-only critic,
    reward model or teacher has none to freeze (and its engine would refuse the option).
    """
    from polyrl.models.processor import is_vision_model

    return {"freeze_vision_tower": bool(model.freeze_vision_tower) and is_vision_model(path)}


def vision_processor(cfg: PolyRLConfig, model_dir: Any, tokenizer: Any = None) -> Any:
    """Return the model's :class:`~polyrl.models.processor.VisionProcessor` (``None``: text).

    ``data.image_min_pixels`` / ``data.image_max_pixels`` (0: the model's own) bound the
    resized image area, so the number of image tokens.
    """
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(
        model_dir,
        tokenizer=tokenizer,
        min_pixels=cfg.data.image_min_pixels or None,
        max_pixels=cfg.data.image_max_pixels or None,
    )


def load_datasets(
    cfg: PolyRLConfig,
    tokenizer: Any,
    out_dir: Path,
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    val_rows: Sequence[Mapping[str, Any]] | None = None,
    custom_reward: bool = False,
    processor: Any = None,
) -> tuple[Any, Any]:
    """Return the training and validation prompt datasets (validation may be ``None``).

    Rows given directly win; otherwise ``data.task`` is generated into ``data.data_dir`` (or
    ``out_dir/data``), else ``data.train_files`` / ``data.val_files`` are read. With
    ``custom_reward`` (a user function scores every row) a row needs only its prompt. With a
    vision model's ``processor`` (:func:`vision_processor`) rows' images are processed at load.
    """
    from polyrl.data.dataset import RLDataset

    data = cfg.data
    kwargs = {
        "processor": processor,
        "image_key": data.image_key,
        "video_key": data.video_key,
        "max_prompt_length": data.max_prompt_length,
        "prompt_key": data.prompt_key,
        "truncation": data.truncation,
        "require_reward_fields": not custom_reward,
        "template_string_prompts": data.template_string_prompts,
        "apply_chat_template_kwargs": data.apply_chat_template_kwargs,
    }
    if train_rows is not None:
        train = RLDataset(list(train_rows), tokenizer, **kwargs)
        val = RLDataset(list(val_rows), tokenizer, **kwargs) if val_rows else None
        return train, val
    train_files, val_files = data_files(cfg, out_dir)
    train = RLDataset(train_files, tokenizer, **kwargs)
    val = RLDataset(val_files, tokenizer, **kwargs) if val_files else None
    return train, val


def replica_options(cfg: PolyRLConfig, settings: RunSettings | None = None) -> dict[str, Any]:
    """Return the rollout backend's options for the replicas the trainer starts.

    ``rollout.*`` maps onto the backend's options dataclass by field name, so an option is
    declared once there and once in the config (tensor parallel size, GPU memory share, enforce
    eager, prefix caching, ...); the values resolved from ``auto`` or from other groups
    (device, dtype, seed, thread count, matmul dtype, model length, sleep mode, vLLM's pixel
    bounds) are set here.
    Unset (``None``) options are left to the backend's defaults.
    """
    from polyrl.rollout.base import backend_options_class

    ro, run = cfg.rollout, settings_for(cfg, settings)
    options_class = backend_options_class(ro.backend)
    matmul, dtype, on_cuda = run.matmul_dtype, run.rollout_dtype, run.rollout_device == "cuda"
    computed = {
        "dtype": dtype,
        "device": run.rollout_device,
        "seed": cfg.seed_for("rollout"),
        "num_threads": ro.num_threads or None,  # 0: the launcher's share of the cores
        "matmul_dtype": matmul if matmul != dtype else None,
        "max_model_len": ro.max_model_len or None,  # 0: the model's own limit
        "enable_sleep_mode": run.sleeps_during_training,
        # SGLang keeps its weights on the GPU through a level-1 sleep unless it may back them
        # up on the host; hybrid placement needs that memory for training.
        "weights_cpu_backup": run.sleeps_during_training and on_cuda,
        # CUDA graphs are a GPU matter: on CPU the backend keeps its own default (eager).
        "enforce_eager": ro.enforce_eager if on_cuda else None,
        # vLLM's image processor runs with the trainer's pixel bounds (its token-in route
        # takes none per request); the native server is sent them with each prompt.
        "image_min_pixels": cfg.data.image_min_pixels or None,
        "image_max_pixels": cfg.data.image_max_pixels or None,
    }
    names = {f.name for f in dataclasses.fields(options_class)}
    options = constructor_kwargs(
        options_class, ro, **{k: v for k, v in computed.items() if k in names}
    )
    return {k: v for k, v in options.items() if v is not None}


def choose_transport(
    trainer_device: str, rollout_device: str, same_host: bool, same_gpu: bool = False
) -> tuple[str, dict[str, Any]]:
    """Return the weight transport (name, options) that suits where trainer and replicas run.

    CUDA IPC when each replica shares a GPU with an engine rank (hybrid placement: that rank
    sends to it, on whichever node they are); NCCL broadcast (``dist``) when both run on GPUs
    otherwise; shared memory when they share a host; a gloo broadcast between hosts. Never
    NCCL with a replica on an engine rank's GPU: one communicator cannot hold two ranks on one
    GPU. The devices are ``"cpu"`` or ``"cuda"``.
    """
    for what, device in (("trainer", trainer_device), ("rollout", rollout_device)):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{what} device must be 'cpu' or 'cuda', got {device!r}")
    on_gpus = trainer_device == rollout_device == "cuda"
    if on_gpus and same_gpu:
        return "cuda_ipc", {}
    if on_gpus:
        return "dist", {"backend": "nccl"}
    if same_host:
        return "shm", {}
    return "dist", {"backend": "gloo"}


@dataclasses.dataclass
class RolloutServers:
    """The rollout servers a run uses, and what the weight transport needs to know of them.

    Attributes:
        urls: the servers' URLs.
        api_key: the key they require (``None``: none).
        same_host: whether every server runs on the host of the sending engine rank.
        placement: ``hybrid`` or ``separate`` (external servers count as separate).
        group: the Ray worker group whose ranks run the servers (``None`` otherwise).
        processes: the servers' :class:`~polyrl.rollout.launcher.ServerProcess` children, when
            this process started them (in ``urls`` order).
        leaders: the ranks of ``group`` that run each server (in ``urls`` order).
        senders: hybrid placement: the engine rank that shares each server's GPU, which sends
            it the weights (in ``urls`` order; empty: rank 0 sends to every server).
        plans: the :class:`~polyrl.workers.rollout_replica.ReplicaPlan` of each server of
            ``group`` (in ``urls`` order), with which a dead rank's server starts again.
    """

    urls: list[str]
    api_key: str | None = None
    same_host: bool = True
    placement: str = "separate"
    group: Any = None
    processes: list[Any] = dataclasses.field(default_factory=list)
    leaders: list[int] = dataclasses.field(default_factory=list)
    senders: list[int] = dataclasses.field(default_factory=list)
    plans: list[Any] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        """Stop the servers of the Ray group and the group (before the engines' pools go)."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            if group.is_alive:
                group.stop_server()
        finally:
            group.shutdown()
            group.pool.release()  # nothing for a pool shared with the engines


def weight_transport(
    cfg: PolyRLConfig,
    servers: RolloutServers,
    trainer_host: str = "127.0.0.1",
    settings: RunSettings | None = None,
) -> tuple[str, dict[str, Any]]:
    """Resolve ``rollout.weight_transport`` for this run's placement (``auto`` chooses).

    A transport named explicitly is used as named (``dist`` over NCCL when both sides train
    and serve on GPUs in separate placement; over gloo in hybrid placement, where a replica
    shares a GPU with the sending rank and NCCL refuses two ranks on one GPU). ``dist``
    between hosts opens its rendezvous on ``trainer_host`` (the sending rank's address); the
    servers' API key travels with every transport.
    """
    run = settings_for(cfg, settings)
    trainer, rollout = run.training_device, run.rollout_device
    name = cfg.rollout.weight_transport
    options: dict[str, Any] = {}
    hybrid = servers.placement == "hybrid"
    if name == "auto":
        name, options = choose_transport(trainer, rollout, servers.same_host, same_gpu=hybrid)
    elif name == "dist" and trainer == rollout == "cuda":
        options = {"backend": "gloo" if hybrid else "nccl"}
    if name == "dist" and not servers.same_host:
        options["host"] = trainer_host
    if servers.api_key:
        options["api_key"] = servers.api_key
    return name, options


def visible_gpus() -> list[str]:
    """Return this process's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (all when unset)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [g.strip() for g in value.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def local_replica_gpus(
    placement: str, replicas: int, per_replica: int, engine_gpus: int, visible: Sequence[str]
) -> list[list[str]]:
    """Return the GPUs of each replica started as a subprocess on this machine.

    The engine ranks use the first ``engine_gpus`` of ``visible`` (rank ``i`` on GPU ``i``).
    Hybrid: replica ``i`` shares ``visible[i*g : (i+1)*g]`` with the ranks there; separate:
    replicas take the GPUs after the engines'. ``g`` is ``per_replica``; 0 means CPU replicas
    (no GPUs).

    Raises:
        ConfigError: the replicas do not fit on the GPUs.
    """
    if not per_replica:
        return [[] for _ in range(replicas)]
    need = replicas * per_replica
    if placement == "hybrid":
        first, room, where = 0, min(engine_gpus, len(visible)), "the trainer's"
    else:
        first, room, where = engine_gpus, len(visible) - engine_gpus, "spare"
    if need > room:
        raise ConfigError(
            f"{replicas} replica(s) x {per_replica} GPU(s) need {need} GPUs but only {room} of "
            f"this machine's {len(visible)} are {where} ({placement} placement); lower "
            "rollout.replicas or rollout.gpus_per_replica",
            key="rollout.replicas",
        )
    return [
        list(visible[first + i * per_replica : first + (i + 1) * per_replica])
        for i in range(replicas)
    ]


def replica_env(
    cfg: PolyRLConfig, gpus: Sequence[str], settings: RunSettings | None = None
) -> dict[str, str]:
    """Return the environment a replica on ``gpus`` runs with (besides the inherited one).

    Its ``CUDA_VISIBLE_DEVICES``; and, for the trainer's own CUDA replicas when the transport
    may be ``cuda_ipc``, the opt-in that lets them map the trainer's IPC handles (the servers
    only take requests from this run: loopback, or its API key).
    """
    from polyrl.weights.base import CUDA_IPC_ENV

    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}
    on_cuda = settings_for(cfg, settings).rollout_device == "cuda"
    if on_cuda and cfg.rollout.weight_transport in ("auto", "cuda_ipc"):
        env[CUDA_IPC_ENV] = "1"
    return env


def replica_processes(
    cfg: PolyRLConfig,
    model_dir: Path,
    visible: Sequence[str] | None = None,
    api_key: str | None = None,
    settings: RunSettings | None = None,
) -> list[Any]:
    """Return the replica subprocesses a run on one machine starts (not started yet).

    Each gets the backend options of :func:`replica_options`, ``api_key`` and, on GPUs, its
    own ``CUDA_VISIBLE_DEVICES`` (:func:`local_replica_gpus` over ``visible``, default
    :func:`visible_gpus`).
    """
    from polyrl.rollout.launcher import ServerProcess

    run = settings_for(cfg, settings)
    per = run.gpus_per_replica
    gpus = local_replica_gpus(
        run.placement,
        run.replicas,
        per,
        cfg.trainer.world_size,
        visible_gpus() if visible is None and per else (visible or []),
    )
    options = replica_options(cfg, run)
    return [
        ServerProcess(
            model_dir,
            backend=cfg.rollout.backend,
            api_key=api_key,
            options=options,
            env=replica_env(cfg, g, run),
        )
        for g in gpus
    ]


def _loopback(urls: Sequence[str]) -> bool:
    from urllib.parse import urlsplit

    from polyrl.core.http_guard import is_loopback

    return all(is_loopback(urlsplit(u).hostname or "") for u in urls)


def start_replicas(
    cfg: PolyRLConfig,
    model_dir: Path,
    closers: list[Callable[[], None]],
    engine_groups: Sequence[Any] = (),
    settings: RunSettings | None = None,
) -> RolloutServers:
    """Start the run's rollout servers (unless ``rollout.urls`` names running ones).

    With the ``ray`` worker backend the servers run on Ray actors placed by a resource pool
    (:func:`start_ray_replicas`); otherwise as subprocesses of this process
    (:func:`replica_processes`). Each started server's stop goes to ``closers``.
    """
    from polyrl.rollout.options import API_KEY_ENV

    ro = cfg.rollout
    if ro.urls:
        return RolloutServers(
            list(ro.urls), os.environ.get(API_KEY_ENV) or None, same_host=_loopback(ro.urls)
        )
    run = settings_for(cfg, settings)
    if cfg.trainer.worker_backend == "ray":
        return start_ray_replicas(cfg, model_dir, closers, engine_groups, run)
    from polyrl.rollout.launcher import start_processes

    # Even on loopback: another local process must not pause the replicas or push weights.
    api_key = run_api_key()
    processes = replica_processes(cfg, model_dir, api_key=api_key, settings=run)
    start_processes(processes)
    for process in processes:
        closers.append(process.stop)
    return RolloutServers(
        [str(p.url) for p in processes],
        api_key,
        placement=run.placement,
        processes=processes,
        senders=hybrid_senders(run.placement, len(processes), run.gpus_per_replica),
    )


def hybrid_senders(placement: str, replicas: int, per_replica: int) -> list[int]:
    """Return the engine rank that shares each local replica's GPU (hybrid on GPUs; else []).

    Replica ``i`` of :func:`local_replica_gpus` holds the GPUs of ranks ``i*per_replica`` on,
    and the first of them sends it the weights: the only rank whose CUDA IPC buffers it can
    open (it sees no other GPU).
    """
    if placement != "hybrid" or not per_replica:
        return []
    return [i * per_replica for i in range(replicas)]


def replica_supervisor(cfg: PolyRLConfig, servers: RolloutServers) -> Any:
    """Return the :class:`~polyrl.trainer.rl.supervisor.ReplicaSupervisor` of the run's replicas.

    ``None`` for servers the run did not start (``rollout.urls``).
    """
    from polyrl.trainer.rl.supervisor import LocalReplica, RayReplica, ReplicaSupervisor

    if servers.processes:
        handles: list[Any] = [LocalReplica(p) for p in servers.processes]
    elif servers.group is not None and servers.leaders:
        plans = servers.plans or [None] * len(servers.leaders)
        # A dead actor is a dead worker: recreated only by a run that recovers from those.
        recreate = cfg.trainer.max_restarts > 0
        handles = [
            RayReplica(servers.group, rank, url, plan, recreate=recreate)
            for rank, url, plan in zip(servers.leaders, servers.urls, plans, strict=True)
        ]
    else:
        return None
    ro = cfg.rollout
    return ReplicaSupervisor(handles, ro.restart_timeout_s, ro.max_replica_restarts)


def run_api_key() -> str:
    """Return a fresh key for the servers a run starts (they accept nothing without it)."""
    import secrets

    return secrets.token_urlsafe(24)


def start_ray_replicas(
    cfg: PolyRLConfig,
    model_dir: Path,
    closers: list[Callable[[], None]],
    engine_groups: Sequence[Any] = (),
    settings: RunSettings | None = None,
) -> RolloutServers:
    """Start the rollout servers on Ray actors of a :class:`RolloutReplicaWorker` group.

    Hybrid placement: one rank beside each rank of the first engine group, in the same bundles
    (:meth:`~polyrl.controller.ResourcePool.share`); separate: a pool of its own with one bundle
    of ``gpus_per_replica`` GPUs per replica. Servers bind their node's address and require a
    key made for this run.
    """
    from polyrl.controller import ResourcePool, WorkerGroup, WorkerSpec
    from polyrl.workers.rollout_replica import RolloutReplicaWorker, replica_plans

    run = settings_for(cfg, settings)
    placement, per, count = run.placement, run.gpus_per_replica, run.replicas
    if placement == "hybrid":
        if not engine_groups:
            raise ValueError("hybrid placement on Ray starts the replicas beside the engines")
        pool = engine_groups[0].pool.share("rl-rollout")
        ranks_per_replica = max(per, 1)
        if count * ranks_per_replica > pool.world_size:
            raise ConfigError(
                f"{count} replica(s) x {ranks_per_replica} GPU(s) exceed the {pool.world_size} "
                "training ranks they share in hybrid placement; lower rollout.replicas",
                key="rollout.replicas",
            )
    else:
        pool = ResourcePool(
            "rl-rollout",
            count,
            cpus_per_worker=1.0,
            gpus_per_worker=float(per),
            claim_device=False,
        )
        ranks_per_replica = 1
    api_key = run_api_key()
    spec = WorkerSpec(
        RolloutReplicaWorker,
        kwargs={
            "model_dir": str(model_dir),
            "backend": cfg.rollout.backend,
            "options": replica_options(cfg, run),
            "api_key": api_key,
            "env": replica_env(cfg, [], run),
        },
    )
    group = WorkerGroup(spec, pool=pool, backend="ray", name="rl-rollout", init_distributed=False)
    plans = replica_plans(group.placement(), ranks_per_replica)[:count]
    trainer_node = engine_groups[0].worker_info[0].node_id if engine_groups else None
    same_host = trainer_node is not None and all(p.node_id == trainer_node for p in plans)
    servers = RolloutServers([], api_key, same_host, placement, group)
    closers.append(servers.close)  # also called by the trainer before the engines stop
    started = group.start_server(plans)
    servers.leaders = [rank for rank, url in enumerate(started) if url is not None]
    servers.urls = [started[rank] for rank in servers.leaders]
    by_leader = {p.leader: p for p in plans}
    servers.plans = [by_leader[rank] for rank in servers.leaders]
    if placement == "hybrid" and per:
        # Rollout rank r runs in the bundle of engine rank r (the pool is shared), on its GPU.
        servers.senders = list(servers.leaders)
    return servers


def engine_specs(
    cfg: PolyRLConfig,
    model_dir: Path,
    total_steps: int,
    use_ref: bool,
    use_critic: bool,
    use_prm: bool = False,
    settings: RunSettings | None = None,
) -> dict[str, Any]:
    """Return the worker specs of the actor, and of the reference, critic and PRM when used.

    The PRM (PRIME's implicit process reward model, role ``prm``) is a causal LM started from
    ``prime.model_path`` or the policy model, with the ``prime`` group's optimizer options and
    the actor's engine options (micro-batching, precision) but its own gradient clip.

    With LoRA (``model.lora_rank > 0``) there is no reference spec: the reference is the actor's
    frozen base model, which the actor computes with its adapter disabled. With on-policy
    distillation (``algorithm.distill_coef > 0``, ``teacher_source=engine``) the reference is
    the teacher, ``algorithm.teacher_model_path``, LoRA or not.  The critic and the
    PRM train every weight of their own models (LoRA applies to the policy only).
    """
    from polyrl.controller import WorkerSpec
    from polyrl.model_engine import (
        CheckpointConfig,
        EngineConfig,
        MixedPrecisionConfig,
        ModelSpec,
        OptimizerConfig,
        ParallelismConfig,
    )
    from polyrl.workers.engine import EngineWorker

    # Each config section maps onto the constructor it configures by field name
    # (constructor_kwargs); only what the config spells differently is named here.
    actor, critic, run = cfg.actor, cfg.critic, settings_for(cfg, settings)
    model = ModelSpec(**constructor_kwargs(ModelSpec, cfg.model, path=str(model_dir)))
    engine = EngineConfig(
        **constructor_kwargs(
            EngineConfig,
            actor,
            actor.optim,
            device=run.training_device,
            dynamic_batching=True,
            mixed_precision=MixedPrecisionConfig(param_dtype=run.compute_dtype),
            # The reference shares the actor's engine config, so its mesh too: the fsdp2 sizes
            # (actor.tensor_parallel_size ...) or Megatron's (actor.megatron.*, verl's names).
            parallelism=ParallelismConfig(
                **constructor_kwargs(
                    ParallelismConfig,
                    actor.megatron if actor.engine_backend == "megatron" else actor,
                )
            ),
            seed=cfg.seed,
        )
    )
    # Only the actor prunes its own checkpoints: the critic and the PRM save before it, and
    # pruning there would drop the step the actor's newest complete checkpoint (the one a
    # crash mid-save resumes from) still needs. RLTrainer.save prunes them after the actor.
    actor_ckpt = CheckpointConfig(max_to_keep=cfg.trainer.max_ckpt_to_keep)
    side_ckpt = CheckpointConfig(max_to_keep=0)

    def trained(role: str, spec: Any, engine_cfg: Any, section: Any) -> Any:
        """Spec a trained role; its optimizer options come from its config ``section.optim``."""
        ckpt = actor_ckpt if role == "actor" else side_ckpt
        optimizer = OptimizerConfig(
            **constructor_kwargs(OptimizerConfig, section.optim, total_steps=max(total_steps, 1))
        )
        kwargs = {"role": role, "model": spec, "engine": engine_cfg, "optimizer": optimizer}
        return WorkerSpec(EngineWorker, kwargs={**kwargs, "checkpoint": ckpt})

    specs: dict[str, Any] = {"actor": trained("actor", model, engine, actor)}
    algo = cfg.algorithm
    engine_teacher = algo.distill_coef > 0 and algo.teacher_source == "engine"
    teacher = algo.teacher_model_path if engine_teacher else ""
    if use_ref and (teacher or not model.lora_rank):
        # On-policy distillation: the reference role is the teacher, a model of its own (with
        # LoRA too, where the reference is otherwise the actor's base).
        ref_model = (
            dataclasses.replace(model, path=teacher, lora_rank=0, **_vision_freeze(model, teacher))
            if teacher
            else model
        )
        specs["ref"] = WorkerSpec(
            EngineWorker, kwargs={"role": "reference", "model": ref_model, "engine": engine}
        )
    if use_critic:
        critic_path = critic.model_path or str(model_dir)
        critic_model = dataclasses.replace(
            model,
            path=critic_path,
            kind="value",
            lora_rank=0,
            **_vision_freeze(model, critic_path),
        )
        critic_engine = dataclasses.replace(
            engine,
            **constructor_kwargs(
                EngineConfig,
                critic.optim,
                parallelism=ParallelismConfig(**constructor_kwargs(ParallelismConfig, critic)),
            ),
        )
        specs["critic"] = trained("critic", critic_model, critic_engine, critic)
    if use_prm:
        prime = cfg.prime
        prm_path = prime.model_path or str(model_dir)
        prm_model = dataclasses.replace(
            model, path=prm_path, lora_rank=0, **_vision_freeze(model, prm_path)
        )
        prm_engine = dataclasses.replace(engine, **constructor_kwargs(EngineConfig, prime.optim))
        specs["prm"] = trained("prm", prm_model, prm_engine, prime)
    return specs


def engine_pool(
    cfg: PolyRLConfig,
    name: str,
    groups: int = 1,
    first: bool = True,
    settings: RunSettings | None = None,
) -> Any:
    """Return the resource pool of one engine worker group (``groups`` of them in the run).

    On CUDA every rank gets a GPU of its own, with the Ray backend and the local one alike (a
    local rank then picks ``cuda:<local rank>`` and its group runs NCCL for CUDA tensors);
    on CPU, Ray's separate groups each ask for a fraction of a core, so a two-core machine can
    still place actor, reference and critic. In hybrid placement on Ray the ``first`` group
    leaves room in its bundles for the replicas that run beside it.
    """
    from polyrl.controller import ResourcePool

    run = settings_for(cfg, settings)
    use_gpu = run.trains_on_gpu
    on_ray = cfg.trainer.worker_backend == "ray"
    shared = on_ray and not cfg.rollout.urls and run.placement == "hybrid"
    return ResourcePool(
        name,
        cfg.trainer.world_size,
        cpus_per_worker=1.0 if use_gpu or not on_ray else 1.0 / groups,
        gpus_per_worker=1.0 if use_gpu else 0.0,
        max_colocate_count=2 if shared and first else 1,
    )


def start_engines(
    cfg: PolyRLConfig,
    specs: Mapping[str, Any],
    closers: list[Callable[[], None]],
    settings: RunSettings | None = None,
) -> tuple[EngineHandles, list[Any]]:
    """Start the engine worker groups; return the roles' typed handles and the groups.

    ``trainer.placement=colocated`` puts every role in one group (one process per rank),
    ``separate`` gives each its own. Ray is started here when the run needs it (and its
    shutdown appended to ``closers``).
    """
    from polyrl.controller import WorkerGroup
    from polyrl.workers.handles import EngineHandles

    world = cfg.trainer.world_size
    backend = cfg.trainer.worker_backend
    run = settings_for(cfg, settings)
    use_gpu = run.trains_on_gpu
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            options = ray_init_options(cfg)
            if not use_gpu and options.get("address") == "local" and "num_cpus" not in options:
                # On one CPU host the engines and the replica servers share the cores as they
                # do without Ray; give Ray a CPU slot for each replica besides the engines'.
                options["num_cpus"] = max(os.cpu_count() or 1, world + run.replicas)
            if not sys.stdout.isatty():
                # The workers' lines Ray echoes here land in a file: without colour codes.
                os.environ.setdefault("RAY_COLOR_PREFIX", "0")
            ray.init(**options)
            closers.append(ray.shutdown)
    layouts = (
        [specs] if cfg.trainer.placement == "colocated" else [{k: v} for k, v in specs.items()]
    )
    views: dict[str, RoleView] = {}
    groups: list[Any] = []
    for layout in layouts:
        name = "+".join(layout)
        pool = engine_pool(cfg, f"rl-{name}", len(layouts), first=not groups, settings=run)
        group = WorkerGroup(
            layout,
            pool=pool,
            backend=backend,
            name=f"rl-{name}",
            call_timeout_s=cfg.trainer.call_timeout_s or None,
        )
        groups.append(group)
        for role in layout:
            views[role] = group.role(role)
    return EngineHandles.of(views), groups


def start_transfer_queue(
    cfg: PolyRLConfig, closers: list[Callable[[], None]], settings: RunSettings | None = None
) -> tuple[Any, str]:
    """Start the transfer queue (``transfer.backend``; auto follows the worker backend).

    Returns the queue client and the backend it runs on; its close goes to ``closers``.
    """
    from polyrl.transfer import make_transfer_queue

    backend = settings_for(cfg, settings).transfer_backend
    options = {"num_storage_units": cfg.transfer.num_storage_units} if backend == "ray" else {}
    queue = make_transfer_queue(backend, **options)
    closers.append(queue.close)
    return queue, backend
