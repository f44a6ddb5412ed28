"""CUDA devices named the same way on both sides of a process boundary.

Two facts every cross-process GPU path trips on: ``torch.device("cuda")`` has no index (so
``torch.cuda.set_device`` refuses it and ``cuda:0 != cuda`` compares unequal), and two
processes with different ``CUDA_VISIBLE_DEVICES`` number the same GPU differently (a CUDA IPC
handle carries the sender's index). :func:`indexed_device` resolves the first; CUDA IPC
handles here travel with the GPU's UUID, which every process sees alike, and
:func:`open_cuda_tensor` maps it to the receiver's own index.

Nothing here initialises CUDA at import; the functions that need a GPU say so.
"""

from __future__ import annotations

import base64
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "HostStash",
    "cuda_uuids",
    "export_cuda_tensor",
    "indexed_device",
    "local_cuda_index",
    "open_cuda_tensor",
    "process_group_backend",
    "remap_ipc_device",
]

#: Where ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` takes the storage's device
#: index among the arguments that ``reduce_tensor`` returns.
_IPC_DEVICE_ARG = 6


def indexed_device(
    device: str | torch.device | None, current: Callable[[], int] | None = None
) -> torch.device:
    """Return ``device`` with an index: ``cuda`` (or ``None``) becomes ``cuda:<current>``.

    ``current`` gives this process's current CUDA device index (default
    ``torch.cuda.current_device``, which needs CUDA); CPU devices and indexed CUDA devices come
    back unchanged.
    """
    resolved = torch.device("cuda" if device is None else device)
    if resolved.type != "cuda" or resolved.index is not None:
        return resolved
    return torch.device("cuda", (current or torch.cuda.current_device)())


def process_group_backend(device: str | torch.device) -> str:
    """Return the ``torch.distributed`` backend for ranks computing on ``device``.

    On CUDA: NCCL for CUDA tensors and gloo for CPU ones (object collectives, CPU-side
    metrics); gloo alone cannot run FSDP2's collectives on CUDA tensors, even in a world of one.
    """
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


@functools.cache
def cuda_uuids() -> tuple[str, ...]:
    """Return the UUID of each GPU this process sees, in its own index order.

    Cached: a process's visible GPUs do not change, and every CUDA IPC bucket asks.
    """
    return tuple(
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    )


def local_cuda_index(uuid: str | None, uuids: Sequence[str], fallback: int) -> int:
    """Return the index, among ``uuids`` (this process's GPUs), of the GPU ``uuid``.

    ``uuid=None`` (a sender that did not say) keeps ``fallback``, the sender's own index.

    Raises:
        RuntimeError: this process does not see that GPU.
    """
    if uuid is None:
        return fallback
    for index, candidate in enumerate(uuids):
        if candidate == uuid:
            return index
    raise RuntimeError(
        f"a CUDA IPC buffer lives on GPU {uuid}, which this process cannot see (it sees "
        f"{list(uuids)}; check CUDA_VISIBLE_DEVICES): only a process on the sender's GPU can "
        "open its buffers"
    )


def remap_ipc_device(args: Sequence[Any], index: int) -> tuple[Any, ...]:
    """Return ``reduce_tensor``'s rebuild arguments with the storage device set to ``index``."""
    out = list(args)
    if len(out) <= _IPC_DEVICE_ARG or not isinstance(out[_IPC_DEVICE_ARG], int):
        raise ValueError(
            f"not the rebuild arguments of a CUDA tensor: expected a device index at position "
            f"{_IPC_DEVICE_ARG}, got {len(out)} arguments"
        )
    out[_IPC_DEVICE_ARG] = index
    return tuple(out)


def export_cuda_tensor(tensor: torch.Tensor) -> dict[str, str]:
    """Describe a CUDA tensor for another process: ``{"handle", "device_uuid"}`` (JSON-safe).

    The handle is ``base64(pickle(reduce_tensor(tensor)))``; the caller keeps ``tensor`` alive
    while a receiver may open it.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    handle = base64.b64encode(pickle.dumps(reduce_tensor(tensor))).decode("ascii")
    return {
        "handle": handle,
        "device_uuid": str(torch.cuda.get_device_properties(tensor.device).uuid),
    }


def open_cuda_tensor(handle: str, device_uuid: str | None = None) -> torch.Tensor:
    """Open a tensor :func:`export_cuda_tensor` described, on this process's index of its GPU.

    The handle is a pickle: only a trusted sender's may reach this (the caller gates it).
    """
    rebuild, args = pickle.loads(base64.b64decode(handle))  # noqa: S301 - trusted senders only
    index = local_cuda_index(
        device_uuid, cuda_uuids() if device_uuid else (), args[_IPC_DEVICE_ARG]
    )
    return rebuild(*remap_ipc_device(args, index))


class HostStash:
    """Host copies of device tensors that go back and forth (sleep and wake), kept between.

    Each name's buffer is allocated on first use and reused while its shape and dtype stay
    (pinned with ``pin``, so copies to and from a GPU are DMA transfers instead of staged
    through pageable memory), rather than a fresh host allocation every sleep. Copies with
    ``pin`` are asynchronous: synchronise the device before reading a buffer on the host.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        #: Host buffers allocated so far (stays at one per name across sleeps).
        self.allocations = 0

    def save(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into the host buffer of ``name``; return that buffer."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            self._buffers[name] = buf
            self.allocations += 1
        buf.copy_(tensor, non_blocking=self.pin)
        return buf

    def load(self, name: str, device: torch.device | str) -> torch.Tensor:
        """Return a new tensor on ``device`` holding the saved copy of ``name``."""
        return self._buffers[name].to(device, non_blocking=self.pin, copy=True)

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
