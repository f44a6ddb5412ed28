"""The catalogue of polyrl's option groups: one ``ConfigGroup`` dataclass per group.

The framework these are declared with (:func:`option`, :class:`ConfigGroup`, the type checks,
:func:`constructor_kwargs`) is :mod:`polyrl.config.options`; its public names are re-exported
here. Adding a group is a new ``ConfigGroup`` dataclass plus one field on :class:`PolyRLConfig`::

    @dataclasses.dataclass
    class EngineConfig(ConfigGroup):
        lr: float = option(1e-6, "Learning rate.", gt=0.0)

    # in PolyRLConfig:
    engine: EngineConfig = option(EngineConfig, "Model engine options.")
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from polyrl.config.options import (
    _DEFER_REGISTRY,
    _DEFER_VALIDATE,
    ConfigError,
    ConfigGroup,
    canonical_mapping,
    canonical_path,
    check_value,
    constructor_kwargs,
    deferred_registry_checks,
    deferred_validation,
    option,
    option_help,
    resolved_type_hints,
    type_name,
    validate_tree,
)
from polyrl.core.dtypes import FLOAT_DTYPES
from polyrl.core.prompts import TRUNCATION_POLICIES, check_template_kwargs
from polyrl.models.archs import TINY_ARCHS

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "CriticConfig",
    "ConfigGroup",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "PolyRLConfig",
    "PrimeConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "TransferConfig",
    "canonical_mapping",
    "canonical_path",
    "check_value",
    "constructor_kwargs",
    "deferred_registry_checks",
    "deferred_validation",
    "option",
    "option_help",
    "resolved_type_hints",
    "type_name",
    "validate_tree",
]


def _import_user_modules(entries: Sequence[str]) -> None:
    """Import the user modules of ``trainer.imports`` (see :mod:`polyrl.core.plugins`)."""
    from polyrl.core.plugins import PluginImportError, import_plugins

    try:
        import_plugins(entries)
    except PluginImportError as exc:
        raise ConfigError(str(exc), key="trainer.imports") from None


def _require_nonempty(value: str, key: str) -> None:
    if not value.strip():
        raise ConfigError("must not be empty", key=key)


TINY_SIZES = ("nano", "micro", "small")
TASKS = (
    "",
    "arithmetic",
    "arithmetic_pairs",
    "countdown",
    "string_reverse",
    "string_sort",
    "code_simple",
    "visual_count",
)
TRUNCATIONS = TRUNCATION_POLICIES  # the rule's own list (polyrl.core.prompts)
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
DEVICES = ("auto", "cpu", "cuda")
WORKER_BACKENDS = ("ray", "local")
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULERS = ("constant", "linear", "cosine")
SFT_TRUNCATIONS = ("error", "filter", "right")
ROLLOUT_BACKENDS = ("native", "vllm", "sglang")
WEIGHT_TRANSPORTS = ("auto", "shm", "dist", "disk", "cuda_ipc")
ROLLOUT_PLACEMENTS = ("auto", "hybrid", "separate")
ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "prime",
    "turn_grpo",
)
PRIME_UPDATES = ("before", "after", "none")
KL_ESTIMATORS = ("k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs", "full")
KL_CONTROLLERS = ("fixed", "adaptive")
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov")
CURRICULA = ("none", "pass_rate")
ROLLOUT_RS_MODES = ("none", "token", "icepop", "sequence", "geometric")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")
PAIR_TRUNCATIONS = ("error", "filter")
AGENT_LOOPS = ("single_turn", "tool", "env", "openai_agent")
TOOLS = ("calculator", "countdown_check", "gsm8k_check", "python")
TOOL_PARSERS = ("hermes",)
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
PLACEMENTS = ("colocated", "separate")


@dataclasses.dataclass
class OptimConfig(ConfigGroup):
    """Optimizer, learning-rate schedule and gradient clipping of one trained model.

    Every group that trains a model holds one as its ``optim`` option, with that model's
    defaults (``actor.optim.lr`` is 1e-6, ``critic.optim.lr`` 1e-5); the class defaults are the
    actor's. The trainers build the engine's ``OptimizerConfig`` from it, and take
    ``EngineConfig.grad_clip`` from it, by :func:`constructor_kwargs` (``maps_to`` names the
    argument where the spelling differs). The old flat spellings (``actor.lr``) stay accepted
    through :data:`OPTIM_ALIASES`.
    """

    optimizer: str = option(
        "adamw", "Optimizer (OptimizerConfig.name).", choices=OPTIMIZERS, maps_to="name"
    )
    lr: float = option(1e-6, "Peak learning rate (OptimizerConfig.lr).", ge=0.0)
    weight_decay: float = option(
        0.0, "Decoupled weight decay (OptimizerConfig.weight_decay).", ge=0.0
    )
    lr_scheduler: str = option(
        "constant",
        "Learning-rate shape after warmup (OptimizerConfig.scheduler).",
        choices=LR_SCHEDULERS,
        maps_to="scheduler",
    )
    warmup_ratio: float = option(
        0.0,
        "Linear warmup as a fraction of the total steps (OptimizerConfig.warmup_ratio).",
        ge=0.0,
        lt=1.0,
    )
    min_lr_ratio: float = option(
        0.0,
        "Floor of the decayed learning rate as a fraction of lr (OptimizerConfig.min_lr_ratio).",
        ge=0.0,
        le=1.0,
    )
    grad_clip: float = option(
        1.0, "Max global gradient norm; 0 disables clipping (EngineConfig.grad_clip).", ge=0.0
    )


#: The flat spellings of the ``optim`` options (``actor.lr`` is ``actor.optim.lr``), kept as
#: aliases by every group that holds an ``optim``.
OPTIM_ALIASES = {f.name: f"optim.{f.name}" for f in dataclasses.fields(OptimConfig)}


#: The model-engine options that several groups declare (actor, sft, dpo, rm): name ->
#: (what it does, bounds). Each maps onto the ``EngineConfig`` field of the same name by
#: :func:`constructor_kwargs`; :func:`_engine_option` builds a group's field from it.
_ENGINE_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "dynamic_batching": (
        "Form micro-batches by token budget with padding removed, else of fixed rows",
        {},
    ),
    "micro_batch_size": ("Rows per micro-batch when dynamic_batching is off", {"ge": 1}),
    "max_tokens_per_micro_batch": (
        "Token budget of a micro-batch with dynamic batching",
        {"ge": 1},
    ),
    "gradient_checkpointing": ("Recompute activations in the backward pass", {}),
    "share_prefix": (
        "Run a prefix that rows share before their first trained token once per micro-batch, "
        "exact to rounding, off under gradient_checkpointing",
        {},
    ),
}


def _engine_option(name: str, default: Any, detail: str = "") -> Any:
    """Return the field of engine option ``name`` with a group's ``default``.

    ``detail`` says what the option means in that group (a unit, a lower bound, advice); the
    help names the ``EngineConfig`` field it sets.
    """
    what, bounds = _ENGINE_OPTIONS[name]
    detail = f"; {detail}" if detail else ""
    return option(default, f"{what}{detail} (EngineConfig.{name}).", **bounds)


#: Model-parallel sizes a trained role's engine takes (``ParallelismConfig`` fields): name ->
#: what it does.  The product with the data-parallel size must equal the role's rank count.
_PARALLEL_OPTIONS: dict[str, str] = {
    "tensor_parallel_size": (
        "Ranks splitting each layer's heads and MLP width and the LM head's vocabulary (llama, "
        "mistral, qwen2, qwen3); they train the same rows"
    ),
    "ulysses_sequence_parallel_size": (
        "Ranks splitting each packed micro-batch's tokens, attention heads exchanged by "
        "all-to-all (Ulysses); must divide the key/value heads; they train the same rows"
    ),
    "expert_parallel_size": (
        "Ranks splitting a mixture-of-experts layer's experts, taken from the data x "
        "sequence-parallel ranks"
    ),
}


def _parallel_option(name: str, detail: str = "") -> Any:
    """Return the field of model-parallel option ``name`` (default 1) for one role."""
    detail = f"; {detail}" if detail else ""
    return option(1, f"{_PARALLEL_OPTIONS[name]}{detail} (ParallelismConfig.{name}).", ge=1)


def _optim(help: str, **defaults: Any) -> Any:
    """Return the ``optim`` option of a group that trains a model, with its own ``defaults``."""
    return option(OptimConfig(**defaults), help)


@dataclasses.dataclass
class ModelConfig(ConfigGroup):
    """Which policy model to load, or which tiny random-init model to build."""

    path: str = option("", "Local Hugging Face model directory; empty builds a tiny model.")
    tiny_arch: str = option(
        "qwen2", "Architecture of the tiny model built when path is empty.", choices=TINY_ARCHS
    )
    tiny_size: str = option(
        "nano",
        "Tiny model size preset: nano ~0.3M, micro ~2.5M, small ~100M parameters.",
        choices=TINY_SIZES,
    )
    dtype: str = option("float32", "Parameter dtype of the model.", choices=FLOAT_DTYPES)
    compute_dtype: str = option(
        "auto",
        "Compute dtype of the training engines (mixed precision; master weights and optimizer "
        "stay in dtype): auto = bfloat16 on CUDA, dtype on CPU.",
        choices=("auto", *FLOAT_DTYPES),
    )
    trust_remote_code: bool = option(
        False, "Allow running modelling code shipped inside the model directory."
    )
    lora_rank: int = option(
        0,
        "LoRA rank of the policy (actor, SFT); 0 trains every weight. > 0 freezes the model and "
        "trains low-rank adapters (needs peft: pip install 'polyrl[lora]'); checkpoints hold "
        "the adapter, rollout replicas and export_hf get the merged weights, and the reference "
        "is the actor with its adapter disabled (no separate engine).",
        ge=0,
    )
    lora_alpha: float = option(
        16.0, "LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) * B @ A.", gt=0.0
    )
    target_modules: list[str] = option(
        ["all-linear"],
        "Layers that get a LoRA adapter: all-linear (every linear layer but the LM head) or "
        "module names such as [q_proj, v_proj].",
    )
    lora_dropout: float = option(
        0.0, "Dropout on the LoRA branch's input while training.", ge=0.0, lt=1.0
    )
    lora_export_adapter: bool = option(
        True,
        "With LoRA, the exported model directory also holds the adapter alone (peft format) "
        "in its 'adapter' folder.",
    )
    freeze_vision_tower: bool = option(
        False,
        "Vision-language models: keep the vision tower (model.visual.*) fixed while training; "
        "its weights get no gradient and are left out of the optimizer. Refused for a text "
        "model.",
    )

    def validate(self) -> None:
        """Check target_modules names layers (all-linear alone)."""
        names = self.target_modules
        if not names or not all(n.strip() for n in names):
            raise ConfigError(
                "must be all-linear or a list of module names, got an empty name or list",
                key="target_modules",
            )
        if "all-linear" in names and len(names) > 1:
            raise ConfigError(f"all-linear stands alone, got {names}", key="target_modules")


@dataclasses.dataclass
class DataConfig(ConfigGroup):
    """Training and validation prompts: files or a built-in generated task, and batching."""

    task: str = option(
        "",
        "Generated task to train on (built-in or registered); empty means read train_files.",
        choices=TASKS,
        registry="polyrl.data.tasks:TASKS",
    )
    train_files: list[str] = option([], "Training data files (parquet or jsonl).")
    val_files: list[str] = option([], "Validation data files (parquet or jsonl).")
    task_options: dict[str, Any] = option(
        {}, "Keyword options of the generated task, e.g. {max_digits: 1, ops: '+'}."
    )
    num_train: int = option(1000, "Number of training examples to generate for a task.", ge=1)
    num_val: int = option(100, "Number of validation examples to generate for a task.", ge=0)
    data_dir: str = option(
        "", "Directory for generated task files; empty means under trainer.output_dir."
    )
    prompt_key: str = option("prompt", "Column holding the prompt in the data files.")
    max_prompt_length: int = option(512, "Maximum prompt length in tokens.", ge=1)
    max_response_length: int = option(512, "Maximum response length in tokens.", ge=1)
    train_batch_size: int = option(32, "Prompts per training step.", ge=1)
    val_batch_size: int = option(64, "Prompts per validation batch.", ge=1)
    truncation: str = option(
        "error",
        "What to do with prompts over max_prompt_length: raise, drop, or cut left/right.",
        choices=TRUNCATIONS,
    )
    shuffle: bool = option(True, "Shuffle training prompts every epoch.")
    train_file_weights: list[float] = option(
        [],
        "One weight per data.train_files entry: each file's share of the prompts drawn, "
        "whatever its size (OpenRLHF's prompt_probs); prompts are then drawn by weight, not "
        "epoch by epoch. Empty: every prompt alike.",
    )
    curriculum: str = option(
        "none",
        "Online difficulty curriculum: pass_rate draws a prompt always or never solved in its "
        "last data.curriculum_window steps data.curriculum_min_weight times as often as one "
        "solved half the time (weight max(min_weight, 4p(1-p)) of its pass rate p).",
        choices=CURRICULA,
    )
    curriculum_window: int = option(8, "Curriculum: outcomes kept per prompt.", ge=1)
    curriculum_min_weight: float = option(
        0.1, "Curriculum: weight of a prompt always or never solved.", gt=0.0, le=1.0
    )
    seed: int = option(
        -1, "Seed for data shuffling and generation; -1 uses the top-level seed.", ge=-1
    )
    template_string_prompts: bool = option(
        True,
        "Render a prompt given as a plain string through the chat template as one user "
        "message; false tokenizes it as it is, as TRL does with its 'standard' format (the "
        "TRL-style trainers, GRPOTrainer and the others, set false). Chat-message prompts "
        "are always templated.",
    )
    apply_chat_template_kwargs: dict[str, Any] = option(
        {},
        "Extra arguments of the tokenizer's apply_chat_template wherever a chat is rendered "
        "(the RL dataset, every agent loop, SFT and DPO/RM data), e.g. {enable_thinking: "
        "false} for Qwen3; verl's key "
        "of the same name. May not set tokenize, add_generation_prompt, tools, conversation, "
        "return_dict or return_tensors (polyrl sets them).",
    )
    image_key: str = option(
        "images",
        "Column holding a row's images (a list of {bytes}/{path} dicts, bytes or base64), used "
        "when the model is a vision-language model; a row without it may have TRL's one-image "
        "'image' column. Prompt strings mark each image's place with <image>. verl's key.",
    )
    video_key: str = option(
        "videos",
        "Column holding a row's videos, each a list of frames (images); prompt strings mark "
        "each video's place with <video>. verl's key.",
    )
    image_min_pixels: int = option(
        0,
        "Smallest image area (width x height) after the processor's resize; more pixels mean "
        "more image tokens. 0 keeps the model's preprocessor setting.",
        ge=0,
    )
    image_max_pixels: int = option(
        0,
        "Largest image area (width x height) after the processor's resize, bounding an "
        "image's tokens (about pixels / (patch x merge)^2). 0 keeps the model's setting.",
        ge=0,
    )

    def validate(self) -> None:
        """Check the prompt column, the template arguments and the file weights."""
        _require_nonempty(self.prompt_key, "prompt_key")
        _require_nonempty(self.image_key, "image_key")
        _require_nonempty(self.video_key, "video_key")
        if 0 < self.image_max_pixels < self.image_min_pixels:
            raise ConfigError(
                f"image_min_pixels ({self.image_min_pixels}) is larger than image_max_pixels "
                f"({self.image_max_pixels})",
                key="image_min_pixels",
            )
        weights = self.train_file_weights
        if weights and (any(w < 0 for w in weights) or sum(weights) <= 0):
            raise ConfigError(
                f"invalid value {weights}; weights must be >= 0 and not all 0",
                key="train_file_weights",
            )
        if weights and self.train_files and len(weights) != len(self.train_files):
            raise ConfigError(
                f"{len(weights)} weight(s) for {len(self.train_files)} train_files; give one each",
                key="train_file_weights",
            )
        try:
            check_template_kwargs(self.apply_chat_template_kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc), key="apply_chat_template_kwargs") from None


@dataclasses.dataclass
class RewardConfig(ConfigGroup):
    """How responses are scored."""

    custom_function: str = option(
        "", "User reward function as 'path/to/file.py:function'; empty uses built-in scorers."
    )
    timeout_s: float = option(10.0, "Seconds allowed to score one response.", gt=0.0)
    num_workers: int = option(1, "Reward worker processes; 0 scores in the calling process.", ge=0)
    error_reward: float = option(0.0, "Reward given when scoring raises or times out.")
    max_failure_fraction: float = option(
        0.5,
        "Stop the run when more than this fraction of a batch's samples fail to score "
        "(raise, time out or return garbage); 1 never stops.",
        ge=0.0,
        le=1.0,
    )
    overlong_buffer_len: int = option(
        0,
        "DAPO soft overlong punishment: penalise the last N tokens before the length cap "
        "linearly (0 turns it off).",
        ge=0,
    )
    overlong_penalty_factor: float = option(
        1.0, "Penalty at the length cap when overlong_buffer_len > 0.", ge=0.0
    )
    rule_weight: float = option(
        1.0,
        "Weight of the rule-based score (registered scorers or custom_function) in the reward; "
        "0 skips rule scoring (a reward model or judge alone).",
    )
    model_path: str = option(
        "",
        "Scalar reward model: a local Hugging Face *ForSequenceClassification directory "
        "(num_labels=1); empty: none.",
    )
    model_weight: float = option(1.0, "Weight of the reward model's score in the reward.")
    model_device: str = option(
        "auto", "Device of the reward model (auto: CUDA when available).", choices=DEVICES
    )
    model_dtype: str = option(
        "float32", "Parameter dtype of the reward model.", choices=FLOAT_DTYPES
    )
    model_batch_size: int = option(16, "Texts per reward-model forward pass.", ge=1)
    model_max_length: int = option(
        4096, "Reward-model inputs are cut to this many tokens (from the left).", ge=1
    )
    judge_template: str = option(
        "",
        "Generative judge prompt with {prompt}, {response} and {ground_truth}; empty: no judge.",
    )
    judge_url: str = option(
        "", "OpenAI-compatible server of the judge; empty: the policy's own rollout replicas."
    )
    judge_model: str = option("", "Model name sent to judge_url (empty: the server's default).")
    judge_parse: str = option(
        "yes_no",
        "How a verdict becomes a score: yes_no, number (divided by judge_max_score), or a "
        "regular expression whose first group is yes/no or a number.",
    )
    judge_max_score: float = option(1.0, "A numeric verdict is divided by this.", gt=0.0)
    judge_weight: float = option(1.0, "Weight of the judge's score in the reward.")
    judge_max_tokens: int = option(64, "Longest verdict in tokens.", ge=1)
    judge_temperature: float = option(0.0, "Sampling temperature of the judge.", ge=0.0)
    judge_timeout_s: float = option(
        60.0, "Seconds a verdict may take; a late one scores 0 and counts as a failure.", gt=0.0
    )

    def validate(self) -> None:
        """Check custom_function's form, the judge template's fields and parse expression."""
        spec = self.custom_function
        if spec:
            path, sep, func = spec.rpartition(":")
            if not sep or not path.strip() or not func.strip() or not func.isidentifier():
                raise ConfigError(
                    f"invalid value {spec!r}; expected 'path/to/file.py:function_name'",
                    key="custom_function",
                )
        if self.judge_template:
            from polyrl.reward.judge import JUDGE_PARSERS, check_template

            try:
                check_template(self.judge_template)
            except ValueError as exc:
                raise ConfigError(str(exc), key="judge_template") from None
            if self.judge_parse not in JUDGE_PARSERS:
                try:
                    re.compile(self.judge_parse)
                except re.error as exc:
                    raise ConfigError(
                        f"invalid value {self.judge_parse!r}: expected yes_no, number or a "
                        f"regular expression ({exc})",
                        key="judge_parse",
                    ) from None
        if self.judge_url and not self.judge_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"invalid value {self.judge_url!r}; expected an http:// or https:// URL",
                key="judge_url",
            )


@dataclasses.dataclass
class RolloutConfig(ConfigGroup):
    """Default sampling parameters for rollouts."""

    n: int = option(1, "Responses sampled per prompt.", ge=1)
    temperature: float = option(1.0, "Sampling temperature; 0 means greedy.", ge=0.0)
    top_p: float = option(1.0, "Nucleus sampling probability mass.", gt=0.0, le=1.0)
    top_k: int = option(-1, "Sample from the k most likely tokens; -1 turns it off.", ge=-1)
    min_p: float = option(
        0.0, "Drop tokens below this fraction of the top token's probability.", ge=0.0, le=1.0
    )
    max_new_tokens: int = option(512, "Maximum tokens generated per response.", ge=1)
    repetition_penalty: float = option(
        1.0, "Penalty on already generated tokens; 1 turns it off.", gt=0.0
    )
    seed: int = option(-1, "Sampling seed; -1 uses the top-level seed.", ge=-1)
    stop_token_ids: list[int] = option([], "Token ids that end a response besides EOS.")
    backend: str = option("native", "Rollout server backend.", choices=ROLLOUT_BACKENDS)
    replicas: int = option(
        0,
        "Rollout server replicas the RL trainer starts; 0 = auto: one per gpus_per_replica of "
        "the trainer's GPUs in hybrid placement, else 1.",
        ge=0,
    )
    urls: list[str] = option(
        [], "Already running rollout servers to use instead of starting replicas."
    )
    device: str = option(
        "auto",
        "Device the replicas serve on; auto = cuda when the trainer trains on CUDA, else cpu.",
        choices=DEVICES,
    )
    dtype: str = option(
        "auto",
        "Weights and KV-cache dtype of the replicas, independent of the training dtype; auto = "
        "bfloat16 on CUDA, model.dtype on CPU.",
        choices=("auto", *FLOAT_DTYPES),
    )
    placement: str = option(
        "auto",
        "hybrid: each replica shares the GPUs of trainer ranks and sleeps while the engines "
        "train (verl's default); separate: replicas get GPUs of their own. auto = hybrid on "
        "CUDA, separate on CPU.",
        choices=ROLLOUT_PLACEMENTS,
    )
    tensor_parallel_size: int = option(
        1, "GPUs one replica shards its model over (vllm, sglang).", ge=1
    )
    gpus_per_replica: int = option(0, "GPUs each replica holds; 0 = tensor_parallel_size.", ge=0)
    gpu_memory_utilization: float = option(
        0.5,
        "Fraction of each GPU a vllm/sglang replica may take (weights and KV cache); leave "
        "room for training in hybrid placement.",
        gt=0.0,
        le=1.0,
    )
    max_model_len: int = option(
        0, "Longest prompt + response a replica accepts; 0 = the model's own limit.", ge=0
    )
    enforce_eager: bool = option(
        False, "vllm/sglang on CUDA: no CUDA graphs (slower decoding, faster start-up)."
    )
    enable_prefix_caching: bool = option(
        True, "Reuse the KV cache of shared prompt prefixes (the n samples of one prompt)."
    )
    max_num_seqs: int = option(256, "Most sequences a native replica decodes at once.", ge=1)
    num_threads: int = option(
        0, "Torch threads of each native replica; 0 keeps torch's default (all cores).", ge=0
    )
    matmul_dtype: str = option(
        "auto",
        "Dtype of the native replicas' projection matmuls (norms, attention, KV cache and LM "
        "head stay in model.dtype); auto = the training engines' compute dtype.",
        choices=("auto", *FLOAT_DTYPES),
    )
    weight_transport: str = option(
        "auto",
        "How the trainer pushes new weights to the replicas. auto picks by placement: "
        "cuda_ipc in hybrid placement on GPUs (each replica from the engine rank on its GPU), "
        "dist over NCCL between GPUs otherwise, shm on one CPU host, dist over gloo between "
        "hosts.",
        choices=WEIGHT_TRANSPORTS,
    )
    weight_bucket_mb: float = option(64.0, "Bucket size of a weight transfer in MiB.", gt=0.0)
    weight_sync_mode: str = option(
        "staged",
        "staged: atomic switch, one model of extra replica memory; inplace: two buckets, "
        "replica paused during the transfer.",
        choices=("staged", "inplace"),
    )
    sleep_during_training: bool = option(
        False,
        "Release the replicas' KV cache (and, on GPUs, their weights) while the engines train; "
        "always on in hybrid placement.",
    )
    val_n: int = option(1, "Responses per validation prompt (k of mean@k / pass@k).", ge=1)
    val_temperature: float = option(0.0, "Validation sampling temperature; 0 means greedy.", ge=0.0)
    # Lost replicas (the trainer's own; not rollout.urls): restarts and how long they may take.
    restart_timeout_s: float = option(
        300.0,
        "Seconds a lost replica may take to restart and take the current weights; with no "
        "replica left, generation waits that long before the run fails naming the replica.",
        gt=0.0,
    )
    max_replica_restarts: int = option(
        3,
        "Restarts of each replica the trainer started after it dies (crash, kill); one more "
        "loss fails the run with the replica's log tail. 0: never restart.",
        ge=0,
    )

    def validate(self) -> None:
        """Reject top_k == 0, native tensor parallelism, too few GPUs per replica, and so on.

        A matmul dtype applies to the native backend only.
        """
        if self.top_k == 0:
            raise ConfigError("invalid value 0; use -1 to turn top_k off, or k >= 1", key="top_k")
        if self.tensor_parallel_size > 1 and self.backend == "native":
            raise ConfigError(
                f"{self.tensor_parallel_size}: the native backend serves a model on one device; "
                "use backend vllm or sglang for tensor parallelism, or set it to 1",
                key="tensor_parallel_size",
            )
        if self.gpus_per_replica and self.gpus_per_replica < self.tensor_parallel_size:
            raise ConfigError(
                f"{self.gpus_per_replica} is fewer than tensor_parallel_size "
                f"({self.tensor_parallel_size}); each replica needs a GPU per shard",
                key="gpus_per_replica",
            )
        if self.matmul_dtype != "auto" and self.backend != "native":
            raise ConfigError(
                f"applies to the native backend only (backend is {self.backend!r}); leave it "
                "at auto",
                key="matmul_dtype",
            )


@dataclasses.dataclass
class TrainerConfig(ConfigGroup):
    """Run length, bookkeeping and logging."""

    project_name: str = option("polyrl", "Project name used by loggers.")
    experiment_name: str = option("default", "Experiment (run) name used by loggers.")
    output_dir: str = option("outputs", "Directory for checkpoints, logs and generated files.")
    total_steps: int = option(0, "Training steps; 0 runs total_epochs over the data.", ge=0)
    total_epochs: int = option(1, "Passes over the training data when total_steps is 0.", ge=1)
    loggers: list[str] = option(["console"], "Metric sinks to write to.", choices=LOGGERS)
    save_freq: int = option(0, "Save a checkpoint every N steps (and at the last); 0: none.", ge=0)
    save_interval_s: float = option(
        1800.0,
        "Also save a checkpoint after a step that ends this many seconds after the last save "
        "(or the start), so that a restart (trainer.max_restarts) or a relaunch redoes at most "
        "that much work; 0: steps only (trainer.save_freq).",
        ge=0.0,
    )
    test_freq: int = option(0, "Validate every N steps; 0 never validates.", ge=0)
    device: str = option(
        "auto", "Device to train on; auto picks cuda when available.", choices=DEVICES
    )
    resume: bool = option(
        True,
        "Resume from the latest checkpoint in output_dir when there is one (a relaunch "
        "continues the run; a fresh output_dir starts fresh); false always starts over.",
    )
    resume_mode: str = option(
        "",
        "'auto' (latest checkpoint in output_dir, if any), 'never', or a checkpoint path; "
        "empty follows trainer.resume (true means auto).",
    )
    max_ckpt_to_keep: int = option(
        0, "Keep only the newest N checkpoints in output_dir; 0 keeps all.", ge=0
    )
    max_restarts: int = option(
        2,
        "RL runs: times the run rebuilds its workers and continues from its last checkpoint "
        "(from the start without one; see trainer.save_freq) after a worker dies; 0 stops at "
        "the first death, a rollout replica's Ray actor or a reward worker's included (a "
        "replica's crashed server is still restarted: rollout.max_replica_restarts).",
        ge=0,
    )
    restart_backoff_s: float = option(
        10.0, "Seconds to wait before the k-th rebuild after a worker death, times k.", ge=0.0
    )
    call_timeout_s: float = option(
        3600.0,
        "RL runs: an engine call (update, log-probs, save) with no result after this many "
        "seconds counts as a dead worker although it still answers health checks (hung); "
        "the run is rebuilt as after a death (trainer.max_restarts). 0: no limit.",
        ge=0.0,
    )
    val_before_train: bool = option(
        True, "Validate once before the first step (when validation is on and not resuming)."
    )
    plot_metrics: list[str] = option(
        [], "Metric keys drawn in the learning-curve PNG at the end; empty uses the defaults."
    )
    nnodes: int = option(1, "Nodes to train on; world size is nnodes * n_gpus_per_node.", ge=1)
    n_gpus_per_node: int = option(
        1, "Ranks per node: GPUs, or CPU worker processes when training on CPU.", ge=1
    )
    worker_backend: str = option(
        "ray",
        "Controller backend when the world size is > 1: Ray actors, or local subprocesses.",
        choices=WORKER_BACKENDS,
    )
    placement: str = option(
        "colocated",
        "RL engines (actor, reference, critic) in one process per rank, or one group each.",
        choices=PLACEMENTS,
    )
    export_hf: bool = option(
        True, "RL: write the final policy as a Hugging Face directory to output_dir/hf_model."
    )
    critic_warmup: int = option(
        0, "RL steps that train only the critic before the actor starts updating.", ge=0
    )
    mode: str = option(
        "sync",
        "RL: sync (generate, then train), one_step_off (step k+1 generates while step k "
        "trains) or async (rollout runs ahead into a replay buffer; see async_rl).",
        choices=("sync", "one_step_off", "async"),
    )
    imports: list[str] = option(
        [],
        "User modules (names on PYTHONPATH, or .py files) imported before the config is "
        "checked and in every worker process: they register estimators, policy losses, "
        "scorers, agent loops, envs, tools or tasks.",
    )

    @property
    def world_size(self) -> int:
        """Training ranks: ``nnodes * n_gpus_per_node``."""
        return self.nnodes * self.n_gpus_per_node

    def validate(self) -> None:
        """Check names are set and loggers are not repeated."""
        _require_nonempty(self.project_name, "project_name")
        _require_nonempty(self.experiment_name, "experiment_name")
        _require_nonempty(self.output_dir, "output_dir")
        dupes = sorted({x for x in self.loggers if self.loggers.count(x) > 1})
        if dupes:
            raise ConfigError(f"repeated logger(s): {', '.join(dupes)}", key="loggers")


@dataclasses.dataclass
class SFTConfig(ConfigGroup):
    """Supervised fine-tuning on chat data (``polyrl sft``): sequence layout and optimisation."""

    aliases = OPTIM_ALIASES

    messages_key: str = option(
        "messages", "Column holding the chat messages (list of role/content dicts) in SFT files."
    )
    max_length: int = option(
        0,
        "Longest conversation in tokens; 0 uses data.max_prompt_length + data.max_response_length.",
        ge=0,
    )
    truncation: str = option(
        "error",
        "Conversations over max_length: raise, drop them, or cut the end off.",
        choices=SFT_TRUNCATIONS,
    )
    total_steps: int = option(
        0, "SFT steps; 0 follows trainer.total_steps (the demo sets its warm-up length here).", ge=0
    )
    optim: OptimConfig = _optim(
        "Optimizer, schedule and gradient clipping.",
        lr=1e-5,
        weight_decay=0.01,
        lr_scheduler="cosine",
    )
    dynamic_batching: bool = _engine_option("dynamic_batching", True)
    micro_batch_size: int = _engine_option("micro_batch_size", 4)
    max_tokens_per_micro_batch: int = _engine_option(
        "max_tokens_per_micro_batch", 8192, "at least max_length"
    )
    gradient_checkpointing: bool = _engine_option("gradient_checkpointing", False)
    share_prefix: bool = _engine_option(
        "share_prefix", False, "SFT rows rarely share more than the chat header"
    )
    export_hf: bool = option(
        True, "Write the final model as a Hugging Face directory to output_dir/hf_model."
    )

    def validate(self) -> None:
        """Check the messages column name is set."""
        _require_nonempty(self.messages_key, "messages_key")


@dataclasses.dataclass
class PairwiseConfig(ConfigGroup):
    """Options shared by the trainers on preference pairs (``dpo`` and ``rm`` groups)."""

    aliases = OPTIM_ALIASES

    chosen_key: str = option("chosen", "Column holding the preferred completion.")
    rejected_key: str = option("rejected", "Column holding the dispreferred completion.")
    max_length: int = option(
        0,
        "Longest prompt + completion in tokens; 0 uses data.max_prompt_length + "
        "data.max_response_length.",
        ge=0,
    )
    truncation: str = option(
        "error",
        "Pairs with a sequence over max_length: raise, or drop them.",
        choices=PAIR_TRUNCATIONS,
    )
    total_steps: int = option(0, "Training steps; 0 follows trainer.total_steps.", ge=0)
    optim: OptimConfig = _optim("Optimizer, schedule and gradient clipping.", lr_scheduler="linear")
    dynamic_batching: bool = _engine_option("dynamic_batching", True)
    micro_batch_size: int = _engine_option("micro_batch_size", 4, "two rows per pair")
    max_tokens_per_micro_batch: int = _engine_option(
        "max_tokens_per_micro_batch", 8192, "at least 2 * max_length: a pair's rows share one"
    )
    gradient_checkpointing: bool = _engine_option("gradient_checkpointing", False)
    share_prefix: bool = _engine_option("share_prefix", False, "here each pair's shared prompt")
    export_hf: bool = option(
        True, "Write the final model as a Hugging Face directory to output_dir/hf_model."
    )

    def validate(self) -> None:
        """Check the column names are set and differ."""
        _require_nonempty(self.chosen_key, "chosen_key")
        _require_nonempty(self.rejected_key, "rejected_key")
        if self.chosen_key == self.rejected_key:
            raise ConfigError(
                f"names the same column as chosen_key ({self.chosen_key!r})", key="rejected_key"
            )


@dataclasses.dataclass
class DPOConfig(PairwiseConfig):
    """Direct preference optimisation (``polyrl dpo``); names follow TRL's ``DPOConfig``."""

    beta: float = option(
        0.1, "Inverse temperature of the implicit reward beta * (logp - ref_logp).", gt=0.0
    )
    loss_type: str = option(
        "sigmoid",
        "sigmoid (DPO), ipo, or simpo (reference-free, length-normalised); or registered "
        "(register_dpo_loss).",
        choices=DPO_LOSS_TYPES,
        registry="polyrl.algo.preference:DPO_LOSSES",
    )
    label_smoothing: float = option(
        0.0, "Probability that a preference label is flipped (sigmoid, simpo).", ge=0.0, lt=0.5
    )
    simpo_gamma: float = option(0.5, "SimPO's target reward margin gamma.", ge=0.0)
    ref_model_path: str = option(
        "", "Reference model directory; empty: the policy's initial weights, frozen."
    )
    precompute_ref_log_probs: bool = option(
        False,
        "Compute every pair's reference log-probs before training and free the reference "
        "model (else each pair's are computed when first drawn, and kept).",
    )


@dataclasses.dataclass
class RMConfig(PairwiseConfig):
    """Reward-model training on pairs (``polyrl rm``); names follow TRL's ``RewardConfig``."""

    optim: OptimConfig = _optim(
        "Optimizer, schedule and gradient clipping.", lr=1e-5, lr_scheduler="linear"
    )
    margin_key: str = option(
        "margin",
        "Column of per-pair margins m in -logsigmoid(r_c - r_r - m); rows without it use 0.",
    )
    center_rewards_coefficient: float = option(
        0.0, "Weight of the (r_c + r_r)^2 term that keeps rewards centred on zero.", ge=0.0
    )


@dataclasses.dataclass
class AlgorithmConfig(ConfigGroup):
    """RL algorithm: advantage estimator and KL-in-reward settings (``polyrl train``)."""

    adv_estimator: str = option(
        "grpo",
        "Advantage estimator (gae needs a critic; remax a greedy rollout), or any registered one.",
        choices=ADV_ESTIMATORS,
        registry="polyrl.algo.advantages:ADVANTAGE_ESTIMATORS",
    )
    norm_adv_by_std: bool = option(
        True, "GRPO: divide by the group std (false with seq-mean-token-sum-norm is Dr. GRPO)."
    )
    gamma: float = option(
        1.0, "Discount factor (gae, reinforce_plus_plus, turn_grpo's turns).", ge=0.0, le=1.0
    )
    lam: float = option(1.0, "GAE lambda.", ge=0.0, le=1.0)
    use_kl_in_reward: bool = option(False, "Subtract a KL penalty to the reference from rewards.")
    kl_penalty: str = option("k1", "KL estimator of the reward penalty.", choices=KL_ESTIMATORS)
    kl_ctrl: str = option("fixed", "KL coefficient controller.", choices=KL_CONTROLLERS)
    kl_coef: float = option(0.001, "(Initial) KL coefficient of the reward penalty.", ge=0.0)
    target_kl: float = option(0.1, "Adaptive controller: target KL.", gt=0.0)
    kl_horizon: int = option(10000, "Adaptive controller: horizon in samples.", ge=1)
    filter_groups: bool = option(
        False,
        "DAPO dynamic sampling: train only on prompts whose responses differ in "
        "filter_groups_metric, sampling more prompts until the batch is full.",
    )
    filter_groups_metric: str = option(
        "acc", "What must vary within a group to keep it.", choices=("acc", "score")
    )
    max_gen_batches: int = option(
        10, "Dynamic sampling: generation rounds per step at most (then uninformative fill).", ge=1
    )
    gen_batch_size: int = option(
        0,
        "Dynamic sampling: prompts generated per round, before filtering (verl's "
        "data.gen_batch_size); 0 is data.train_batch_size. Epochs count rounds of this size.",
        ge=0,
    )
    rollout_is: str = option(
        "none",
        "Truncated importance sampling from the rollout's log-probs to the trainer's old "
        "policy (corrects rollout/training numerics): per token, per sequence, or none.",
        choices=("none", "token", "sequence"),
    )
    rollout_is_threshold: float = option(
        2.0, "Rollout importance weights are truncated at this value.", ge=1.0
    )
    rollout_rs: str = option(
        "none",
        "Rollout masks on the rollout/trainer ratio rho = pi_old / pi_rollout out of the band "
        "[rollout_rs_threshold_lower, rollout_rs_threshold]: token masks those tokens (MIS), "
        "icepop masks them and weights the rest by rho (IcePop), sequence rejects responses "
        "whose product of rho leaves it, geometric those whose geometric mean of rho does; "
        "metrics actor/rollout_rs_*.",
        choices=ROLLOUT_RS_MODES,
    )
    rollout_rs_threshold: float = option(
        2.0, "Upper end of the rollout mask's band (geometric: near 1, e.g. 1.001).", ge=1.0
    )
    rollout_rs_threshold_lower: float = option(
        0.0, "Lower end of the rollout mask's band; 0 is 1 / rollout_rs_threshold.", ge=0.0, le=1.0
    )
    rollout_token_veto_threshold: float = option(
        0.0,
        "Reject every response with a token whose rollout/trainer ratio is below this "
        "(counted in actor/rollout_rs_seq_rejected_frac); 0 turns it off.",
        ge=0.0,
        le=1.0,
    )
    distill_coef: float = option(
        0.0,
        "On-policy distillation: weight c of the teacher's per-token reverse KL, in the "
        "advantage, A_t - c (logp_student - logp_teacher) on each sampled token, or with "
        "algorithm.teacher_topk as a loss term; 0 is off. Needs a teacher "
        "(algorithm.teacher_model_path or algorithm.teachers).",
        ge=0.0,
    )
    teacher_model_path: str = option(
        "",
        "On-policy distillation: the teacher (same tokenizer as the policy). With "
        "teacher_source=engine a model directory the reference role loads (KL terms to the "
        "reference are then to the teacher too); with server a model directory (the run "
        "starts a rollout server for it) or the http(s) URL of a running one.",
    )
    teacher_source: str = option(
        "engine",
        "Where the distillation teacher runs: engine (the reference model-engine role) or "
        "server (a rollout server scoring each sample through /generate with prompt "
        "log-probs, so a large teacher can live on its own replicas).",
        choices=("engine", "server"),
    )
    teacher_topk: int = option(
        0,
        "On-policy distillation against the teacher's top-k distribution: k > 0 adds the "
        "loss term c * KL(student || teacher) over the teacher's k most likely tokens at each "
        "response position (both renormalised there) instead of the sampled-token advantage; "
        "0 is the sampled-token estimate. Needs teacher_source=server.",
        ge=0,
        le=128,
    )
    teachers: dict[str, str] = option(
        {},
        "Multi-teacher distillation: data_source -> teacher (model directory or server URL); "
        "each row is scored by its data_source's teacher, rows of other sources by "
        "algorithm.teacher_model_path. Needs teacher_source=server.",
    )
    overlong_filter: bool = option(
        False,
        "DAPO overlong filtering: responses cut at the length cap (finish reason 'length') "
        "are masked out of the loss (SkyRL: apply_overlong_filtering).",
    )


#: Model-engine backends a run can pick (``actor.engine_backend``).
ENGINE_BACKENDS = ("fsdp2", "megatron")


@dataclasses.dataclass
class MegatronParallelConfig(ConfigGroup):
    """Model-parallel layout of the Megatron-Core engine backend (actor.engine_backend=megatron).

    The names are verl's (``actor_rollout_ref.actor.megatron.*``); the ranks left over are
    data-parallel replicas.
    """

    tensor_model_parallel_size: int = option(
        1,
        "Tensor-parallel ranks per model replica (ParallelismConfig.tensor_parallel_size); they "
        "see the same rows.",
        ge=1,
        maps_to="tensor_parallel_size",
    )
    pipeline_model_parallel_size: int = option(
        1, "Pipeline stages; only 1 is supported yet.", ge=1, le=1, maps_to="pipeline_parallel_size"
    )
    expert_model_parallel_size: int = option(
        1,
        "Ranks the MoE experts are split over (ParallelismConfig.expert_parallel_size).",
        ge=1,
        maps_to="expert_parallel_size",
    )
    expert_tensor_parallel_size: int = option(
        1,
        "Tensor-parallel ranks of each expert (ParallelismConfig.expert_tensor_parallel_size).",
        ge=1,
        maps_to="expert_tensor_parallel_size",
    )
    context_parallel_size: int = option(
        1,
        "Context-parallel ranks; only 1 is supported yet.",
        ge=1,
        le=1,
        maps_to="context_parallel_size",
    )


@dataclasses.dataclass
class ActorConfig(ConfigGroup):
    """Policy (actor) optimisation in RL: loss, clipping, mini-batches and optimizer."""

    aliases = OPTIM_ALIASES

    policy_loss: str = option(
        "ppo_clip",
        "Policy loss, built-in or registered (register_policy_loss): ppo_clip (PPO clip), gspo "
        "(sequence ratio), cispo (clipped stop-gradient IS weight), sapo (soft sigmoid gate), "
        "gmpo (geometric mean of token ratios), gpg (plain policy gradient), clip_cov / kl_cov "
        "(covariance-selected tokens detached / KL-penalised).",
        choices=POLICY_LOSSES,
        registry="polyrl.algo.losses:POLICY_LOSSES",
    )
    loss_agg_mode: str = option(
        "token-mean", "How per-token losses are reduced.", choices=LOSS_AGG_MODES
    )
    clip_ratio_low: float = option(0.2, "Lower clip range of the ratio (1 - low).", ge=0.0)
    clip_ratio_high: float = option(
        0.2, "Upper clip range of the ratio (1 + high); above low is clip-higher.", ge=0.0
    )
    clip_ratio_c: float = option(
        3.0, "Dual-clip bound on the loss for negative advantages; 0 turns it off.", ge=0.0
    )
    tau_pos: float = option(
        1.0, "sapo: gate temperature of tokens with positive advantages.", gt=0.0
    )
    tau_neg: float = option(
        1.05, "sapo: gate temperature of the others (larger damps them more).", gt=0.0
    )
    clip_cov_ratio: float = option(
        2e-4, "clip_cov: share of tokens detached, drawn from the candidates.", ge=0.0, le=1.0
    )
    clip_cov_lb: float = option(
        1.0, "clip_cov: candidates have a log-prob/advantage covariance at least this."
    )
    clip_cov_ub: float = option(5.0, "clip_cov: and at most this.")
    kl_cov_ratio: float = option(
        2e-4, "kl_cov: share of tokens, of largest covariance, penalised.", ge=0.0, le=1.0
    )
    kl_cov_coef: float = option(
        0.1, "kl_cov: weight of the |log-ratio| penalty (verl: ppo_kl_coef).", ge=0.0
    )
    entropy_coeff: float = option(0.0, "Weight of the entropy bonus.", ge=0.0)
    use_kl_loss: bool = option(False, "Add a KL-to-reference term to the policy loss.")
    kl_loss_coef: float = option(0.001, "Weight of the KL loss term.", ge=0.0)
    kl_loss_type: str = option("k3", "KL estimator of the loss term.", choices=KL_ESTIMATORS)
    router_replay: bool = option(
        False,
        "MoE models: the rollout returns the experts each token was routed to and the actor's "
        "forwards (old log-probs and updates) force the same experts (R3, rollout routing "
        "replay); needs the native rollout backend.",
    )
    router_aux_loss_coef: float = option(
        0.0,
        "MoE models: weight of the routers' load-balancing loss added to the policy loss "
        "(Switch-Transformer form, 1 at uniform load; reported as router_aux_loss).",
        ge=0.0,
    )
    ppo_mini_batch_size: int = option(
        0, "Prompts per optimizer step (times rollout.n rows); 0 is the whole batch.", ge=0
    )
    ppo_epochs: int = option(1, "Passes over each step's batch.", ge=1)
    optim: OptimConfig = _optim("Policy optimizer, schedule and gradient clipping.")
    max_tokens_per_micro_batch: int = _engine_option(
        "max_tokens_per_micro_batch", 16384, "the reference, critic and PRM use it too"
    )
    gradient_checkpointing: bool = _engine_option(
        "gradient_checkpointing", False, "the reference, critic and PRM use it too"
    )
    share_prefix: bool = _engine_option(
        "share_prefix",
        False,
        "here each prompt once for all its responses, logits from the first response token "
        "on, in the actor and the reference; opt-in: it changes rounding, and the demo lands "
        "lower with it",
    )
    engine_backend: str = option(
        "fsdp2",
        "Model-engine backend of the actor and the reference: fsdp2, or megatron (Megatron-Core, "
        "needs pip install 'polyrl[megatron]'; causal LMs without LoRA) (EngineConfig.backend).",
        choices=ENGINE_BACKENDS,
        maps_to="backend",
    )
    # maps_to: no constructor field of that name; the RL build turns it into the engine's
    # ParallelismConfig (EngineConfig.megatron holds other, backend-internal options).
    megatron: MegatronParallelConfig = option(
        MegatronParallelConfig,
        "Megatron-Core model-parallel layout (engine_backend=megatron).",
        maps_to="megatron_parallelism",
    )
    offload_params: bool = option(
        False,
        "Hybrid placement on GPUs: move the actor's parameters to host memory after each weight "
        "push, while the replicas generate (for models whose training state and replicas do "
        "not fit one GPU together; costs two host copies a step).",
    )
    offload_optimizer: bool = option(
        False,
        "Hybrid placement on GPUs: move the actor's optimizer state to host memory from the "
        "end of each update until the next (before the replicas wake).",
    )
    tensor_parallel_size: int = _parallel_option(
        "tensor_parallel_size", "the reference uses the actor's"
    )
    ulysses_sequence_parallel_size: int = _parallel_option(
        "ulysses_sequence_parallel_size", "the reference uses the actor's"
    )
    expert_parallel_size: int = _parallel_option(
        "expert_parallel_size", "the reference uses the actor's"
    )

    def validate(self) -> None:
        """Reject a bad dual-clip bound or Clip-Cov range, and parallel sizes the run cannot use."""
        if self.clip_cov_lb > self.clip_cov_ub:
            raise ConfigError(
                f"invalid value {self.clip_cov_lb}; above clip_cov_ub ({self.clip_cov_ub})",
                key="clip_cov_lb",
            )
        if 0.0 < self.clip_ratio_c <= 1.0:
            raise ConfigError(
                f"invalid value {self.clip_ratio_c}; dual clip needs > 1 (or 0 to turn it off)",
                key="clip_ratio_c",
            )
        split = {
            f.name: getattr(self.megatron, f.name)
            for f in dataclasses.fields(self.megatron)
            if getattr(self.megatron, f.name) != 1
        }
        if split and self.engine_backend != "megatron":
            raise ConfigError(
                f"{split} need engine_backend=megatron (fsdp2 shards data-parallel only)",
                key="megatron",
            )
        fsdp2_sizes = {
            key: getattr(self, key)
            for key in (
                "tensor_parallel_size",
                "ulysses_sequence_parallel_size",
                "expert_parallel_size",
            )
            if getattr(self, key, 1) != 1
        }
        if fsdp2_sizes and self.engine_backend == "megatron":
            raise ConfigError(
                f"{fsdp2_sizes} are the fsdp2 engine's sizes; with engine_backend=megatron set "
                "megatron.tensor_model_parallel_size / megatron.expert_model_parallel_size",
                key="engine_backend",
            )


@dataclasses.dataclass
class CriticConfig(ConfigGroup):
    """Value model (critic) optimisation, used by the gae estimator (PPO)."""

    aliases = OPTIM_ALIASES

    model_path: str = option("", "Critic initialisation; empty starts from the policy model.")
    cliprange_value: float = option(0.5, "Clip range of the value update.", ge=0.0)
    loss_agg_mode: str = option(
        "token-mean", "How per-token value losses are reduced.", choices=LOSS_AGG_MODES
    )
    ppo_epochs: int = option(1, "Passes over each step's batch.", ge=1)
    optim: OptimConfig = _optim("Value-model optimizer, schedule and gradient clipping.", lr=1e-5)
    tensor_parallel_size: int = _parallel_option("tensor_parallel_size")
    ulysses_sequence_parallel_size: int = _parallel_option("ulysses_sequence_parallel_size")
    expert_parallel_size: int = _parallel_option("expert_parallel_size")


@dataclasses.dataclass
class AgentConfig(ConfigGroup):
    """Multi-turn rollouts through agent loops (polyrl.agent) instead of single-turn generate."""

    enable: bool = option(False, "Roll out every sample through an agent loop.")
    default_loop: str = option(
        "single_turn",
        "Agent loop (built-in or registered) of samples without extra_info.agent_name.",
        choices=AGENT_LOOPS,
        registry="polyrl.agent.base:AGENT_LOOPS",
    )
    max_turns: int = option(4, "Most model turns per trajectory.", ge=1)
    tools: list[str] = option(
        ["calculator"],
        "Tools (built-in or registered) the tool loop offers.",
        choices=TOOLS,
        registry="polyrl.agent.tools:TOOLS",
    )
    tool_config: str = option(
        "",
        "A tool YAML in verl's format (tools: [{class_name, config, tool_schema}]): the tool "
        "loop offers its tools, named by their tool_schema, besides agent.tools.",
    )
    tool_parser: str = option(
        "hermes",
        "Parser (built-in or registered) of the model's tool calls.",
        choices=TOOL_PARSERS,
        registry="polyrl.agent.tool_loop:TOOL_PARSERS",
    )
    tool_timeout_s: float = option(10.0, "Seconds allowed per tool call.", gt=0.0)
    max_tool_response_tokens: int = option(
        128, "Tool responses longer than this are cut (and say so).", ge=1
    )
    max_concurrency: int = option(256, "Trajectories rolled out at once.", ge=1)
    entrypoint: str = option(
        "",
        "An agent written against the openai client, as module:function or file.py:function "
        "(async def agent(client: openai.AsyncOpenAI, task: dict) -> reward); set, it is the "
        "rollout: agent.enable and agent.default_loop=openai_agent follow unless given.",
    )
    timeout_s: float = option(
        300.0,
        "Seconds one openai_agent episode may take; a slower one is cancelled, counted "
        "(agent/timed_out) and not trained on.",
        gt=0.0,
    )
    non_extending: str = option(
        "split",
        "An openai_agent episode whose calls do not extend one another: split (one linked "
        "sample per extending chain of calls, each with the episode's reward and advantage) "
        "or refuse (counted in agent/non_extending, not trained on).",
        choices=("split", "refuse"),
    )

    def __post_init__(self) -> None:
        # `polyrl train grpo agent.entrypoint=m:f` alone makes the agent the rollout.
        if self.entrypoint and self.default_loop == "single_turn":
            object.__setattr__(self, "default_loop", "openai_agent")
        if self.entrypoint:
            object.__setattr__(self, "enable", True)
        super().__post_init__()

    def validate(self) -> None:
        """``openai_agent`` needs an entry point."""
        if self.default_loop == "openai_agent" and not self.entrypoint:
            raise ConfigError(
                "agent.default_loop=openai_agent needs agent.entrypoint=module:function",
                key="entrypoint",
            )


@dataclasses.dataclass
class TransferConfig(ConfigGroup):
    """The sample store between services (polyrl.transfer): the driver passes references only."""

    enable: bool = option(False, "Move step data through the transfer queue, not the driver.")
    backend: str = option(
        "auto",
        "Queue backend: auto (follows trainer.worker_backend), ray or local.",
        choices=("auto", "ray", "local"),
    )
    num_storage_units: int = option(2, "Storage actors the samples are sharded over.", ge=1)
    num_rollout_workers: int = option(
        2, "Workers that call the rollout servers and put responses into the queue.", ge=1
    )
    timeout_s: float = option(600.0, "Seconds a consumer waits for its samples.", gt=0.0)


@dataclasses.dataclass
class AsyncRLConfig(ConfigGroup):
    """Asynchronous RL (``trainer.mode=async``; also spelled ``async.*`` on the command line)."""

    max_staleness: int = option(
        1,
        "Most weight versions a trained sample may be behind the trained weights; generation "
        "pauses rather than exceed it (0: fresh weights only, still overlapped within a step).",
        ge=0,
    )
    partial_rollout: str = option(
        "continue",
        "Requests in flight when new weights arrive: continue on the new weights, or abort and "
        "resume from their partial tokens with the new weights.",
        choices=("continue", "resume"),
    )
    correction: str = option(
        "decoupled",
        "Off-policy correction: decoupled PPO (the PPO clip around the proximal policy, the "
        "actor before the step's update; truncated importance weights from the rollout's "
        "log-probs to it), tis (truncated importance sampling from the rollout's log-probs to "
        "the current policy) or none. With one optimizer update per step the two are the same "
        "loss and nothing is recomputed; with several (mini-batches, epochs) the proximal "
        "log-probs are computed once per step for both. Applies to one_step_off too; "
        "truncation at algorithm.rollout_is_threshold.",
        choices=("decoupled", "tis", "none"),
    )
    sampling: str = option(
        "fifo",
        "Replay buffer order: fifo (strict, what bounds staleness), freshest, "
        "reward_variance, or a registered one.",
        choices=("fifo", "freshest", "reward_variance"),
        registry="polyrl.transfer.replay:REPLAY_SAMPLERS",
    )
    max_reuse: int = option(1, "Times one generated group may be trained.", ge=1)
    capacity: int = option(
        0, "Most groups reserved or waiting in the buffer; 0 is bounded by the gate only.", ge=0
    )
    producer: str = option(
        "thread",
        "Where the rollout producer of one_step_off and async runs: a thread of the trainer's "
        "process, or a process of its own that streams each scored group back (its HTTP "
        "client, agent loops and reward scoring then take none of the trainer's CPU time or "
        "GIL; it starts reward workers of its own).",
        choices=("thread", "process"),
    )


@dataclasses.dataclass
class RayConfig(ConfigGroup):
    """Where and how to start or join Ray."""

    address: str = option("", "Ray cluster address to join; empty starts a local Ray.")
    num_cpus: int = option(0, "CPUs for a local Ray; 0 detects them.", ge=0)
    num_gpus: int = option(-1, "GPUs for a local Ray; -1 detects them.", ge=-1)
    namespace: str = option("polyrl", "Ray namespace for named actors.")

    def validate(self) -> None:
        """Check the namespace is set."""
        _require_nonempty(self.namespace, "namespace")


@dataclasses.dataclass
class PrimeConfig(ConfigGroup):
    """PRIME's implicit process reward model (algorithm.adv_estimator=prime; polyrl train)."""

    aliases = OPTIM_ALIASES

    beta: float = option(
        0.05, "Scale of the implicit reward beta * log(pi_prm / pi_ref) (verl: beta_train).", gt=0.0
    )
    update: str = option(
        "before",
        "When the PRM trains on a step's outcome labels: before or after it scores the "
        "step's responses, or none (a frozen PRM from prime.model_path).",
        choices=PRIME_UPDATES,
    )
    implicit_reward_coef: float = option(
        5.0,
        "Weight of the implicit process rewards in the advantage (verl: reward_dpo_coef).",
        ge=0.0,
    )
    outcome_reward_coef: float = option(
        5.0, "Weight of the outcome reward in the advantage (verl: reward_gt_coef).", ge=0.0
    )
    whiten_advantages: bool = option(True, "Whiten the combined advantages over the batch.")
    model_path: str = option("", "PRM initialisation; empty starts from the policy model.")
    mini_batch_size: int = option(
        0, "Prompts per PRM optimizer step (times rollout.n rows); 0 is the whole batch.", ge=0
    )
    epochs: int = option(1, "PRM passes over each step's batch.", ge=1)
    optim: OptimConfig = _optim("PRM optimizer, schedule and gradient clipping.", grad_clip=10.0)


@dataclasses.dataclass
class PolyRLConfig(ConfigGroup):
    """The whole polyrl configuration: one field per option group."""

    seed: int = option(42, "Global random seed; groups with seed -1 use it.", ge=0)
    model: ModelConfig = option(ModelConfig, "Policy model.")
    data: DataConfig = option(DataConfig, "Training and validation data.")
    reward: RewardConfig = option(RewardConfig, "Reward computation.")
    rollout: RolloutConfig = option(RolloutConfig, "Rollout sampling defaults.")
    trainer: TrainerConfig = option(TrainerConfig, "Run length, checkpoints and logging.")
    ray: RayConfig = option(RayConfig, "Ray cluster.")
    sft: SFTConfig = option(SFTConfig, "Supervised fine-tuning (polyrl sft).")
    algorithm: AlgorithmConfig = option(AlgorithmConfig, "RL algorithm (polyrl train).")
    actor: ActorConfig = option(ActorConfig, "RL policy optimisation (polyrl train).")
    critic: CriticConfig = option(CriticConfig, "RL value model (polyrl train, gae).")
    agent: AgentConfig = option(AgentConfig, "Multi-turn agent-loop rollouts (polyrl train).")
    transfer: TransferConfig = option(TransferConfig, "Data transfer system (polyrl train).")
    async_rl: AsyncRLConfig = option(
        AsyncRLConfig, "Asynchronous RL (polyrl train, trainer.mode=async)."
    )
    dpo: DPOConfig = option(DPOConfig, "Direct preference optimisation (polyrl dpo).")
    rm: RMConfig = option(RMConfig, "Reward-model training on preference pairs (polyrl rm).")
    prime: PrimeConfig = option(PrimeConfig, "PRIME implicit process reward model (polyrl train).")

    def __post_init__(self) -> None:
        # Built directly in Python, the groups are checked in field order: import the user
        # modules first, so that data.task or algorithm.adv_estimator may name what they add.
        trainer = self.trainer
        imports = trainer.get("imports") if isinstance(trainer, dict) else None
        if isinstance(trainer, TrainerConfig):
            imports = trainer.imports
        if isinstance(imports, list) and not (_DEFER_VALIDATE.get() or _DEFER_REGISTRY.get()):
            _import_user_modules(imports)
        super().__post_init__()

    def prepare(self) -> None:
        """Import ``trainer.imports`` (what they register is then known to the checks)."""
        _import_user_modules(self.trainer.imports)

    def seed_for(self, group: str) -> int:
        """Effective seed of a group that has a ``seed`` option (``-1`` falls back to ``seed``)."""
        sub = getattr(self, group, None)
        if not dataclasses.is_dataclass(sub) or not hasattr(sub, "seed"):
            raise ConfigError(f"group {group!r} has no seed option")
        value = sub.seed
        return self.seed if value < 0 else value
