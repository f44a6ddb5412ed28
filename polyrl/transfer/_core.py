"""Backend-independent pieces shared by the local and the Ray transfer queue.

* :class:`MetadataStore` -- what the controller knows: per partition, which fields of which
  samples are produced, which samples each consumer has been given, groups, lengths, units.
* :class:`ColumnStore` -- what a storage unit holds: per-put column chunks as numpy arrays plus
  an index ``(field, sample_id) -> (chunk, row)``.
* helpers turning a :class:`Batch` into per-row columns and fetched columns back into a Batch.

Images and videos (:class:`~polyrl.core.multimodal.MultiModalInputs` in an object column, e.g.
:data:`~polyrl.core.columns.MULTI_MODAL`) are held once per prompt, not once per sample copy:
:func:`batch_to_columns` makes the rows of a put that hold equal media hold one object (so a
pickled put carries it once), and a :class:`ColumnStore` keeps one object per distinct media
content in a partition (:func:`media_key`), shared by every row that holds it, counted once in
its bytes and dropped with the last row.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from polyrl.core.batch import Batch, _tensor_from_numpy, _tensor_to_numpy
from polyrl.core.multimodal import MultiModalInputs
from polyrl.transfer.base import BatchMeta, MetaRequest, SampleInfo, Sampler, TransferError
from polyrl.transfer.samplers import get_sampler

# A column as shipped to / from a storage unit:
#   ("t", array, dtype_name)  -- a tensor column, rows stacked along axis 0; dtype_name is the
#                                torch dtype when numpy lacks it (bf16 travels as an int view)
#   ("o", object_array, None) -- one Python object per row
Column = tuple[str, np.ndarray, str | None]


# ----------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------
def check_partition(partition: Any) -> str:
    """Return ``partition`` if it is a non-empty str, else raise a clear error."""
    if not isinstance(partition, str) or not partition:
        raise TypeError(f"partition must be a non-empty str, got {partition!r}")
    return partition


def check_fields(fields: Any) -> tuple[str, ...]:
    """Normalize a field list (a single str is rejected: it is almost always a mistake)."""
    if isinstance(fields, str) or not isinstance(fields, Sequence):
        raise TypeError(f"fields must be a sequence of field names, got {fields!r}")
    out = tuple(fields)
    for f in out:
        if not isinstance(f, str) or not f:
            raise TypeError(f"field names must be non-empty str, got {f!r} in {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"fields contain duplicates: {list(out)}")
    return out


def check_batch_size(batch_size: Any) -> int | None:
    """``batch_size`` must be None or an int >= 1."""
    if batch_size is None:
        return None
    if not isinstance(batch_size, int | np.integer) or isinstance(batch_size, bool):
        raise TypeError(f"batch_size must be an int or None, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(
            f"batch_size must be >= 1 (or None for whatever is ready), got {batch_size}"
        )
    return int(batch_size)


def check_sample_ids(sample_ids: Any, n: int) -> list[int] | None:
    """Normalize explicit sample ids (one per row, distinct, >= 0)."""
    if sample_ids is None:
        return None
    if isinstance(sample_ids, torch.Tensor):
        sample_ids = sample_ids.tolist()
    ids = [int(i) for i in sample_ids]
    if len(ids) != n:
        raise ValueError(f"put: got {len(ids)} sample_ids for a batch of {n} rows (one per row)")
    if len(set(ids)) != len(ids):
        raise ValueError("put: sample_ids contain duplicates")
    if ids and min(ids) < 0:
        raise ValueError(f"put: sample_ids must be >= 0, got {min(ids)}")
    return ids


# ----------------------------------------------------------------------------------------------
# Batch <-> columns
# ----------------------------------------------------------------------------------------------
MediaKey = tuple[Any, ...]


def media_key(value: Any) -> MediaKey | None:
    """Content key of a :class:`MultiModalInputs` value (``None`` for any other value).

    Equal keys mean equal media as the model sees them: the items' kinds and content digests
    in order, the placeholder counts they fill, and the names, dtypes and shapes of the
    processed tensors (the same images under other pixel bounds give other tensors, and
    another key).
    """
    if not isinstance(value, MultiModalInputs):
        return None
    shapes = tuple((k, str(t.dtype), tuple(t.shape)) for k, t in sorted(value.tensors.items()))
    return (value.kinds, value.digests, value.token_counts, shapes)


def share_media(values: np.ndarray) -> np.ndarray:
    """Return ``values`` with rows of equal media holding one object (the first row's).

    The ``n`` sample copies of a prompt then pickle as one object plus ``n`` references. The
    array is copied only when a row is replaced; other values are left as they are.
    """
    first: dict[MediaKey, Any] = {}
    out = values
    for i, value in enumerate(values):
        key = media_key(value)
        if key is None:
            continue
        kept = first.setdefault(key, value)
        if kept is not value:
            if out is values:
                out = values.copy()
            out[i] = kept
    return out


def batch_to_columns(batch: Batch) -> dict[str, Column]:
    """Columns of ``batch`` as numpy (tensor columns are CPU views, no copy when contiguous).

    Object columns holding equal media share one object per content (:func:`share_media`).
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"put: expected a polyrl Batch, got {type(batch).__name__}")
    cols: dict[str, Column] = {}
    for key, value in batch.tensors.items():
        arr, dtype_name = _tensor_to_numpy(key, value)
        cols[key] = ("t", arr, dtype_name)
    for key, value in batch.non_tensors.items():
        cols[key] = ("o", share_media(value), None)
    return cols


def slice_columns(cols: Mapping[str, Column], rows: slice | np.ndarray) -> dict[str, Column]:
    """Rows ``rows`` of every column (a slice keeps views; an index array copies)."""
    return {k: (kind, arr[rows], dt) for k, (kind, arr, dt) in cols.items()}


def _group_of(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor | np.ndarray):
        value = value.item()
    return str(value)


def row_groups(batch: Batch, group_key: str) -> list[str | None] | None:
    """Group id per row from ``batch.non_tensors[group_key]`` (None if the column is absent)."""
    if group_key in batch.non_tensors:
        return [_group_of(v) for v in batch.non_tensors[group_key]]
    if group_key in batch.tensors:
        return [_group_of(v) for v in batch.tensors[group_key].reshape(len(batch), -1)[:, 0]]
    return None


def row_lengths(batch: Batch, length_key: str) -> list[int] | None:
    """Token count per row: ``attention_mask`` row sums, else ``len`` of the length column."""
    if "attention_mask" in batch.tensors:
        mask = batch.tensors["attention_mask"]
        return [int(x) for x in mask.reshape(len(batch), -1).sum(dim=1).tolist()]
    if length_key in batch.non_tensors:
        return [len(v) for v in batch.non_tensors[length_key]]
    if length_key in batch.tensors:
        t = batch.tensors[length_key]
        return [int(t[0].numel()) if t.ndim > 1 else 1] * len(batch)
    return None


def _row_as_value(kind: str, arr: np.ndarray, dt: str | None, row: int) -> Any:
    if kind == "o":
        return arr[row]
    return _tensor_from_numpy(np.ascontiguousarray(arr[row]), dt).clone()


def columns_to_batch(
    n: int, parts: Sequence[tuple[Sequence[int], Mapping[str, Column]]], fields: Sequence[str]
) -> Batch:
    """Assemble a Batch of ``n`` rows from per-unit results.

    Args:
        n: rows of the result.
        parts: ``(positions, columns)`` per storage unit: the rows of ``columns`` go to the given
            positions of the result.
        fields: the fields to build, in order.
    """
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, np.ndarray] = {}
    for f in fields:
        pieces = [(pos, cols[f]) for pos, cols in parts if len(pos)]
        stackable = (
            pieces
            and all(kind == "t" for _, (kind, _, _) in pieces)
            and len({(arr.dtype, arr.shape[1:], dt) for _, (_, arr, dt) in pieces}) == 1
        )
        if stackable:
            if len(pieces) == 1 and list(pieces[0][0]) == list(range(n)):
                arr = pieces[0][1][1]  # one unit, rows already in order: keep the zero-copy buffer
            else:
                first = pieces[0][1][1]
                arr = np.empty((n, *first.shape[1:]), dtype=first.dtype)
                for pos, (_, part, _) in pieces:
                    arr[np.asarray(pos, dtype=np.int64)] = part
            tensors[f] = _tensor_from_numpy(arr, pieces[0][1][2])
        else:
            out = np.empty(n, dtype=object)
            for pos, (kind, part, dt) in pieces:
                for j, p in enumerate(pos):
                    out[p] = _row_as_value(kind, part, dt, j)
            objects[f] = out
    return Batch(tensors, objects, batch_size=n)


def value_nbytes(value: Any) -> int:
    """Measured bytes of one stored object (array buffers, strings; shallow size otherwise).

    Media inputs count their processed tensors and their encoded sources.
    """
    if isinstance(value, MultiModalInputs):
        return value.nbytes + value_nbytes(value.sources)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return sum(value_nbytes(v) for v in value.ravel())
        return int(value.nbytes)
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(value_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(value_nbytes(k) + value_nbytes(v) for k, v in value.items())
    return sys.getsizeof(value)


# ----------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------
@dataclass
class _Chunk:
    kind: str
    array: np.ndarray
    dtype_name: str | None
    nbytes: int
    live: int  # rows still referenced by the index; the chunk is dropped at 0
    # Opaque handle of the object all columns of this put came in (the Ray backend keeps the
    # producer's ObjectRef here, to hand readers the original object instead of a copy).
    source: Any = None
    # The distinct media contents the rows refer to (held in _PartitionData.media).
    media: tuple[MediaKey, ...] = ()


@dataclass
class _Media:
    """One media content of a partition: the object every row holding it gets."""

    value: MultiModalInputs
    nbytes: int
    chunks: int = 0  # chunks referring to it; dropped at 0


@dataclass
class _PartitionData:
    chunks: dict[int, _Chunk] = field(default_factory=dict)
    # field -> sample_id -> (chunk id, row)
    index: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    next_chunk: int = 0
    media: dict[MediaKey, _Media] = field(default_factory=dict)


class ColumnStore:
    """Per-put column chunks (numpy arrays) of many partitions, indexed by (field, sample).

    Media values of object columns are held once per content and partition (see the module
    docstring): rows that came with equal copies, in one put or several, get one object back.

    Not thread-safe: the local backend calls it under its lock, a storage unit actor runs one
    call at a time.
    """

    def __init__(self) -> None:
        self._parts: dict[str, _PartitionData] = {}
        self._bytes = 0

    def put(
        self,
        partition: str,
        sample_ids: Sequence[int],
        cols: Mapping[str, Column],
        source: Any = None,
    ) -> None:
        """Store rows ``i`` of every column as field values of ``sample_ids[i]``.

        ``source`` (optional) names the object the columns came in, whose row ``i`` is row ``i``
        of every column; :meth:`find_source` returns it for requests it can serve whole.
        """
        part = self._parts.setdefault(partition, _PartitionData())
        n = len(sample_ids)
        for name, (kind, arr, dt) in cols.items():
            if int(arr.shape[0]) != n:
                raise ValueError(f"column {name!r} has {arr.shape[0]} rows for {n} sample ids")
            if n == 0:
                continue
            media: tuple[MediaKey, ...] = ()
            if kind == "o":
                arr, media, nbytes = self._hold_media(part, arr)
            else:
                nbytes = value_nbytes(arr)
            cid = part.next_chunk
            part.next_chunk += 1
            part.chunks[cid] = _Chunk(kind, arr, dt, nbytes, n, source, media)
            self._bytes += nbytes
            idx = part.index.setdefault(name, {})
            replaced = [idx[sid][0] for sid in sample_ids if sid in idx]
            idx.update(zip(sample_ids, zip([cid] * n, range(n), strict=True), strict=True))
            for old in replaced:
                self._release(part, old)

    def _hold_media(
        self, part: _PartitionData, values: np.ndarray
    ) -> tuple[np.ndarray, tuple[MediaKey, ...], int]:
        """Point the rows of an object column at the partition's one object per media content.

        Returns the column (copied if a row was replaced), the media contents it refers to
        and the bytes of its other values. A content new to the partition is counted in the
        store's bytes here, once, however many rows and puts hold it.
        """
        out = values
        keys: dict[MediaKey, None] = {}
        rest = 0
        for i, value in enumerate(values):
            key = media_key(value)
            if key is None:
                rest += value_nbytes(value)
                continue
            held = part.media.get(key)
            if held is None:
                held = part.media[key] = _Media(value, value_nbytes(value))
                self._bytes += held.nbytes
            if key not in keys:
                keys[key] = None
                held.chunks += 1
            if held.value is not value:
                if out is values:
                    out = values.copy()
                out[i] = held.value
        return out, tuple(keys), rest

    def _release(self, part: _PartitionData, cid: int) -> None:
        chunk = part.chunks[cid]
        chunk.live -= 1
        if chunk.live == 0:
            del part.chunks[cid]
            self._bytes -= chunk.nbytes
            for key in chunk.media:
                held = part.media[key]
                held.chunks -= 1
                if held.chunks == 0:
                    del part.media[key]
                    self._bytes -= held.nbytes

    def get(
        self, partition: str, sample_ids: Sequence[int], fields: Sequence[str]
    ) -> dict[str, Column]:
        """Rows of ``sample_ids`` for each field, gathered into one column per field.

        A field whose rows sit in tensor chunks of one dtype and trailing shape comes back as a
        stacked ``"t"`` column (a view when the rows are one contiguous run of one chunk, else a
        fresh array); anything else comes back as an ``"o"`` column of per-row values.
        """
        part = self._parts.get(partition)
        if part is None:
            raise TransferError(
                f"partition {partition!r} holds no data in this storage unit (never put, or "
                "cleared)"
            )
        out: dict[str, Column] = {}
        for f in fields:
            idx = part.index.get(f, {})
            locs = []
            missing = []
            for sid in sample_ids:
                loc = idx.get(sid)
                if loc is None:
                    missing.append(sid)
                else:
                    locs.append(loc)
            if missing:
                raise TransferError(
                    f"field {f!r} of partition {partition!r} is missing for sample ids "
                    f"{missing[:16]}{' ...' if len(missing) > 16 else ''} ({len(missing)} of "
                    f"{len(sample_ids)}); put it first or ask get_meta for it"
                )
            out[f] = self._gather(part, locs)
        return out

    @staticmethod
    def _gather(part: _PartitionData, locs: list[tuple[int, int]]) -> Column:
        n = len(locs)
        cids = {c for c, _ in locs}
        chunks = {c: part.chunks[c] for c in cids}
        kinds = {
            (ch.kind, ch.array.dtype, ch.array.shape[1:], ch.dtype_name) for ch in chunks.values()
        }
        if n and len(kinds) == 1 and next(iter(kinds))[0] == "t":
            first = next(iter(chunks.values()))
            if len(cids) == 1:
                rows = [r for _, r in locs]
                r0 = rows[0]
                if rows == list(range(r0, r0 + n)):
                    return ("t", first.array[r0 : r0 + n], first.dtype_name)
                return ("t", first.array[np.asarray(rows, dtype=np.int64)], first.dtype_name)
            arr = np.empty((n, *first.array.shape[1:]), dtype=first.array.dtype)
            for i, (c, r) in enumerate(locs):
                arr[i] = chunks[c].array[r]
            return ("t", arr, first.dtype_name)
        if n and len(kinds) == 1 and next(iter(kinds))[0] == "o" and len(cids) == 1:
            first = next(iter(chunks.values()))
            return ("o", first.array[np.asarray([r for _, r in locs], dtype=np.int64)], None)
        out = np.empty(n, dtype=object)
        for i, (c, r) in enumerate(locs):
            ch = chunks[c]
            out[i] = _row_as_value(ch.kind, ch.array, ch.dtype_name, r)
        return ("o", out, None)

    def holds(self, partition: str, sample_ids: Sequence[int], fields: Sequence[str]) -> bool:
        """Whether every field of ``fields`` of every sample of ``sample_ids`` is held."""
        part = self._parts.get(partition)
        if part is None:
            return not sample_ids
        for f in fields:
            idx = part.index.get(f)
            if idx is None:
                if sample_ids:
                    return False
                continue
            if any(sid not in idx for sid in sample_ids):
                return False
        return True

    def find_source(
        self, partition: str, sample_ids: Sequence[int], fields: Sequence[str]
    ) -> tuple[Any, int, int] | None:
        """Find the one source object holding the request as a contiguous run of rows.

        Returns ``(source, start, stop)`` if every field of ``sample_ids`` is rows
        ``start:stop``, in order, of chunks that came in one ``source`` object; else None.
        """
        part = self._parts.get(partition)
        if part is None or not sample_ids or not fields:
            return None
        found: tuple[Any, int, int] | None = None
        for f in fields:
            idx = part.index.get(f)
            if idx is None:
                return None
            first = idx.get(sample_ids[0])
            if first is None:
                return None
            chunk = part.chunks[first[0]]
            if chunk.source is None:
                return None
            start = first[1]
            for k, sid in enumerate(sample_ids):
                if idx.get(sid) != (first[0], start + k):
                    return None
            if found is None:
                found = (chunk.source, start, start + len(sample_ids))
            elif found[0] is not chunk.source or found[1] != start:
                return None
        return found

    def clear(self, partition: str) -> None:
        """Drop every chunk of ``partition``."""
        part = self._parts.pop(partition, None)
        if part is not None:
            self._bytes -= sum(ch.nbytes for ch in part.chunks.values())
            self._bytes -= sum(m.nbytes for m in part.media.values())

    def nbytes(self) -> int:
        """Bytes of the chunks held (measured from their arrays when stored), media once."""
        return self._bytes

    def partitions(self) -> list[str]:
        """Partitions with data here."""
        return list(self._parts)


# ----------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------
@dataclass
class _PartitionMeta:
    fields: dict[int, frozenset[str]] = field(default_factory=dict)  # sample -> produced fields
    groups: dict[int, str | None] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    units: dict[int, int] = field(default_factory=dict)
    consumed: dict[str, set[int]] = field(default_factory=dict)
    next_id: int = 0
    sorted_ids: list[int] = field(default_factory=list)
    ids_sorted: bool = True
    # consumer -> position in sorted_ids before which every sample is consumed by it, so that
    # scans for ready samples skip the consumed prefix (consumers mostly go in id order).
    watermark: dict[str, int] = field(default_factory=dict)


class MetadataStore:
    """The controller's state; every method is synchronous and must be called under one lock."""

    def __init__(self) -> None:
        self._parts: dict[str, _PartitionMeta] = {}

    def allocate(self, partition: str, n: int) -> int:
        """Reserve ``n`` new contiguous ids; return the first."""
        part = self._parts.setdefault(partition, _PartitionMeta())
        first = part.next_id
        part.next_id += n
        return first

    def locate(self, partition: str, sample_ids: Sequence[int]) -> list[int]:
        """Storage unit of each sample, -1 for samples never stored."""
        part = self._parts.get(partition)
        if part is None:
            return [-1] * len(sample_ids)
        return [part.units.get(int(s), -1) for s in sample_ids]

    def commit(
        self,
        partition: str,
        sample_ids: Sequence[int],
        fields: Sequence[str],
        units: Sequence[int],
        groups: Sequence[str | None] | None,
        lengths: Sequence[int] | None,
    ) -> BatchMeta:
        """Mark ``fields`` of ``sample_ids`` produced (their data is already stored)."""
        part = self._parts.setdefault(partition, _PartitionMeta())
        ids = [int(s) for s in sample_ids]
        added = frozenset(fields)
        # Samples share their (immutable) field sets: one set per distinct history, not per
        # sample, and one dict lookup per sample instead of a set update.
        merged: dict[frozenset[str], frozenset[str]] = {}
        empty: frozenset[str] = frozenset()
        for i, sid in enumerate(ids):
            have = part.fields.get(sid)
            if have is None:
                have = empty
                if part.sorted_ids and sid < part.sorted_ids[-1]:
                    part.ids_sorted = False
                part.sorted_ids.append(sid)
                part.groups[sid] = None
                part.lengths[sid] = 0
            new = merged.get(have)
            if new is None:
                new = merged[have] = have | added
            part.fields[sid] = new
            part.units[sid] = int(units[i])
            if groups is not None:
                part.groups[sid] = groups[i]
            if lengths is not None:
                part.lengths[sid] = int(lengths[i])
            if sid >= part.next_id:
                part.next_id = sid + 1
        return self._meta(part, partition, ids, fields)

    @staticmethod
    def _meta(
        part: _PartitionMeta, partition: str, ids: Sequence[int], fields: Sequence[str]
    ) -> BatchMeta:
        units, groups, lengths = part.units, part.groups, part.lengths
        return BatchMeta._trusted(
            partition,
            tuple(ids),
            tuple(fields),
            tuple([units[i] for i in ids]),
            tuple([groups[i] for i in ids]),
            tuple([lengths[i] for i in ids]),
        )

    def ready(self, partition: str, fields: Sequence[str], consumer: str) -> list[SampleInfo]:
        """Return samples with every field of ``fields`` produced that ``consumer`` has not had."""
        part = self._parts.get(partition)
        if part is None:
            return []
        if not part.ids_sorted:
            part.sorted_ids.sort()
            part.ids_sorted = True
            part.watermark.clear()
        done = part.consumed.get(consumer, ())
        ids = part.sorted_ids
        start = part.watermark.get(consumer, 0)
        while start < len(ids) and ids[start] in done:
            start += 1
        part.watermark[consumer] = start
        want = set(fields)
        return [
            SampleInfo(sid, part.groups[sid], part.lengths[sid])
            for sid in ids[start:]
            if sid not in done and want <= part.fields[sid]
        ]

    def try_take(
        self,
        partition: str,
        fields: Sequence[str],
        consumer: str,
        batch_size: int | None,
        sampler: Sampler,
    ) -> tuple[BatchMeta | None, int]:
        """Run the sampler; on success mark its choice consumed.

        Returns ``(meta or None, number of ready samples)``.
        """
        ready = self.ready(partition, fields, consumer)
        chosen = sampler.select(ready, batch_size)
        if chosen is None:
            return None, len(ready)
        chosen = [int(i) for i in chosen]
        if batch_size is not None and len(chosen) != batch_size:
            raise TransferError(
                f"sampler {type(sampler).__name__} returned {len(chosen)} samples for "
                f"batch_size={batch_size}"
            )
        ready_ids = {s.sample_id for s in ready}
        if len(set(chosen)) != len(chosen) or not set(chosen) <= ready_ids:
            raise TransferError(
                f"sampler {type(sampler).__name__} returned repeated or not-ready sample ids"
            )
        if not chosen:
            return BatchMeta.empty(partition, fields), len(ready)
        part = self._parts[partition]
        part.consumed.setdefault(consumer, set()).update(chosen)
        return self._meta(part, partition, chosen, fields), len(ready)

    def take_or_wait(
        self, request: MetaRequest, sampler: Sampler, deadline: float | None
    ) -> tuple[BatchMeta | None, float | None]:
        """One turn of a ``get_meta``: what to return, or how long to wait for a commit.

        Returns ``(meta, None)`` when the call is served (an empty meta when it may not wait),
        else ``(None, seconds)`` to wait on the commit condition before the next turn (None:
        no limit). Both backends loop on it, each around its own condition (a thread's or an
        event loop's). Raises ``get_meta``'s timeout error once ``deadline``
        (:func:`time.monotonic`) has passed.
        """
        r = request
        meta, n_ready = self.try_take(r.partition, r.fields, r.consumer, r.batch_size, sampler)
        if meta is not None:
            return meta, None
        if r.batch_size is None or not r.block:
            return BatchMeta.empty(r.partition, r.fields), None
        if deadline is None:
            return None, None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timeout_error(
                r.partition,
                r.consumer,
                r.fields,
                r.batch_size,
                n_ready,
                r.timeout,
                self.has_partition(r.partition),
            )
        return None, remaining

    def committed(
        self, partition: str, sample_ids: Sequence[int], fields: Sequence[str]
    ) -> bool | None:
        """Whether every field of every sample is produced (None: unknown partition)."""
        part = self._parts.get(partition)
        if part is None:
            return None
        want = set(fields)
        return all(want <= part.fields.get(int(sid), frozenset()) for sid in sample_ids)

    def has_partition(self, partition: str) -> bool:
        """Whether ``partition`` has metadata."""
        return partition in self._parts

    def clear(self, partition: str) -> None:
        """Forget ``partition``."""
        self._parts.pop(partition, None)

    def partitions(self) -> list[str]:
        """Known partitions."""
        return list(self._parts)

    def status(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """Per partition: sample count, ready count per field, consumed count per consumer."""
        names = self.partitions() if partition is None else [partition]
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            part = self._parts.get(name)
            if part is None:
                out[name] = {"samples": 0, "fields": {}, "consumers": {}}
                continue
            counts: dict[str, int] = {}
            for fs in part.fields.values():
                for f in fs:
                    counts[f] = counts.get(f, 0) + 1
            out[name] = {
                "samples": len(part.fields),
                "fields": dict(sorted(counts.items())),
                "consumers": {c: len(s) for c, s in sorted(part.consumed.items())},
            }
        return out


def resolve_sampler(sampler: str | Sampler, sampler_kwargs: Mapping[str, Any]) -> Sampler:
    """Return a sampler object from a name (+ kwargs) or an object."""
    return get_sampler(sampler, **dict(sampler_kwargs))


def check_get_meta_args(request: MetaRequest) -> tuple[MetaRequest, Sampler]:
    """Check ``get_meta``'s arguments; return them (fields a tuple) and the sampler object."""
    fields = check_fields(request.fields)
    batch_size = check_batch_size(request.batch_size)
    check_partition(request.partition)
    consumer, timeout = request.consumer, request.timeout
    if not isinstance(consumer, str) or not consumer:
        raise TypeError(f"consumer must be a non-empty str, got {consumer!r}")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    sampler = resolve_sampler(request.sampler, request.sampler_kwargs)
    return request._replace(fields=fields, batch_size=batch_size), sampler


def timeout_error(
    partition: str,
    consumer: str,
    fields: Sequence[str],
    batch_size: int | None,
    ready: int,
    timeout: float | None,
    known: bool,
) -> TransferError:
    """Build the error raised when a blocking get_meta times out."""
    extra = "" if known else " (the partition does not exist yet: nothing was put to it)"
    return TransferError(
        f"get_meta timed out after {timeout} s: partition {partition!r}, consumer {consumer!r}, "
        f"fields {list(fields)}: {ready} samples ready for this consumer, {batch_size} needed"
        f"{extra}"
    )
