"""Python API of the RL trainer, for notebooks and scripts.

::

    from polyrl import GRPOTrainer, RLConfig

    def correct(completions, answer, **kwargs):          # TRL style: the whole batch at once
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(
        model="path/to/hf_model",            # or a transformers model object
        reward_funcs=[correct, "file.py:fn"],  # callables, "file.py:function" or scorer names
        reward_weights=[1.0, 0.5],
        train_dataset=dataset,               # a datasets.Dataset, list of dicts, or file paths
        eval_dataset=val_dataset,
        config=RLConfig(),                   # optional; or load_config("grpo", [...])
    )
    summary = trainer.train()

A TRL script keeps its arguments: ``args=GRPOConfig(...)`` (TRL's fields and defaults, see
:mod:`polyrl.config.trl_compat`) instead of ``config=``, ``processing_class=`` for the
tokenizer and ``peft_config=LoraConfig(...)`` for the ``model.lora_*`` options.

Each class fixes the advantage estimator (``GRPOTrainer``: ``grpo``, ``PPOTrainer``: ``gae``
with a critic, ...) and has defaults valid for it (:attr:`_RLTrainerAPI.defaults`:
``rollout.n=8`` for GRPO and RLOO): a default applies where the config still holds
``RLConfig()``'s value for that option, so anything the user set wins. Everything else comes
from the config, exactly as for ``polyrl train``, which is a thin layer over the same
:class:`~polyrl.trainer.rl.RLTrainer`.

Reward functions are per-sample (verl style: ``compute_score(data_source, solution_str,
ground_truth, extra_info)``) or batched (TRL style: ``f(prompts, completions, completion_ids,
**columns) -> list[float | None]``), told apart by their parameters and checked here, at
construction; see :mod:`polyrl.reward.functions`. ``reward_fn=`` (one function) still works;
``reward_funcs=`` takes one or several, with ``reward_weights``.

With a reward function, a row needs only its prompt (``data.prompt_key``: a string or a chat
message list; as in TRL, only a message list goes through the chat template and a string is
tokenized as it is, ``data.template_string_prompts=False``); its other columns reach the
reward (batched functions: as keyword arguments; per-sample functions: in ``extra_info``).
Without one, rows follow :mod:`polyrl.data.schema` (``data_source`` picks the registered
scorer, ``reward_model: {"ground_truth": ...}``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.config.trl_compat import DPOConfig, GRPOConfig, RewardConfig, RLOOConfig

__all__ = [
    "DPOTrainer",
    "GRPOTrainer",
    "PPOTrainer",
    "REINFORCEPlusPlusTrainer",
    "RLOOTrainer",
    "ReMaxTrainer",
    "RewardModelTrainer",
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
    if isinstance(data, Mapping):
        raise TypeError(
            f"{what} must be a dataset, a list of row dicts or file paths, got a "
            f"{type(data).__name__} (for a datasets.DatasetDict pass one split, e.g. ds['train'])"
        )
    rows = [dict(row) for row in data]
    if not rows:
        raise ValueError(f"{what} is empty")
    return rows, []


def _with_datasets(
    cfg: PolyRLConfig, train_dataset: DatasetLike | None, eval_dataset: DatasetLike | None
) -> tuple[PolyRLConfig, list[dict] | None, list[dict] | None]:
    """Point ``cfg`` at the datasets a trainer was given; return it with their in-memory rows.

    Files replace ``data.train_files`` (and the preset's generated task) / ``data.val_files``;
    rows are returned for the trainer to pass in.

    Raises:
        ConfigError: no training data at all.
    """
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
    return cfg, train_rows, val_rows


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


def _columns(rows: list[dict] | None, prompt_key: str) -> list[str] | None:
    if rows is None:
        return None
    return sorted({k for row in rows for k in row if k != prompt_key})


def _reward_functions(
    reward_fn: Any,
    reward_funcs: Any,
    reward_weights: Sequence[float] | None,
    cfg: PolyRLConfig,
    rows: list[dict] | None,
) -> Any:
    """Check the reward arguments now and return what the RLTrainer takes as ``reward_fn``."""
    from polyrl.reward.functions import is_batched, resolve_reward_functions
    from polyrl.reward.user_fn import bind_scorer, load_user_function

    if reward_fn is not None and reward_funcs is not None:
        raise TypeError("pass reward_funcs= or reward_fn=, not both (reward_fn is one function)")
    if reward_weights is not None and reward_funcs is None:
        raise TypeError("reward_weights= goes with reward_funcs=")
    columns = _columns(rows, cfg.data.prompt_key)
    pickled = cfg.reward.num_workers > 0
    if reward_funcs is not None:
        return resolve_reward_functions(reward_funcs, reward_weights, columns, pickled=pickled)
    fn = _resolve_reward(reward_fn)
    loaded = load_user_function(fn) if isinstance(fn, str) else fn
    if loaded is not None and is_batched(loaded):
        return resolve_reward_functions(fn, None, columns, pickled=pickled)
    if loaded is not None:
        bind_scorer(loaded)  # a signature it cannot be called with fails here, not at train()
    return fn


def _check_rows_have_reward_fields(rows: list[dict] | None, what: str) -> None:
    """Without a reward function, rows need a data_source and reward_model: say so now."""
    for i, row in enumerate(rows or []):
        missing = [f for f in ("data_source", "reward_model") if f not in row]
        if missing:
            from polyrl.data.schema import RowValidationError

            raise RowValidationError(
                f"{what} row {i} has no {' or '.join(missing)}, which pick the registered "
                "scorer when no reward function is given; pass reward_funcs= (a row then needs "
                "only its prompt) or give the rows a data_source and reward_model"
            )


class _TRLArguments:
    """A trainer's config and tokenizer, from polyrl's ``config=`` or TRL's arguments.

    TRL's are ``args=`` (a config of :mod:`polyrl.config.trl_compat`), ``processing_class=``
    and ``peft_config=``.
    """

    def __init__(
        self,
        trainer: Any,
        config: PolyRLConfig | None,
        args: Any,
        tokenizer: Any,
        processing_class: Any,
        peft_config: Any,
        model: Any,
    ) -> None:
        name = type(trainer).__name__
        if args is not None:
            accepted = trainer.trl_config
            if accepted is None or not isinstance(args, accepted):
                wanted = (
                    f"a {accepted.__name__} (polyrl.{accepted.__name__})"
                    if accepted
                    else ("no TRL config (pass config=)")
                )
                raise TypeError(f"{name} takes {wanted} as args=, got {type(args).__name__}")
            if config is not None:
                raise TypeError("pass args= (TRL's config) or config= (polyrl's), not both")
            config = args.to_polyrl()
        cfg = config if config is not None else PolyRLConfig()
        if not isinstance(cfg, PolyRLConfig):
            raise TypeError(f"config must be an RLConfig, got {type(cfg).__name__}")
        if peft_config is not None:
            from polyrl.config.trl_compat import with_lora

            cfg = with_lora(cfg, peft_config, model)
        if processing_class is not None and tokenizer is not None:
            raise TypeError("pass processing_class= (TRL's name) or tokenizer=, not both")
        self.config = cfg
        self.tokenizer = processing_class if processing_class is not None else tokenizer


class _RLTrainerAPI:
    """Shared constructor of the algorithm-specific trainers (see the module docstring).

    TRL's keyword arguments are taken too: ``args=`` (this class's :attr:`trl_config`, e.g.
    ``GRPOConfig``, instead of ``config=``), ``processing_class=`` (the tokenizer) and
    ``peft_config=`` (a ``peft.LoraConfig``: the ``model.lora_*`` options).
    """

    adv_estimator: ClassVar[str] = ""
    #: The TRL config class ``args=`` takes (None: only ``config=``).
    trl_config: ClassVar[type | None] = None
    #: Options (dotted keys) this trainer sets where the config still holds ``RLConfig()``'s
    #: default, so that ``config=RLConfig()`` (or no config) runs this algorithm; any value the
    #: user set, even by ``load_config``, wins.
    defaults: ClassVar[Mapping[str, Any]] = {}
    #: Defaults every TRL-style trainer applies, by the same rule (before :attr:`defaults`):
    #: a plain-string prompt is tokenized as it is, as TRL does; chat messages are templated.
    trl_defaults: ClassVar[Mapping[str, Any]] = {"data.template_string_prompts": False}

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        tokenizer: Any = None,
        config: PolyRLConfig | None = None,
        reward_fn: str | Callable[..., Any] | None = None,
        train_dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
        *,
        reward_funcs: Any = None,
        reward_weights: Sequence[float] | None = None,
        args: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ) -> None:
        trl = _TRLArguments(self, config, args, tokenizer, processing_class, peft_config, model)
        cfg = trl.config
        if args is not None and reward_weights is None and reward_funcs is not None:
            reward_weights = args.reward_weights
        cfg = dataclasses.replace(
            cfg,
            algorithm=dataclasses.replace(cfg.algorithm, adv_estimator=self.adv_estimator),
        )
        # A TRL config states every option it sets (num_generations=1 too): only the
        # TRL-wide defaults apply over it, not this class's.
        own = {} if args is not None else self.defaults
        cfg, self.applied_defaults = _apply_defaults(cfg, {**self.trl_defaults, **own})
        tokenizer = trl.tokenizer
        cfg, train_rows, val_rows = _with_datasets(cfg, train_dataset, eval_dataset)
        self._reward_fn = _reward_functions(
            reward_fn, reward_funcs, reward_weights, cfg, train_rows
        )
        if self._reward_fn is None and not cfg.reward.custom_function:
            _check_rows_have_reward_fields(train_rows, "train_dataset")
            _check_rows_have_reward_fields(val_rows, "eval_dataset")
        self.config = cfg
        self._model = model
        self._tokenizer = tokenizer
        self._train_rows = train_rows
        self._val_rows = val_rows

    def _model_dir(self) -> Path | None:
        return _model_dir(self._model, self._tokenizer, self.config)

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


def _model_dir(model: Any, tokenizer: Any, config: PolyRLConfig) -> Path | None:
    """Return a directory holding the model and tokenizer (saving in-memory objects first)."""
    if model is None:
        return None
    if isinstance(model, str | os.PathLike) and tokenizer is None:
        return Path(model)
    staged = Path(config.trainer.output_dir) / "initial_model"
    staged.mkdir(parents=True, exist_ok=True)
    if isinstance(model, str | os.PathLike):
        from polyrl.models.loader import load_causal_lm

        model = load_causal_lm(model)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"model must be a model directory or a transformers model, got {type(model).__name__}"
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


def _apply_defaults(
    cfg: PolyRLConfig, defaults: Mapping[str, Any]
) -> tuple[PolyRLConfig, dict[str, Any]]:
    """Set each ``group.option`` of ``defaults`` that ``cfg`` leaves at the schema default."""
    applied: dict[str, Any] = {}
    for key, value in defaults.items():
        group_name, option = key.split(".")
        group = getattr(cfg, group_name)
        if getattr(group, option) == getattr(type(group)(), option):
            group = dataclasses.replace(group, **{option: value})
            cfg = dataclasses.replace(cfg, **{group_name: group})
            applied[key] = value
    return cfg, applied


class GRPOTrainer(_RLTrainerAPI):
    """GRPO: group-relative advantages over ``rollout.n`` responses per prompt, no critic."""

    adv_estimator = "grpo"
    defaults = {"rollout.n": 8}
    trl_config = GRPOConfig


class PPOTrainer(_RLTrainerAPI):
    """PPO with a critic (value model) and GAE advantages."""

    adv_estimator = "gae"


class RLOOTrainer(_RLTrainerAPI):
    """REINFORCE leave-one-out over ``rollout.n`` responses per prompt."""

    adv_estimator = "rloo"
    defaults = {"rollout.n": 8}
    trl_config = RLOOConfig


class REINFORCEPlusPlusTrainer(_RLTrainerAPI):
    """REINFORCE++: discounted returns whitened over the batch."""

    adv_estimator = "reinforce_plus_plus"


class ReMaxTrainer(_RLTrainerAPI):
    """ReMax: the greedy response's reward is the baseline."""

    adv_estimator = "remax"


class _PreferenceTrainerAPI:
    """Shared constructor of :class:`DPOTrainer` and :class:`RewardModelTrainer`."""

    kind: ClassVar[str] = ""
    #: The TRL config class ``args=`` takes.
    trl_config: ClassVar[type | None] = None

    def __init__(
        self,
        model: str | os.PathLike[str] | Any = None,
        tokenizer: Any = None,
        config: PolyRLConfig | None = None,
        train_dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
        *,
        args: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ) -> None:
        trl = _TRLArguments(self, config, args, tokenizer, processing_class, peft_config, model)
        cfg, train_rows, val_rows = _with_datasets(trl.config, train_dataset, eval_dataset)
        self.config = cfg
        self._model = model
        self._tokenizer = trl.tokenizer
        self._train_rows = train_rows
        self._val_rows = val_rows

    def _model_dir(self) -> Path | None:
        return _model_dir(self._model, self._tokenizer, self.config)

    def _run_kwargs(self) -> dict[str, Any]:
        return {
            "train_rows": self._train_rows,
            "val_rows": self._val_rows,
            "model_dir": self._model_dir(),
        }

    def train(self) -> dict[str, Any]:
        """Run the training job; returns the run summary (also in ``<kind>_summary.json``)."""
        from polyrl.trainer.preference import run_preference

        return run_preference(self.config, self.kind, **self._run_kwargs())


class DPOTrainer(_PreferenceTrainerAPI):
    """Direct preference optimisation (``dpo.loss_type``: sigmoid, ipo, simpo) on pairs.

    ::

        from polyrl import DPOTrainer
        from polyrl.config import load_config

        trainer = DPOTrainer(
            model="path/to/hf_model",          # or a transformers model (+ tokenizer=)
            ref_model=None,                    # None: the model's initial weights, frozen
            train_dataset=rows,                # prompt / chosen / rejected (TRL's columns)
            eval_dataset=val_rows,
            config=load_config("dpo_demo", ["dpo.beta=0.1"]),
        )
        summary = trainer.train()              # summary["last_val_accuracy"], "hf_model", ...

    Rows with ``ref_chosen_logps`` / ``ref_rejected_logps`` need no reference model. Options are
    the ``dpo`` config group (TRL's ``DPOConfig`` names); ``model=None`` builds the tiny model
    of ``model.*``. TRL's ``args=DPOConfig(...)``, ``processing_class=`` and ``peft_config=``
    are taken as by the RL trainers.
    """

    kind = "dpo"
    trl_config = DPOConfig

    def __init__(
        self,
        model: str | os.PathLike[str] | Any = None,
        ref_model: str | os.PathLike[str] | None = None,
        tokenizer: Any = None,
        config: PolyRLConfig | None = None,
        train_dataset: DatasetLike | None = None,
        eval_dataset: DatasetLike | None = None,
        *,
        args: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            config,
            train_dataset,
            eval_dataset,
            args=args,
            processing_class=processing_class,
            peft_config=peft_config,
        )
        if ref_model is not None and not isinstance(ref_model, str | os.PathLike):
            raise TypeError(
                f"ref_model must be a model directory, got {type(ref_model).__name__} (save an "
                "in-memory model with save_pretrained first)"
            )
        self._ref_model = ref_model

    def _run_kwargs(self) -> dict[str, Any]:
        kwargs = super()._run_kwargs()
        if self._ref_model is not None:
            kwargs["ref_model_dir"] = Path(self._ref_model)
        return kwargs


class RewardModelTrainer(_PreferenceTrainerAPI):
    """A reward model (the model's backbone plus a scalar head) trained on preference pairs.

    The score of a sequence is the head's output at its last token; the loss is
    Bradley-Terry, ``-logsigmoid(r_chosen - r_rejected - margin)`` (``margin`` from the
    ``rm.margin_key`` column when present). The final model in ``<output_dir>/hf_model`` loads
    with ``transformers.AutoModelForSequenceClassification``. Options are the ``rm`` group.
    """

    kind = "rm"
    trl_config = RewardConfig
