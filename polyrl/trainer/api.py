"""Python API of the RL trainer, for notebooks and scripts.

::

    from polyrl import GRPOTrainer, RLConfig
    from polyrl.config import load_config

    config = load_config("grpo", ["trainer.total_steps=20"])        # or RLConfig()
    trainer = GRPOTrainer(
        model="path/to/hf_model",            # or a transformers model object
        config=config,
        reward_fn=my_reward,                 # callable, "file.py:function" or a scorer name
        train_dataset=rows,                  # list of dicts, a datasets.Dataset, or file paths
        eval_dataset=val_rows,
    )
    summary = trainer.train()

Each class only fixes the advantage estimator (``GRPOTrainer``: ``grpo``, ``PPOTrainer``:
``gae`` with a critic, ...); everything else comes from the config, exactly as for
``polyrl train``, which is a thin layer over the same :class:`~polyrl.trainer.rl.RLTrainer`.

Rows are dicts with the prompt (``data.prompt_key``, a string or a chat message list), a
``data_source`` and ``reward_model: {"ground_truth": ...}``; see :mod:`polyrl.data.schema`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from polyrl.config import ConfigError, PolyRLConfig

__all__ = [
    "GRPOTrainer",
    "PPOTrainer",
    "REINFORCEPlusPlusTrainer",
    "RLOOTrainer",
    "ReMaxTrainer",
]

DatasetLike = str | os.PathLike[str] | Iterable[Mapping[str, Any]]


def _rows_or_files(data: DatasetLike | None, what: str) -> tuple[list[dict] | None, list[str]]:
    if data is None:
        return None, []
    if isinstance(data, str | os.PathLike):
        return None, [os.fspath(data)]
    if (
        isinstance(data, list | tuple)
        and data
        and all(isinstance(d, str | os.PathLike) for d in data)
    ):
        return None, [os.fspath(d) for d in data]
    rows = [dict(row) for row in data]
    if not rows:
        raise ValueError(f"{what} is empty")
    return rows, []


def _resolve_reward(reward_fn: str | Callable[..., Any] | None) -> str | Callable[..., Any] | None:
    """Pass a ``file.py:function`` spec or callable through; look a bare name up as a scorer."""
    if reward_fn is None or callable(reward_fn):
        return reward_fn
    if not isinstance(reward_fn, str) or not reward_fn:
        raise TypeError(f"reward_fn must be a callable or a str, got {reward_fn!r}")
    if ":" in reward_fn:
        return reward_fn
    from polyrl.reward.registry import get_scorer

    return get_scorer(reward_fn)


class _RLTrainerAPI:
    """Shared constructor of the algorithm-specific trainers (see the module docstring)."""

    adv_estimator: ClassVar[str] = ""

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        tokenizer: Any = None,
        config: PolyRLConfig | None = None,
        reward_fn: str | Callable[..., Any] | None = None,
        train_dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
    ) -> None:
        cfg = config if config is not None else PolyRLConfig()
        if not isinstance(cfg, PolyRLConfig):
            raise TypeError(f"config must be an RLConfig, got {type(cfg).__name__}")
        cfg = dataclasses.replace(
            cfg,
            algorithm=dataclasses.replace(cfg.algorithm, adv_estimator=self.adv_estimator),
        )
        train_rows, train_files = _rows_or_files(train_dataset, "train_dataset")
        val_rows, val_files = _rows_or_files(eval_dataset, "eval_dataset")
        if train_dataset is not None:
            cfg = dataclasses.replace(
                cfg, data=dataclasses.replace(cfg.data, task="", train_files=train_files)
            )
        if eval_dataset is not None:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, val_files=val_files))
        if train_rows is None and not cfg.data.train_files and not cfg.data.task:
            raise ConfigError(
                "no training data: pass train_dataset= or set data.task / data.train_files",
                key="data.train_files",
            )
        self.config = cfg
        self._model = model
        self._tokenizer = tokenizer
        self._reward_fn = _resolve_reward(reward_fn)
        self._train_rows = train_rows
        self._val_rows = val_rows

    def _model_dir(self) -> Path | None:
        """Return a directory holding the model and tokenizer (saving in-memory objects first)."""
        model, tokenizer = self._model, self._tokenizer
        if model is None:
            return None
        if isinstance(model, str | os.PathLike) and tokenizer is None:
            return Path(model)
        staged = Path(self.config.trainer.output_dir) / "initial_model"
        staged.mkdir(parents=True, exist_ok=True)
        if isinstance(model, str | os.PathLike):
            from polyrl.models.loader import load_causal_lm

            model = load_causal_lm(model)
        if not hasattr(model, "save_pretrained"):
            raise TypeError(
                "model must be a model directory or a transformers model, got "
                f"{type(model).__name__}"
            )
        model.save_pretrained(staged)
        if tokenizer is None:
            source = getattr(getattr(model, "config", None), "_name_or_path", "")
            if not source or not Path(source).is_dir():
                raise ValueError(
                    "pass tokenizer= with an in-memory model (its tokenizer is not on disk)"
                )
            from polyrl.models.loader import load_tokenizer

            tokenizer = load_tokenizer(source)
        if isinstance(tokenizer, str | os.PathLike):
            from polyrl.models.loader import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        tokenizer.save_pretrained(staged)
        return staged

    def train(self) -> dict[str, Any]:
        """Run the training job; returns the run summary (also in ``rl_summary.json``)."""
        from polyrl.trainer.rl import RLTrainer

        trainer = RLTrainer(
            self.config,
            reward_fn=self._reward_fn,
            train_rows=self._train_rows,
            val_rows=self._val_rows,
            model_dir=self._model_dir(),
        )
        return trainer.fit()


class GRPOTrainer(_RLTrainerAPI):
    """GRPO: group-relative advantages over ``rollout.n`` responses per prompt, no critic."""

    adv_estimator = "grpo"


class PPOTrainer(_RLTrainerAPI):
    """PPO with a critic (value model) and GAE advantages."""

    adv_estimator = "gae"


class RLOOTrainer(_RLTrainerAPI):
    """REINFORCE leave-one-out over ``rollout.n`` responses per prompt."""

    adv_estimator = "rloo"


class REINFORCEPlusPlusTrainer(_RLTrainerAPI):
    """REINFORCE++: discounted returns whitened over the batch."""

    adv_estimator = "reinforce_plus_plus"


class ReMaxTrainer(_RLTrainerAPI):
    """ReMax: the greedy response's reward is the baseline."""

    adv_estimator = "remax"
