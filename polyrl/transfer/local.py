"""The one-process transfer queue: same API and semantics as the Ray backend.

For tests and single-process runs. Thread-safe: producers and consumers may be threads of one
process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyrl.core.batch import Batch
from polyrl.transfer._core import (
    ColumnStore,
    MetadataStore,
    batch_to_columns,
    check_fields,
    check_get_meta_args,
    check_partition,
    check_sample_ids,
    columns_to_batch,
    row_groups,
    row_lengths,
)
from polyrl.transfer.base import BatchMeta, MetaRequest, TransferError, TransferQueue

__all__ = ["LocalTransferQueue"]


class LocalTransferQueue(TransferQueue):
    """A transfer queue living in this process (one storage unit, index 0).

    Args:
        group_key: object (or tensor) column holding each sample's group id.
        length_key: object column whose per-row ``len`` is the sample length when the put has no
            ``attention_mask`` tensor column.
        copy: copy tensor data on put (default) so later in-place changes to the caller's
            tensors cannot alter what was stored.

    A local queue cannot be shared across processes, so pickling it raises ``TypeError``.
    """

    def __init__(
        self, group_key: str = "uid", length_key: str = "response_ids", copy: bool = True
    ) -> None:
        self.group_key = group_key
        self.length_key = length_key
        self.copy = copy
        self._meta = MetadataStore()
        self._store = ColumnStore()
        # One lock for metadata and storage; the condition wakes blocked get_meta calls on puts.
        self._cond = threading.Condition(threading.Lock())

    def __reduce__(self) -> Any:
        raise TypeError(
            "LocalTransferQueue lives in one process and cannot be pickled; use "
            "make_transfer_queue('ray') to share a queue between processes or Ray actors"
        )

    # ------------------------------------------------------------------------------- writes
    def _put(self, batch: Batch, partition: str, sample_ids: Sequence[int] | None) -> BatchMeta:
        """Store the rows of ``batch`` (see :meth:`TransferQueue.put`)."""
        check_partition(partition)
        cols = batch_to_columns(batch)
        n = len(batch)
        ids = check_sample_ids(sample_ids, n)
        if self.copy:
            cols = {
                k: (kind, arr.copy() if kind == "o" else np.array(arr, copy=True), dt)
                for k, (kind, arr, dt) in cols.items()
            }
        groups = row_groups(batch, self.group_key)
        lengths = row_lengths(batch, self.length_key)
        with self._cond:
            if ids is None:
                first = self._meta.allocate(partition, n)
                ids = list(range(first, first + n))
            # Data first, then metadata: a consumer never sees a reference to unstored data.
            self._store.put(partition, ids, cols)
            meta = self._meta.commit(partition, ids, list(cols), [0] * n, groups, lengths)
            self._cond.notify_all()
        return meta

    def _clear(self, partition: str) -> None:
        """Drop the data and metadata of ``partition``."""
        check_partition(partition)
        with self._cond:
            self._meta.clear(partition)
            self._store.clear(partition)

    # -------------------------------------------------------------------------------- reads
    def _get_meta(self, request: MetaRequest) -> BatchMeta:
        """Return references to ready samples not yet given to the consumer (see the base class)."""
        request, smp = check_get_meta_args(request)
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        with self._cond:
            while True:
                meta, wait = self._meta.take_or_wait(request, smp, deadline)
                if meta is not None:
                    return meta
                self._cond.wait(wait)

    def _get_data(self, meta: BatchMeta, fields: Sequence[str] | None) -> Batch:
        """Rows of ``meta`` in its order (see :meth:`TransferQueue.get_data`)."""
        if not isinstance(meta, BatchMeta):
            raise TypeError(f"get_data: expected a BatchMeta, got {type(meta).__name__}")
        fields = meta.fields if fields is None else check_fields(fields)
        n = len(meta)
        if n == 0:
            return Batch(batch_size=0)
        with self._cond:
            if not self._meta.has_partition(meta.partition):
                raise TransferError(
                    f"get_data: unknown partition {meta.partition!r} (never put, or cleared); "
                    f"known partitions: {sorted(self._meta.partitions())}"
                )
            cols = self._store.get(meta.partition, meta.sample_ids, fields)
        # Results must not alias the store: a consumer may write into what it gets.
        cols = {k: (kind, arr.copy(), dt) for k, (kind, arr, dt) in cols.items()}
        return columns_to_batch(n, [(range(n), cols)], fields)

    def _status(self, partition: str | None) -> dict[str, Any]:
        """Readiness, consumption and bytes held (see :meth:`TransferQueue.status`)."""
        with self._cond:
            parts = self._meta.status(partition)
            nbytes = self._store.nbytes()
        return {"partitions": parts, "storage_bytes": nbytes, "units": [nbytes]}

    def storage_bytes(self) -> int:
        """Bytes of sample data held."""
        with self._cond:
            return self._store.nbytes()
