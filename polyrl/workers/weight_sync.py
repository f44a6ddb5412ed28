"""Engine-side weight sync: stream an engine's weights to rollout replicas.

The engine worker's ``sync_weights`` method calls :func:`sync_engine_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from polyrl.weights.base import create_transport
from polyrl.weights.sender import WeightSender

__all__ = ["sync_engine_weights"]


def sync_engine_weights(
    engine: Any,
    rank: int,
    transport: str,
    urls: Sequence[str],
    *,
    bucket_mb: float = 64.0,
    dtype: torch.dtype | None = None,
    checksum: bool = False,
    version: int | None = None,
    transport_options: dict[str, Any] | None = None,
    mode: str = "staged",
    inflight: str = "keep",
) -> dict[str, Any] | None:
    """Stream ``engine.named_tensors()`` to ``urls``; only rank 0 sends.

    ``named_tensors`` is collective, so every other rank still walks it (gathering each full
    tensor) and discards the tensors. The sender casts to ``dtype`` and moves to the host chunk
    by chunk while packing. ``mode``/``inflight``: see :class:`WeightSender`. Returns rank 0's
    send statistics, ``None`` elsewhere.
    """
    tensors = engine.named_tensors()
    if rank != 0:
        for _ in tensors:
            pass
        return None
    sender_transport = create_transport(transport, urls=list(urls), **(transport_options or {}))
    try:
        stats = WeightSender(
            sender_transport,
            bucket_mb=bucket_mb,
            dtype=dtype,
            checksum=checksum,
            mode=mode,
            inflight=inflight,
        ).send(tensors, version=version)
    finally:
        sender_transport.close()
    return {
        "version": stats.version,
        "buckets": stats.buckets,
        "bytes": stats.bytes,
        "seconds": stats.seconds,
        "buffer_bytes": stats.buffer_bytes,
        "replica_versions": stats.replica_versions,
    }
