"""Turn a saved engine checkpoint into a Hugging Face model directory (``polyrl export``).

A checkpoint step directory (see :mod:`polyrl.model_engine.checkpoint`) holds sharded weights
but no ``config.json`` or tokenizer; those come from the base model directory, which the
checkpoint's ``configs.json`` records (``model.path``).  :func:`export_checkpoint` builds a
one-rank CPU engine on that base model, loads the checkpoint's weights into it and writes the
same directory the trainers write at the end of a run (:meth:`TrainingEngine.export_hf`).  It
needs no GPU, no Ray and no trainer.

Accepted inputs: a ``global_step_<N>`` directory, a folder holding them (the newest complete one
is taken), an RL run's ``checkpoints`` folder or output directory (its ``actor`` checkpoints).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.model_engine import checkpoint as ckpt

__all__ = ["CheckpointExportError", "ExportResult", "export_checkpoint", "find_step_dir"]

_ENGINE_STATE = "engine_state.pt"
_CONFIGS = "configs.json"
_STATE_FORMAT = "polyrl.fsdp2"
# Where an output directory or a checkpoints folder keeps the policy's step directories.
_SUBDIRS = ("actor", os.path.join("checkpoints", "actor"), "checkpoints")
_STEP_RE = re.compile(r"^global_step_\d+$")


class CheckpointExportError(ValueError):
    """The input is not an exportable checkpoint, or the output cannot be written."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    directory: str  #: the Hugging Face model directory
    checkpoint: str  #: the step directory it came from
    step: int
    base_model: str  #: the model directory config and tokenizer were taken from


def find_step_dir(path: str | os.PathLike[str]) -> str:
    """Return the complete step directory that ``path`` names.

    ``path`` may be a step directory, a folder of step directories (newest complete one), or a
    folder with ``actor/``, ``checkpoints/actor/`` or ``checkpoints/`` holding them.

    Raises:
        CheckpointExportError: ``path`` is missing or holds no complete checkpoint.
    """
    root = os.path.abspath(os.fspath(path))
    if not os.path.exists(root):
        raise CheckpointExportError(f"checkpoint path {root!r} does not exist")
    if not os.path.isdir(root):
        raise CheckpointExportError(f"checkpoint path {root!r} is a file, not a directory")
    for candidate in (root, *(os.path.join(root, sub) for sub in _SUBDIRS)):
        if not os.path.isdir(candidate):
            continue
        try:
            return ckpt.resolve_checkpoint(candidate)
        except FileNotFoundError as exc:
            if candidate == root and _STEP_RE.match(os.path.basename(root)):
                raise CheckpointExportError(str(exc)) from None
    raise CheckpointExportError(
        f"{root!r} is not a checkpoint: expected a global_step_<N> directory with a "
        f"{ckpt.COMPLETE_MARKER} marker, or a folder holding them"
    )


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointExportError(f"cannot read {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointExportError(f"{path!r} does not hold a JSON object")
    return data


def _read_engine_state(step_dir: str) -> dict[str, Any]:
    import torch

    path = os.path.join(step_dir, _ENGINE_STATE)
    if not os.path.isfile(path):
        raise CheckpointExportError(
            f"{step_dir!r} has no {_ENGINE_STATE}; not an engine checkpoint"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file fails in many ways
        raise CheckpointExportError(f"cannot read {path!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise CheckpointExportError(f"{path!r} is not an FSDP2 engine state file")
    return state


def _candidates(recorded: str, step_dir: str) -> list[str]:
    """Where a recorded (possibly relative) model path may be now."""
    if os.path.isabs(recorded):
        return [recorded]
    # A relative path was relative to the run's working directory, which is some ancestor of
    # the checkpoint (output_dir/checkpoints/...), or the current directory.
    found = [os.path.abspath(recorded)]
    found += [str(parent / recorded) for parent in Path(step_dir).parents]
    return found


def _base_model(configs: dict[str, Any], step_dir: str, override: str | None) -> str:
    if override is not None:
        path = os.path.abspath(os.fspath(override))
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointExportError(
                f"--model {path!r} is not a Hugging Face model directory (no config.json)"
            )
        return path
    recorded = str((configs.get("model") or {}).get("path") or "")
    if recorded:
        for path in _candidates(recorded, step_dir):
            if os.path.isfile(os.path.join(path, "config.json")):
                return path
    raise CheckpointExportError(
        f"the checkpoint's base model {recorded or '(not recorded)'!r} is not a model directory "
        "here (no config.json); pass --model DIR with the model the run started from"
    )


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_dir: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the causal LM of ``checkpoint`` as a Hugging Face directory ``out_dir``.

    Args:
        checkpoint: a step directory or a folder holding them (see :func:`find_step_dir`).
        out_dir: the directory to write; it must not exist or be empty, unless ``overwrite`` and
            it holds a model (``config.json``).
        model_dir: the base model directory (config, tokenizer, generation config); default: the
            path recorded in the checkpoint.
        dtype: dtype of the written weights; default: the checkpoint's stored dtype.
        overwrite: replace an existing model directory at ``out_dir``.

    Raises:
        CheckpointExportError: bad input (no checkpoint, a value-model checkpoint, unreadable
            files, missing base model) or an output that would clobber other files.
    """
    from polyrl.core.dtypes import resolve_dtype

    try:
        torch_dtype = resolve_dtype(dtype) if dtype else None
    except (TypeError, ValueError) as exc:
        raise CheckpointExportError(str(exc)) from None
    step_dir = find_step_dir(checkpoint)
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CheckpointExportError(f"output {out!r} is a file")
        if os.listdir(out):
            if not overwrite:
                raise CheckpointExportError(
                    f"output {out!r} exists and is not empty; pass --overwrite to replace it"
                )
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise CheckpointExportError(
                    f"output {out!r} is not a model directory (no config.json); refusing to "
                    "replace it"
                )
    if os.path.commonpath([out, step_dir]) == step_dir:
        raise CheckpointExportError(f"output {out!r} lies inside the checkpoint {step_dir!r}")
    state = _read_engine_state(step_dir)
    kind = state.get("model_kind", "causal_lm")
    if kind != "causal_lm":
        raise CheckpointExportError(
            f"{step_dir!r} holds a {kind!r} model (a critic); only causal-LM checkpoints (the "
            "actor / policy, or SFT) export as a Hugging Face causal LM"
        )
    if not os.path.isfile(os.path.join(step_dir, "dcp", ".metadata")):
        raise CheckpointExportError(f"{step_dir!r} has no dcp/.metadata; its weights are missing")
    configs = _read_json(os.path.join(step_dir, _CONFIGS))
    base = _base_model(configs, step_dir, model_dir)
    if out == base:
        raise CheckpointExportError(f"output {out!r} is the base model directory itself")
    engine = _build_engine(configs, base, model_dir is not None)
    # DCP's own error type is a BaseException: catch it by name.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # schedule mismatch notes are about resuming
            try:
                info = engine.load_checkpoint(step_dir)
            except (Exception, CheckpointException) as exc:  # corrupt or mismatched shards
                raise CheckpointExportError(
                    f"cannot load the weights of {step_dir!r} into {base!r}: {_reason(exc)}"
                ) from None
        os.makedirs(os.path.dirname(out), exist_ok=True)
        written = engine.export_hf(out, dtype=torch_dtype)
    finally:
        engine.close()
    return ExportResult(written, step_dir, int(info["step"]), base)


def _reason(exc: BaseException) -> str:
    """One line for a load failure; DCP wraps each rank's error with its traceback."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (a truncated file?)"


def _build_engine(configs: dict[str, Any], base: str, base_overridden: bool) -> Any:
    from polyrl.model_engine.config import (
        CheckpointConfig,
        EngineConfig,
        ModelSpec,
        OptimizerConfig,
    )
    from polyrl.model_engine.engine import build_engine

    saved = dict(configs.get("model") or {})
    # A LoRA checkpoint holds the adapter only: rebuild the same adapter on the base model.
    fields = (
        "dtype",
        "attn_implementation",
        "trust_remote_code",
        "override_config",
        "lora_rank",
        "lora_alpha",
        "target_modules",
        "lora_dropout",
        "lora_export_adapter",
    )
    kwargs = {k: saved[k] for k in fields if k in saved}
    tokenizer = saved.get("tokenizer_path")
    if base_overridden or not (tokenizer and os.path.isdir(tokenizer)):
        tokenizer = None  # the base model's own tokenizer files
    try:
        spec = ModelSpec(path=base, kind="causal_lm", tokenizer_path=tokenizer, **kwargs)
    except (TypeError, ValueError) as exc:
        raise CheckpointExportError(f"the checkpoint's model settings are invalid: {exc}") from None
    try:
        # The run's schedule, so that loading its scheduler state raises no questions.
        optimizer = OptimizerConfig(**dict(configs.get("optimizer") or {}))
    except (TypeError, ValueError):
        optimizer = OptimizerConfig()
    try:
        return build_engine(
            spec,
            EngineConfig(device="cpu", retain_freed_memory=False),
            optimizer,
            CheckpointConfig(load_optimizer=False),
        )
    except (OSError, ValueError) as exc:
        raise CheckpointExportError(f"cannot load the base model {base!r}: {exc}") from None
