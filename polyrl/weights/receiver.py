"""Rollout-server side of a weight transfer: unpack buckets, stage, switch atomically.

Tensors are copied out of each bucket into a per-transfer staging dict (split tensors are
reassembled by byte ``start``). Nothing touches the serving weights until :meth:`commit`, which
hands the complete set to the engine's atomic ``load_weights``; a transfer that is aborted,
superseded by a new ``begin`` or simply never committed leaves the old version serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from polyrl.weights.base import (
    BucketMeta,
    WeightTransferError,
    bucket_checksum,
    dtype_from_name,
)

__all__ = ["LoadFn", "NameMap", "WeightReceiver"]

#: ``load_fn(named_tensors, version) -> new_version``: the engine's atomic switch.
LoadFn = Callable[[list[tuple[str, torch.Tensor]], int], int]
#: Maps one sender name to the backend's ``(name, tensor)`` pairs (e.g. fusing q/k/v).
NameMap = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


class WeightReceiver:
    """Collects the buckets of one transfer and commits them in one switch.

    Args:
        load_fn: the engine's atomic switch.
        current_version: returns the version now serving.
        name_map: optional hook renaming/reshaping tensors before they reach ``load_fn``.
    """

    def __init__(
        self,
        load_fn: LoadFn,
        current_version: Callable[[], int],
        name_map: NameMap | None = None,
    ):
        self.load_fn = load_fn
        self.current_version = current_version
        self.name_map = name_map
        self._lock = threading.Lock()
        self._transfer: str | None = None
        self._version = -1
        self._staged: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}
        self._seen: set[int] = set()
        self.staged_bytes = 0

    def status(self) -> dict[str, Any]:
        """Report the transfer in progress (if any) and how far it got."""
        with self._lock:
            return {
                "transfer_id": self._transfer,
                "version": self._version,
                "buckets": len(self._seen),
                "staged_bytes": self.staged_bytes,
                "weight_version": self.current_version(),
            }

    def _reset(self) -> None:
        self._transfer = None
        self._version = -1
        self._staged = {}
        self._filled = {}
        self._seen: set[int] = set()
        self.staged_bytes = 0

    def begin(self, transfer_id: str, version: int) -> int:
        """Start a transfer (dropping any unfinished one); return the version now serving.

        ``version < 0`` means "decided at commit" (the sender asks for current + 1).
        """
        current = self.current_version()
        if version >= 0 and version <= current:
            raise WeightTransferError(
                f"transfer {transfer_id} announces weight version {version}, but version "
                f"{current} is already serving; expected a version > {current}"
            )
        with self._lock:
            self._reset()
            self._transfer = transfer_id
            self._version = version
        return current

    def _check(self, transfer_id: str) -> None:
        if self._transfer != transfer_id:
            raise WeightTransferError(
                f"transfer {transfer_id} is not in progress here (current: {self._transfer}); "
                "it was aborted or superseded, start again with begin"
            )

    def receive(self, meta: BucketMeta, data: memoryview) -> None:
        """Copy the tensors of one bucket out of ``data`` into staging."""
        with self._lock:
            self._check(meta.transfer_id)
            if meta.index in self._seen or meta.index < 0:
                raise WeightTransferError(
                    f"bucket {meta.index} of transfer {meta.transfer_id} arrived twice or has a "
                    "negative index"
                )
            if len(data) < meta.nbytes:
                raise WeightTransferError(
                    f"bucket {meta.index} holds {len(data)} bytes, its metadata says {meta.nbytes}"
                )
            if meta.checksum is not None:
                got = bucket_checksum(data[: meta.nbytes])
                if got != meta.checksum:
                    names = [t.name for t in meta.tensors]
                    raise WeightTransferError(
                        f"checksum mismatch in bucket {meta.index} (tensors {names}): "
                        f"got {got:#010x}, expected {meta.checksum:#010x}"
                    )
            raw = (
                torch.frombuffer(data, dtype=torch.uint8, count=meta.nbytes)
                if meta.nbytes
                else (torch.empty(0, dtype=torch.uint8))
            )
            for t in meta.tensors:
                if t.offset < 0 or t.offset + t.nbytes > meta.nbytes:
                    raise WeightTransferError(
                        f"tensor {t.name!r} spans bytes [{t.offset}, {t.offset + t.nbytes}) "
                        f"outside bucket {meta.index} of {meta.nbytes} bytes"
                    )
                staged = self._staged.get(t.name)
                if staged is None:
                    # Buckets may land out of order (two are in flight), so any chunk may
                    # be the first one seen of a split tensor.
                    staged = torch.empty(t.shape, dtype=dtype_from_name(t.dtype))
                    self._staged[t.name] = staged
                    self._filled[t.name] = 0
                    self.staged_bytes += staged.numel() * staged.element_size()
                dest = staged.reshape(-1).view(torch.uint8)
                if t.start + t.nbytes > dest.numel():
                    raise WeightTransferError(
                        f"tensor {t.name!r} of shape {list(t.shape)} {t.dtype} is "
                        f"{dest.numel()} bytes; a chunk reaches byte {t.start + t.nbytes}"
                    )
                dest[t.start : t.start + t.nbytes].copy_(raw[t.offset : t.offset + t.nbytes])
                self._filled[t.name] += t.nbytes
            self._seen.add(meta.index)

    def abort(self, transfer_id: str | None = None) -> bool:
        """Drop the staging of ``transfer_id`` (or of any transfer); True if something was."""
        with self._lock:
            if self._transfer is None or (transfer_id and transfer_id != self._transfer):
                return False
            self._reset()
            return True

    def commit(self, transfer_id: str, version: int, buckets: int | None = None) -> int:
        """Hand the complete staged set to the engine's atomic switch; return the new version.

        ``buckets``: how many buckets the sender sent; fewer received is an error.
        """
        with self._lock:
            self._check(transfer_id)
            if buckets is not None and len(self._seen) != buckets:
                missing = sorted(set(range(buckets)) - self._seen)
                self._reset()
                raise WeightTransferError(
                    f"transfer {transfer_id} sent {buckets} buckets but buckets {missing} never "
                    "arrived; the old weights keep serving"
                )
            incomplete = sorted(
                n
                for n, s in self._staged.items()
                if self._filled[n] != s.numel() * s.element_size()
            )
            staged = self._staged
            self._reset()
        if incomplete:
            raise WeightTransferError(
                f"transfer {transfer_id} ended with incomplete tensors {incomplete}; "
                "the old weights keep serving"
            )
        pairs: list[tuple[str, torch.Tensor]] = []
        for name, tensor in staged.items():
            pairs.extend(self.name_map(name, tensor) if self.name_map else [(name, tensor)])
        staged.clear()
        return self.load_fn(pairs, version)
