"""Wiring of an RL run: check the config, load data, start replicas, engines and the queue.

Every function here runs once, at :meth:`~polyrl.trainer.rl.loop.RLTrainer.setup`; the step
itself lives in :mod:`polyrl.trainer.rl.loop`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.config.schema import constructor_kwargs
from polyrl.core.dtypes import dtype_name
from polyrl.trainer.rl.rollout import response_cap

__all__ = [
    "check_config",
    "choose_transport",
    "engine_specs",
    "load_datasets",
    "replica_options",
    "rollout_matmul_dtype",
    "start_engines",
    "start_replicas",
    "start_transfer_queue",
    "trains_on_gpu",
    "weight_transport",
]


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
    return dtype_name(compute)


def check_config(cfg: PolyRLConfig, has_rows: bool = False) -> None:
    """Refuse settings that cannot run together, naming the option to change."""
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


def load_datasets(
    cfg: PolyRLConfig,
    tokenizer: Any,
    out_dir: Path,
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    val_rows: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[Any, Any]:
    """Return the training and validation prompt datasets (validation may be ``None``).

    Rows given directly win; otherwise ``data.task`` is generated into ``data.data_dir`` (or
    ``out_dir/data``), else ``data.train_files`` / ``data.val_files`` are read.
    """
    from polyrl.data.dataset import RLDataset

    data = cfg.data
    kwargs = {
        "max_prompt_length": data.max_prompt_length,
        "prompt_key": data.prompt_key,
        "truncation": data.truncation,
    }
    if train_rows is not None:
        train = RLDataset(list(train_rows), tokenizer, **kwargs)
        val = RLDataset(list(val_rows), tokenizer, **kwargs) if val_rows else None
        return train, val
    from polyrl.trainer.sft import data_files

    train_files, val_files = data_files(cfg, out_dir)
    train = RLDataset(train_files, tokenizer, **kwargs)
    val = RLDataset(val_files, tokenizer, **kwargs) if val_files else None
    return train, val


def replica_options(cfg: PolyRLConfig) -> dict[str, Any]:
    """Return the rollout backend's options for the replicas the trainer starts.

    ``rollout.*`` maps onto the backend's options dataclass by field name, so an option is
    declared once there and once in the config; the values computed from other groups
    (dtype, seed, thread count, matmul dtype) are set here. Unset (``None``) options are left
    to the backend's defaults.
    """
    from polyrl.rollout.base import backend_options_class

    ro = cfg.rollout
    options_class = backend_options_class(ro.backend)
    matmul = rollout_matmul_dtype(cfg)
    computed = {
        "dtype": cfg.model.dtype,
        "seed": cfg.seed_for("rollout"),
        "num_threads": ro.num_threads or None,  # 0: the launcher's share of the cores
        "matmul_dtype": matmul if matmul != cfg.model.dtype else None,
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

    CUDA IPC when a replica shares the trainer's GPU; NCCL broadcast (``dist``) when both run
    on GPUs otherwise; shared memory when they share a host; a gloo broadcast between hosts.
    The devices are ``"cpu"`` or ``"cuda"``.
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


def weight_transport(cfg: PolyRLConfig, urls: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """Resolve ``rollout.weight_transport`` for this run's placement (``auto`` chooses).

    The replicas share the trainer's host when their URLs are loopback addresses and the
    engines are local processes or Ray runs on one node. A transport named explicitly is
    used as named (``dist`` over NCCL when both sides train and serve on GPUs).
    """
    from urllib.parse import urlsplit

    trainer = "cuda" if trains_on_gpu(cfg) else "cpu"
    rollout = "cpu"  # the launched replicas serve on the CPU (rollout.device is issue 22)
    loopback = all(urlsplit(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls)
    one_node = True
    if cfg.trainer.worker_backend == "ray":
        import ray

        one_node = not ray.is_initialized() or len([n for n in ray.nodes() if n["Alive"]]) <= 1
    name = cfg.rollout.weight_transport
    if name == "auto":
        return choose_transport(trainer, rollout, same_host=loopback and one_node)
    if name == "dist" and trainer == rollout == "cuda":
        return name, {"backend": "nccl"}
    return name, {}


def start_replicas(
    cfg: PolyRLConfig, model_dir: Path, closers: list[Callable[[], None]]
) -> list[str]:
    """Start ``rollout.replicas`` rollout servers (unless ``rollout.urls`` names running ones).

    Returns their URLs; each started server's stop is appended to ``closers``.
    """
    from polyrl.rollout.launcher import start_replicas as launch

    ro = cfg.rollout
    if ro.urls:
        return list(ro.urls)
    replicas = launch(model_dir, ro.replicas, backend=ro.backend, options=replica_options(cfg))
    for replica in replicas:
        closers.append(replica.stop)
    return [str(r.url) for r in replicas]


def engine_specs(
    cfg: PolyRLConfig, model_dir: Path, total_steps: int, use_ref: bool, use_critic: bool
) -> dict[str, Any]:
    """Return the worker specs of the actor, and of the reference and critic when used."""
    from polyrl.controller import WorkerSpec
    from polyrl.model_engine import (
        CheckpointConfig,
        EngineConfig,
        MixedPrecisionConfig,
        ModelSpec,
        OptimizerConfig,
    )
    from polyrl.workers.engine import EngineWorker

    # Each config section maps onto the constructor it configures by field name
    # (constructor_kwargs); only what the config spells differently is named here.
    actor, critic = cfg.actor, cfg.critic
    model = ModelSpec(**constructor_kwargs(ModelSpec, cfg.model, path=str(model_dir)))
    engine = EngineConfig(
        **constructor_kwargs(
            EngineConfig,
            actor,
            device=cfg.trainer.device,
            dynamic_batching=True,
            mixed_precision=MixedPrecisionConfig(param_dtype=cfg.model.compute_dtype),
            seed=cfg.seed,
        )
    )
    ckpt = CheckpointConfig(max_to_keep=cfg.trainer.max_ckpt_to_keep)
    specs: dict[str, Any] = {
        "actor": WorkerSpec(
            EngineWorker,
            kwargs={
                "role": "actor",
                "model": model,
                "engine": engine,
                "optimizer": OptimizerConfig(
                    **constructor_kwargs(
                        OptimizerConfig,
                        actor,
                        name=actor.optimizer,
                        scheduler=actor.lr_scheduler,
                        total_steps=max(total_steps, 1),
                    )
                ),
                "checkpoint": ckpt,
            },
        )
    }
    if use_ref:
        specs["ref"] = WorkerSpec(
            EngineWorker, kwargs={"role": "reference", "model": model, "engine": engine}
        )
    if use_critic:
        critic_model = dataclasses.replace(
            model, path=critic.model_path or str(model_dir), kind="value"
        )
        specs["critic"] = WorkerSpec(
            EngineWorker,
            kwargs={
                "role": "critic",
                "model": critic_model,
                "engine": dataclasses.replace(engine, **constructor_kwargs(EngineConfig, critic)),
                "optimizer": OptimizerConfig(
                    **constructor_kwargs(
                        OptimizerConfig,
                        critic,
                        name=critic.optimizer,
                        total_steps=max(total_steps, 1),
                    )
                ),
                "checkpoint": ckpt,
            },
        )
    return specs


def start_engines(
    cfg: PolyRLConfig, specs: Mapping[str, Any], closers: list[Callable[[], None]]
) -> tuple[dict[str, Any], list[Any]]:
    """Start the engine worker groups; return each role's view and the groups.

    ``trainer.placement=colocated`` puts every role in one group (one process per rank),
    ``separate`` gives each its own. Ray is started here when the run needs it (and its
    shutdown appended to ``closers``).
    """
    from polyrl.controller import ResourcePool, WorkerGroup

    world = cfg.trainer.world_size
    backend = cfg.trainer.worker_backend
    use_gpu = trains_on_gpu(cfg)
    if backend == "ray":
        import ray

        if not ray.is_initialized():
            from polyrl.trainer.sft import ray_init_options

            ray.init(**ray_init_options(cfg))
            closers.append(ray.shutdown)
    layouts = (
        [specs] if cfg.trainer.placement == "colocated" else [{k: v} for k, v in specs.items()]
    )
    views: dict[str, Any] = {}
    groups: list[Any] = []
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
        groups.append(group)
        for role in layout:
            views[role] = group.role(role)
    return views, groups


def start_transfer_queue(cfg: PolyRLConfig, closers: list[Callable[[], None]]) -> tuple[Any, str]:
    """Start the transfer queue (``transfer.backend``; auto follows the worker backend).

    Returns the queue client and the backend it runs on; its close goes to ``closers``.
    """
    from polyrl.transfer import make_transfer_queue

    backend = cfg.transfer.backend
    if backend == "auto":
        backend = "ray" if cfg.trainer.worker_backend == "ray" else "local"
    options = {"num_storage_units": cfg.transfer.num_storage_units} if backend == "ray" else {}
    queue = make_transfer_queue(backend, **options)
    closers.append(queue.close)
    return queue, backend
