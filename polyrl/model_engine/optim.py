"""Optimizer and learning-rate schedule built from :class:`OptimizerConfig`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from polyrl.model_engine.config import OptimizerConfig

__all__ = ["LRSchedule", "apply_configured_schedule", "build_optimizer", "build_scheduler"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD over ``params`` with the configured hyper-parameters."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    if cfg.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        # The fused kernel needs every parameter on CPU or CUDA in a floating dtype.
        fused = cfg.fused and all(
            p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
        )
        return cls(
            params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


class LRSchedule:
    """LR multiplier: linear warmup from 0, then constant / linear / cosine decay to a floor.

    A plain callable object (not a closure) so the scheduler's ``state_dict`` stays picklable.
    """

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float) -> None:
        self.kind = kind
        self.warmup = warmup
        self.total = total
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        """Multiplier of the peak LR after ``step`` scheduler steps."""
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def _schedule(cfg: OptimizerConfig) -> LRSchedule:
    return LRSchedule(cfg.scheduler, cfg.num_warmup_steps, cfg.total_steps, cfg.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> LambdaLR:
    """Build a ``LambdaLR`` following :class:`LRSchedule` for ``cfg``."""
    return LambdaLR(optimizer, _schedule(cfg))


def apply_configured_schedule(scheduler: LambdaLR, cfg: OptimizerConfig) -> list[str]:
    """Give a restored scheduler the schedule shape of ``cfg``; return what changed.

    ``LambdaLR.load_state_dict`` restores the attributes of callable-object multipliers, so a
    checkpoint would otherwise impose its own warmup, total and decay on a run resumed with a
    longer ``total_steps`` (the decay would end at the old total).  The step count and base LRs
    stay the checkpoint's; the schedule's shape follows the configuration being run, as in a
    fresh run with that configuration.  Each entry of the result reads ``"field: old -> new"``.
    """
    wanted = vars(_schedule(cfg))
    changes: set[str] = set()
    for schedule in scheduler.lr_lambdas:
        if isinstance(schedule, LRSchedule):
            changes.update(
                f"{name}: {old!r} -> {wanted[name]!r}"
                for name, old in vars(schedule).items()
                if old != wanted[name]
            )
            vars(schedule).update(wanted)
    if changes:
        # The LR of the current step must follow the new shape too, not only later steps.
        for group, base_lr, schedule in zip(
            scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base_lr * schedule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return sorted(changes)
