"""LoRA adapters on a model-engine causal LM, through ``peft``.

With ``ModelSpec.lora_rank > 0`` the engine injects peft LoRA layers into the Hugging Face model
before sharding it: every targeted ``nn.Linear`` becomes a peft ``lora.Linear`` whose frozen
``base_layer`` keeps the original weight ``W`` and whose trainable ``lora_A`` (``r x in``) and
``lora_B`` (``out x r``, zero at the start) add ``scale * B @ A`` with ``scale = lora_alpha / r``.
The Hugging Face model stays the root module (its forward, config and decoder-layer classes are
unchanged), so FSDP2 sharding, the shared-prefix forward and export work as without LoRA.

Parameter names inside the engine then read ``<layer>.base_layer.weight`` and
``<layer>.lora_A.default.weight``; the helpers here map them back to the base model's own names
(``<layer>.weight``), merge a layer's weight (:func:`merge_lora_weight`) and write the adapter in
peft's on-disk format (:func:`save_peft_adapter`).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from polyrl.model_engine.config import ALL_LINEAR, ModelSpec
from polyrl.model_engine.vision import vision_info

__all__ = [
    "ADAPTER_NAME",
    "LoraLayout",
    "apply_lora",
    "merge_lora_weight",
    "peft_adapter_key",
    "require_peft",
    "resolve_target_modules",
    "save_peft_adapter",
]

#: The one adapter the engine trains (peft's default name).
ADAPTER_NAME = "default"
_BASE = ".base_layer."
_LORA_MARK = ".lora_"


def require_peft() -> Any:
    """Import and return ``peft``; a clear error names the option that needs it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "ModelSpec.lora_rank > 0 (model.lora_rank) trains LoRA adapters through peft, which "
            "is not installed: pip install 'polyrl[lora]' (peft>=0.13)"
        ) from exc
    return peft


def _linear_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Dotted names of the model's linear layers: all of them, and all but the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    family = vision_info(model)
    every = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name and not (family and family.in_tower(name))
    ]
    body = [name for name in every if model.get_submodule(name) is not head]
    return every, body


def resolve_target_modules(model: nn.Module, targets: list[str]) -> list[str]:
    """Return the module-name suffixes peft should adapt, checked against ``model``.

    ``["all-linear"]`` gives the last name component of every linear layer but the output head
    (``q_proj``, ``k_proj``, ..., ``down_proj`` for Llama-style models).  Any other entry must be
    a suffix of at least one linear layer's dotted name (``q_proj``, ``self_attn.q_proj``, or
    ``lm_head`` for an untied output head).

    Raises:
        ValueError: an entry names no linear layer, or the model has none.
    """
    every, body = _linear_names(model)
    if not body:
        raise ValueError(f"ModelSpec.target_modules: {type(model).__name__} has no linear layers")
    if targets == [ALL_LINEAR]:
        return sorted({name.rsplit(".", 1)[-1] for name in body})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in every):
            leaves = sorted({name.rsplit(".", 1)[-1] for name in every})
            raise ValueError(
                f"ModelSpec.target_modules: {target!r} names no linear layer of "
                f"{type(model).__name__} (its linear layers are {leaves})"
            )
    return list(targets)


def apply_lora(model: nn.Module, spec: ModelSpec) -> Any:
    """Inject LoRA layers into ``model`` in place and freeze everything but them.

    Returns the peft wrapper (a ``PeftModel``), kept for its ``disable_adapter()`` context;
    ``model`` itself stays the module to shard and run.  Adapter weights take the model's dtype
    (no float32 up-cast), so an FSDP unit holds one dtype.

    Raises:
        ValueError: bad ``target_modules``, or a targeted layer that is not a plain linear layer
            with an untied weight (the merged weight must have one name).
    """
    peft = require_peft()
    targets = resolve_target_modules(model, list(spec.target_modules))
    # LoRA adapts the language model only: a VLM's vision tower keeps its weights (or is trained
    # in full), and the rollout engines' LoRA paths cover the LM alone. A target name is
    # matched as a suffix, so "q_proj" or "fc1" could also pick vision-tower layers: exclude the
    # tower explicitly.
    family = vision_info(model)
    config = peft.LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules=targets,
        exclude_modules=family.tower_regex if family is not None else None,
        lora_dropout=spec.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    config.base_model_name_or_path = spec.path
    with warnings.catch_warnings():
        # peft asks transformers >= 5 a deprecated question about gradient checkpointing.
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    from peft.tuners.lora import Linear as LoraLinear

    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if type(module) is not LoraLinear or module.fan_in_fan_out:
            raise ValueError(
                f"ModelSpec.target_modules: {name!r} became a {type(module).__name__} adapter; "
                "the engine merges adapters of plain nn.Linear layers only"
            )
        if counts.get(id(module.base_layer.weight), 0) > 1:
            raise ValueError(
                f"ModelSpec.target_modules: {name!r} shares its weight with another layer (tied "
                "weights); leave it out of target_modules"
            )
    return wrapped


class LoraLayout:
    """Where the adapters sit in a LoRA-wrapped model, by (wrapper-free) layer name.

    Args:
        model: the model after :func:`apply_lora` (sharded or not).
        clean: maps a raw parameter name to its Hugging Face spelling (drops wrapper prefixes).
    """

    def __init__(self, model: nn.Module, clean: Any = lambda name: name) -> None:
        self.scaling: dict[str, float] = {}
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and ADAPTER_NAME in getattr(module, "scaling", {}):
                self.scaling[clean(name)] = float(module.scaling[ADAPTER_NAME])

    def is_adapter(self, name: str) -> bool:
        """Whether ``name`` (a clean parameter name) is a LoRA A/B tensor."""
        layer, sep, _ = name.partition(_LORA_MARK)
        return bool(sep) and layer in self.scaling

    def base_of(self, name: str) -> tuple[str, str] | None:
        """``(layer, leaf)`` when ``name`` is ``<layer>.base_layer.<leaf>`` of an adapted layer."""
        layer, sep, leaf = name.rpartition(_BASE)
        if sep and layer in self.scaling:
            return layer, leaf
        return None

    @staticmethod
    def adapter_names(layer: str) -> tuple[str, str]:
        """Names of the ``lora_A`` and ``lora_B`` weights of the layer named ``layer``."""
        return (
            f"{layer}.lora_A.{ADAPTER_NAME}.weight",
            f"{layer}.lora_B.{ADAPTER_NAME}.weight",
        )


def merge_lora_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Return ``weight + scaling * lora_b @ lora_a`` in ``weight``'s dtype (a new tensor).

    ``weight`` is ``(out, in)``, ``lora_a`` ``(r, in)`` and ``lora_b`` ``(out, r)``; the sum is
    formed in float32 and rounded once, so a bfloat16 model is not rounded twice.
    """
    if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_b.shape[1] != lora_a.shape[0]:
        raise ValueError(
            f"LoRA shapes do not chain: A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}"
        )
    if tuple(weight.shape) != (lora_b.shape[0], lora_a.shape[1]):
        raise ValueError(
            f"LoRA update B @ A is {(lora_b.shape[0], lora_a.shape[1])}, the weight "
            f"{tuple(weight.shape)}"
        )
    delta = lora_b.float() @ lora_a.float()
    return (weight.float() + scaling * delta).to(weight.dtype)


def peft_adapter_key(name: str) -> str:
    """Return the key peft stores an engine adapter tensor under (no adapter name in it).

    ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` becomes
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
    """
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def save_peft_adapter(directory: str, config: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` as peft's ``save_pretrained``.

    ``config`` is the engine's ``LoraConfig``; ``tensors`` maps engine adapter names to full
    tensors.  ``PeftModel.from_pretrained(base_model, directory)`` loads the result.
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = {peft_adapter_key(k): v.detach().contiguous() for k, v in tensors.items()}
    save_file(state, os.path.join(directory, "adapter_model.safetensors"), {"format": "pt"})
    saved = copy.copy(config)
    saved.inference_mode = True  # as peft's own save_pretrained records it
    saved.save_pretrained(directory)
