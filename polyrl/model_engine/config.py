"""Typed configuration of the model engine: model, engine/parallelism, optimizer, checkpoints.

Every field has a default and a ``metadata={"help": ...}`` string so a config system can render
``--help`` text and YAML presets from these dataclasses.  Each dataclass validates itself in
``__post_init__`` and raises ``ValueError`` naming the field, the bad value and what is expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.core.dtypes import resolve_dtype

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "MegatronConfig",
    "MixedPrecisionConfig",
    "ModelSpec",
    "OptimizerConfig",
    "ParallelismConfig",
    "config_to_dict",
]

MODEL_KINDS = ("causal_lm", "value")
SCHEDULERS = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "adam", "sgd")
DEVICES = ("auto", "cpu", "cuda")
#: ``ModelSpec.target_modules`` value: every linear layer but the output (LM) head.
ALL_LINEAR = "all-linear"


def _check_choice(value: Any, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {list(choices)}, got {value!r}")


def _check_positive(value: Any, what: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a number {bound}, got {value!r}")


@dataclass
class ModelSpec:
    """Which model to train and how to load it."""

    path: str = field(
        default="",
        metadata={"help": "Local Hugging Face model directory (config.json + weights)."},
    )
    kind: str = field(
        default="causal_lm",
        metadata={
            "help": "'causal_lm': the HF causal LM with its LM head (actor, reference, SFT); "
            "'value': the same backbone with a scalar head giving one value per token (critic)."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the stored (master) parameters; mixed precision is set in "
            "EngineConfig.mixed_precision."
        },
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={"help": "HF attention implementation: 'sdpa', 'eager' or 'flash_attention_2'."},
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory copied by export_hf; None: `path` if it has one."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code shipped with the model."}
    )
    override_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "HF config attributes to override at load time (e.g. dropout rates)."},
    )
    value_head_init_std: float | None = field(
        default=None,
        metadata={
            "help": "Std of the normal init of a fresh value head; None uses the backbone's "
            "initializer_range (0.02 if it has none)."
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "LoRA rank; 0 trains every weight. > 0 freezes the model and trains low-rank "
            "adapters (peft) on target_modules: only they are optimised and checkpointed, while "
            "rollout weight syncs and export_hf get the merged weights W + scale*B@A."
        },
    )
    lora_alpha: float = field(
        default=16.0,
        metadata={
            "help": "LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) * B @ A."
        },
    )
    target_modules: list[str] = field(
        default_factory=lambda: [ALL_LINEAR],
        metadata={
            "help": "Layers that get a LoRA adapter: 'all-linear' (every linear layer but the "
            "LM head) or module names such as [q_proj, v_proj] (a name matches every module "
            "whose dotted path ends with it)."
        },
    )
    lora_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the LoRA branch's input while training."}
    )
    lora_export_adapter: bool = field(
        default=True,
        metadata={
            "help": "With LoRA, export_hf also writes the adapter alone, in peft format, to the "
            "'adapter' folder of the exported model directory."
        },
    )

    freeze_vision_tower: bool = field(
        default=False,
        metadata={
            "help": "Vision-language models: keep the vision tower (model.visual.*) fixed; its "
            "weights get no gradient and are left out of the optimizer."
        },
    )
    value_head_bias: bool = field(
        default=True,
        metadata={
            "help": "Give the value head a bias. A reward model has none (a pairwise loss "
            "cannot train it), like Hugging Face's <Arch>ForSequenceClassification score head."
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ValueError(f"ModelSpec.path must be a str, got {type(self.path).__name__}")
        _check_choice(self.kind, MODEL_KINDS, "ModelSpec.kind")
        resolve_dtype(self.dtype, "ModelSpec.dtype")
        if not isinstance(self.override_config, dict):
            raise ValueError(
                f"ModelSpec.override_config must be a dict, got {type(self.override_config)}"
            )
        if self.value_head_init_std is not None:
            _check_positive(self.value_head_init_std, "ModelSpec.value_head_init_std")
        # One name (YAML ``target_modules: all-linear``) means a list of one.
        if isinstance(self.target_modules, str | tuple):
            self.target_modules = (
                [self.target_modules]
                if isinstance(self.target_modules, str)
                else list(self.target_modules)
            )
        rank = self.lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"ModelSpec.lora_rank must be an int >= 0, got {rank!r}")
        _check_positive(self.lora_alpha, "ModelSpec.lora_alpha")
        _check_positive(self.lora_dropout, "ModelSpec.lora_dropout", allow_zero=True)
        if self.lora_dropout >= 1.0:
            raise ValueError(f"ModelSpec.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        names = self.target_modules
        if (
            not isinstance(names, list)
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(
                "ModelSpec.target_modules must be 'all-linear' or a non-empty list of module "
                f"names, got {names!r}"
            )
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError(f"ModelSpec.target_modules: 'all-linear' stands alone, got {names!r}")
        if self.lora_rank and self.kind != "causal_lm":
            raise ValueError(
                f"ModelSpec.lora_rank={self.lora_rank}: LoRA is for causal LMs (actor, reference, "
                f"SFT); a {self.kind!r} model trains every weight (set lora_rank=0)"
            )


@dataclass
class ParallelismConfig:
    """How the data-parallel ranks shard the model."""

    fsdp_size: int = field(
        default=-1,
        metadata={
            "help": "Ranks that shard one model replica; -1 = all ranks (plain FSDP). A divisor "
            "of the world size below it gives HSDP: shard within groups, replicate across them."
        },
    )
    reshard_after_forward: bool = field(
        default=True,
        metadata={"help": "Free gathered parameters after each layer's forward (saves memory)."},
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks splitting each layer's attention heads and MLP width (and the LM "
            "head's vocabulary); they see the same rows. fsdp2: DTensor plans for llama, "
            "mistral, qwen2, qwen3; megatron: Megatron's tensor_model_parallel_size."
        },
    )
    ulysses_sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "fsdp2: ranks splitting each packed micro-batch's tokens (Ulysses: attention "
            "heads exchanged by all-to-all); they see the same rows. Must divide the (key/value) "
            "heads. megatron needs 1 (see context_parallel_size)."
        },
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={"help": "Megatron backend: pipeline stages (only 1 is supported yet)."},
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "MoE models: ranks that split each layer's experts (tokens reach them by "
            "all-to-all); taken from the data x sequence-parallel ranks."
        },
    )
    expert_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Megatron backend: tensor-parallel ranks of each expert."},
    )
    context_parallel_size: int = field(
        default=1,
        metadata={"help": "Megatron backend: context-parallel ranks (only 1 is supported yet)."},
    )

    #: The sizes only the Megatron backend has (fsdp2 refuses them above 1).
    MEGATRON_ONLY_FIELDS = (
        "pipeline_parallel_size",
        "expert_tensor_parallel_size",
        "context_parallel_size",
    )
    #: The Megatron model-parallel sizes.
    MODEL_PARALLEL_FIELDS = (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "expert_parallel_size",
        "expert_tensor_parallel_size",
        "context_parallel_size",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.fsdp_size, int) or (self.fsdp_size < 1 and self.fsdp_size != -1):
            raise ValueError(
                f"ParallelismConfig.fsdp_size must be -1 or an int >= 1, got {self.fsdp_size!r}"
            )
        for name in (*self.MODEL_PARALLEL_FIELDS, "ulysses_sequence_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelismConfig.{name} must be an int >= 1, got {value!r}")


@dataclass
class MegatronConfig:
    """Options of the Megatron-Core backend (``EngineConfig.backend='megatron'``)."""

    transformer_impl: str = field(
        default="auto",
        metadata={
            "help": "Megatron layer spec: 'local' (plain torch), 'transformer_engine', or 'auto' "
            "(TransformerEngine on CUDA when it imports, else local; always local on CPU)."
        },
    )
    make_vocab_size_divisible_by: int = field(
        default=128,
        metadata={
            "help": "Pad the vocabulary to a multiple of this times the tensor-parallel size "
            "(Megatron-LM's default 128); padded logits are dropped before any softmax."
        },
    )

    def __post_init__(self) -> None:
        _check_choice(
            self.transformer_impl,
            ("auto", "local", "transformer_engine"),
            "MegatronConfig.transformer_impl",
        )
        value = self.make_vocab_size_divisible_by
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"MegatronConfig.make_vocab_size_divisible_by must be an int >= 1, got {value!r}"
            )


@dataclass
class MixedPrecisionConfig:
    """FSDP mixed-precision policy: compute dtype vs. gradient-reduction dtype."""

    param_dtype: str = field(
        default="auto",
        metadata={
            "help": "Compute/all-gather dtype of parameters; 'auto' = bfloat16 on CUDA, the "
            "stored dtype on CPU."
        },
    )
    reduce_dtype: str = field(
        default="float32", metadata={"help": "dtype of the gradient reduction across ranks."}
    )

    def __post_init__(self) -> None:
        if self.param_dtype != "auto":
            resolve_dtype(self.param_dtype, "MixedPrecisionConfig.param_dtype")
        resolve_dtype(self.reduce_dtype, "MixedPrecisionConfig.reduce_dtype")

    def compute_dtype(self, device_type: str, stored: str | torch.dtype) -> torch.dtype:
        """Return the compute dtype on ``device_type`` for weights stored as ``stored``."""
        if self.param_dtype == "auto":
            return torch.bfloat16 if device_type == "cuda" else resolve_dtype(stored)
        return resolve_dtype(self.param_dtype)


@dataclass
class EngineConfig:
    """Engine backend, parallelism and micro-batching settings."""

    backend: str = field(
        default="fsdp2", metadata={"help": "Registered engine backend (see build_engine)."}
    )
    device: str = field(
        default="auto", metadata={"help": "'auto' (CUDA when available), 'cpu' or 'cuda'."}
    )
    parallelism: ParallelismConfig = field(
        default_factory=ParallelismConfig, metadata={"help": "Sharding layout."}
    )
    mixed_precision: MixedPrecisionConfig = field(
        default_factory=MixedPrecisionConfig, metadata={"help": "Mixed-precision policy."}
    )
    megatron: MegatronConfig = field(
        default_factory=MegatronConfig,
        metadata={"help": "Megatron-Core backend options (backend='megatron')."},
    )
    dynamic_batching: bool = field(
        default=True,
        metadata={
            "help": "Form micro-batches by token budget (max_tokens_per_micro_batch) with padding "
            "removed; False uses fixed micro_batch_size rows with the batch's padding."
        },
    )
    micro_batch_size: int = field(
        default=4, metadata={"help": "Rows per micro-batch when dynamic_batching is off."}
    )
    max_tokens_per_micro_batch: int = field(
        default=8192,
        metadata={
            "help": "Token budget of one micro-batch with dynamic batching (counting the padding "
            "to the longest row when not packing); must be >= the longest sequence."
        },
    )
    pack_sequences: bool = field(
        default=False,
        metadata={
            "help": "With dynamic batching, concatenate a micro-batch's sequences into one row "
            "(attention kept per sequence through position_ids resets; best with "
            "flash_attention_2). Off: rows are sorted by length and trimmed to the longest."
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute decoder-layer activations in backward."}
    )
    share_prefix: bool = field(
        default=False,
        metadata={
            "help": "Causal LMs, batches with a loss_mask: run each distinct prefix before the "
            "first trained column once per micro-batch (GRPO groups, DPO pairs) and the LM head "
            "only from there on; log-probs before that column read 0. Off under "
            "gradient_checkpointing. Opt-in: bit-reproducible and equal to a full forward up to "
            "rounding, but that rounding differs from the plain forward's."
        },
    )
    grad_clip: float = field(
        default=1.0, metadata={"help": "Max global gradient norm; <= 0 disables clipping."}
    )
    logprob_chunk_size: int = field(
        default=1024,
        metadata={"help": "Tokens per chunk for log-prob/entropy (bounds fp32 softmax memory)."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the torch/numpy/python RNGs (the same on every rank)."},
    )
    retain_freed_memory: bool = field(
        default=True,
        metadata={
            "help": "On CPU, keep freed host memory in the process instead of faulting it back "
            "in every step (glibc mallopt; see polyrl.core.cpu.retain_freed_memory)."
        },
    )

    def __post_init__(self) -> None:
        # Accept plain dicts for nested sections (e.g. from YAML/OmegaConf containers).
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        if isinstance(self.mixed_precision, dict):
            self.mixed_precision = MixedPrecisionConfig(**self.mixed_precision)
        if isinstance(self.megatron, dict):
            self.megatron = MegatronConfig(**self.megatron)
        if not isinstance(self.megatron, MegatronConfig):
            raise ValueError("EngineConfig.megatron must be a MegatronConfig or dict")
        if not isinstance(self.parallelism, ParallelismConfig):
            raise ValueError("EngineConfig.parallelism must be a ParallelismConfig or dict")
        if not isinstance(self.mixed_precision, MixedPrecisionConfig):
            raise ValueError("EngineConfig.mixed_precision must be a MixedPrecisionConfig or dict")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"EngineConfig.backend must be a non-empty str, got {self.backend!r}")
        _check_choice(self.device, DEVICES, "EngineConfig.device")
        for name in ("micro_batch_size", "max_tokens_per_micro_batch", "logprob_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.grad_clip, int | float):
            raise ValueError(f"EngineConfig.grad_clip must be a number, got {self.grad_clip!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"EngineConfig.seed must be an int, got {self.seed!r}")


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = field(default="adamw", metadata={"help": "'adamw', 'adam' or 'sgd'."})
    lr: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    betas: tuple[float, float] = field(
        default=(0.9, 0.999), metadata={"help": "Adam betas (ignored by sgd)."}
    )
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon."})
    weight_decay: float = field(default=0.01, metadata={"help": "Decoupled weight decay."})
    momentum: float = field(default=0.0, metadata={"help": "SGD momentum (sgd only)."})
    fused: bool = field(
        default=True,
        metadata={"help": "Use the fused Adam/AdamW kernel (CPU and CUDA; much less overhead)."},
    )
    scheduler: str = field(
        default="constant",
        metadata={"help": "LR shape after warmup: 'constant', 'linear' or 'cosine' decay."},
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Linear warmup steps (overrides warmup_ratio when > 0)."}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "Warmup as a fraction of total_steps (when warmup_steps=0)."}
    )
    total_steps: int = field(
        default=0,
        metadata={"help": "Scheduler steps of the whole run; required by 'linear'/'cosine'."},
    )
    min_lr_ratio: float = field(
        default=0.0, metadata={"help": "Floor of the decayed LR as a fraction of lr."}
    )

    def __post_init__(self) -> None:
        _check_choice(self.name, OPTIMIZERS, "OptimizerConfig.name")
        _check_choice(self.scheduler, SCHEDULERS, "OptimizerConfig.scheduler")
        _check_positive(self.lr, "OptimizerConfig.lr", allow_zero=True)
        _check_positive(self.eps, "OptimizerConfig.eps")
        _check_positive(self.weight_decay, "OptimizerConfig.weight_decay", allow_zero=True)
        _check_positive(self.momentum, "OptimizerConfig.momentum", allow_zero=True)
        betas = tuple(self.betas) if isinstance(self.betas, list | tuple) else None
        if betas is None or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"OptimizerConfig.betas must be two numbers in [0, 1), got {self.betas!r}"
            )
        self.betas = (float(betas[0]), float(betas[1]))
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"OptimizerConfig.{name} must be an int >= 0, got {value!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(
                f"OptimizerConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}"
            )
        if self.scheduler != "constant" and self.total_steps <= 0:
            raise ValueError(
                f"OptimizerConfig.scheduler={self.scheduler!r} decays over total_steps, which must "
                f"be > 0 (got {self.total_steps})"
            )
        if self.warmup_ratio > 0 and self.warmup_steps == 0 and self.total_steps <= 0:
            raise ValueError("OptimizerConfig.warmup_ratio needs total_steps > 0")

    @property
    def num_warmup_steps(self) -> int:
        """Warmup length in scheduler steps."""
        if self.warmup_steps > 0:
            return self.warmup_steps
        return int(self.warmup_ratio * self.total_steps)


@dataclass
class CheckpointConfig:
    """What a checkpoint holds and how many are kept."""

    save_optimizer: bool = field(
        default=True, metadata={"help": "Save optimizer state (needed for an exact resume)."}
    )
    load_optimizer: bool = field(
        default=True, metadata={"help": "Restore optimizer state when the checkpoint has it."}
    )
    max_to_keep: int = field(
        default=0,
        metadata={"help": "Keep only the newest N step checkpoints in a directory; 0 keeps all."},
    )

    def __post_init__(self) -> None:
        if not isinstance(self.max_to_keep, int) or self.max_to_keep < 0:
            raise ValueError(
                f"CheckpointConfig.max_to_keep must be an int >= 0, got {self.max_to_keep!r}"
            )


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-dict view of one of these dataclasses (nested sections included)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"expected a config dataclass instance, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)
