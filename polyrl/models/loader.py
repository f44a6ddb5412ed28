"""Load any local Hugging Face causal-LM directory: tokenizer and model, never from the network."""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from polyrl.core.dtypes import resolve_dtype

__all__ = [
    "checkpoint_dtypes",
    "checkpoint_shapes",
    "load_causal_lm",
    "load_tokenizer",
    "missing_weights",
    "safetensors_files",
    "weight_mismatch",
]

logger = logging.getLogger(__name__)

# Any one of these is enough for a tokenizer; vocab.json needs merges.txt beside it.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt")
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


def _model_dir(path: str | os.PathLike[str], what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} path must be a str or os.PathLike, got {type(path).__name__}")
    directory = Path(path).expanduser()
    if not directory.exists():
        raise FileNotFoundError(
            f"{what} directory {str(directory)!r} does not exist; expected a local Hugging Face "
            "model directory (models are never downloaded)"
        )
    if not directory.is_dir():
        raise NotADirectoryError(
            f"{what} path {str(directory)!r} is a file; expected a Hugging Face model directory"
        )
    return directory


def _check_tokenizer_files(directory: Path) -> None:
    present = [name for name in _TOKENIZER_FILES if (directory / name).is_file()]
    if present == ["vocab.json"] and not (directory / "merges.txt").is_file():
        raise FileNotFoundError(
            f"tokenizer directory {str(directory)!r} has vocab.json but no merges.txt"
        )
    if not present:
        found = sorted(p.name for p in directory.iterdir())[:20]
        raise FileNotFoundError(
            f"tokenizer directory {str(directory)!r} lacks tokenizer files: expected one of "
            f"{', '.join(_TOKENIZER_FILES)} (with merges.txt for vocab.json); found {found}"
        )


def load_tokenizer(
    path: str | os.PathLike[str], trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory with ``AutoTokenizer``.

    The tokenizer is returned as saved (``padding_side`` included: callers set left padding
    for prompts themselves), except that a missing pad token is set to the eos token, which
    is logged.

    Args:
        path: local directory holding the tokenizer files.
        trust_remote_code: allow tokenizer code shipped inside the directory to run.

    Raises:
        FileNotFoundError: the directory or its tokenizer files are missing.
        ValueError: the tokenizer has neither a pad nor an eos token.
    """
    directory = _model_dir(path, "tokenizer")
    _check_tokenizer_files(directory)
    tokenizer = AutoTokenizer.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=trust_remote_code
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer in {str(directory)!r} has neither a pad token nor an eos token; "
                "set pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(
            "tokenizer in %s has no pad token; using eos token %r (id %d) for padding",
            directory,
            tokenizer.eos_token,
            tokenizer.eos_token_id,
        )
    return tokenizer


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"invalid device {device!r}; expected e.g. 'cpu', 'cuda' or 'cuda:0'"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible"
            )
    return dev


def load_causal_lm(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a local Hugging Face directory with ``AutoModelForCausalLM``.

    Args:
        path: local directory with ``config.json`` and weights (safetensors or ``.bin``).
        dtype: parameter dtype, a name :func:`polyrl.core.dtypes.resolve_dtype` accepts or a
            floating torch dtype.
        device: where to put the model, e.g. ``"cpu"`` or ``"cuda:0"``.
        trust_remote_code: allow modelling code shipped inside the directory to run.

    Returns:
        The model, in eval mode as ``from_pretrained`` leaves it.

    Raises:
        FileNotFoundError: the directory, its ``config.json`` or its weights are missing.
        ValueError: unknown dtype or unusable device.
    """
    directory = _model_dir(path, "model")
    torch_dtype = resolve_dtype(dtype)
    dev = _resolve_device(device)
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(any(directory.glob(p)) for p in _WEIGHT_PATTERNS):
        missing.append(f"weights ({' or '.join(_WEIGHT_PATTERNS)})")
    if missing:
        raise FileNotFoundError(
            f"model directory {str(directory)!r} lacks {' and '.join(missing)}; expected a "
            "Hugging Face causal-LM directory as written by save_pretrained"
        )
    # A vision-language model (its config has a vision tower) loads with the image-text class;
    # it is still a causal LM over its tokens, with images placed at their placeholder tokens.
    from polyrl.models.processor import is_vision_model

    auto = AutoModelForImageTextToText if is_vision_model(directory) else AutoModelForCausalLM
    model = auto.from_pretrained(
        str(directory),
        dtype=torch_dtype,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
    )
    return model.to(dev)


def safetensors_files(path: str) -> list[str]:
    """Return the ``*.safetensors`` files of a model directory, in a stable order.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no safetensors file.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"weights path {path!r} is not a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")
        )
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in weights directory {path!r}")
    return files


def _read_header(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of a safetensors model directory (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(str(model_dir)):
        for name, entry in _read_header(file).items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in entry["shape"])
    return shapes


#: safetensors header dtype codes → torch dtype names.
_ST_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def checkpoint_dtypes(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Names and torch dtype names (``float32``, ...) of a safetensors model directory's tensors."""
    dtypes: dict[str, str] = {}
    for file in safetensors_files(str(model_dir)):
        for name, entry in _read_header(file).items():
            if name != "__metadata__":
                code = str(entry["dtype"])
                dtypes[name] = _ST_DTYPE_NAMES.get(code, code.lower())
    return dtypes


_LM_HEAD = "lm_head.weight"


def weight_mismatch(
    expected: dict[str, tuple[int, ...]], name: str, shape: Sequence[int]
) -> str | None:
    """Why tensor ``name`` of ``shape`` does not fit a checkpoint's ``expected`` shapes, or None.

    A tied output head (``lm_head.weight`` where the checkpoint has only the input embedding,
    as Hugging Face saves tied models) is accepted.
    """
    want = expected.get(name)
    if want is None:
        if name == _LM_HEAD and any(n.endswith("embed_tokens.weight") for n in expected):
            return None
        return (
            f"unknown tensor {name!r}: the serving model has no such weight "
            f"(expected names like {sorted(expected)[:3]})"
        )
    if tuple(want) != tuple(shape):
        return f"tensor {name!r} has shape {list(shape)}, the serving model expects {list(want)}"
    return None


def missing_weights(expected: dict[str, tuple[int, ...]], names: Iterable[str]) -> list[str]:
    """Names of ``expected`` (a checkpoint's tensors) absent from ``names``, sorted."""
    return sorted(set(expected) - set(names))
