"""Joining or creating the ``torch.distributed`` process group an engine runs in."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyrl.core.cuda import process_group_backend
from polyrl.core.process import free_port

__all__ = ["DistInfo", "free_port", "init_distributed", "release_distributed", "select_device"]

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Engines sharing a process group that polyrl created; the last one released destroys it.
_OWNED_USERS = 0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the process group."""

    rank: int
    world_size: int
    local_rank: int
    owned: bool  # True when the group was created by polyrl (released via release_distributed)


def select_device(preference: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` or ``cpu`` from ``"auto"`` / ``"cuda"`` / ``"cpu"``."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {preference!r}")
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("EngineConfig.device='cuda' but CUDA is not available")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(device: torch.device) -> DistInfo:
    """Use the existing default process group, or create one (call :func:`release_distributed`).

    * Already initialised (e.g. by a controller worker): used as is.
    * ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment (torchrun-style):
      ``env://`` rendezvous.
    * Otherwise a single-process group on a free local port.

    The backend is gloo on CPU and NCCL for CUDA tensors (with gloo kept for CPU tensors).
    """
    global _OWNED_USERS
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        owned = _OWNED_USERS > 0
        _OWNED_USERS += int(owned)
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, owned)
    backend = process_group_backend(device)
    present = [k for k in _ENV_KEYS if k in os.environ]
    if len(present) == len(_ENV_KEYS):
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            missing = [k for k in _ENV_KEYS if k not in os.environ]
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {missing} are not set; set all of "
                f"{list(_ENV_KEYS)} or initialise torch.distributed before the engine"
            )
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )
    _OWNED_USERS = 1
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, True)


def release_distributed(info: DistInfo) -> None:
    """Give back a group from :func:`init_distributed`; the last user of an owned group ends it.

    Groups created outside polyrl (e.g. by a controller worker) are never destroyed here.
    """
    global _OWNED_USERS
    if not info.owned or _OWNED_USERS == 0:
        return
    _OWNED_USERS -= 1
    if _OWNED_USERS == 0 and dist.is_initialized():
        dist.destroy_process_group()
