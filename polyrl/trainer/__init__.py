"""Trainers built on the model engine, and their bookkeeping: tracking, plots, checkpoints.

* :func:`polyrl.trainer.sft.run_sft` -- supervised fine-tuning (``polyrl sft``);
* :class:`polyrl.trainer.run_loop.RunLoop` -- the run loop every trainer runs in (resume,
  tracking, progress, validation and save cadence, plot and summary);
* :class:`polyrl.trainer.tracking.Tracker` -- metrics fan-out to console / jsonl / tensorboard /
  wandb / mlflow backends;
* :func:`polyrl.trainer.plotting.plot_learning_curves` -- learning-curve PNGs from metrics.jsonl;
* :mod:`polyrl.trainer.checkpointing` -- checkpoint location and ``resume_mode`` resolution;
* :mod:`polyrl.trainer.common` -- what every trainer needs before its first step (model
  directory, data files, device checks, Ray options, the resolved config file).

Submodules import lazily so ``import polyrl.trainer`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SFTDataset",
    "Tracker",
    "available_trackers",
    "plot_learning_curves",
    "register_tracker",
    "run_sft",
    "tokenize_chat",
]

_LAZY = {
    "SFTDataset": "polyrl.trainer.sft_data",
    "tokenize_chat": "polyrl.trainer.sft_data",
    "Tracker": "polyrl.trainer.tracking",
    "available_trackers": "polyrl.trainer.tracking",
    "register_tracker": "polyrl.trainer.tracking",
    "plot_learning_curves": "polyrl.trainer.plotting",
    "run_sft": "polyrl.trainer.sft",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polyrl.trainer' has no attribute {name!r}")
