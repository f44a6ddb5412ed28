"""Model-engine side of a weight transfer: pack ``named_tensors()`` into fixed-size buckets.

Memory stays bounded by two buckets (the transport's two staging buffers, reused across
buckets and transfers), whatever the model size: while bucket *k* is in flight, bucket *k+1*
is packed into the other buffer, and buffer *k* is only reused once every replica has
acknowledged it. A dtype cast or device-to-host move happens chunk by chunk while copying into
the bucket, so no per-tensor temporary is made. A tensor larger than the bucket is *split*
across consecutive buckets (each chunk carries its byte ``start`` inside the tensor, whole
elements only), so no oversize buffer is ever needed. Every tensor starts at a 16-byte aligned
offset, so a replica can view any chunk as its dtype and convert while copying.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.weights.base import (
    BucketMeta,
    TensorMeta,
    Transport,
    WeightTransferError,
    align_up,
    bucket_checksum,
    dtype_name,
)
from polyrl.weights.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = ["SendStats", "WeightSender"]


@dataclass
class SendStats:
    """What one :meth:`WeightSender.send` did.

    ``buffer_bytes``: the two bucket buffers; ``peak_temp_bytes``: the largest temporary made
    while packing (a contiguous copy of a non-contiguous tensor, else 0); ``rss_peak_delta``:
    the process's peak RSS over its RSS at the start (with ``measure_memory``);
    ``direct_tensors``: tensors written straight into the replicas' shadows (no bucket);
    ``shared_mapped_bytes``: the replicas' shadow arenas mapped here for that (shared pages,
    counted in this process's RSS but allocated by the replicas).
    """

    version: int
    buckets: int = 0
    tensors: int = 0
    direct_tensors: int = 0
    shared_mapped_bytes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buffer_bytes: int = 0
    peak_temp_bytes: int = 0
    rss_peak_delta: int | None = None
    replica_versions: list[int] = field(default_factory=list)


class WeightSender:
    """Packs tensors into buckets and hands them to a :class:`Transport`.

    Args:
        transport: where the buckets go (reusable: keep one per sender for repeated updates).
        bucket_mb: bucket size in MiB (may be fractional, e.g. for tests).
        dtype: cast floating-point tensors to this dtype on the wire (``None``: keep); the
            cast happens chunk by chunk while packing, so no cast copy of a tensor is made.
        checksum: attach a CRC32 per bucket that the receiver verifies.
        on_bucket: called with each bucket's metadata after it was handed to the transport.
        mode: receiver staging, ``staged`` (atomic, one model of extra memory on the replica)
            or ``inplace`` (~2 buckets; the replica pauses and refuses requests until commit).
        inflight: in-flight requests during the transfer: ``keep`` (async RL), ``pause`` or
            ``abort`` (on-policy).
        stall_timeout: seconds without a bucket after which replicas drop the transfer.
        measure_memory: have the replicas (and this process) measure their peak RSS.
    """

    def __init__(
        self,
        transport: Transport,
        bucket_mb: float = 64.0,
        dtype: torch.dtype | None = None,
        checksum: bool = False,
        on_bucket: Callable[[BucketMeta], None] | None = None,
        mode: str = "staged",
        inflight: str = "keep",
        stall_timeout: float | None = None,
        measure_memory: bool = False,
    ):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        if mode not in ("staged", "inplace"):
            raise ValueError(f"mode must be 'staged' or 'inplace', got {mode!r}")
        if inflight not in ("keep", "pause", "abort"):
            raise ValueError(f"inflight must be 'keep', 'pause' or 'abort', got {inflight!r}")
        self.transport = transport
        self.bucket_bytes = align_up(max(64, int(bucket_mb * 1024 * 1024)))
        self.dtype = dtype
        self.checksum = checksum
        self.on_bucket = on_bucket
        self.options: dict[str, Any] = {"mode": mode, "inflight": inflight}
        if stall_timeout is not None:
            self.options["stall_timeout"] = float(stall_timeout)
        self.measure_memory = measure_memory
        if measure_memory:
            self.options["measure_memory"] = True

    def _source(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype, int]:
        """Flat view of ``tensor`` (no copy when contiguous), its wire dtype, extra bytes."""
        tensor = tensor.detach()
        extra = 0
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            extra = tensor.numel() * tensor.element_size()
        wire = self.dtype if (self.dtype is not None and tensor.is_floating_point()) else None
        return tensor.reshape(-1), wire or tensor.dtype, extra

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> SendStats:
        """Send every tensor, then commit; on any error the replicas are told to abort.

        Args:
            named_tensors: ``(name, tensor)`` pairs, consumed one at a time.
            version: the new weight version (default: the replicas' current version + 1).

        Returns:
            Counters of the transfer, with the versions the replicas switched to.
        """
        transfer_id = uuid.uuid4().hex
        rss0 = None
        if self.measure_memory and reset_peak_rss():
            rss0 = rss_bytes()
        t0 = time.perf_counter()
        current = self.transport.begin(
            transfer_id, -1 if version is None else version, self.options
        )
        if version is None:
            if len(set(current)) > 1:
                self.transport.abort(transfer_id)
                raise WeightTransferError(
                    f"replicas disagree on their weight version {current}; pass version="
                )
            version = (current[0] if current else 0) + 1
        stats = SendStats(version=version)
        pending: list[Callable[[], None] | None] = [None, None]
        slot = 0
        entries: list[TensorMeta] = []
        fill = 0
        view: torch.Tensor | None = None
        buffers: dict[int, int] = {}
        bucket = self.bucket_bytes

        def acquire() -> torch.Tensor:
            wait = pending[slot]
            if wait is not None:
                pending[slot] = None
                wait()
            mem = self.transport.buffer(slot, bucket)
            buffers[slot] = max(buffers.get(slot, 0), mem.numel())
            stats.buffer_bytes = sum(buffers.values())
            return mem

        def flush() -> None:
            nonlocal slot, entries, fill, view
            if not entries or view is None:
                return
            check = bucket_checksum(view[:fill]) if self.checksum else None
            meta = BucketMeta(
                transfer_id, version, stats.buckets, fill, tuple(entries), checksum=check
            )
            pending[slot] = self.transport.send_bucket(slot, meta)
            stats.buckets += 1
            if self.on_bucket is not None:
                self.on_bucket(meta)
            slot ^= 1
            entries, fill, view = [], 0, None

        try:
            for name, tensor in named_tensors:
                if not isinstance(tensor, torch.Tensor):
                    raise WeightTransferError(
                        f"tensor {name!r} is a {type(tensor).__name__}; expected a torch.Tensor"
                    )
                flat, wire, extra = self._source(tensor)
                stats.peak_temp_bytes = max(stats.peak_temp_bytes, extra)
                wire_name = dtype_name(wire)
                size = torch.empty((), dtype=wire).element_size()
                shape = tuple(tensor.shape)
                total = flat.numel()  # elements
                start = 0
                stats.tensors += 1
                if total and self.transport.write_direct(name, flat, shape, wire, self.checksum):
                    stats.direct_tensors += 1  # one copy, straight into the replicas' shadows
                    stats.bytes += total * size
                    continue
                if view is None:
                    view = acquire()
                fill = align_up(fill)  # every tensor starts aligned: chunks view as any dtype
                if total == 0:
                    if fill > bucket:
                        flush()
                        view = acquire()
                    entries.append(TensorMeta(name, shape, wire_name, min(fill, bucket), 0, 0))
                    continue
                while start < total:
                    if view is None:
                        view = acquire()
                    room = (bucket - fill) // size  # whole elements only
                    if room <= 0:
                        flush()
                        continue
                    take = min(total - start, room)
                    dst = view[fill : fill + take * size].view(wire)
                    # One copy: casts and moves device→host on the way into the bucket.
                    dst.copy_(flat[start : start + take])
                    entries.append(
                        TensorMeta(name, shape, wire_name, fill, take * size, start * size)
                    )
                    fill += take * size
                    stats.bytes += take * size  # payload only, not the alignment padding
                    start += take
                    if fill >= bucket:
                        flush()
                    elif start < total:
                        fill = align_up(fill)
                del flat
            flush()
            for i in (0, 1):
                wait = pending[i]
                if wait is not None:
                    pending[i] = None
                    wait()
            stats.replica_versions = self.transport.commit(transfer_id, version, stats.buckets)
        except BaseException:
            for wait in pending:
                if wait is not None:
                    try:
                        wait()
                    except Exception:  # noqa: BLE001, S110 - the original error matters more
                        pass
            try:
                self.transport.abort(transfer_id)
            except Exception:  # noqa: BLE001, S110 - replicas drop stale staging on next begin
                pass
            raise
        stats.seconds = time.perf_counter() - t0
        stats.shared_mapped_bytes = self.transport.shared_mapped_bytes()
        if rss0 is not None:
            peak = peak_rss_bytes()
            stats.rss_peak_delta = None if peak is None else max(0, peak - rss0)
        return stats
