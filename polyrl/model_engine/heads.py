"""Model types the engine trains: a causal LM (LM head) and a value model (scalar head).

Both load from a local Hugging Face directory.  The value model puts ``score = Linear(hidden, 1)``
on the backbone of any causal LM (``AutoModel`` of the same checkpoint) and returns one value per
token.  Its parameter names follow Hugging Face's ``<Arch>ForTokenClassification`` (backbone under
the architecture's ``base_model_prefix``, head ``score.weight`` / ``score.bias``), so an exported
value model also loads with ``AutoModelForTokenClassification`` (``num_labels=1``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine.config import ModelSpec

__all__ = [
    "ValueModel",
    "enable_activation_checkpointing",
    "load_model",
    "model_forward",
    "no_split_module_classes",
    "read_safetensors",
    "to_sequence_classifier",
]

VALUE_HEAD_KEY = "polyrl_value_model"


def _check_model_dir(path: str) -> None:
    if not path:
        raise ValueError("ModelSpec.path is empty; set it to a local Hugging Face model directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {path!r} has no config.json")


def _load_config(spec: ModelSpec) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    for key, value in spec.override_config.items():
        if not hasattr(config, key):
            raise ValueError(
                f"ModelSpec.override_config: the {type(config).__name__} of {spec.path!r} has "
                f"no attribute {key!r}"
            )
        setattr(config, key, value)
    # Training never uses the KV cache, and a cache object would disable packed-sequence masks.
    config.use_cache = False
    return config


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def read_safetensors(path: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors stored in a HF directory's safetensors files (all, or just ``names``)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no safetensors weights in {path!r}")
    wanted = None if names is None else set(names)
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if wanted is None or key in wanted:
                    out[key] = f.get_tensor(key)
    return out


class ValueModel(nn.Module):
    """A scalar value head on a Hugging Face decoder backbone: one value per token.

    Args:
        backbone: the base model (e.g. ``Qwen2Model``) producing ``last_hidden_state``.
        init_std: std of the normal init of the head weight (bias starts at 0).
        seed: seed of the head init, so every rank builds the same head.
        bias: give the head a bias (``score.bias``).
    """

    def __init__(
        self, backbone: nn.Module, init_std: float = 0.02, seed: int = 0, bias: bool = True
    ) -> None:
        super().__init__()
        self.base_model_prefix: str = getattr(backbone, "base_model_prefix", "") or "model"
        setattr(self, self.base_model_prefix, backbone)
        config = backbone.config
        hidden = config.get_text_config().hidden_size
        self.config = config
        self.score = nn.Linear(hidden, 1, bias=bias)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(self.score.weight.shape, generator=gen) * init_std
            self.score.weight.copy_(weight.to(self.score.weight.dtype))
            if self.score.bias is not None:
                self.score.bias.zero_()
        self.score.to(next(backbone.parameters()).dtype)

    @property
    def backbone(self) -> nn.Module:
        """The base model under its Hugging Face prefix."""
        return getattr(self, self.base_model_prefix)

    @property
    def _no_split_modules(self) -> list[str]:
        return list(getattr(self.backbone, "_no_split_modules", None) or [])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **media: torch.Tensor,
    ) -> torch.Tensor:
        """Values ``(B, T)`` in fp32: the head applied to each token's last hidden state.

        ``media``: a vision-language backbone's image/video tensors (``pixel_values``, ...).
        """
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **media,
        )
        # A fresh tensor, not a view: FSDP hooks the root output for backward.
        return self.score(out.last_hidden_state).squeeze(-1).to(torch.float32, copy=True)

    @classmethod
    def from_pretrained(cls, spec: ModelSpec, seed: int = 0) -> ValueModel:
        """Backbone from ``spec.path``; the head too if the directory holds a value model."""
        from transformers import AutoModel

        _check_model_dir(spec.path)
        config = _load_config(spec)
        with _quiet_transformers():
            # The causal LM's lm_head (or a value model's score) is expectedly unused here.
            backbone = AutoModel.from_pretrained(
                spec.path,
                config=config,
                dtype=resolve_dtype(spec.dtype),
                attn_implementation=spec.attn_implementation,
                trust_remote_code=spec.trust_remote_code,
            )
        std = spec.value_head_init_std
        if std is None:
            std = float(getattr(config, "initializer_range", 0.02) or 0.02)
        model = cls(backbone, init_std=std, seed=seed, bias=spec.value_head_bias)
        if getattr(config, VALUE_HEAD_KEY, False):
            head = read_safetensors(spec.path, ["score.weight", "score.bias"])
            if "score.weight" not in head:
                raise ValueError(
                    f"{spec.path!r} is marked as a value model but has no score.weight tensor"
                )
            with torch.no_grad():
                model.score.weight.copy_(head["score.weight"].reshape(model.score.weight.shape))
                if "score.bias" in head and model.score.bias is not None:
                    model.score.bias.copy_(head["score.bias"].reshape(model.score.bias.shape))
        return model

    def export_config(self) -> Any:
        """HF config for an exported value model (loadable by AutoModelForTokenClassification)."""
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        )

        config = self.config.__class__.from_dict(self.config.to_dict())
        arch = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
        config.architectures = [arch] if arch else [type(self).__name__]
        config.num_labels = 1
        setattr(config, VALUE_HEAD_KEY, True)
        return config


def to_sequence_classifier(directory: str, pad_token_id: int | None = None) -> str:
    """Turn an exported value model into an ``<Arch>ForSequenceClassification`` directory.

    The weights stay as they are (backbone under its prefix, ``score.weight``); the config
    names the sequence-classification class of the model type (``num_labels=1``) and the pad
    id, which Hugging Face uses to find each row's last non-pad token, whose value is the
    sequence's score.  The directory still loads as a polyrl value model.

    Raises:
        ValueError: the head has a bias (``ModelSpec.value_head_bias``), which the Hugging Face
            class has no place for, or the model type has no sequence-classification class.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    if "score.bias" in read_safetensors(directory, ["score.bias"]):
        raise ValueError(
            f"{directory!r} has a value-head bias (score.bias); a sequence classifier's score "
            "head has none: train the reward model with ModelSpec.value_head_bias=False"
        )
    config = AutoConfig.from_pretrained(directory)
    arch = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise ValueError(f"model type {config.model_type!r} has no sequence-classification class")
    config.architectures = [arch]
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = int(pad_token_id)
    config.save_pretrained(directory)
    return directory


def load_model(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """Build the model described by ``spec`` on CPU in ``spec.dtype``.

    ``causal_lm`` gives the ``AutoModelForCausalLM`` of the directory; ``value`` a
    :class:`ValueModel`.
    """
    from polyrl.models.processor import is_vision_model

    vision = bool(spec.path) and os.path.isfile(os.path.join(spec.path, "config.json"))
    vision = vision and is_vision_model(spec.path)
    if spec.kind == "value":
        # A VLM's AutoModel is its vision tower plus language model: the head reads the latter.
        return ValueModel.from_pretrained(spec, seed=seed)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    _check_model_dir(spec.path)
    config = _load_config(spec)
    # A VLM is still a causal LM over its tokens; its Auto class keeps the vision tower.
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(
        spec.path,
        config=config,
        dtype=resolve_dtype(spec.dtype),
        attn_implementation=spec.attn_implementation,
        trust_remote_code=spec.trust_remote_code,
    )


def model_forward(
    model: nn.Module,
    kind: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    media: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the model: logits ``(R, W, V)`` for a causal LM, values ``(R, W)`` for a value model.

    ``media``: a vision-language model's image/video tensors by argument name
    (``pixel_values``, ``image_grid_thw``, ...), passed through to its forward.
    """
    if kind == "value":
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **(media or {}),
        )
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **(media or {}),
    )
    return out.logits


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (Hugging Face's mechanism)."""
    target = model.backbone if isinstance(model, ValueModel) else model
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(target, "gradient_checkpointing_enable"):  # transformers < 5
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"{type(target).__name__} does not support activation checkpointing")


def no_split_module_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """Classes of the repeated blocks (decoder layers) that each become one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return tuple(sorted(found, key=lambda c: c.__name__))
