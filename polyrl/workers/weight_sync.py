"""Engine-side weight sync: stream an engine's weights to rollout replicas.

Each engine rank holds one :class:`WeightSync` for the run (the engine worker's
``sync_weights`` calls it): its transport -- buffers, shared-memory segments, a ``dist``
group -- is made on the first sync and reused by every later one with the same replicas.

Which rank sends to which replica is the caller's choice (``senders``): by default rank 0
sends to all; in hybrid placement on GPUs each replica is sent to by the rank that shares its
GPU, since a CUDA IPC handle opens only on the GPU it was made on and a replica sees only its
own GPUs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from polyrl.weights.base import Transport, create_transport
from polyrl.weights.sender import WeightSender

__all__ = ["WeightSync", "replicas_of_rank"]

#: Transports whose buffers may live on the sending rank's GPU (cuda_ipc; dist over NCCL):
#: they are told which one rather than trusting the thread's current device.
_DEVICE_TRANSPORTS = ("cuda_ipc", "dist")


def replicas_of_rank(rank: int, urls: Sequence[str], senders: Sequence[int] | None) -> list[str]:
    """Return the replicas (of ``urls``) that ``rank`` sends to.

    ``senders[i]`` is the rank that sends to ``urls[i]``; ``None``: rank 0 sends to every one.

    Raises:
        ValueError: ``senders`` does not name one rank per URL.
    """
    if senders is None:
        return list(urls) if rank == 0 else []
    if len(senders) != len(urls):
        raise ValueError(
            f"senders names {len(senders)} rank(s) for {len(urls)} replica URL(s); expected one "
            "sending rank per replica"
        )
    return [url for url, sender in zip(urls, senders, strict=True) if sender == rank]


class WeightSync:
    """One engine rank's weight sender to the rollout replicas, kept for the run.

    The transport is made for a set of replicas and options and kept while they stay the
    same; a different set (a restarted replica, a push to a subset) gets a new one and the old
    one is closed (its NCCL group shut down).
    """

    def __init__(self) -> None:
        self._transport: Transport | None = None
        self._key: tuple[Any, ...] | None = None
        #: Transports made so far (one for a run whose replicas stay the same).
        self.transports_made = 0

    def _transport_for(self, name: str, urls: Sequence[str], options: dict[str, Any]) -> Transport:
        key = (name, tuple(urls), json.dumps(options, sort_keys=True, default=str))
        if self._transport is None or key != self._key:
            self.close()
            self._transport = create_transport(name, urls=list(urls), **options)
            self._key = key
            self.transports_made += 1
        return self._transport

    def send(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        rank: int,
        transport: str,
        urls: Sequence[str],
        *,
        senders: Sequence[int] | None = None,
        device: torch.device | None = None,
        bucket_mb: float = 64.0,
        dtype: torch.dtype | None = None,
        checksum: bool = False,
        version: int | None = None,
        transport_options: dict[str, Any] | None = None,
        mode: str = "staged",
        inflight: str = "keep",
    ) -> dict[str, Any] | None:
        """Stream ``tensors`` to this rank's replicas; ``None`` when it sends to none.

        ``tensors`` (the engine's ``named_tensors()``) is collective: a rank with no replica
        still walks it (gathering each full tensor) and discards the tensors. The sender casts
        to ``dtype`` (the replicas' dtype: the bytes on the wire) while packing. ``device``:
        this rank's device, where a ``cuda_ipc`` transport keeps its buffers. ``mode`` /
        ``inflight``: see :class:`WeightSender`.
        """
        mine = replicas_of_rank(rank, urls, senders)
        if not mine:
            for _ in tensors:
                pass
            return None
        options = dict(transport_options or {})
        if transport in _DEVICE_TRANSPORTS and device is not None and device.type == "cuda":
            options.setdefault("device", str(device))
        sender_transport = self._transport_for(transport, mine, options)
        try:
            stats = WeightSender(
                sender_transport,
                bucket_mb=bucket_mb,
                dtype=dtype,
                checksum=checksum,
                mode=mode,
                inflight=inflight,
            ).send(tensors, version=version)
        except BaseException:
            # A failed transfer may leave a broken group or half-used buffers: start afresh.
            self.close()
            raise
        return {
            "version": stats.version,
            "buckets": stats.buckets,
            "bytes": stats.bytes,
            "seconds": stats.seconds,
            "buffer_bytes": stats.buffer_bytes,
            "replica_versions": stats.replica_versions,
            "rank": rank,
            "urls": mine,
            "transfers": getattr(sender_transport, "transfers", None),
            # Buckets the replicas received, by how they came (summed over the replicas).
            "received": _summed(getattr(sender_transport, "received", [])),
        }

    def close(self) -> None:
        """Close the transport (the next send makes a new one)."""
        transport, self._transport, self._key = self._transport, None, None
        if transport is not None:
            transport.close()


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for kind, n in count.items():
            total[kind] = total.get(kind, 0) + int(n)
    return total
