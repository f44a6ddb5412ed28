"""Models: local Hugging Face loading and the tiny-model factory with its tokenizer.

Attributes are imported lazily so ``python -m polyrl.models.tiny`` does not import its own
module twice and ``import polyrl.models`` stays cheap until something is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "TINY_ARCHS",
    "TINY_SIZES",
    "build_tiny_model",
    "build_tokenizer",
    "count_parameters",
    "load_causal_lm",
    "load_tokenizer",
    "save_tokenizer",
]

_WHERE = {
    "load_causal_lm": "loader",
    "load_tokenizer": "loader",
    "TINY_ARCHS": "tiny",
    "TINY_SIZES": "tiny",
    "build_tiny_model": "tiny",
    "count_parameters": "tiny",
    "CHAT_TEMPLATE": "tokenizer",
    "SPECIAL_TOKENS": "tokenizer",
    "TAG_TOKENS": "tokenizer",
    "build_tokenizer": "tokenizer",
    "save_tokenizer": "tokenizer",
}

if TYPE_CHECKING:
    from polyrl.models.loader import load_causal_lm, load_tokenizer
    from polyrl.models.tiny import TINY_ARCHS, TINY_SIZES, build_tiny_model, count_parameters
    from polyrl.models.tokenizer import (
        CHAT_TEMPLATE,
        SPECIAL_TOKENS,
        TAG_TOKENS,
        build_tokenizer,
        save_tokenizer,
    )


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'polyrl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"polyrl.models.{module}"), name)
