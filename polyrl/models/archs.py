"""The tiny-model architectures by name.

A module of its own, importing nothing, so that the config schema can validate
``model.tiny_arch`` without importing torch and transformers (:mod:`polyrl.models.tiny` builds
the models).
"""

from __future__ import annotations

__all__ = ["TINY_ARCHS"]

#: Architectures :func:`polyrl.models.tiny.build_tiny_model` builds.
TINY_ARCHS: tuple[str, ...] = (
    "qwen2",
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "smolvlm",
)
