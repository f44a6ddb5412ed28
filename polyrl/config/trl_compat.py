"""TRL's trainer configs (``GRPOConfig``, ``RLOOConfig``, ``DPOConfig``, ``RewardConfig``, GKD).

``GKDConfig`` carries TRL's on-policy distillation names over (there is no ``GKDTrainer``).

A TRL script keeps its ``args=GRPOConfig(...)``: these classes take TRL's field names with TRL's
defaults (those of TRL 1.9), and :meth:`TRLConfig.to_polyrl` turns one into a
:class:`PolyRLConfig` through one table per class (:meth:`TRLConfig.rows`, plus the options the
TRL algorithm fixes, :attr:`TRLConfig.fixed`), the table ``docs/migrating_from_trl.md`` shows
(``python -m polyrl.config.trl_compat`` prints it). Each row is one TRL field and says what it
sets:

* a converter ``(value, args) -> {polyrl key: value}``: the field sets those options (``{}``
  when another row does the work, e.g. ``gradient_accumulation_steps`` is read by
  ``per_device_train_batch_size``); it returns ``None`` for a value polyrl cannot honour, and
  raises :class:`ConfigError` for a value that would train a different objective;
* no converter: polyrl has no such setting.

A field polyrl does not honour is never dropped silently: every one whose value differs from
TRL's default is named in one :class:`ConfigNote`. A field TRL has and these classes lack is a
``TypeError`` (an unexpected keyword argument), as a misspelt field is in TRL.

``peft_config=`` (a ``peft.LoraConfig``) maps onto the ``model.lora_*`` options by
:func:`lora_options`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from polyrl.config.loader import ConfigNote
from polyrl.config.schema import LOGGERS, ConfigError, PolyRLConfig

__all__ = [
    "DPOConfig",
    "GKDConfig",
    "GRPOConfig",
    "RLOOConfig",
    "RewardConfig",
    "Row",
    "TRLConfig",
    "lora_options",
    "markdown_table",
    "with_lora",
]

Convert = Callable[[Any, Any], Mapping[str, Any] | None]


class Row(NamedTuple):
    """One TRL field: what it sets in polyrl (``to``; ``None``: nothing) and the docs' words."""

    field: str
    polyrl: str
    to: Convert | None


def _set(*keys: str) -> Convert:
    """Set each of ``keys`` to the value as it is."""
    return lambda value, args: dict.fromkeys(keys, value)


def _read_with(field: str, other: str) -> Row:
    """Return the row of a field that ``other``'s row reads (it sets nothing itself)."""
    return Row(field, f"read with `{other}`", lambda value, args: {})


def _choice(key: str, mapping: Mapping[Any, Any], refuse: bool = False) -> Convert:
    """Map TRL's value through ``mapping``; other values are not honoured (or refused)."""

    def convert(value: Any, args: Any) -> Mapping[str, Any] | None:
        if value in mapping:
            return {key: mapping[value]}
        if refuse:
            raise ConfigError(
                f"{type(args).__name__}: polyrl has no equivalent of {value!r}; supported: "
                + ", ".join(repr(v) for v in mapping),
                key=key,
            )
        return None

    return convert


def _whole(key: str, zero: Any = None) -> Convert:
    """Take a whole number (TRL allows a float); ``zero`` replaces values below 1 if given."""

    def convert(value: Any, args: Any) -> Mapping[str, Any] | None:
        if zero is not None and value < 1:
            return {key: zero}
        if value < 1 or value != int(value):
            return None
        return {key: int(value)}

    return convert


def _loggers(value: Any, args: Any) -> Mapping[str, Any] | None:
    names = [value] if isinstance(value, str) else list(value or [])
    if names in ([], ["none"]):
        return {"trainer.loggers": ["console"]}
    if not set(names) <= set(LOGGERS):
        return None
    return {"trainer.loggers": ["console", *names]}


def _precision(value: Any, args: Any) -> Mapping[str, Any]:
    # TRL: bf16=None means bf16 where the hardware has it, as polyrl's compute_dtype=auto.
    if args.fp16:
        return {"model.compute_dtype": "float16"}
    if value is None:
        return {}
    return {"model.compute_dtype": "bfloat16" if value else "float32"}


def _saving(value: Any, args: Any) -> Mapping[str, Any] | None:
    if args.save_strategy == "no":
        return {"trainer.save_freq": 0}
    if args.save_strategy != "steps" or value < 1 or value != int(value):
        return None
    return {"trainer.save_freq": int(value)}


def _evaluating(value: Any, args: Any) -> Mapping[str, Any] | None:
    if value == "no":
        return {}
    if value != "steps":
        return None
    every = args.eval_steps if args.eval_steps is not None else args.logging_steps
    return {"trainer.test_freq": int(every)} if every >= 1 and every == int(every) else None


def _training_rows(group: str) -> tuple[Row, ...]:
    """``transformers.TrainingArguments`` fields; ``group`` holds the trained model's options."""
    optim = f"{group}.optim"
    schedulers = {"linear": "linear", "cosine": "cosine", "constant": "constant"}
    schedulers["constant_with_warmup"] = "constant"  # polyrl's schedules all start with warmup
    return (
        Row("output_dir", "`trainer.output_dir`", _set("trainer.output_dir")),
        Row("seed", "`seed`", _set("seed")),
        Row(
            "run_name",
            "`trainer.experiment_name` (None: unchanged)",
            _unless_none("trainer.experiment_name"),
        ),
        Row("learning_rate", f"`{optim}.lr`", _set(f"{optim}.lr")),
        Row("weight_decay", f"`{optim}.weight_decay`", _set(f"{optim}.weight_decay")),
        Row(
            "lr_scheduler_type",
            f"`{optim}.lr_scheduler` (linear, cosine, constant)",
            _choice(f"{optim}.lr_scheduler", schedulers),
        ),
        Row("warmup_ratio", f"`{optim}.warmup_ratio`", _set(f"{optim}.warmup_ratio")),
        Row("warmup_steps", "not honoured: use warmup_ratio", None),
        Row("max_grad_norm", f"`{optim}.grad_clip`", _set(f"{optim}.grad_clip")),
        Row(
            "optim",
            f"`{optim}.optimizer` (adamw_torch, adamw_torch_fused: adamw; sgd)",
            _choice(
                f"{optim}.optimizer",
                {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"},
            ),
        ),
        Row("adam_beta1", "torch's default (0.9) only", None),
        Row("adam_beta2", "torch's default (0.999) only", None),
        Row("adam_epsilon", "torch's default (1e-8) only", None),
        Row(
            "num_train_epochs",
            "`trainer.total_epochs` (whole numbers)",
            _whole("trainer.total_epochs"),
        ),
        Row(
            "max_steps",
            "`trainer.total_steps` (-1: 0, run the epochs)",
            _whole("trainer.total_steps", zero=0),
        ),
        _read_with("gradient_accumulation_steps", "per_device_train_batch_size"),
        Row(
            "gradient_checkpointing",
            f"`{group}.gradient_checkpointing`",
            _set(f"{group}.gradient_checkpointing"),
        ),
        Row(
            "bf16",
            "`model.compute_dtype` (None: auto, bfloat16 on CUDA, float32 on CPU where TRL "
            "takes bfloat16 too)",
            _precision,
        ),
        Row("fp16", "`model.compute_dtype=float16` (read with `bf16`)", lambda value, args: {}),
        Row(
            "use_cpu",
            "`trainer.device=cpu` when true",
            lambda value, args: {"trainer.device": "cpu"} if value else {},
        ),
        Row("logging_steps", "not honoured: polyrl logs every step", None),
        Row(
            "save_strategy",
            "read with `save_steps` (no, steps)",
            lambda value, args: {} if value in ("no", "steps") else None,
        ),
        Row("save_steps", "`trainer.save_freq` (whole steps)", _saving),
        Row("save_total_limit", "not honoured: see `trainer.max_ckpt_to_keep`", None),
        Row("eval_strategy", "`trainer.test_freq` from `eval_steps` (no, steps)", _evaluating),
        _read_with("eval_steps", "eval_strategy"),
        Row("per_device_eval_batch_size", "not honoured: see `data.val_batch_size`", None),
        Row("report_to", "`trainer.loggers` (console plus tensorboard, wandb, mlflow)", _loggers),
        Row("logging_dir", "not honoured: loggers write under `trainer.output_dir`", None),
        Row("push_to_hub", "not honoured", None),
        Row("remove_unused_columns", "not needed: polyrl keeps every column", lambda v, a: {}),
        Row("dataloader_num_workers", "not honoured (speed only)", None),
        Row("disable_dropout", "not honoured: the model's dropout is kept (0 in most LLMs)", None),
    )


def _unless_none(key: str) -> Convert:
    return lambda value, args: {} if value is None else {key: value}


@dataclasses.dataclass
class TRLConfig:
    """The fields every TRL config has (``transformers.TrainingArguments``), TRL's defaults."""

    #: Where ``GRPOTrainer(args=...)`` and friends accept this class.
    trainer_kind: ClassVar[str] = ""
    #: The config group of the trained model's optimizer and engine options.
    group: ClassVar[str] = "actor"
    #: Options the TRL trainer's algorithm implies whatever the fields say.
    fixed: ClassVar[Mapping[str, Any]] = {}

    output_dir: str = "trainer_output"
    seed: int = 42
    run_name: str | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = True
    bf16: bool | None = None
    fp16: bool = False
    use_cpu: bool = False
    logging_steps: float = 10
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    per_device_eval_batch_size: int = 8
    report_to: str | list[str] = "none"
    logging_dir: str | None = None
    push_to_hub: bool = False
    remove_unused_columns: bool = False
    dataloader_num_workers: int = 0
    disable_dropout: bool = True

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the table: one row per field, in the docs' order."""
        return _training_rows(cls.group)

    def to_polyrl(self, base: PolyRLConfig | None = None) -> PolyRLConfig:
        """Return ``base`` (default ``PolyRLConfig()``) with every field's meaning applied.

        Fields polyrl does not honour, at a value other than TRL's default, are named in one
        :class:`ConfigNote` warning (also in :meth:`unhonoured`).

        Raises:
            ConfigError: a value that would train another objective (a loss polyrl lacks), or
                batch sizes that do not divide into whole groups.
        """
        values: dict[str, Any] = dict(self.fixed)
        for row in self.rows():
            if row.to is None:
                continue
            changes = row.to(getattr(self, row.field), self)
            if changes is not None:
                values.update(changes)
        skipped = self.unhonoured()
        if skipped:
            warnings.warn(
                f"{type(self).__name__}: polyrl does not honour "
                + ", ".join(skipped)
                + "; they are left out (docs/migrating_from_trl.md lists what each field sets)",
                ConfigNote,
                stacklevel=3,
            )
        return _with_options(base if base is not None else PolyRLConfig(), values)

    def unhonoured(self) -> list[str]:
        """``field=value`` for each field polyrl does not honour that differs from TRL's default."""
        default = type(self)()
        out = []
        for row in self.rows():
            value = getattr(self, row.field)
            honoured = row.to is not None and row.to(value, self) is not None
            if not honoured and value != getattr(default, row.field):
                out.append(f"{row.field}={value!r}")
        return out


def _with_options(cfg: PolyRLConfig, values: Mapping[str, Any]) -> PolyRLConfig:
    """Return a copy of ``cfg`` with each dotted option of ``values`` set (and checked)."""
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        *groups, name = key.split(".")
        owner: Any = cfg
        for group in groups:
            owner = getattr(owner, group)
        setattr(owner, name, value)
    return cfg


def _groups_of(what: str, count: int, n: int, args: Any) -> int:
    if count % n:
        raise ConfigError(
            f"{type(args).__name__}: {what} ({count}) must be a multiple of num_generations "
            f"({n}), as in TRL",
            key="data.train_batch_size",
        )
    return count // n


def _rl_batches(value: Any, args: Any) -> Mapping[str, Any]:
    """TRL counts completions of one process; polyrl counts prompts (``rollout.n`` each)."""
    step = value * args.gradient_accumulation_steps  # completions per optimizer step
    per_generation = args.steps_per_generation or args.gradient_accumulation_steps
    generated = args.generation_batch_size or value * per_generation
    n = args.num_generations
    return {
        "data.train_batch_size": _groups_of("generation_batch_size", generated, n, args),
        "actor.ppo_mini_batch_size": _groups_of(
            "per_device_train_batch_size x gradient_accumulation_steps", step, n, args
        ),
    }


def _clip(value: Any, args: Any) -> Mapping[str, Any]:
    high = value if args.epsilon_high is None else args.epsilon_high
    return {"actor.clip_ratio_low": value, "actor.clip_ratio_high": high}


def _kl_loss(value: Any, args: Any) -> Mapping[str, Any]:
    # TRL's GRPO: beta * k3 estimate of KL(policy || reference), per token, in the loss.
    return {"actor.use_kl_loss": value > 0, "actor.kl_loss_coef": value, "actor.kl_loss_type": "k3"}


def _off_unless_none(what: str) -> Convert:
    def convert(value: Any, args: Any) -> Mapping[str, Any]:
        if value is None:
            return {}
        raise ConfigError(f"{type(args).__name__}: polyrl has no {what}", key=what)

    return convert


@dataclasses.dataclass
class _OnlineConfig(TRLConfig):
    """Fields TRL's ``GRPOConfig`` and ``RLOOConfig`` share (generation, clipping, KL)."""

    #: TRL's clipped objectives have no dual clip.
    fixed: ClassVar[Mapping[str, Any]] = {"actor.clip_ratio_c": 0.0}

    learning_rate: float = 1e-6
    disable_dropout: bool = False
    num_generations: int = 8
    max_completion_length: int = 256
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    mask_truncated_completions: bool = False
    shuffle_dataset: bool = True
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    reward_weights: list[float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    log_completions: bool = False

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the training rows, then those of generation and the policy loss."""
        return _training_rows(cls.group) + (
            Row(
                "per_device_train_batch_size",
                "`data.train_batch_size` = generation batch / "
                "num_generations prompts; `actor.ppo_mini_batch_size` = per_device x "
                "gradient_accumulation_steps / num_generations (one process)",
                _rl_batches,
            ),
            _read_with("generation_batch_size", "per_device_train_batch_size"),
            _read_with("steps_per_generation", "per_device_train_batch_size"),
            Row("num_generations", "`rollout.n`", _set("rollout.n")),
            Row(
                "max_completion_length",
                "`data.max_response_length`, `rollout.max_new_tokens`",
                _set("data.max_response_length", "rollout.max_new_tokens"),
            ),
            Row("temperature", "`rollout.temperature`", _set("rollout.temperature")),
            Row("top_p", "`rollout.top_p`", _set("rollout.top_p")),
            Row(
                "top_k",
                "`rollout.top_k` (None, 0: -1, off)",
                lambda value, args: {"rollout.top_k": value if value else -1},
            ),
            Row(
                "min_p",
                "`rollout.min_p` (None: 0)",
                lambda value, args: {"rollout.min_p": value or 0.0},
            ),
            Row(
                "repetition_penalty",
                "`rollout.repetition_penalty`",
                _set("rollout.repetition_penalty"),
            ),
            Row(
                "beta",
                "`actor.use_kl_loss` (beta > 0), `actor.kl_loss_coef`, `actor.kl_loss_type=k3`",
                _kl_loss,
            ),
            Row("num_iterations", "`actor.ppo_epochs`", _set("actor.ppo_epochs")),
            Row(
                "epsilon",
                "`actor.clip_ratio_low` (and `_high` when epsilon_high is None)",
                _clip,
            ),
            _read_with("epsilon_high", "epsilon"),
            Row(
                "mask_truncated_completions",
                "`algorithm.overlong_filter`",
                _set("algorithm.overlong_filter"),
            ),
            Row("shuffle_dataset", "`data.shuffle`", _set("data.shuffle")),
            Row(
                "use_vllm",
                "`rollout.backend`: vllm, else native",
                lambda value, args: {"rollout.backend": "vllm" if value else "native"},
            ),
            Row("vllm_mode", "not honoured: polyrl places replicas by `rollout.placement`", None),
            Row(
                "vllm_gpu_memory_utilization",
                "`rollout.gpu_memory_utilization`",
                _set("rollout.gpu_memory_utilization"),
            ),
            Row(
                "vllm_tensor_parallel_size",
                "`rollout.tensor_parallel_size`",
                _set("rollout.tensor_parallel_size"),
            ),
            Row(
                "reward_weights",
                "the trainer's `reward_weights=` (when not given there)",
                lambda value, args: {},
            ),
            Row(
                "chat_template_kwargs",
                "`data.apply_chat_template_kwargs` (None: {})",
                lambda value, args: {"data.apply_chat_template_kwargs": value or {}},
            ),
            Row("log_completions", "not honoured: completions are not logged", None),
        )


def _prompt_limit(value: Any, args: Any) -> Mapping[str, Any]:
    if value is None:  # TRL >= 1.0 has no prompt limit; polyrl keeps its own
        return {}
    return {"data.max_prompt_length": value, "data.truncation": "left"}


@dataclasses.dataclass
class GRPOConfig(_OnlineConfig):
    """TRL's ``GRPOConfig``: its field names, meanings and defaults; see the module docstring."""

    trainer_kind: ClassVar[str] = "grpo"

    max_prompt_length: int | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    loss_type: str = "dapo"
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_truncate"
    vllm_importance_sampling_cap: float = 2.0
    scale_rewards: str | bool = "group"
    entropy_coef: float = 0.0

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the shared rows, then GRPO's own."""
        return super().rows() + (
            Row(
                "max_prompt_length",
                "TRL before 1.0: `data.max_prompt_length`, `data.truncation=left`; None: "
                "`data.max_prompt_length` stays (512), a longer prompt is an error",
                _prompt_limit,
            ),
            Row("delta", "None only (two-sided clipping is an error)", _off_unless_none("delta")),
            Row(
                "importance_sampling_level",
                "`actor.policy_loss`: token: ppo_clip, sequence: gspo",
                _choice("actor.policy_loss", {"token": "ppo_clip", "sequence": "gspo"}, True),
            ),
            Row(
                "loss_type",
                "`actor.loss_agg_mode`: grpo: seq-mean-token-mean, dapo and bnpo: "
                "token-mean, dr_grpo: seq-mean-token-sum-norm (over max_completion_length); "
                "cispo: `actor.policy_loss=cispo`, token-mean, the weight capped at epsilon_high "
                "(`actor.clip_ratio_high` = epsilon_high - 1, no lower bound)",
                _loss_type,
            ),
            Row(
                "vllm_importance_sampling_correction",
                "read with `vllm_importance_sampling_mode` (with use_vllm only, as in TRL)",
                lambda value, args: {},
            ),
            Row(
                "vllm_importance_sampling_mode",
                "with use_vllm: token_truncate / sequence_truncate: `algorithm.rollout_is` "
                "token / sequence; the mask modes are not honoured",
                _vllm_is,
            ),
            _read_with("vllm_importance_sampling_cap", "vllm_importance_sampling_mode"),
            Row(
                "scale_rewards",
                "`algorithm.norm_adv_by_std`: group, true: true; none, false: "
                "false (batch is an error)",
                _choice(
                    "algorithm.norm_adv_by_std",
                    {"group": True, True: True, "none": False, False: False},
                    True,
                ),
            ),
            Row("entropy_coef", "`actor.entropy_coeff`", _set("actor.entropy_coeff")),
        )


_AGG_OF_LOSS_TYPE = {
    "grpo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _loss_type(value: Any, args: Any) -> Mapping[str, Any] | None:
    if value != "cispo":
        return _choice("actor.loss_agg_mode", _AGG_OF_LOSS_TYPE | {"cispo": ""}, True)(value, args)
    # TRL's CISPO: -sg(min(r, epsilon_high)) A logp, normalised over the batch's tokens.
    cap = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if cap < 1.0:
        raise ConfigError(
            f"GRPOConfig: loss_type='cispo' caps the importance weight at epsilon_high, which "
            f"must be >= 1 (got {cap}); TRL's examples use 5.0",
            key="actor.clip_ratio_high",
        )
    return {
        "actor.policy_loss": "cispo",
        "actor.loss_agg_mode": "token-mean",
        "actor.clip_ratio_low": 1.0,
        "actor.clip_ratio_high": cap - 1.0,
    }


def _vllm_is(value: Any, args: Any) -> Mapping[str, Any] | None:
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return {}
    level = {"token_truncate": "token", "sequence_truncate": "sequence"}.get(value)
    if level is None:
        return None  # token_mask / sequence_mask: one-sided masks polyrl does not have
    return {
        "algorithm.rollout_is": level,
        "algorithm.rollout_is_threshold": args.vllm_importance_sampling_cap,
    }


def _kl_in_reward(value: Any, args: Any) -> Mapping[str, Any]:
    # TRL's RLOO subtracts beta * sum_t (logp_old - logp_ref) of each sequence from its reward.
    return {
        "algorithm.use_kl_in_reward": value > 0,
        "algorithm.kl_coef": value,
        "algorithm.kl_penalty": "k1",
        "actor.use_kl_loss": False,
    }


@dataclasses.dataclass
class RLOOConfig(_OnlineConfig):
    """TRL's ``RLOOConfig``: its field names, meanings and defaults; the KL is in the reward.

    TRL clips one ratio per sequence, of the summed log-probs; polyrl clips per token. With
    ``num_iterations=1`` (the default) the ratio is 1 and the two updates are the same.
    """

    trainer_kind: ClassVar[str] = "rloo"
    #: TRL's RLOO loss: the mean over sequences of each sequence's summed token terms.
    fixed: ClassVar[Mapping[str, Any]] = {
        "actor.clip_ratio_c": 0.0,
        "actor.loss_agg_mode": "seq-mean-token-sum",
    }

    num_generations: int = 2
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the shared rows (``beta`` a penalty on the reward), then RLOO's own."""
        kl = Row(
            "beta",
            "`algorithm.use_kl_in_reward` (beta > 0), `algorithm.kl_coef`, "
            "`algorithm.kl_penalty=k1`",
            _kl_in_reward,
        )
        return tuple(kl if row.field == "beta" else row for row in super().rows()) + (
            Row("normalize_advantages", "not honoured: RLOO's advantages stay unscaled", None),
            Row("reward_clip_range", "not honoured: rewards are not clipped", None),
        )


def _dpo_loss(value: Any, args: Any) -> Mapping[str, Any] | None:
    # TRL takes a list of losses (summed with loss_weights); polyrl trains one.
    losses = [value] if isinstance(value, str) else list(value)
    name = losses[0] if len(losses) == 1 else "+".join(losses)
    return _choice("dpo.loss_type", {"sigmoid": "sigmoid", "ipo": "ipo"}, True)(name, args)


def _pairs(value: Any, args: Any) -> Mapping[str, Any]:
    return {"data.train_batch_size": value * args.gradient_accumulation_steps}


@dataclasses.dataclass
class _PairConfig(TRLConfig):
    """Fields of TRL's ``DPOConfig`` and ``RewardConfig`` alike."""

    max_length: int | None = 1024

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the training rows, then the pair rows of DPO and reward models."""
        return _training_rows(cls.group) + (
            Row(
                "per_device_train_batch_size",
                "`data.train_batch_size` (pairs) x gradient_accumulation_steps (one process)",
                _pairs,
            ),
            Row(
                "max_length",
                f"`{cls.group}.max_length` (pairs over it are an error; None: not honoured)",
                lambda value, args: None if value is None else {f"{cls.group}.max_length": value},
            ),
        )


@dataclasses.dataclass
class DPOConfig(_PairConfig):
    """TRL's ``DPOConfig``: its field names, meanings and defaults; see the module docstring."""

    trainer_kind: ClassVar[str] = "dpo"
    group: ClassVar[str] = "dpo"

    learning_rate: float = 1e-6
    beta: float = 0.1
    loss_type: str | list[str] = dataclasses.field(default_factory=lambda: ["sigmoid"])
    label_smoothing: float = 0.0
    truncation_mode: str = "keep_start"
    precompute_ref_log_probs: bool = False

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the pair rows, then DPO's own."""
        return super().rows() + (
            Row("beta", "`dpo.beta`", _set("dpo.beta")),
            Row(
                "loss_type",
                "`dpo.loss_type`: sigmoid, ipo (one loss; others and mixtures are an error)",
                _dpo_loss,
            ),
            Row("label_smoothing", "`dpo.label_smoothing`", _set("dpo.label_smoothing")),
            Row(
                "truncation_mode",
                "not honoured: a pair over max_length is an error, not cut "
                "(`dpo.truncation=filter` drops it)",
                None,
            ),
            Row(
                "precompute_ref_log_probs",
                "`dpo.precompute_ref_log_probs`",
                _set("dpo.precompute_ref_log_probs"),
            ),
        )


@dataclasses.dataclass
class RewardConfig(_PairConfig):
    """TRL's ``RewardConfig`` (for ``RewardModelTrainer``): names, meanings and defaults."""

    trainer_kind: ClassVar[str] = "rm"
    group: ClassVar[str] = "rm"

    learning_rate: float = 1e-4
    center_rewards_coefficient: float | None = None

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the pair rows, then the reward model's own."""
        return super().rows() + (
            Row(
                "center_rewards_coefficient",
                "`rm.center_rewards_coefficient` (None: 0)",
                lambda value, args: {"rm.center_rewards_coefficient": value or 0.0},
            ),
        )


def _only(field: str, value_ok: Any, what: str) -> Convert:
    """Honour one value of ``field`` (nothing to set); refuse any other as another objective."""

    def convert(value: Any, args: Any) -> Mapping[str, Any]:
        if value == value_ok:
            return {}
        raise ConfigError(
            f"{type(args).__name__}.{field}={value!r}: {what}; set it to {value_ok!r}", key=field
        )

    return convert


def _gkd_batches(value: Any, args: Any) -> Mapping[str, Any]:
    prompts = value * args.gradient_accumulation_steps  # one completion each, one update
    return {"data.train_batch_size": prompts, "actor.ppo_mini_batch_size": prompts}


@dataclasses.dataclass
class GKDConfig(TRLConfig):
    """TRL's ``GKDConfig`` (``trl.experimental.gkd``): names, meanings and defaults.

    polyrl's on-policy distillation is GKD with ``lmbda=1`` (only the student's own samples)
    and ``beta=1`` (the reverse KL): other values train another objective and are refused by
    name. One completion per prompt makes GRPO's outcome advantage 0, so the teacher's
    per-token reverse KL is the whole signal, as in TRL.
    """

    trainer_kind: ClassVar[str] = "opd"
    fixed: ClassVar[Mapping[str, Any]] = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.distill_coef": 1.0,
        "rollout.n": 1,
        "actor.clip_ratio_c": 0.0,
    }

    learning_rate: float = 2e-5
    max_length: int | None = 1024
    packing: bool = False
    dataset_text_field: str = "text"
    temperature: float = 0.9
    lmbda: float = 0.5
    beta: float = 0.5
    max_new_tokens: int = 128
    teacher_model_name_or_path: str | None = None
    teacher_model_init_kwargs: dict[str, Any] | None = None
    seq_kd: bool = False

    @classmethod
    def rows(cls) -> tuple[Row, ...]:
        """Return the training rows, then GKD's own."""
        return _training_rows(cls.group) + (
            Row(
                "per_device_train_batch_size",
                "`data.train_batch_size` = `actor.ppo_mini_batch_size` = per_device x "
                "gradient_accumulation_steps prompts (one process)",
                _gkd_batches,
            ),
            Row("max_length", "not honoured: see `data.max_prompt_length`", None),
            Row("packing", "not honoured (speed only: padding is always removed)", None),
            Row("dataset_text_field", "not used: the rows' prompts are sampled", None),
            Row(
                "temperature",
                "`rollout.temperature` (sampling; the KL reads both models at it too)",
                _set("rollout.temperature"),
            ),
            Row(
                "lmbda",
                "1.0 only: polyrl distils on the student's own samples (other values mix in "
                "the dataset's completions: refused)",
                _only(
                    "lmbda",
                    1.0,
                    "lmbda < 1 mixes in the dataset's completions; polyrl distils on-policy only",
                ),
            ),
            Row(
                "beta",
                "1.0 only: the reverse KL (other generalized-JSD mixtures are refused)",
                _only("beta", 1.0, "beta != 1 is a generalized JSD; polyrl's is the reverse KL"),
            ),
            Row(
                "max_new_tokens",
                "`data.max_response_length`, `rollout.max_new_tokens`",
                _set("data.max_response_length", "rollout.max_new_tokens"),
            ),
            Row(
                "teacher_model_name_or_path",
                "`algorithm.teacher_model_path` (a local model directory; None: unchanged)",
                _unless_none("algorithm.teacher_model_path"),
            ),
            Row("teacher_model_init_kwargs", "not honoured: the teacher loads as the policy", None),
            Row(
                "seq_kd",
                "False only (sequence-level KD on the teacher's samples is refused)",
                _only("seq_kd", False, "seq_kd trains on the teacher's generations, not on-policy"),
            ),
        )


#: ``peft.LoraConfig`` fields polyrl reads (:func:`lora_options`); any other field at a value
#: other than peft's default is named in a note.
_LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type")


def lora_options(peft_config: Any, model: Any = None) -> dict[str, Any]:
    """``model.lora_*`` options (dotted keys) of a ``peft.LoraConfig``.

    ``target_modules=None`` means peft's per-architecture default, looked up by the model
    directory's ``model_type`` (``q_proj``, ``v_proj`` for Qwen2 and Llama).

    Raises:
        TypeError: ``peft_config`` is not a ``LoraConfig``.
        ConfigError: a target it cannot resolve (a regex, or no known default).
    """
    import peft

    if not isinstance(peft_config, peft.LoraConfig):
        raise TypeError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}")
    targets = peft_config.target_modules
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        model_type = _model_type(model)
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type or "")
        if targets is None:
            raise ConfigError(
                f"peft_config: target_modules=None has no peft default for model type "
                f"{model_type!r}; name the modules",
                key="model.target_modules",
            )
    elif isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(
            f"peft_config: target_modules={targets!r} (a pattern) is not supported; list the "
            "module names or use 'all-linear'",
            key="model.target_modules",
        )
    default = peft.LoraConfig()
    others = [
        f"{f.name}={getattr(peft_config, f.name)!r}"
        for f in dataclasses.fields(peft.LoraConfig)
        if f.name not in _LORA_FIELDS
        and f.init
        and not f.name.startswith("_")
        and getattr(peft_config, f.name) != getattr(default, f.name)
        and f.name not in ("peft_type", "base_model_name_or_path", "revision")
    ]
    if others:
        warnings.warn(
            "peft_config: polyrl does not honour " + ", ".join(others) + "; they are left out",
            ConfigNote,
            stacklevel=3,
        )
    return {
        "model.lora_rank": int(peft_config.r),
        "model.lora_alpha": float(peft_config.lora_alpha),
        "model.lora_dropout": float(peft_config.lora_dropout),
        "model.target_modules": [targets] if isinstance(targets, str) else sorted(targets),
    }


def _model_type(model: Any) -> str | None:
    config = getattr(model, "config", None)
    if config is not None:
        return getattr(config, "model_type", None)
    if isinstance(model, str | Path):
        path = Path(model) / "config.json"
        if path.is_file():
            return json.loads(path.read_text()).get("model_type")
    return None


def with_lora(cfg: PolyRLConfig, peft_config: Any, model: Any) -> PolyRLConfig:
    """``cfg`` with the LoRA options of ``peft_config`` (see :func:`lora_options`)."""
    return _with_options(cfg, lora_options(peft_config, model))


def markdown_table() -> str:
    """Each config's rows as Markdown tables (TRL field, TRL default, what it sets)."""
    out = []
    for cls in (GRPOConfig, RLOOConfig, DPOConfig, RewardConfig, GKDConfig):
        defaults = cls()
        lines = [
            f"### `{cls.__name__}`",
            "",
            "| TRL field | TRL default | polyrl |",
            "| --- | --- | --- |",
        ]
        for row in cls.rows():
            value = getattr(defaults, row.field)
            target = row.polyrl.replace("|", "\\|")
            lines.append(f"| `{row.field}` | `{value!r}` | {target} |")
        if cls.fixed:
            always = ", ".join(f"`{k}={v}`" for k, v in cls.fixed.items())
            lines += ["", f"Always (TRL's algorithm): {always}."]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
