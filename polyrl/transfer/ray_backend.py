"""The Ray transfer queue: a metadata controller actor, storage unit actors, a picklable client.

* :class:`TransferController` (an asyncio actor) holds only metadata (:class:`MetadataStore`)
  and serves ``get_meta``: a request that cannot be served yet awaits a condition that every
  commit notifies, so blocked consumers cost nothing and need no polling.
* :class:`StorageUnit` actors hold the columns (:class:`ColumnStore`): the numpy arrays a
  producer sends arrive in Ray's object store and are kept there as they are (zero-copy);
  ``get`` gathers the requested rows into one array per field, which the reader maps
  zero-copy from the object store.
* :class:`RayTransferQueue` is the client: ``put`` sends rows straight to the storage units,
  and the controller marks the fields produced once they are stored; ``get_data`` fetches
  straight from the units, in parallel. The client pickles to a few actor handles, so any Ray
  actor can use it.

Copies: a block of at least ``direct_bytes`` is copied once by the producer: into a shared-memory
segment of its own pool (:mod:`polyrl.transfer.segments`) when the block's unit runs on the
producer's node, else with ``ray.put``. The unit maps it zero-copy and keeps it. A reader on the
unit's node asking for an in-order run of one such block gets the segment's descriptor (or the
object's reference) and maps the producer's copy itself, so a put + get costs the one copy a
plain ``ray.put`` + ``ray.get`` costs; a segment also spares the messages any ``ObjectRef`` and
its pages are reused from put to put, so they take no page faults. Other reads are gathered by
the unit into fresh arrays (one more copy). If the producer process dies, its objects go with
it (and its segment files are swept); readers then fall back to the unit's gathered copy of
the rows it still maps.

Sample -> unit placement: new samples go to the units on the client's own Ray node (all units
when none is local), round-robin in blocks: each put is cut into blocks of ``block_size`` rows
and each block goes to the client's next unit. Samples created with explicit ids go to unit
``(sample_id // block_size) % n_candidates`` (so producers adding members of one new sample
agree). Fields added later to an existing sample go to the unit that already holds it.

Round trips: a put of at most ``block_size`` new samples of at least ``direct_bytes`` is sealed
by the producer, which asks the controller to allocate and commit the ids (waking blocked
consumers, who can read the sealed block at once), then has the unit map and index it
(``adopt``, run by Ray once the commit is done); the put returns once both are done. A reader
that reaches the unit before the block does (it was committed first) waits for it. A smaller
put of new samples is one call to one unit, which holds the data, asks the controller to commit
it and indexes the rows before it serves its next call. Larger puts issue the id allocation, the
storage calls and the commit together, the later ones taking the earlier ones' ObjectRefs as
arguments (Ray runs them in dependency order); the producer waits once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.exceptions import ObjectLostError, RayTaskError

from polyrl.core.batch import Batch
from polyrl.transfer._core import (
    Column,
    ColumnStore,
    MetadataStore,
    batch_to_columns,
    check_fields,
    check_get_meta_args,
    check_partition,
    check_sample_ids,
    columns_to_batch,
    resolve_sampler,
    row_groups,
    row_lengths,
    slice_columns,
)
from polyrl.transfer._twins import offload, waits_in_place
from polyrl.transfer.base import BatchMeta, MetaRequest, Sampler, TransferError, TransferQueue
from polyrl.transfer.fastpath import FastPathClient, FastPathServer, FastPathUnavailable
from polyrl.transfer.segments import ShmBlock, map_block, segment_pool, sweep_segments

__all__ = ["RayTransferQueue", "StorageUnit", "TransferController", "start_ray_transfer_queue"]


class TransferController:
    """Ray actor (asyncio) holding the metadata of every partition; never sees sample data."""

    def __init__(self) -> None:
        self._meta = MetadataStore()
        self._cond: asyncio.Condition | None = None
        # partition -> blocks put as one producer object: [first id, count, fields, [ref], node]
        # (a reference, never data: a consumer of a whole in-order run reads the object itself
        # and skips a round trip to the storage unit).
        self._sources: dict[str, list[tuple[int, int, frozenset[str], Any, str]]] = {}
        self._fast: FastPathServer | None = None

    def _condition(self) -> asyncio.Condition:
        # Created on first use so that it binds to the actor's event loop.
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def ping(self) -> bool:
        """Return True (readiness probe)."""
        return True

    async def fast_path(self) -> tuple[str, str]:
        """Start (once) the same-node socket for the hot calls; return its path and node id.

        See :mod:`polyrl.transfer.fastpath`: clients on this node commit sealed blocks and wait
        in ``get_meta`` through it, skipping Ray's task round trips.
        """
        if self._fast is None:
            self._fast = FastPathServer(self)
        path = await self._fast.start()
        return path, ray.get_runtime_context().get_node_id()

    async def allocate(self, partition: str, n: int) -> int:
        """Reserve ``n`` new contiguous sample ids of ``partition``; return the first."""
        return self._meta.allocate(partition, n)

    async def locate(self, partition: str, sample_ids: Sequence[int]) -> list[int]:
        """Return the storage unit of each sample (-1 for samples never stored)."""
        return self._meta.locate(partition, sample_ids)

    async def commit(
        self,
        partition: str,
        sample_ids: Sequence[int] | int,
        fields: Sequence[str],
        units: Sequence[int],
        groups: Sequence[str | None] | None,
        lengths: Sequence[int] | None,
        *stored: Any,
    ) -> BatchMeta:
        """Mark fields produced and wake blocked consumers.

        Args:
            partition: the partition.
            sample_ids: the ids, or the first id of a block of ``len(units)`` allocated ids.
            fields: the fields stored.
            units: the storage unit of each sample.
            groups: group id per sample (None: keep the known ones).
            lengths: token length per sample (None: keep the known ones).
            stored: results of the storage units' ``put`` calls; clients pass their ObjectRefs,
                so Ray runs this only once the data is stored.
        """
        if isinstance(sample_ids, int):
            sample_ids = range(sample_ids, sample_ids + len(units))
        blocks = self._sources.get(partition)
        if blocks:
            # Rewritten fields of these samples now live elsewhere: forget stale sources.
            ids, written = set(sample_ids), set(fields)
            lo, hi = min(ids, default=0), max(ids, default=-1)
            blocks[:] = [
                b
                for b in blocks
                if not (
                    b[2] & written
                    and b[0] <= hi
                    and lo < b[0] + b[1]
                    and any(i in ids for i in range(b[0], b[0] + b[1]))
                )
            ]
        meta = self._meta.commit(partition, sample_ids, fields, units, groups, lengths)
        cond = self._condition()
        async with cond:
            cond.notify_all()
        return meta

    async def commit_new(
        self,
        partition: str,
        fields: Sequence[str],
        units: Sequence[int],
        groups: Sequence[str | None] | None,
        lengths: Sequence[int] | None,
        source: list[Any] | None = None,
        node: str = "",
    ) -> BatchMeta:
        """Allocate ``len(units)`` new ids and mark their fields produced, in one step.

        Called by a storage unit that already holds the data (see ``StorageUnit.put_new``);
        ``source`` is ``[ref]`` to the producer's object of the whole block, or the
        :class:`ShmBlock` it was written to, on ``node``.
        """
        first = self._meta.allocate(partition, len(units))
        meta = await self.commit(partition, first, fields, units, groups, lengths)
        if source is not None:
            self._sources.setdefault(partition, []).append(
                (first, len(units), frozenset(fields), source, node)
            )
        return meta

    def _source_hint(self, meta: BatchMeta) -> tuple[list[Any], int, int, str] | None:
        """``([ref], start, stop, node)`` when ``meta`` is one in-order run of one source."""
        ids = meta.sample_ids
        if not ids or ids[-1] - ids[0] != len(ids) - 1:
            return None
        for first, count, fields, source, node in self._sources.get(meta.partition, ()):
            if first <= ids[0] and ids[-1] < first + count and set(meta.fields) <= fields:
                if ids == tuple(range(ids[0], ids[0] + len(ids))):
                    return source, ids[0] - first, ids[0] - first + len(ids), node
        return None

    async def get_meta_hinted(self, *args: Any) -> tuple[BatchMeta, Any]:
        """:meth:`get_meta` plus the source hint of the samples (see ``_source_hint``)."""
        meta = await self.get_meta(*args)
        return meta, self._source_hint(meta)

    async def get_meta_local(self, *args: Any) -> tuple[BatchMeta, Any]:
        """:meth:`get_meta_hinted` for the socket fast path: only segment hints (no refs)."""
        meta, hint = await self.get_meta_hinted(*args)
        if hint is not None and not isinstance(hint[0], ShmBlock):
            hint = None  # an ObjectRef cannot cross the socket; the unit hands it out instead
        return meta, hint

    async def get_meta(
        self,
        fields: Sequence[str],
        batch_size: int | None,
        partition: str,
        consumer: str,
        sampler: str | Sampler,
        block: bool,
        timeout: float | None,
        sampler_kwargs: dict[str, Any],
    ) -> BatchMeta:
        """Serve :meth:`TransferQueue.get_meta` (waits on the commit condition when blocking)."""
        request = MetaRequest(
            fields, batch_size, partition, consumer, sampler, block, timeout, sampler_kwargs
        )
        smp = resolve_sampler(sampler, sampler_kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._condition()
        async with cond:
            while True:
                meta, wait = self._meta.take_or_wait(request, smp, deadline)
                if meta is not None:
                    return meta
                with contextlib.suppress(TimeoutError):  # the next turn raises get_meta's error
                    await asyncio.wait_for(cond.wait(), wait)

    async def has_partition(self, partition: str) -> bool:
        """Whether ``partition`` has metadata."""
        return self._meta.has_partition(partition)

    async def committed(
        self, partition: str, sample_ids: Sequence[int], fields: Sequence[str]
    ) -> bool | None:
        """Whether every field of every sample is produced (None: unknown partition)."""
        return self._meta.committed(partition, sample_ids, fields)

    async def clear(self, partition: str) -> None:
        """Forget the metadata of ``partition``."""
        self._meta.clear(partition)
        self._sources.pop(partition, None)

    async def status(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """Per-partition readiness and consumption counts."""
        return self._meta.status(partition)


class StorageUnit:
    """Ray actor holding column chunks of samples; one call at a time."""

    def __init__(self, index: int, controller: Any = None) -> None:
        self.index = index
        self._controller = controller
        self._store = ColumnStore()
        self._node = ray.get_runtime_context().get_node_id()

    def node_id(self) -> str:
        """Return the Ray node id this unit runs on."""
        return ray.get_runtime_context().get_node_id()

    def put(
        self, partition: str, sample_ids: Sequence[int] | int, cols: dict[str, Column] | list[Any]
    ) -> int:
        """Store rows (kept as received: zero-copy views of the object store); return bytes held.

        Args:
            partition: the partition.
            sample_ids: one id per row, or the first of consecutive ids: clients pass the
                controller's allocation as an ObjectRef, so allocation and data travel together.
            cols: the columns, or ``[ref]`` to columns the producer ``ray.put``: the unit maps
                them zero-copy and keeps the reference, so readers of whole runs of that put
                get the producer's object itself instead of a copy.
        """
        cols, source = _open_payload(cols)
        if isinstance(sample_ids, int):
            n = len(next(iter(cols.values()))[1]) if cols else 0
            sample_ids = range(sample_ids, sample_ids + n)
        self._store.put(partition, sample_ids, cols, source=source)
        return self._store.nbytes()

    def put_new(
        self,
        partition: str,
        n: int,
        fields: Sequence[str],
        cols: dict[str, Column] | list[Any],
        groups: Sequence[str | None] | None,
        lengths: Sequence[int] | None,
    ) -> BatchMeta:
        """Store a put of ``n`` new samples; have the controller allocate and commit their ids.

        The unit holds the data (or the reference to the producer's sealed object) before it
        asks for the commit, and indexes the rows under the ids before it serves any other
        call (an actor runs one call at a time), so a consumer woken by the commit finds them.
        Saves the producer a round trip; mapping the object overlaps with the commit.
        """
        if self._controller is None:
            raise TransferError(f"storage unit {self.index} was started without its controller")
        ref = self._controller.commit_new.remote(
            partition,
            list(fields),
            [self.index] * n,
            groups,
            lengths,
            cols if isinstance(cols, list) else None,  # [ref]: stays a reference
            self._node,
        )
        source = None
        if isinstance(cols, list):
            source = cols[0]
            cols, meta = ray.get([source, ref])
        else:
            meta = ray.get(ref)
        self._store.put(partition, meta.sample_ids, cols, source=source)
        return meta

    def adopt(self, partition: str, committed: BatchMeta, source: list[Any] | ShmBlock) -> int:
        """Index a block the producer committed itself; return the bytes held.

        Args:
            partition: the partition.
            committed: the controller's :meth:`TransferController.commit_new` result (its
                sample ids); clients pass its ObjectRef, so Ray runs this after the commit.
            source: ``[ref]`` to the producer's sealed columns, or the shared-memory segment
                they were written to (mapped zero-copy, kept).
        """
        cols, held = _open_payload(source)
        self._store.put(partition, committed.sample_ids, cols, source=held)
        return self._store.nbytes()

    def put_offset(
        self, partition: str, first: int, offset: int, cols: dict[str, Column] | list[Any]
    ) -> int:
        """Store rows as samples ``first + offset``, ``first + offset + 1``, ... (see put)."""
        return self.put(partition, first + offset, cols)

    def get(
        self,
        partition: str,
        sample_ids: Sequence[int],
        fields: Sequence[str],
        reader_node: str | None = None,
        strict: bool = True,
    ) -> tuple[Any, ...]:
        """Return the rows of ``sample_ids``.

        ``("ref", [ref], start, stop)`` when the reader runs on this unit's node and the rows
        are one in-order run of one producer object (the reader maps it zero-copy and slices);
        otherwise ``("cols", columns)`` with the rows gathered into one column per field.
        With ``strict=False``, rows not held (yet) give ``("missing",)`` instead of an error:
        a block its producer committed first may still be on its way here (see :meth:`adopt`).
        """
        if reader_node is not None and reader_node == self._node:
            hit = self._store.find_source(partition, sample_ids, fields)
            if hit is not None:
                if isinstance(hit[0], ShmBlock):
                    return ("shm", hit[0], hit[1], hit[2])
                return ("ref", [hit[0]], hit[1], hit[2])
        if not strict and not self._store.holds(partition, sample_ids, fields):
            return ("missing",)
        return ("cols", self._store.get(partition, sample_ids, fields))

    def clear(self, partition: str) -> int:
        """Drop ``partition``; return bytes still held."""
        self._store.clear(partition)
        return self._store.nbytes()

    def nbytes(self) -> int:
        """Return the bytes of sample data held."""
        return self._store.nbytes()


def _open_payload(cols: dict[str, Column] | list[Any] | ShmBlock) -> tuple[dict[str, Column], Any]:
    """Columns of a put's payload and the source to keep with them (None: data came inline).

    A ``[ref]`` payload is mapped zero-copy from the object store (the reference is kept); a
    :class:`ShmBlock` is mapped from its segment (the block is kept; the mapping's lock keeps
    the producer from reusing the segment while the rows are held here).
    """
    if isinstance(cols, ShmBlock):
        mapped = map_block(cols)
        if mapped is None:
            raise TransferError(
                f"the shared-memory block {cols.path} is gone before its storage unit mapped it "
                "(did its producer exit during the put?)"
            )
        return mapped, cols
    if isinstance(cols, list):
        return ray.get(cols[0]), cols[0]
    return cols, None


def _unwrap(exc: BaseException) -> BaseException:
    """Return the user-facing error inside a Ray task error (keeps our messages clean)."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, TransferError | ValueError | TypeError):
            return cause
    return exc


async def _resolve(refs: Any) -> Any:
    """Return the value of an ObjectRef, or the values of a list of them (Ray's errors as is).

    For a blocked caller (see :func:`~polyrl.transfer._twins.waits_in_place`) this is one
    ``ray.get``, as a plain blocking call makes it; awaited, the references are awaited.
    """
    if waits_in_place():
        return ray.get(refs)
    if isinstance(refs, list):
        return list(await asyncio.gather(*refs))
    return await refs


async def _fetch(refs: Any) -> Any:
    """:func:`_resolve`, raising the user-facing error of a failed task (see ``_unwrap``)."""
    try:
        return await _resolve(refs)
    except RayTaskError as exc:
        raise _unwrap(exc) from None


async def _fetch_values(items: list[Any]) -> list[Any]:
    """:func:`_fetch` the ObjectRefs of ``items``; other items are values already."""
    refs = [x for x in items if isinstance(x, ray.ObjectRef)]
    values = iter(await _fetch(refs) if refs else [])
    return [next(values) if isinstance(x, ray.ObjectRef) else x for x in items]


async def _fast_call(fast: FastPathClient, method: str, *args: Any) -> Any:
    """Call ``method`` on the controller's socket (see :mod:`polyrl.transfer.fastpath`).

    For a blocked caller: on the calling thread's own connection, as a plain blocking call
    makes it; awaited: on a connection of its own, so concurrent calls do not mix.
    """
    if waits_in_place():
        return fast.call(method, *args)
    return await fast.acall(method, *args)


def _rows_index(pos: list[int]) -> slice | np.ndarray:
    """Return a slice when ``pos`` is one increasing run (keeps views), else an index array."""
    if pos and pos == list(range(pos[0], pos[0] + len(pos))):
        return slice(pos[0], pos[0] + len(pos))
    return np.asarray(pos, dtype=np.int64)


class RayTransferQueue(TransferQueue):
    """Client of a Ray transfer queue; picklable (a few actor handles), usable in any actor.

    Build one with :func:`start_ray_transfer_queue` (starts the actors) or
    :meth:`RayTransferQueue.connect` (attaches to actors started elsewhere, by name).

    Args:
        controller: the :class:`TransferController` actor handle.
        units: the :class:`StorageUnit` actor handles (index = unit id).
        unit_nodes: the Ray node id of each unit.
        name: the queue's name (prefix of its actor names).
        group_key: column holding each sample's group id.
        length_key: object column whose per-row ``len`` is the sample length when the put has
            no ``attention_mask`` tensor column.
        block_size: rows of a put placed together on one unit.
        direct_bytes: blocks with at least this many tensor bytes are ``ray.put`` by the
            producer and the unit keeps the reference, so that a reader on the unit's node of a
            whole in-order run of the block maps the producer's object without another copy
            (smaller blocks travel inline in the call to the unit).
        adopt_timeout: seconds a reader waits for committed rows to reach their storage unit
            (a block is committed before its unit has mapped it; see ``StorageUnit.adopt``).
        use_shm: write large blocks bound for a unit on this node into shared-memory segments
            (:mod:`polyrl.transfer.segments`) instead of Ray's object store.
        fast_path: ``(socket path, node id)`` of the controller's same-node socket
            (:mod:`polyrl.transfer.fastpath`; :func:`start_ray_transfer_queue` and
            :meth:`connect` fill it in); None: every call goes through Ray.
    """

    def __init__(
        self,
        controller: Any,
        units: Sequence[Any],
        unit_nodes: Sequence[str],
        name: str,
        group_key: str = "uid",
        length_key: str = "response_ids",
        block_size: int = 1024,
        direct_bytes: int = 1 << 20,
        adopt_timeout: float = 60.0,
        use_shm: bool = True,
        fast_path: tuple[str, str] | None = None,
    ) -> None:
        if not units:
            raise ValueError("RayTransferQueue needs at least one storage unit")
        if len(unit_nodes) != len(units):
            raise ValueError(f"got {len(unit_nodes)} unit node ids for {len(units)} units")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.controller = controller
        self.units = list(units)
        self.unit_nodes = list(unit_nodes)
        self.name = name
        self.group_key = group_key
        self.length_key = length_key
        self.block_size = block_size
        self.direct_bytes = direct_bytes
        self.adopt_timeout = float(adopt_timeout)
        self.use_shm = bool(use_shm)
        self.fast_path = fast_path
        self._fast: FastPathClient | None = None
        self._fast_failed = False
        self._owns_actors = False
        self._candidates: list[int] | None = None
        self._rr = os.getpid()  # spreads the first blocks of clients in different processes
        self._node_id: str | None = None
        # Source hints of the metas this client got (see TransferController._source_hint).
        self._hints: dict[tuple[str, int, int], tuple[list[Any], int, int, str]] = {}

    # ------------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_owns_actors"] = False  # only the client that started the actors may kill them
        state["_candidates"] = None  # the receiver may run on another node
        state["_node_id"] = None
        state["_hints"] = {}
        state["_fast"] = None  # sockets stay with their process
        state["_fast_failed"] = False
        state.pop("_loops", None)  # event loops and threads stay with their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rr = os.getpid()

    @classmethod
    def connect(cls, name: str, **kwargs: Any) -> RayTransferQueue:
        """Attach to the actors of the queue ``name`` (see :func:`start_ray_transfer_queue`)."""
        try:
            controller = ray.get_actor(f"{name}:controller")
        except ValueError:
            raise TransferError(f"no transfer queue named {name!r} in this Ray namespace") from None
        units = []
        while True:
            try:
                units.append(ray.get_actor(f"{name}:unit{len(units)}"))
            except ValueError:
                break
        nodes = ray.get([u.node_id.remote() for u in units])
        kwargs.setdefault("fast_path", tuple(ray.get(controller.fast_path.remote())))
        return cls(controller, units, nodes, name, **kwargs)

    def _fast_client(self) -> FastPathClient | None:
        """Return the socket client when this process runs on the controller's node, else None."""
        if self.fast_path is None or self._fast_failed or self._node() != self.fast_path[1]:
            return None
        if self._fast is None:
            self._fast = FastPathClient(self.fast_path[0])
        return self._fast

    def _fast_down(self) -> None:
        # The socket cannot be reached from here (another container, the controller moved):
        # stop trying; Ray calls reach the controller wherever it is.
        self._fast_failed = True

    # ------------------------------------------------------------------------------ placement
    def _candidate_units(self) -> list[int]:
        if self._candidates is None:
            here = ray.get_runtime_context().get_node_id()
            local = [i for i, node in enumerate(self.unit_nodes) if node == here]
            self._candidates = local or list(range(len(self.units)))
        return self._candidates

    def _unit_for_new(self, sample_id: int) -> int:
        cands = self._candidate_units()
        return cands[(sample_id // self.block_size) % len(cands)]

    def _next_block_unit(self) -> int:
        cands = self._candidate_units()
        self._rr += 1
        return cands[self._rr % len(cands)]

    def _submit_put(
        self,
        batch: Batch,
        partition: str,
        sample_ids: Sequence[int] | None,
        known: Any,
        sealed: list[Any],
    ) -> list[Any]:
        """Issue the storage and commit calls without waiting; return their ObjectRefs.

        The first ObjectRef is the commit's (its value is the put's :class:`BatchMeta`, which is
        there already when the commit went through the fast path); put
        returns once every one of them is done, then settles the shared-memory segments this
        appended to ``sealed``.

        New samples: the controller's id allocation (an ObjectRef) is handed to the storage
        units and the commit directly, so the producer waits for one reply only.
        """
        n = len(batch)
        cols = batch_to_columns(batch)
        groups = row_groups(batch, self.group_key)
        lengths = row_lengths(batch, self.length_key)
        stored = []
        if sample_ids is None and 0 < n <= self.block_size:
            u = self._next_block_unit()
            payload = self._payload(cols, u, sealed)
            if not isinstance(payload, dict):
                # A sealed block: commit it at once (consumers read it directly, one hop from
                # here), then the unit maps it (Ray runs adopt once the commit is done, so it
                # does not compete with the consumers the commit wakes); put returns once
                # both are done, so the rows outlive this process from then on.
                args = (partition, list(cols), [u] * n, groups, lengths, payload, self._node())
                fast = self._fast_client() if isinstance(payload, ShmBlock) else None
                meta = None
                if fast is not None:
                    try:
                        meta = fast.call("commit_new", *args)
                    except FastPathUnavailable:
                        self._fast_down()
                if meta is None:
                    meta = self.controller.commit_new.remote(*args)
                return [meta, self.units[u].adopt.remote(partition, meta, payload)]
            # Small: the data travels in the call; the unit stores it, then commits it.
            unit = self.units[u]
            return [unit.put_new.remote(partition, n, list(cols), payload, groups, lengths)]
        if sample_ids is None:
            first = self.controller.allocate.remote(partition, n)
            # Round-robin in blocks: each block of ``block_size`` rows goes to the next unit.
            units: list[int] = []
            for start in range(0, n, self.block_size):
                stop = min(n, start + self.block_size)
                u = self._next_block_unit()
                units.extend([u] * (stop - start))
                part = slice_columns(cols, slice(start, stop))
                # ids of the block = first + start + row; the unit adds ``start`` to ``first``.
                stored.append(self._put_block(u, partition, first, start, part, sealed))
            ids_arg: Any = first
        else:
            ids = list(sample_ids)
            units = [
                self._unit_for_new(sid) if known[i] < 0 else known[i] for i, sid in enumerate(ids)
            ]
            rows_by_unit: dict[int, list[int]] = {}
            for row, u in enumerate(units):
                rows_by_unit.setdefault(u, []).append(row)
            for u, rows in rows_by_unit.items():
                part = self._payload(slice_columns(cols, _rows_index(rows)), u, sealed)
                stored.append(self.units[u].put.remote(partition, [ids[r] for r in rows], part))
            ids_arg = ids
        # Data first, then metadata: Ray runs the commit only after every ``stored`` call
        # succeeded, so a consumer never gets a reference to unstored data.
        return [
            self.controller.commit.remote(
                partition, ids_arg, list(cols), units, groups, lengths, *stored
            )
        ]

    def _payload(
        self, part: dict[str, Column], unit: int, sealed: list[Any]
    ) -> dict[str, Column] | list[Any] | ShmBlock:
        """Return what a block travels as: inline columns, a shared-memory segment or ``[ref]``.

        Large blocks are copied once, by the producer, and the unit keeps them: into a segment
        of this process's pool when the unit runs on this node (readers here map it; the
        messages carry a small descriptor), else into the object store (the unit keeps the
        reference). Either way a reader of the whole block maps that one copy.
        """
        nbytes = sum(arr.nbytes for kind, arr, _ in part.values() if kind == "t")
        if nbytes < self.direct_bytes:
            return part
        if self.use_shm and self.unit_nodes[unit] == self._node():
            pool = segment_pool()
            written = None if pool is None else pool.seal(part, self._node())
            if written is not None:
                sealed.append((pool, written[1]))
                return written[0]
        return [ray.put(part)]

    @staticmethod
    def _settle(sealed: list[Any]) -> None:
        for pool, segment in sealed:
            pool.settle(segment)

    def _put_block(
        self, u: int, partition: str, first: Any, start: int, part: Any, sealed: list[Any]
    ) -> Any:
        payload = self._payload(part, u, sealed)
        if start == 0:
            return self.units[u].put.remote(partition, first, payload)
        return self.units[u].put_offset.remote(partition, first, start, payload)

    # ------------------------------------------------------------------------------- writes
    def _check_put(
        self, batch: Batch, partition: str, sample_ids: Sequence[int] | None
    ) -> list[int] | None:
        check_partition(partition)
        if not isinstance(batch, Batch):
            raise TypeError(f"put: expected a polyrl Batch, got {type(batch).__name__}")
        return check_sample_ids(sample_ids, len(batch))

    async def _put(
        self, batch: Batch, partition: str, sample_ids: Sequence[int] | None
    ) -> BatchMeta:
        """Store the rows of ``batch`` (see :meth:`TransferQueue.put`)."""
        ids = self._check_put(batch, partition, sample_ids)
        known = None
        if ids is not None:
            known = await _fetch(self.controller.locate.remote(partition, ids))
        sealed: list[Any] = []
        try:
            # Sealing copies the block and its commit may be a blocking socket call: awaited,
            # they run in a worker thread.
            refs = await offload(self._submit_put, batch, partition, ids, known, sealed)
            return (await _fetch_values(refs))[0]
        finally:
            self._settle(sealed)

    async def _clear(self, partition: str) -> None:
        """Drop the metadata, then the data, of ``partition`` on every unit."""
        check_partition(partition)
        self._forget_hints(partition)
        await _fetch(self.controller.clear.remote(partition))
        await _fetch([u.clear.remote(partition) for u in self.units])

    # -------------------------------------------------------------------------------- reads
    def _fast_get_meta(self, request: MetaRequest) -> FastPathClient | None:
        """Return the fast-path client for this get_meta (None: go through Ray).

        Named samplers with plain arguments only: a Sampler object may not pickle outside Ray.
        """
        kwargs = request.sampler_kwargs
        plain = all(isinstance(v, int | float | str | bool | None) for v in kwargs.values())
        if not isinstance(request.sampler, str) or not plain:
            return None
        return self._fast_client()

    async def _get_meta(self, request: MetaRequest) -> BatchMeta:
        """Serve :meth:`get_meta` (see the base class); awaited, the event loop keeps running."""
        # The sampler is built here too, so bad names/arguments fail in the caller, not the actor.
        request, _ = check_get_meta_args(request)
        fast = self._fast_get_meta(request)
        if fast is not None:
            try:
                return self._remember(*(await _fast_call(fast, "get_meta_local", *request)))
            except FastPathUnavailable:
                self._fast_down()
        return self._remember(*(await _fetch(self.controller.get_meta_hinted.remote(*request))))

    def _forget_hints(self, partition: str) -> None:
        # A hint holds a reference that pins the producer's object: drop it with the partition.
        for key in [k for k in self._hints if k[0] == partition]:
            del self._hints[key]

    def _remember(self, meta: BatchMeta, hint: Any) -> BatchMeta:
        if hint is not None:
            if len(self._hints) >= 8:  # only the latest metas are worth a shortcut
                self._hints.pop(next(iter(self._hints)))
            self._hints[(meta.partition, meta.sample_ids[0], len(meta))] = hint
        return meta

    def _hinted_source(
        self, meta: BatchMeta, fields: Sequence[str] | None
    ) -> tuple[tuple[str, ...], Any, Batch | None]:
        """Return the fields to read, ``meta``'s source hint and, for a segment, its rows.

        A segment hint is read here (mapping it is local and cheap): the Batch comes back and
        the hint is spent. An object-store hint comes back for the caller to fetch (in place or
        awaited). ``(fields, None, None)``: no usable hint, ask the units.
        """
        if not isinstance(meta, BatchMeta):
            return tuple(fields or ()), None, None
        chosen = meta.fields if fields is None else check_fields(fields)
        if not meta.sample_ids:
            return chosen, None, None
        hint = self._hints.pop((meta.partition, meta.sample_ids[0], len(meta)), None)
        if hint is None or hint[3] != self._node() or not set(chosen) <= set(meta.fields):
            return chosen, None, None
        if isinstance(hint[0], ShmBlock):
            cols = map_block(hint[0], chosen)  # None: the segment is gone, ask the units
            batch = None if cols is None else self._from_source(meta, chosen, hint, cols)
            return chosen, None, batch
        return chosen, hint, None

    def _data_calls(
        self, meta: BatchMeta, fields: Sequence[str] | None
    ) -> tuple[tuple[str, ...], list[list[int]], list[Any], list[int]]:
        """Issue one ``get`` per storage unit; return fields, positions, refs and units."""
        if not isinstance(meta, BatchMeta):
            raise TypeError(f"get_data: expected a BatchMeta, got {type(meta).__name__}")
        fields = meta.fields if fields is None else check_fields(fields)
        pos_by_unit: dict[int, list[int]] = {}
        for p, u in enumerate(meta.units):
            if not 0 <= u < len(self.units):
                raise TransferError(
                    f"get_data: sample {meta.sample_ids[p]} names storage unit {u}; this queue "
                    f"has units 0..{len(self.units) - 1}"
                )
            pos_by_unit.setdefault(u, []).append(p)
        positions = list(pos_by_unit.values())
        refs = [self._read(meta, fields, pos, u) for u, pos in pos_by_unit.items()]
        return fields, positions, refs, list(pos_by_unit)

    async def _wait_for_adopted(
        self,
        meta: BatchMeta,
        fields: Sequence[str],
        positions: list[list[int]],
        units: list[int],
        results: list[tuple[Any, ...]],
    ) -> list[tuple[Any, ...]]:
        """Re-read rows a unit did not hold yet: committed blocks still being adopted.

        A producer commits a sealed block before its unit has indexed it (see
        ``StorageUnit.adopt``), so a reader can be a moment early. Rows the controller never
        committed, or a cleared partition, are errors at once; committed rows that do not
        arrive within ``adopt_timeout`` seconds (their producer died in between) are an error.
        """
        deadline = time.monotonic() + self.adopt_timeout
        delay = 0.001
        results = list(results)
        while True:
            waiting = [k for k, r in enumerate(results) if r[0] == "missing"]
            if not waiting:
                return results
            for k in waiting:
                ids = [meta.sample_ids[p] for p in positions[k]]
                done = await _fetch(self.controller.committed.remote(meta.partition, ids, fields))
                if done is None:
                    raise TransferError(
                        f"get_data: unknown partition {meta.partition!r} (never put, or cleared)"
                    )
                if not done:  # the unit's own error names the missing fields and samples
                    await _fetch(self._gathered(meta, fields, positions[k], units[k]))
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"get_data: samples {ids[:8]}{' ...' if len(ids) > 8 else ''} of "
                        f"partition {meta.partition!r} were committed to storage unit "
                        f"{units[k]} but did not reach it within {self.adopt_timeout:g} s "
                        "(did their producer die during its put?)"
                    )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            reads = [self._read(meta, fields, positions[k], units[k]) for k in waiting]
            again = await _fetch(reads)
            for k, r in zip(waiting, again, strict=True):
                results[k] = r

    def _node(self) -> str:
        if self._node_id is None:
            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    @staticmethod
    def _map_segments(
        results: list[tuple[Any, ...]], fields: Sequence[str]
    ) -> tuple[list[tuple[Any, ...]], list[int]]:
        """Map the shared-memory blocks units pointed to; also return those that are gone.

        A unit answers ``("shm", block, start, stop)`` for a whole in-order run of a block on
        the reader's node; the rows become ``("cols", ...)`` views of the segment. A block whose
        producer exited (file removed) or reused the segment cannot be mapped: the caller asks
        the unit for a gathered copy of those rows instead (the unit still maps them).
        """
        out, unmapped = list(results), []
        for k, r in enumerate(out):
            if r[0] != "shm":
                continue
            cols = map_block(r[1], fields)
            if cols is None:
                unmapped.append(k)
            else:
                out[k] = ("cols", slice_columns(cols, slice(r[2], r[3])))
        return out, unmapped

    def _read(self, meta: BatchMeta, fields: Sequence[str], pos: list[int], unit: int) -> Any:
        """Ask ``unit`` for the rows at ``pos`` of ``meta`` as this reader: see StorageUnit.get."""
        ids = [meta.sample_ids[p] for p in pos]
        return self.units[unit].get.remote(meta.partition, ids, fields, self._node(), strict=False)

    def _gathered(self, meta: BatchMeta, fields: Sequence[str], pos: list[int], unit: int) -> Any:
        """Ask ``unit`` for a gathered copy of the rows at ``pos`` (rows not held: an error)."""
        ids = [meta.sample_ids[p] for p in pos]
        return self.units[unit].get.remote(meta.partition, ids, fields)

    @staticmethod
    def _source_refs(results: list[tuple[Any, ...]]) -> list[Any]:
        return [r[1][0] for r in results if r[0] == "ref"]

    @staticmethod
    def _columns(
        results: list[tuple[Any, ...]], sources: list[Any], fields: Sequence[str]
    ) -> list[dict[str, Column]]:
        out, k = [], 0
        for r in results:
            if r[0] == "cols":
                out.append(r[1])
            else:
                cols = sources[k]
                k += 1
                out.append(slice_columns({f: cols[f] for f in fields}, slice(r[2], r[3])))
        return out

    async def _refetch(
        self,
        meta: BatchMeta,
        fields: Sequence[str],
        positions: list[list[int]],
        units: list[int],
    ) -> list[tuple[Any, ...]]:
        """Gathered copies from the units (when a producer's object is gone with its owner)."""
        pairs = zip(positions, units, strict=True)
        return await _fetch([self._gathered(meta, fields, p, u) for p, u in pairs])

    async def _missing_partition(self, meta: BatchMeta) -> TransferError | None:
        if not await _fetch(self.controller.has_partition.remote(meta.partition)):
            return TransferError(
                f"get_data: unknown partition {meta.partition!r} (never put, or cleared)"
            )
        return None

    def _from_source(self, meta: BatchMeta, fields: Sequence[str], hint: Any, cols: Any) -> Batch:
        part = slice_columns({f: cols[f] for f in fields}, slice(hint[1], hint[2]))
        return columns_to_batch(len(meta), [(list(range(len(meta))), part)], fields)

    async def _get_data(self, meta: BatchMeta, fields: Sequence[str] | None) -> Batch:
        """Fetch the rows of ``meta`` from the storage units in parallel, in meta order.

        A meta this client got from :meth:`get_meta` that covers one in-order block put as one
        object is read from that object directly (no call to the storage unit).
        """
        chosen, hint, mapped = self._hinted_source(meta, fields)
        if mapped is not None:
            return mapped
        if hint is not None:
            try:
                return self._from_source(meta, chosen, hint, await _resolve(hint[0][0]))
            except ObjectLostError:
                pass  # the producer is gone: the storage unit still has the rows
        fields, positions, refs, units = self._data_calls(meta, fields)
        if not refs:
            return Batch(batch_size=0)
        try:
            results = await _resolve(refs)
        except RayTaskError as exc:
            raise (await self._missing_partition(meta) or _unwrap(exc)) from None
        if any(r[0] == "missing" for r in results):
            results = await self._wait_for_adopted(meta, fields, positions, units, results)
        results, unmapped = self._map_segments(results, fields)
        if unmapped:
            again = await _fetch(
                [self._gathered(meta, fields, positions[k], units[k]) for k in unmapped]
            )
            for k, r in zip(unmapped, again, strict=True):
                results[k] = r
        try:
            sources = await _resolve(self._source_refs(results))
        except ObjectLostError:  # the producer that owned it died; the unit still maps it
            results, sources = await self._refetch(meta, fields, positions, units), []
        cols = self._columns(results, sources, fields)
        return columns_to_batch(len(meta), list(zip(positions, cols, strict=True)), fields)

    async def _unit_bytes(self) -> list[int]:
        return await _fetch([u.nbytes.remote() for u in self.units])

    async def _status(self, partition: str | None) -> dict[str, Any]:
        """Readiness, consumption and bytes held per unit (see :meth:`TransferQueue.status`)."""
        parts_ref = self.controller.status.remote(partition)
        units = await self._unit_bytes()
        return {"partitions": await _fetch(parts_ref), "storage_bytes": sum(units), "units": units}

    def storage_bytes(self) -> int:
        """Bytes of sample data held by all units."""
        return int(sum(self._loops.run(self._unit_bytes())))

    def close(self) -> None:
        """Kill the controller and the units if this client started them (see the base class)."""
        super().close()
        if not self._owns_actors:
            return
        for actor in [self.controller, *self.units]:
            try:
                ray.kill(actor)
            except Exception:  # already dead or Ray shut down: nothing left to free
                pass
        self._owns_actors = False
        sweep_segments()  # segment files of producers killed meanwhile


def start_ray_transfer_queue(
    num_storage_units: int = 2,
    name: str | None = None,
    group_key: str = "uid",
    length_key: str = "response_ids",
    block_size: int = 1024,
    spread: bool = True,
    direct_bytes: int = 1 << 20,
    use_shm: bool = True,
) -> RayTransferQueue:
    """Start a controller and ``num_storage_units`` storage units; return the client.

    Args:
        num_storage_units: storage unit actors to start.
        name: prefix of the actor names (``{name}:controller``, ``{name}:unit{i}``); a unique
            one by default, so several queues coexist in one Ray session.
        group_key: column holding each sample's group id.
        length_key: object column whose per-row ``len`` is a sample's length (when the put
            has no ``attention_mask``).
        block_size: rows of a put placed together on one unit.
        spread: place the units on different nodes when the cluster has several.
        direct_bytes: see :class:`RayTransferQueue`.
        use_shm: see :class:`RayTransferQueue`.

    The actors take no CPU slot (they mostly wait); the returned client's :meth:`close` kills
    them.
    """
    if not isinstance(num_storage_units, int) or num_storage_units < 1:
        raise ValueError(f"num_storage_units must be an int >= 1, got {num_storage_units!r}")
    if not ray.is_initialized():
        raise TransferError("start_ray_transfer_queue needs Ray: call ray.init() first")
    name = name or f"polyrl-tq-{uuid.uuid4().hex[:8]}"
    sweep_segments()
    controller = (
        ray.remote(TransferController)
        .options(name=f"{name}:controller", num_cpus=0, max_concurrency=10_000)
        .remote()
    )
    unit_cls = ray.remote(StorageUnit)
    units = [
        unit_cls.options(
            name=f"{name}:unit{i}",
            num_cpus=0,
            scheduling_strategy="SPREAD" if spread else "DEFAULT",
        ).remote(i, controller)
        for i in range(num_storage_units)
    ]
    nodes = ray.get([u.node_id.remote() for u in units])
    fast_path = tuple(ray.get(controller.fast_path.remote()))
    client = RayTransferQueue(
        controller,
        units,
        nodes,
        name,
        group_key,
        length_key,
        block_size=block_size,
        direct_bytes=direct_bytes,
        use_shm=use_shm,
        fast_path=fast_path,
    )
    client._owns_actors = True
    return client
