"""Where trainers keep checkpoints and which one a run resumes from.

Layout under ``trainer.output_dir``::

    checkpoints/global_step_<N>/   # engine checkpoints (atomic; see polyrl.model_engine.checkpoint)
    checkpoints/latest             # name of the newest complete one

``trainer.resume_mode`` picks the checkpoint: ``auto`` (the newest complete one, or a fresh start
when there is none), ``never``, or a path (a step directory, or a root to take the newest from).
An empty ``resume_mode`` follows the boolean ``trainer.resume`` (true means ``auto``).
"""

from __future__ import annotations

import os
from pathlib import Path

from polyrl.config import ConfigError
from polyrl.model_engine import checkpoint as ckpt

__all__ = ["CHECKPOINT_DIR", "checkpoint_root", "effective_resume_mode", "resolve_resume_path"]

CHECKPOINT_DIR = "checkpoints"


def checkpoint_root(output_dir: str | os.PathLike[str]) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / CHECKPOINT_DIR


def effective_resume_mode(resume_mode: str, resume: bool) -> str:
    """``resume_mode`` itself, or ``auto``/``never`` from ``resume`` when it is empty."""
    if not isinstance(resume_mode, str):
        raise ConfigError(f"expected a str, got {resume_mode!r}", key="trainer.resume_mode")
    mode = resume_mode.strip()
    if not mode:
        return "auto" if resume else "never"
    return mode


def resolve_resume_path(resume_mode: str, resume: bool, root: str | os.PathLike[str]) -> str | None:
    """Return the checkpoint directory to resume from, or ``None`` to start fresh.

    Raises:
        ConfigError: ``resume_mode`` names a path that holds no complete checkpoint.
    """
    mode = effective_resume_mode(resume_mode, resume)
    if mode == "never":
        return None
    if mode == "auto":
        return ckpt.find_latest_checkpoint(os.fspath(root))
    try:
        return ckpt.resolve_checkpoint(os.path.abspath(mode))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{exc}; expected 'auto', 'never' or the path of a checkpoint "
            "(a global_step_<N> directory or a folder holding them)",
            key="trainer.resume_mode",
        ) from None
