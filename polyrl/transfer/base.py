"""The small interface of the transfer system: references, sample info, the client API.

A :class:`TransferQueue` keeps samples of RL steps between the services that produce and consume
them. Data is addressed by ``(partition, sample_id, field)``: a *partition* is typically one
training step, a *sample* one row (one response), a *field* one column (``input_ids``,
``old_log_probs``, ...). Producers :meth:`~TransferQueue.put` columns; consumers ask
:meth:`~TransferQueue.get_meta` for references to samples whose fields are all produced (each
consumer gets every sample once), then fetch the rows with :meth:`~TransferQueue.get_data`.
Only :class:`BatchMeta` references (small tuples of ints and strings) pass through whoever
coordinates the consumers; the rows move from the storage to the consumer directly.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from polyrl.transfer._twins import ClientLoops, on_client_loop, serve

if TYPE_CHECKING:
    from polyrl.core.batch import Batch

__all__ = ["BatchMeta", "SampleInfo", "Sampler", "TransferError", "TransferQueue"]


class TransferError(RuntimeError):
    """A transfer-queue request that cannot be served (timeout, unknown data, missing field)."""


class SampleInfo(NamedTuple):
    """What a sampler knows about one ready sample (a named tuple: cheap to build in bulk).

    Attributes:
        sample_id: the sample's id in its partition.
        group: the sample's group id (e.g. the prompt uid shared by its ``n`` responses), or None.
        length: the sample's token count (0 if unknown).
    """

    sample_id: int
    group: str | None
    length: int


@runtime_checkable
class Sampler(Protocol):
    """Chooses which ready samples a consumer gets, in which order."""

    def select(self, ready: Sequence[SampleInfo], batch_size: int | None) -> list[int] | None:
        """Return the chosen sample ids in delivery order, or None if it cannot serve yet.

        Args:
            ready: samples whose requested fields are all produced and that the consumer has not
                been given yet, in ascending id order.
            batch_size: how many samples to return; None means whatever can be served now
                (possibly an empty list).
        """
        ...


def _check_tuple(name: str, value: Any, n: int | None) -> tuple[Any, ...]:
    value = tuple(value)
    if n is not None and len(value) != n:
        raise ValueError(
            f"BatchMeta.{name} has {len(value)} entries, expected {n} (one per sample)"
        )
    return value


def _smallest_int_array(values: Sequence[int]) -> tuple[str, bytes]:
    arr = np.asarray(values, dtype=np.int64)
    low, high = (int(arr.min()), int(arr.max())) if len(arr) else (0, 0)
    for dtype in ("int8", "int16", "int32"):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype, arr.astype(dtype).tobytes()
    return "int64", arr.tobytes()


def _pack_ints(values: tuple[int, ...]) -> Any:
    n = len(values)
    if n and values[-1] - values[0] == n - 1 and values == tuple(range(values[0], values[0] + n)):
        return ("range", values[0], n)
    if n and all(v == values[0] for v in values):
        return ("fill", values[0], n)
    return _smallest_int_array(values)


def _unpack_ints(packed: Any) -> tuple[int, ...]:
    kind = packed[0]
    if kind == "range":
        return tuple(range(packed[1], packed[1] + packed[2]))
    if kind == "fill":
        return (packed[1],) * packed[2]
    return tuple(np.frombuffer(packed[1], dtype=kind).tolist())


def _pack_groups(groups: tuple[str | None, ...]) -> Any:
    table: dict[str | None, int] = {}
    index = [table.setdefault(g, len(table)) for g in groups]
    return tuple(table), _smallest_int_array(index)


def _unpack_groups(packed: Any) -> tuple[str | None, ...]:
    table, (dtype, index) = packed
    return tuple(table[i] for i in np.frombuffer(index, dtype=dtype).tolist())


def _meta_from_packed(
    partition: str, ids: Any, fields: tuple[str, ...], units: Any, groups: Any, lengths: Any
) -> BatchMeta:
    return BatchMeta._trusted(
        partition,
        _unpack_ints(ids),
        fields,
        _unpack_ints(units),
        _unpack_groups(groups),
        _unpack_ints(lengths),
    )


@dataclass(frozen=True)
class BatchMeta:
    """References to samples of one partition: ids and per-sample metadata, never data.

    It pickles small (tuples of ints and strings), so it can pass through the driver and be
    split among data-parallel ranks, each of which then fetches its own rows with
    :meth:`TransferQueue.get_data`.

    Attributes:
        partition: the partition the samples belong to.
        sample_ids: the sample ids, in delivery order.
        fields: the fields the consumer asked for (the default of ``get_data``).
        units: storage unit index per sample (the local backend has one unit, 0).
        groups: group id per sample (None where the sample has none).
        lengths: token length per sample (0 where unknown).
    """

    partition: str
    sample_ids: tuple[int, ...]
    fields: tuple[str, ...]
    units: tuple[int, ...]
    groups: tuple[str | None, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.partition, str):
            raise TypeError(f"BatchMeta.partition must be a str, got {type(self.partition)}")
        ids = tuple(int(i) for i in self.sample_ids)
        object.__setattr__(self, "sample_ids", ids)
        object.__setattr__(self, "fields", tuple(str(f) for f in self.fields))
        n = len(ids)
        object.__setattr__(
            self, "units", tuple(int(u) for u in _check_tuple("units", self.units, n))
        )
        object.__setattr__(self, "groups", _check_tuple("groups", self.groups, n))
        lengths = _check_tuple("lengths", self.lengths, n)
        object.__setattr__(self, "lengths", tuple(int(x) for x in lengths))

    @classmethod
    def _trusted(
        cls,
        partition: str,
        sample_ids: tuple[int, ...],
        fields: tuple[str, ...],
        units: tuple[int, ...],
        groups: tuple[str | None, ...],
        lengths: tuple[int, ...],
    ) -> BatchMeta:
        # Built by the metadata store from values it already validated: skip the per-sample
        # conversions of __post_init__ (they cost milliseconds on large puts).
        meta = object.__new__(cls)
        for name, value in (
            ("partition", partition),
            ("sample_ids", sample_ids),
            ("fields", fields),
            ("units", units),
            ("groups", groups),
            ("lengths", lengths),
        ):
            object.__setattr__(meta, name, value)
        return meta

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Metas cross the driver once per rank and phase, so their size is the driver's
        # traffic: runs of ids/units/lengths go as int arrays (a contiguous id run as its two
        # ends), repeated group ids (n responses per prompt) as a table plus an index array.
        return _meta_from_packed, (
            self.partition,
            _pack_ints(self.sample_ids),
            self.fields,
            _pack_ints(self.units),
            _pack_groups(self.groups),
            _pack_ints(self.lengths),
        )

    @classmethod
    def empty(cls, partition: str, fields: Sequence[str] = ()) -> BatchMeta:
        """Return a meta with no samples."""
        return cls(partition, (), tuple(fields), (), (), ())

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: slice | Sequence[int]) -> BatchMeta:
        """Sub-meta of the given positions (a slice or a sequence of positions, not ids)."""
        if isinstance(index, slice):
            pos = range(len(self))[index]
        elif isinstance(index, int):
            raise TypeError(
                "BatchMeta is indexed by a slice or a sequence of positions; use meta[i : i + 1] "
                "for one sample"
            )
        else:
            pos = [int(i) for i in index]
            n = len(self)
            for i in pos:
                if not -n <= i < n:
                    raise IndexError(f"position {i} is out of range for a BatchMeta of length {n}")
        return BatchMeta(
            self.partition,
            tuple(self.sample_ids[i] for i in pos),
            self.fields,
            tuple(self.units[i] for i in pos),
            tuple(self.groups[i] for i in pos),
            tuple(self.lengths[i] for i in pos),
        )

    def chunk(self, n: int) -> list[BatchMeta]:
        """Split into exactly ``n`` contiguous pieces whose sizes differ by at most 1.

        The first ``len % n`` pieces get one extra sample (like :meth:`Batch.chunk`); pieces may
        be empty when there are fewer samples than pieces.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"BatchMeta.chunk: n must be an int >= 1, got {n!r}")
        base, extra = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            out.append(self[start:stop])
            start = stop
        return out

    def __dp_chunks__(self, n: int) -> list[BatchMeta]:
        """Cut for ``n`` data-parallel ranks (the worker-group dispatch protocol): :meth:`chunk`."""
        return self.chunk(n)

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Join metas of one partition end to end; fields are those of the first meta."""
        metas = list(metas)
        if not metas:
            raise ValueError("BatchMeta.concat needs at least one meta")
        for i, m in enumerate(metas):
            if not isinstance(m, BatchMeta):
                raise TypeError(f"BatchMeta.concat: item {i} is a {type(m).__name__}")
        parts = {m.partition for m in metas}
        if len(parts) > 1:
            raise ValueError(
                f"BatchMeta.concat: all metas must belong to one partition, got {sorted(parts)}"
            )
        return BatchMeta(
            metas[0].partition,
            tuple(i for m in metas for i in m.sample_ids),
            metas[0].fields,
            tuple(u for m in metas for u in m.units),
            tuple(g for m in metas for g in m.groups),
            tuple(x for m in metas for x in m.lengths),
        )


class MetaRequest(NamedTuple):
    """The arguments of one :meth:`TransferQueue.get_meta` call, as its backend gets them."""

    fields: Sequence[str]
    batch_size: int | None
    partition: str
    consumer: str
    sampler: str | Sampler
    block: bool
    timeout: float | None
    sampler_kwargs: dict[str, Any]


class TransferQueue(ABC):
    """Client of a sample store; both backends implement it with the same semantics.

    Clients are picklable: hand one to a Ray actor and it talks to the same store.
    The ``async_*`` variants take the same arguments and never block the event loop; the sync
    ones may be called from any thread, one that runs an event loop included (they block it).

    A backend implements each call once, as the hook named after it (``_put``, ``_get_meta``,
    ...): a coroutine (the Ray queue), or a plain method when its work blocks (the local queue;
    awaited, it runs in a worker thread). The ``async_*`` methods call the hooks; the sync ones
    run the ``async_*`` ones to completion on an event loop of the client's own (see
    :mod:`polyrl.transfer._twins`).
    """

    @functools.cached_property
    def _loops(self) -> ClientLoops:
        """The event loops of this client's sync calls (made on first use)."""
        return ClientLoops()

    async def async_put(
        self, batch: Batch, partition: str, sample_ids: Sequence[int] | None = None
    ) -> BatchMeta:
        """Store the rows of ``batch`` as samples of ``partition``.

        Args:
            batch: row ``i`` becomes (fields of) sample ``i`` of the put. Tensor columns are split
                into rows; object columns are stored per row as they are.
            partition: the partition (created on first use).
            sample_ids: None creates new samples with ids ``first .. first + len - 1`` (the first
                id of a partition is 0); given ids add (or overwrite) these fields of those
                samples, creating samples never seen.

        Returns:
            A meta of the samples put, with ``fields`` = every column of ``batch``.
        """
        return await serve(self._put, batch, partition, sample_ids)

    async def async_get_meta(
        self,
        fields: Sequence[str],
        batch_size: int | None,
        partition: str,
        consumer: str,
        sampler: str | Sampler = "sequential",
        block: bool = True,
        timeout: float | None = None,
        **sampler_kwargs: Any,
    ) -> BatchMeta:
        """Hand ``consumer`` references to samples whose ``fields`` are all produced.

        Samples are marked consumed by ``consumer`` atomically: no sample is given twice to the
        same consumer, and every consumer gets every sample once.

        Args:
            fields: fields that must all be produced.
            batch_size: how many samples; None = whatever the sampler can serve now (never
                blocks, may be empty).
            partition: the partition to read.
            consumer: the consumer's name (e.g. ``"actor_update"``).
            sampler: a registered sampler name or a :class:`Sampler`.
            block: wait until the sampler can serve ``batch_size`` samples; otherwise return an
                empty meta when it cannot.
            timeout: seconds to wait when blocking (None = forever); on expiry a
                :class:`TransferError` says how many samples were ready and needed.
            **sampler_kwargs: arguments of a sampler given by name (``group_size``, ...).
        """
        request = MetaRequest(
            fields, batch_size, partition, consumer, sampler, block, timeout, sampler_kwargs
        )
        return await serve(self._get_meta, request)

    async def async_get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Batch:
        """Fetch the rows of ``meta`` (in its order) straight from the storage.

        Tensor fields whose rows all have one shape and dtype come back as stacked tensor
        columns; ragged ones and non-tensor values come back as object columns.
        """
        return await serve(self._get_data, meta, fields)

    async def async_clear(self, partition: str) -> None:
        """Drop the data and metadata of ``partition`` (a no-op for an unknown partition)."""
        await serve(self._clear, partition)

    async def async_status(self, partition: str | None = None) -> dict[str, Any]:
        """Readiness per field, consumption per consumer and bytes held.

        Returns ``{"partitions": {name: {"samples": int, "fields": {field: n_ready},
        "consumers": {name: n_consumed}}}, "storage_bytes": int, "units": [bytes, ...]}``
        (only ``partition`` when one is given).
        """
        return await serve(self._status, partition)

    put = on_client_loop(async_put)
    get_meta = on_client_loop(async_get_meta)
    get_data = on_client_loop(async_get_data)
    clear = on_client_loop(async_clear)
    status = on_client_loop(async_status)

    @abstractmethod
    def storage_bytes(self) -> int:
        """Bytes of sample data held by all storage units."""

    def for_processes(self) -> TransferQueue:
        """Return a client of this queue to give (pickled) to other processes.

        This client itself where it is picklable (the Ray backend's);
        :meth:`LocalTransferQueue.for_processes` serves its queue to this host's processes.
        """
        return self

    def close(self) -> None:
        """Release what this client started (the Ray backend kills its actors).

        Also closes the calling thread's event loop and the helper threads of the sync calls
        (see :class:`~polyrl.transfer._twins.ClientLoops`); later calls open new ones.
        """
        self._loops.close()

    # The hooks: each call's one implementation (a coroutine or a blocking method, see above).
    @abstractmethod
    def _put(
        self, batch: Batch, partition: str, sample_ids: Sequence[int] | None
    ) -> BatchMeta | Awaitable[BatchMeta]:
        """Serve :meth:`put`."""

    @abstractmethod
    def _get_meta(self, request: MetaRequest) -> BatchMeta | Awaitable[BatchMeta]:
        """Serve :meth:`get_meta` (its arguments unchecked)."""

    @abstractmethod
    def _get_data(self, meta: BatchMeta, fields: Sequence[str] | None) -> Batch | Awaitable[Batch]:
        """Serve :meth:`get_data`."""

    @abstractmethod
    def _clear(self, partition: str) -> None | Awaitable[None]:
        """Serve :meth:`clear`."""

    @abstractmethod
    def _status(self, partition: str | None) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """Serve :meth:`status`."""
