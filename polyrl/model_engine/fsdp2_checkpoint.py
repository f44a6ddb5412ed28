"""Checkpoints and Hugging Face export of the FSDP2 engine, and the RNG state they carry.

:class:`FSDP2Checkpointer` is the part of :class:`~polyrl.model_engine.fsdp2.FSDP2Engine` that
writes and reads files; the engine holds one and checks its own state (offloading) before
calling it.  A step directory (published atomically, see :mod:`polyrl.model_engine.checkpoint`)
holds::

    dcp/                  # torch.distributed.checkpoint: every rank writes its own shards of
                          # the model (the adapter alone with LoRA) and optimizer
    rng/rank_<r>.pt       # each rank's torch / numpy / python (/ CUDA) RNG state
    engine_state.pt       # step, optimizer steps, LR scheduler, extra_state, LoRA signature
    configs.json          # the four engine configs (what export_checkpoint rebuilds from)
    COMPLETE
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine import checkpoint as ckpt
from polyrl.model_engine.config import ModelSpec, config_to_dict
from polyrl.model_engine.heads import ValueModel
from polyrl.model_engine.lora import ADAPTER_NAME, LoraLayout, save_peft_adapter
from polyrl.model_engine.optim import apply_configured_schedule
from polyrl.model_engine.parallel.expert import ExpertParallel

if TYPE_CHECKING:
    from polyrl.model_engine.fsdp2 import FSDP2Engine

__all__ = [
    "ADAPTER_DIR",
    "FSDP2Checkpointer",
    "rng_state",
    "seed_all",
    "set_rng_state",
    "unwrapped_class_name",
]

_STATE_FORMAT = "polyrl.fsdp2"
_STATE_VERSION = 1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
#: A vision-language model's processor files (image/video preprocessing), copied from the model
#: directory so the export loads with AutoProcessor / AutoImageProcessor like the original.
_PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
_MAX_SHARD_BYTES = 2 * 1024**3
#: Folder of an exported LoRA model directory holding the adapter alone (peft format).  Not the
#: directory itself: an adapter_config.json there would make transformers load it as an adapter.
ADAPTER_DIR = "adapter"


# ---------------------------------------------------------------------------------- RNG state
def seed_all(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Return the process's torch / numpy / python RNG states (and ``device``'s if CUDA)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------- LoRA
def _lora_signature(spec: ModelSpec, lora: LoraLayout | None) -> dict[str, Any] | None:
    """Return what a checkpoint's adapter must match to load: rank, scale, layers."""
    if lora is None:
        return None
    return {"rank": spec.lora_rank, "alpha": float(spec.lora_alpha), "layers": sorted(lora.scaling)}


def _check_lora_signature(
    saved: Any, mine: dict[str, Any] | None, spec: ModelSpec, path: str
) -> None:
    if saved == mine:
        return
    if saved is None:
        raise ValueError(
            f"{path!r} holds full model weights, this engine trains a LoRA adapter "
            f"(ModelSpec.lora_rank={spec.lora_rank}); set lora_rank=0 to resume it"
        )
    if mine is None:
        raise ValueError(
            f"{path!r} holds a LoRA adapter of rank {saved['rank']}, this engine trains every "
            f"weight; set ModelSpec.lora_rank={saved['rank']} (lora_alpha={saved['alpha']}, "
            "the same target_modules) to resume it"
        )
    raise ValueError(
        f"{path!r} holds a LoRA adapter (rank {saved['rank']}, alpha {saved['alpha']}, "
        f"{len(saved['layers'])} layers) unlike this engine's (rank {mine['rank']}, alpha "
        f"{mine['alpha']}, {len(mine['layers'])} layers); set ModelSpec.lora_rank, "
        "lora_alpha and target_modules as the run that saved it did"
    )


def unwrapped_class_name(module: torch.nn.Module) -> str:
    """Return the model's own class name, as Hugging Face writes it in ``architectures``.

    ``fully_shard`` swaps a module's class for a generated ``FSDP<Name>`` subclass of
    :class:`FSDPModule` and the original class; the first class in the MRO that is not an FSDP
    class is the original one.
    """
    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__


class FSDP2Checkpointer:
    """Saves, loads and exports an initialised :class:`~polyrl.model_engine.fsdp2.FSDP2Engine`.

    Reads the engine's model, optimizer, configs and tensors through its public members; the LR
    scheduler, the LoRA pieces (peft's wrapper, the adapter layout) and the expert-parallel
    handle are handed over by the engine that builds it.  Every method is collective.

    Under expert parallelism each rank's experts (plain tensors outside FSDP) and their optimizer
    state go to ``torch.distributed.checkpoint`` as DTensors sharded over the ``ep`` ranks
    (:meth:`~polyrl.model_engine.parallel.expert.ExpertParallel.to_checkpoint`).
    """

    def __init__(
        self,
        engine: FSDP2Engine,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        lora: LoraLayout | None = None,
        peft: Any = None,
        experts: ExpertParallel | None = None,
    ) -> None:
        self._engine = engine
        self._scheduler = scheduler
        self._lora = lora
        self._peft = peft
        self._experts = experts

    def _broadcast_token(self) -> str:
        token = [uuid.uuid4().hex[:12]]
        # Process-level (not data-parallel) rank/size: tensor/sequence peers write files too.
        if self._engine.process_world_size > 1:
            dist.broadcast_object_list(token, src=0)
        return str(token[0])

    def _barrier(self) -> None:
        if self._engine.process_world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------------------ checkpoints
    def save(self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None) -> str:
        """See :meth:`~polyrl.model_engine.engine.TrainingEngine.save_checkpoint`."""
        engine = self._engine
        if extra_state is not None and not isinstance(extra_state, Mapping):
            raise TypeError(f"extra_state must be a mapping, got {type(extra_state).__name__}")
        root = os.path.abspath(directory)
        name = ckpt.step_dir_name(step)
        final = os.path.join(root, name)
        token = self._broadcast_token()
        tmp = ckpt.new_tmp_dir(root, name, token)
        is_main = engine.process_rank == 0
        if is_main:
            os.makedirs(root, exist_ok=True)
            ckpt.remove_stale_tmp_dirs(root)
            os.makedirs(os.path.join(tmp, "rng"))
        self._barrier()
        with_optim = engine.checkpoint_config.save_optimizer
        state = self._checkpoint_state(with_optim)
        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(tmp, "dcp"), sync_files=True))
        rng_file = os.path.join(tmp, "rng", f"rank_{engine.process_rank}.pt")
        torch.save(rng_state(engine.device), rng_file)
        if is_main:
            engine_state = {
                "format": _STATE_FORMAT,
                "version": _STATE_VERSION,
                "step": step,
                "optimizer_steps": engine.optimizer_steps,
                "scheduler": self._scheduler.state_dict(),
                "extra_state": dict(extra_state or {}),
                "world_size": engine.world_size,
                "mesh_shape": engine.mesh_shape,
                "has_optimizer": with_optim,
                "model_kind": engine.model_spec.kind,
                "lora": _lora_signature(engine.model_spec, self._lora),
            }
            torch.save(engine_state, os.path.join(tmp, "engine_state.pt"))
            with open(os.path.join(tmp, "configs.json"), "w") as f:
                json.dump(
                    {
                        "model": config_to_dict(engine.model_spec),
                        "engine": config_to_dict(engine.engine_config),
                        "optimizer": config_to_dict(engine.optimizer_config),
                        "checkpoint": config_to_dict(engine.checkpoint_config),
                    },
                    f,
                    indent=1,
                    default=str,
                )
        self._barrier()  # every rank's shards and RNG file are on disk
        if is_main:
            ckpt.write_complete_marker(tmp, {"step": step, "world_size": engine.world_size})
            ckpt.publish_dir(tmp, final)
            ckpt.atomic_write_text(os.path.join(root, ckpt.LATEST_FILE), name)
            ckpt.prune_checkpoints(root, engine.checkpoint_config.max_to_keep)
        self._barrier()
        return final

    def load(self, path: str) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG state.

        Returns ``{"step", "extra_state", "path", "optimizer_steps"}``; the engine keeps the
        last (its update count) and returns the rest.
        """
        engine = self._engine
        spec = engine.model_spec
        resolved = ckpt.resolve_checkpoint(os.path.abspath(path))
        engine_state = ckpt.load_checkpoint_file(resolved, "engine_state.pt", "the engine state")
        if engine_state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{resolved!r} is not an FSDP2 engine checkpoint")
        if engine_state.get("model_kind") != spec.kind:
            raise ValueError(
                f"{resolved!r} holds a {engine_state.get('model_kind')!r} model, this engine "
                f"trains a {spec.kind!r} model"
            )
        _check_lora_signature(
            engine_state.get("lora"), _lora_signature(spec, self._lora), spec, resolved
        )
        saved_shape = engine_state.get("mesh_shape")
        saved = {"sp": 1, "tp": 1, "ep": 1, **(saved_shape or {})}
        shape = engine.mesh_shape
        # Plain FSDP reshards on load; tensor/sequence-parallel layouts are pinned, and under
        # expert parallelism the whole mesh (resharding experts is untested).
        pinned = ["sp", "tp", "ep"]
        if shape["ep"] > 1 or saved["ep"] > 1:
            pinned.append("dp_shard")
        if any(saved.get(k) != shape[k] for k in pinned):
            raise ValueError(
                f"checkpoint {resolved!r} was saved on mesh {saved_shape or 'dp only'}, this "
                f"engine runs on mesh {shape}; resume with the same tensor_parallel_size, "
                "ulysses_sequence_parallel_size and expert_parallel_size (and, with expert "
                "parallelism, the same number of ranks)"
            )
        with_optim = bool(engine_state["has_optimizer"]) and engine.checkpoint_config.load_optimizer
        reader = FileSystemReader(os.path.join(resolved, "dcp"))
        state = self._checkpoint_state(with_optim)
        # Every key of the template must be in the checkpoint (DCP loads strictly); with LoRA
        # the template holds the adapter only and the frozen base stays as loaded.
        dcp.load(state, storage_reader=reader)
        if self._experts is not None:
            state["model"] = self._experts.from_checkpoint(state["model"])
            if with_optim:
                optim = state["optimizer"]
                state["optimizer"] = {
                    **optim,
                    "state": self._experts.from_checkpoint(optim["state"]),
                }
        options = self._state_dict_options(loading=True)
        if with_optim:
            set_state_dict(
                engine.model,
                engine.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
        else:
            set_model_state_dict(engine.model, state["model"], options=options)
        self._scheduler.load_state_dict(engine_state["scheduler"])
        changed = apply_configured_schedule(self._scheduler, engine.optimizer_config)
        if changed and engine.process_rank == 0:
            warnings.warn(
                f"resuming from {resolved}: the LR schedule follows this run's optimizer "
                f"settings, not the checkpoint's ({'; '.join(changed)})",
                stacklevel=3,
            )
        rng_file = os.path.join("rng", f"rank_{engine.process_rank}.pt")
        if os.path.isfile(os.path.join(resolved, rng_file)):
            rng = ckpt.load_checkpoint_file(resolved, rng_file, "the RNG state")
            try:
                set_rng_state(rng, engine.device)
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise ckpt.CorruptCheckpointError(
                    f"checkpoint {resolved!r} is corrupt: its file {rng_file!r} does not hold "
                    f"an RNG state ({type(exc).__name__}: {exc})"
                ) from exc
        self._barrier()
        return {
            "step": int(engine_state["step"]),
            "extra_state": engine_state["extra_state"],
            "path": resolved,
            "optimizer_steps": int(engine_state["optimizer_steps"]),
        }

    def _state_dict_options(self, loading: bool = False) -> StateDictOptions | None:
        if self._peft is None:
            return None
        # The frozen base weights come from ModelSpec.path; only the adapter is saved.
        return StateDictOptions(ignore_frozen_params=True, strict=not loading)

    def _checkpoint_state(self, with_optim: bool) -> dict[str, Any]:
        """Return the state DCP saves/loads: model (adapter only with LoRA) and optimizer."""
        model = self._engine.model
        options = self._state_dict_options()
        if with_optim:
            model_sd, optim_sd = get_state_dict(model, self._engine.optimizer, options=options)
            state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(model, options=options)}
        if self._lora is not None:
            # A frozen weight tied to another name (embeddings / LM head) survives
            # ignore_frozen_params under its second name: drop everything but the adapter.
            lora = self._lora
            state["model"] = {k: v for k, v in state["model"].items() if lora.is_adapter(k)}
        if self._experts is not None:
            state["model"] = self._experts.to_checkpoint(state["model"])
            if with_optim:
                optim = state["optimizer"]
                state["optimizer"] = {**optim, "state": self._experts.to_checkpoint(optim["state"])}
        return state

    # ------------------------------------------------------------------------------ export
    def export_hf(
        self, directory: str, tokenizer: Any = None, dtype: torch.dtype | None = None
    ) -> str:
        """See :meth:`FSDP2Engine.export_hf <polyrl.model_engine.fsdp2.FSDP2Engine.export_hf>`."""
        engine = self._engine
        directory = os.path.abspath(directory)
        is_main = engine.process_rank == 0
        token = self._broadcast_token()
        parent = os.path.dirname(directory)
        tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{token}")
        if is_main:
            os.makedirs(tmp)
        dtype = dtype or resolve_dtype(engine.model_spec.dtype)
        shards: list[list[str]] = []
        current: dict[str, torch.Tensor] = {}
        size = 0
        weight_map: dict[str, str] = {}
        total_bytes = 0

        def flush() -> None:
            nonlocal current, size
            if not current:
                return
            from safetensors.torch import save_file

            name = f"part-{len(shards):05d}.safetensors"
            save_file(current, os.path.join(tmp, name), metadata={"format": "pt"})
            shards.append(list(current))
            current, size = {}, 0

        try:
            for name, tensor in engine.named_tensors(dtype=dtype, device="cpu"):
                if not is_main:
                    continue
                tensor = tensor.contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if current and size + nbytes > _MAX_SHARD_BYTES:
                    flush()
                current[name] = tensor
                size += nbytes
                total_bytes += nbytes
            adapter: dict[str, torch.Tensor] = {}
            if self._peft is not None and engine.model_spec.lora_export_adapter:
                for name, tensor in engine.adapter_tensors(dtype=dtype, device="cpu"):
                    if is_main:
                        adapter[name] = tensor.clone()
            if is_main:
                flush()
                self._finish_export(tmp, shards, weight_map, total_bytes, dtype, tokenizer)
                if adapter:
                    config = self._peft.peft_config[ADAPTER_NAME]
                    save_peft_adapter(os.path.join(tmp, ADAPTER_DIR), config, adapter)
                ckpt.publish_dir(tmp, directory)
        finally:
            if is_main and os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        return directory

    def _finish_export(
        self,
        tmp: str,
        shards: list[list[str]],
        weight_map: dict[str, str],
        total_bytes: int,
        dtype: torch.dtype,
        tokenizer: Any,
    ) -> None:
        n = len(shards)
        for i, names in enumerate(shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(tmp, f"part-{i:05d}.safetensors"), os.path.join(tmp, final))
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        model = self._engine.model
        if isinstance(model, ValueModel):
            config = model.export_config()
        else:
            config = model.config.__class__.from_dict(model.config.to_dict())
            config.architectures = [unwrapped_class_name(model)]
        config.use_cache = True  # training turned the cache off; inference wants it back
        config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(tmp)
        spec = self._engine.model_spec
        src = spec.path
        if os.path.isfile(os.path.join(src, "generation_config.json")):
            shutil.copy2(os.path.join(src, "generation_config.json"), tmp)
        elif not isinstance(model, ValueModel):
            # Generation defaults (bos/eos/pad ids) from the config, as save_pretrained would.
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        for name in _PROCESSOR_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
            return
        if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
            raise TypeError(
                "export_hf: tokenizer must have save_pretrained() or be a directory path, got "
                f"{type(tokenizer).__name__}"
            )
        tok_dir = os.fspath(tokenizer) if tokenizer is not None else (spec.tokenizer_path or src)
        if tokenizer is not None and not os.path.isdir(tok_dir):
            raise FileNotFoundError(f"export_hf: tokenizer directory {tok_dir!r} does not exist")
        for name in _TOKENIZER_FILES:
            path = os.path.join(tok_dir, name)
            if os.path.isfile(path):
                shutil.copy2(path, tmp)
