"""The one dtype table: names accepted in configs and on the wire, their sizes, and the resolver.

Configs and CLIs name floating dtypes (``"bfloat16"``, or an alias such as ``"bf16"``);
weight buckets name every dtype a tensor may have on the wire by its canonical name.
The tables are plain names, so configs and torch-free processes (a vLLM launcher) can use them
without importing torch; only the functions returning torch dtypes import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "dtype_from_name",
    "dtype_name",
    "resolve_dtype",
]

#: Canonical names of the floating dtypes a model's parameters may have (config choices).
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

#: Canonical name (the ``torch`` attribute) of every dtype that may travel (weights on the
#: wire, checkpoints), with its size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

#: Other spellings users write for the floating dtypes.
_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def _canonical(name: str, what: str) -> str:
    key = name.lower() if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in FLOAT_DTYPES:
        accepted = sorted([*FLOAT_DTYPES, *_ALIASES])
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {accepted}")
    return key


def resolve_dtype(name: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """Turn a floating dtype name (``"bfloat16"``, ``"bf16"``, ...) or dtype into a torch dtype.

    Raises:
        ValueError: naming ``what``, for an unknown name or a non-floating dtype.
    """
    import torch

    if isinstance(name, torch.dtype):
        if not name.is_floating_point:
            raise ValueError(f"{what} must be a floating point type, got {name}")
        return name
    return getattr(torch, _canonical(name, what))


def dtype_name(dtype: torch.dtype) -> str:
    """Return the canonical (wire) name of ``dtype``, e.g. ``"float32"``.

    Raises:
        ValueError: ``dtype`` has no wire name.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in DTYPE_SIZES:
            return name
    raise ValueError(f"dtype {dtype} cannot be transferred; expected one of {list(DTYPE_SIZES)}")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a canonical dtype name.
    """
    if not isinstance(name, str) or name not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {list(DTYPE_SIZES)}")
    import torch

    return getattr(torch, name)
