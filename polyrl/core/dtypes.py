"""The one dtype table: names accepted in configs and on the wire, and the resolver.

Configs and CLIs name floating dtypes (``"bfloat16"``, or an alias such as ``"bf16"``);
weight buckets name every dtype a tensor may have on the wire by its canonical name.
"""

from __future__ import annotations

import torch

__all__ = [
    "FLOAT_DTYPES",
    "dtype_from_name",
    "dtype_name",
    "resolve_dtype",
]

#: Canonical names of the floating dtypes a model's parameters may have (config choices).
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

#: Canonical name of every dtype that may travel (weights on the wire, checkpoints).
_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

#: Other spellings users write for the floating dtypes.
_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def resolve_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """Turn a floating dtype name (``"bfloat16"``, ``"bf16"``, ...) or dtype into a torch dtype.

    Raises:
        ValueError: naming ``what``, for an unknown name or a non-floating dtype.
    """
    if isinstance(name, torch.dtype):
        if not name.is_floating_point:
            raise ValueError(f"{what} must be a floating point type, got {name}")
        return name
    key = name.lower() if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in FLOAT_DTYPES:
        accepted = sorted([*FLOAT_DTYPES, *_ALIASES])
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {accepted}")
    return _BY_NAME[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Return the canonical (wire) name of ``dtype``, e.g. ``"float32"``.

    Raises:
        ValueError: ``dtype`` has no wire name.
    """
    for key, value in _BY_NAME.items():
        if value == dtype:
            return key
    raise ValueError(f"dtype {dtype} cannot be transferred; expected one of {list(_BY_NAME)}")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a canonical dtype name.
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; expected one of {list(_BY_NAME)}") from None
