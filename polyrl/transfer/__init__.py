"""The data transfer system: a TransferQueue-style sample store between the services.

Metadata (which fields of which samples are produced, which consumer has had which samples)
is kept apart from the data (columns held by storage units), so services pass small
:class:`BatchMeta` references while rows move point-to-point. See :mod:`polyrl.transfer.base`
for the API, :mod:`polyrl.transfer.local` and :mod:`polyrl.transfer.ray_backend` for the backends,
and :mod:`polyrl.transfer.segments` / :mod:`polyrl.transfer.fastpath` for the Ray backend's
same-node data path (shared-memory segments) and control path (the controller's Unix socket).
"""

from __future__ import annotations

from typing import Any

from polyrl.transfer.base import BatchMeta, SampleInfo, Sampler, TransferError, TransferQueue
from polyrl.transfer.local import LocalTransferQueue
from polyrl.transfer.samplers import get_sampler, register_sampler, registered_samplers

__all__ = [
    "BatchMeta",
    "LocalTransferQueue",
    "RayTransferQueue",
    "SampleInfo",
    "Sampler",
    "TransferError",
    "TransferQueue",
    "get_sampler",
    "make_transfer_queue",
    "register_sampler",
    "registered_samplers",
    "start_ray_transfer_queue",
]


def make_transfer_queue(backend: str = "ray", **kwargs: Any) -> TransferQueue:
    """Build a transfer queue.

    Args:
        backend: ``"ray"`` (controller and storage-unit actors, see
            :func:`~polyrl.transfer.ray_backend.start_ray_transfer_queue`, which gets ``kwargs``)
            or ``"local"`` (:class:`LocalTransferQueue` in this process).
        **kwargs: backend options.
    """
    if backend == "local":
        return LocalTransferQueue(**kwargs)
    if backend == "ray":
        from polyrl.transfer.ray_backend import start_ray_transfer_queue

        return start_ray_transfer_queue(**kwargs)
    raise ValueError(f"unknown transfer queue backend {backend!r}; expected 'ray' or 'local'")


def __getattr__(name: str) -> Any:
    # The Ray backend is imported on first use so that the local backend does not need Ray.
    if name in (
        "RayTransferQueue",
        "start_ray_transfer_queue",
        "TransferController",
        "StorageUnit",
    ):
        from polyrl.transfer import ray_backend

        return getattr(ray_backend, name)
    raise AttributeError(f"module 'polyrl.transfer' has no attribute {name!r}")
