"""What the SFT, preference and RL trainers share before their first step.

The run's inputs (the model directory, the data files), the machine checks and Ray options,
the training device and compute dtype that ``auto`` leaves to the machine, and the run
directory's config file, which shows those resolved values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.config import ConfigError, PolyRLConfig, describe, to_yaml

__all__ = [
    "check_devices",
    "compute_dtype",
    "data_files",
    "ray_init_options",
    "resolve_model_dir",
    "save_run_config",
    "training_device",
    "with_training_autos",
]


def resolve_model_dir(cfg: PolyRLConfig, out_dir: Path) -> Path:
    """``model.path``, or a tiny model built (once) under ``<out_dir>/model``."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{str(path)!r} is not a Hugging Face model directory (no config.json)",
                key="model.path",
            )
        return path
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(
        cfg.model.tiny_arch, out_dir / "model", size=cfg.model.tiny_size, seed=cfg.seed
    )


def data_files(cfg: PolyRLConfig, out_dir: Path) -> tuple[list[str], list[str]]:
    """Return the run's training and validation files (a generated task's splits, or files).

    With ``data.task`` the task's train/test splits are written under ``data.data_dir``
    (default ``<out_dir>/data``); ``data.val_files``, when given, replace the generated test
    split. Used by the SFT, preference and RL trainers alike.

    Raises:
        ConfigError: neither a task nor training files are set.
    """
    data = cfg.data
    if not data.task:
        if not data.train_files:
            raise ConfigError("no training data files", key="data.train_files")
        return list(data.train_files), list(data.val_files)
    from polyrl.data.tasks import write_task_splits

    data_dir = Path(data.data_dir) if data.data_dir else out_dir / "data"
    train_path, test_path = write_task_splits(
        data.task,
        data_dir,
        data.num_train,
        data.num_val,
        seed=cfg.seed_for("data"),
        **data.task_options,
    )
    val_files = list(data.val_files) or ([str(test_path)] if data.num_val > 0 else [])
    return [str(train_path)], val_files


def check_devices(cfg: PolyRLConfig, keys: Sequence[str] = ("trainer.device",)) -> None:
    """Refuse ``cuda`` in the device options ``keys`` on a machine without CUDA, at once.

    Otherwise Ray waits for GPUs that never come and the run fails a minute later.
    """
    import torch

    for key in keys:
        group, name = key.split(".")
        if getattr(getattr(cfg, group), name) == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "is cuda but this machine has no CUDA device visible to torch "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "use cpu or auto",
                key=key,
            )


def ray_init_options(cfg: PolyRLConfig) -> dict[str, Any]:
    """``ray.init`` keyword arguments for ``cfg.ray`` (join ``address`` or start a local Ray)."""
    opts: dict[str, Any] = {
        "namespace": cfg.ray.namespace,
        "include_dashboard": False,
        "configure_logging": False,
    }
    if cfg.ray.address:
        opts["address"] = cfg.ray.address
    else:
        # "local" starts a Ray of our own even where a cluster is already running on this
        # machine (`ray start`, another run): plain ray.init() would join that one, and then
        # refuse num_cpus/num_gpus.
        opts["address"] = "local"
        if cfg.ray.num_cpus:
            opts["num_cpus"] = cfg.ray.num_cpus
        if cfg.ray.num_gpus >= 0:
            opts["num_gpus"] = cfg.ray.num_gpus
    return opts


def training_device(cfg: PolyRLConfig) -> str:
    """Return where the training engines run: ``trainer.device``, auto is CUDA when available."""
    import torch

    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(cfg: PolyRLConfig, device: str) -> str:
    """Return the engines' compute dtype on ``device`` (``model.compute_dtype``).

    ``auto`` is bfloat16 on CUDA and ``model.dtype`` on CPU, as the engine's own
    :class:`~polyrl.model_engine.MixedPrecisionConfig` decides.
    """
    from polyrl.core.dtypes import dtype_name
    from polyrl.model_engine import MixedPrecisionConfig

    precision = MixedPrecisionConfig(param_dtype=cfg.model.compute_dtype)
    return dtype_name(precision.compute_dtype(device, cfg.model.dtype))


def with_training_autos(cfg: PolyRLConfig) -> PolyRLConfig:
    """Return ``cfg`` with ``trainer.device`` and ``model.compute_dtype`` resolved from auto."""
    device = training_device(cfg)
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, device=device),
        model=dataclasses.replace(cfg.model, compute_dtype=compute_dtype(cfg, device)),
    )


def save_run_config(
    given: PolyRLConfig, resolved: PolyRLConfig, path: str | os.PathLike[str]
) -> Path:
    """Write the run's config to ``path`` with its ``auto`` settings resolved; return the path.

    The file is ``resolved`` as YAML (:func:`~polyrl.config.load_config` reads it back), headed
    by a comment that names each option the run resolved and what ``given`` said, so a reader
    sees which values the machine decided.
    """
    before = {o.key: o.default for o in describe(given)}
    changed = [
        (o.key, before[o.key], o.default) for o in describe(resolved) if before[o.key] != o.default
    ]
    header = ""
    if changed:
        header = "# Settings this run resolved (the value given -> the value used):\n" + "".join(
            f"#   {key}: {old!r} -> {new!r}\n" for key, old, new in changed
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + to_yaml(resolved), encoding="utf-8")
    return out
