"""Hand tensors to a vLLM server's workers in memory: the polyrl end of ``polyrl_load_shared``.

:func:`pack_weights` turns ``(name, tensor)`` pairs into a *layout* (its form is described in
:mod:`polyrl.rollout.vllm_ext`, whose :func:`~polyrl.rollout.vllm_ext.iter_shared` reads it in
the worker):

* a CPU tensor that already lies in one of this process's shared arenas
  (:class:`polyrl.core.arena.SharedArena`, e.g. the staging arena of
  :class:`polyrl.weights.staging.SharedArenaTarget`) is referenced where it is: no copy;
* every other CPU tensor is copied once into a fresh arena (one POSIX shared-memory file under
  ``/dev/shm``), which the workers map;
* a CUDA tensor travels as a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``,
  pickled and base64-encoded), with its GPU's UUID; each worker opens it.

The :class:`PackedWeights` keeps the tensors and the fresh arena alive until :meth:`close`,
which the caller runs once the workers have loaded them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from polyrl.core.arena import SharedArena, arena_of
from polyrl.core.cuda import export_cuda_tensor

__all__ = ["PackedWeights", "pack_weights"]

_ALIGN = 64  # bytes: every packed tensor starts on a cache line


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclasses.dataclass
class PackedWeights:
    """A layout and what must stay alive while the workers read it."""

    layout: dict[str, Any]
    keep: list[Any] = dataclasses.field(default_factory=list)
    arena: SharedArena | None = None

    @property
    def copied_bytes(self) -> int:
        """Bytes copied into the fresh arena (0 when every tensor was referenced in place)."""
        return 0 if self.arena is None else self.arena.nbytes

    def close(self) -> None:
        """Release the tensors and remove the fresh arena's file."""
        self.keep.clear()
        if self.arena is not None:
            self.arena.unlink()
            self.arena = None


def _cuda_entry(tensor: torch.Tensor) -> dict[str, Any]:
    exported = export_cuda_tensor(tensor)
    return {"cuda_ipc": exported["handle"], "device_uuid": exported["device_uuid"]}


def pack_weights(pairs: Sequence[tuple[str, torch.Tensor]]) -> PackedWeights:
    """Describe ``pairs`` for ``polyrl_load_shared``; see the module doc.

    Raises:
        WeightTransferError: no shared memory to copy CPU tensors into.
        ValueError: a tensor on a device other than CPU or CUDA.
    """
    packed = PackedWeights(layout={"segments": [], "tensors": []})
    segments: dict[int, int] = {}  # id(arena) -> segment index
    entries: list[dict[str, Any]] = []
    to_copy: list[tuple[dict[str, Any], torch.Tensor]] = []
    for name, tensor in pairs:
        entry: dict[str, Any] = {
            "name": str(name),
            "dtype": _dtype_name(tensor.dtype),
            "shape": [int(d) for d in tensor.shape],
        }
        if tensor.device.type == "cuda":
            tensor = tensor.contiguous()
            entry.update(_cuda_entry(tensor))
            packed.keep.append(tensor)
        elif tensor.device.type == "cpu":
            arena = arena_of(tensor) if tensor.is_contiguous() else None
            if arena is not None:
                index = segments.get(id(arena))
                if index is None:
                    index = segments[id(arena)] = len(packed.layout["segments"])
                    packed.layout["segments"].append(
                        {"path": str(arena.path), "size": arena.nbytes}
                    )
                    packed.keep.append(arena)
                entry.update(segment=index, offset=arena.offset_of(tensor))
            else:
                to_copy.append((entry, tensor))
        else:
            raise ValueError(
                f"tensor {name!r} is on {tensor.device}; only CPU and CUDA tensors can be handed "
                "to vLLM in memory"
            )
        entries.append(entry)
    if to_copy:
        offsets = []
        total = 0
        for _, tensor in to_copy:
            offsets.append(total)
            total += -(-_nbytes(tensor) // _ALIGN) * _ALIGN
        packed.arena = SharedArena(total)
        index = len(packed.layout["segments"])
        packed.layout["segments"].append({"path": str(packed.arena.path), "size": total})
        for (entry, tensor), offset in zip(to_copy, offsets, strict=True):
            packed.arena.view(offset, tuple(tensor.shape), tensor.dtype).copy_(tensor)
            entry.update(segment=index, offset=offset)
    packed.layout["tensors"] = entries
    return packed
