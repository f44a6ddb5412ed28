"""The one-process transfer queue: same API and semantics as the Ray backend.

For tests and single-process runs. Thread-safe: producers and consumers may be threads of one
process. Processes of this host reach it through a :class:`LocalQueueClient`
(:meth:`LocalTransferQueue.for_processes`), which sends each call over a Unix socket to a
thread of the queue's process: the ``local`` worker backend's rank subprocesses use one.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
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

__all__ = ["LocalQueueClient", "LocalTransferQueue"]


class LocalTransferQueue(TransferQueue):
    """A transfer queue living in this process (one storage unit, index 0).

    Args:
        group_key: object (or tensor) column holding each sample's group id.
        length_key: object column whose per-row ``len`` is the sample length when the put has no
            ``attention_mask`` tensor column.
        copy: copy tensor data on put (default) so later in-place changes to the caller's
            tensors cannot alter what was stored.

    A local queue cannot be pickled (``TypeError``); :meth:`for_processes` gives a client that
    can, for other processes of this host.
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
        self._server: _QueueServer | None = None
        self._server_lock = threading.Lock()

    def __reduce__(self) -> Any:
        raise TypeError(
            "LocalTransferQueue lives in one process and cannot be pickled; pass "
            "queue.for_processes() to other processes of this host, or use "
            "make_transfer_queue('ray') to share a queue with Ray actors"
        )

    def for_processes(self) -> LocalQueueClient:
        """Return a picklable client of this queue for other processes of this host.

        The first call starts a thread that serves the clients' calls on a Unix socket (each
        connection a thread of its own, so a blocked ``get_meta`` holds only its caller);
        :meth:`close` stops it. Clients cannot reach the queue from another host.
        """
        with self._server_lock:
            if self._server is None:
                self._server = _QueueServer(self)
            return LocalQueueClient(self._server.address, self._server.authkey)

    def close(self) -> None:
        """Stop serving other processes (if :meth:`for_processes` started it); see the base."""
        with self._server_lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
        super().close()

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


def _send(conn: Connection, value: Any) -> None:
    # Plain pickle, not the Connection's ForkingPickler: torch registers reducers there that
    # would move tensors through shared-memory handles instead of by value.
    conn.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


#: The queue's hooks a :class:`LocalQueueClient` may call (the served API, nothing else).
_SERVED = frozenset({"_put", "_get_meta", "_get_data", "_clear", "_status", "storage_bytes"})


class _QueueServer:
    """Serves a :class:`LocalTransferQueue`'s hooks to :class:`LocalQueueClient` connections."""

    def __init__(self, queue: LocalTransferQueue) -> None:
        self.queue = queue
        self.authkey = os.urandom(32)
        self._listener = Listener(family="AF_UNIX", authkey=self.authkey)
        self.address: str = self._listener.address
        self._closed = False
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="local-queue-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):  # closed, or a failed handshake
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    name, args = _receive(conn)
                except (EOFError, OSError):  # the client closed, or the server did
                    return
                try:
                    if name not in _SERVED:
                        raise TransferError(f"local queue server: {name!r} is not served")
                    reply: tuple[bool, Any] = (True, getattr(self.queue, name)(*args))
                except Exception as exc:  # noqa: BLE001 - the caller's error, raised there
                    reply = (False, exc)
                try:
                    _send(conn, reply)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    _send(conn, (False, TransferError(f"{name}: unpicklable reply: {exc!r}")))
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting, close every connection (their clients get an error)."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            # shutdown, not only close: it wakes the serving thread blocked in recv.
            try:
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # accept() does not return when its socket is closed from another thread: connect once.
        try:
            Client(self.address, family="AF_UNIX", authkey=self.authkey).close()
        except OSError:
            pass
        self._listener.close()


class LocalQueueClient(TransferQueue):
    """A :class:`LocalTransferQueue` of another process of this host (see ``for_processes``).

    Picklable: it holds the queue's socket address and key only. Each thread opens its own
    connection on first use; calls have the local queue's semantics (a blocking ``get_meta``
    waits in the queue's process).
    """

    def __init__(self, address: str, authkey: bytes) -> None:
        self.address = address
        self.authkey = authkey
        self._local = threading.local()
        self._opened: list[Connection] = []
        self._opened_lock = threading.Lock()

    def __reduce__(self) -> Any:
        return (LocalQueueClient, (self.address, self.authkey))

    def _call(self, name: str, *args: Any) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
            except OSError as exc:
                raise TransferError(
                    f"cannot reach the local transfer queue at {self.address} ({exc}); it "
                    "serves processes of its own host while it is open"
                ) from exc
            self._local.conn = conn
            with self._opened_lock:
                self._opened.append(conn)
        try:
            _send(conn, (name, args))
            ok, value = _receive(conn)
        except (EOFError, OSError) as exc:
            self._local.conn = None
            raise TransferError(
                f"the local transfer queue at {self.address} went away during {name} ({exc})"
            ) from exc
        if not ok:
            raise value
        return value

    def _put(self, batch: Batch, partition: str, sample_ids: Sequence[int] | None) -> BatchMeta:
        """Serve :meth:`put` in the queue's process."""
        return self._call("_put", batch, partition, sample_ids)

    def _get_meta(self, request: MetaRequest) -> BatchMeta:
        """Serve :meth:`get_meta` in the queue's process."""
        return self._call("_get_meta", request)

    def _get_data(self, meta: BatchMeta, fields: Sequence[str] | None) -> Batch:
        """Serve :meth:`get_data` in the queue's process."""
        return self._call("_get_data", meta, fields)

    def _clear(self, partition: str) -> None:
        """Serve :meth:`clear` in the queue's process."""
        self._call("_clear", partition)

    def _status(self, partition: str | None) -> dict[str, Any]:
        """Serve :meth:`status` in the queue's process."""
        return self._call("_status", partition)

    def storage_bytes(self) -> int:
        """Bytes of sample data the queue holds."""
        return self._call("storage_bytes")

    def close(self) -> None:
        """Close this client's connections (the queue goes on); see the base class."""
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()
        self._local = threading.local()
        super().close()
