"""Model-engine side of a weight transfer: pack ``named_tensors()`` into fixed-size buckets.

Memory stays bounded by two buckets (the transport's two staging buffers) plus the one full
tensor currently being packed, whatever the model size: while bucket *k* is in flight, bucket
*k+1* is packed into the other buffer, and buffer *k* is only reused once every replica has
acknowledged it. A tensor larger than the bucket is *split* across consecutive buckets
(each chunk carries its byte ``start`` inside the tensor), so no oversize buffer is ever needed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from polyrl.weights.base import (
    BucketMeta,
    TensorMeta,
    Transport,
    WeightTransferError,
    bucket_checksum,
    dtype_name,
)

__all__ = ["SendStats", "WeightSender"]


@dataclass
class SendStats:
    """What one :meth:`WeightSender.send` did."""

    version: int
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    buffer_bytes: int = 0
    replica_versions: list[int] = field(default_factory=list)


class WeightSender:
    """Packs tensors into buckets and hands them to a :class:`Transport`.

    Args:
        transport: where the buckets go.
        bucket_mb: bucket size in MiB (may be fractional, e.g. for tests).
        dtype: cast floating-point tensors to this dtype before sending (``None``: keep).
        checksum: attach a CRC32 per bucket that the receiver verifies.
        on_bucket: called with each bucket's metadata after it was handed to the transport.
    """

    def __init__(
        self,
        transport: Transport,
        bucket_mb: float = 64.0,
        dtype: torch.dtype | None = None,
        checksum: bool = False,
        on_bucket: Callable[[BucketMeta], None] | None = None,
    ):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.transport = transport
        self.bucket_bytes = max(64, int(bucket_mb * 1024 * 1024))
        self.dtype = dtype
        self.checksum = checksum
        self.on_bucket = on_bucket

    def _flat(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)

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
        t0 = time.perf_counter()
        current = self.transport.begin(transfer_id, -1 if version is None else version)
        if version is None:
            if len(set(current)) > 1:
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
        buffers: set[int] = set()

        def acquire() -> torch.Tensor:
            wait = pending[slot]
            if wait is not None:
                pending[slot] = None
                wait()
            mem = self.transport.buffer(slot, self.bucket_bytes)
            if slot not in buffers:
                buffers.add(slot)
                stats.buffer_bytes += len(mem)
            return torch.frombuffer(mem, dtype=torch.uint8, count=self.bucket_bytes)

        def flush() -> None:
            nonlocal slot, entries, fill, view
            if not entries or view is None:
                return
            check = None
            if self.checksum:
                check = bucket_checksum(memoryview(view[:fill].numpy()))
            meta = BucketMeta(
                transfer_id, version, stats.buckets, fill, tuple(entries), checksum=check
            )
            pending[slot] = self.transport.send_bucket(slot, meta)
            stats.buckets += 1
            stats.bytes += fill
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
                flat = self._flat(tensor)
                wire = dtype_name(
                    self.dtype if (self.dtype and tensor.is_floating_point()) else tensor.dtype
                )
                shape = tuple(tensor.shape)
                start = 0
                total = flat.numel()
                stats.tensors += 1
                while start < total or (total == 0 and start == 0):
                    if view is None:
                        view = acquire()
                    take = min(total - start, self.bucket_bytes - fill)
                    if take == 0 and total > 0:
                        flush()
                        continue
                    view[fill : fill + take].copy_(flat[start : start + take])
                    entries.append(TensorMeta(name, shape, wire, fill, take, start))
                    fill += take
                    start += take
                    if fill >= self.bucket_bytes:
                        flush()
                    if total == 0:
                        break
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
        return stats
