"""Measure how many bytes reach the driver process from Ray.

Used by the tests and ``benchmarks/dispatch_overhead.py`` to check that chained non-blocking
calls keep data on the workers. :class:`DriverTrafficMeter` counts two things while active:

``deserialized_bytes``
    Every Ray object that becomes a Python value in this process -- ``ray.get`` results, whether
    they arrived inline in a reply or were read from the object store -- passes through Ray's
    single deserialisation entry point, ``Worker.deserialize_objects``. The meter wraps it and
    adds up the size of each object's data and metadata buffers, and records which object ids
    were read (``fetched_ids``), so a test can assert that intermediate results never were.
``inline_bytes``
    Results smaller than Ray's inline limit (100 KiB by default) are not put in the object store:
    they ride in the reply to the caller and land in the driver's in-process memory store
    whether or not anyone reads them. The meter takes the growth of that store
    (``CoreWorker.get_local_memory_store_bytes_used``) between entering and leaving the block,
    so the futures must still be alive at exit (they are, inside the ``with`` block); objects
    freed during the block can make it an under-count, never negative.

``sent_bytes``
    Every value this process serialises for Ray -- task and actor-call arguments, ``ray.put``
    -- passes through the serialisation context's ``serialize``; the meter adds up each
    serialised object's ``total_bytes``.

``total_bytes`` adds the two received counts; an inline object that was also read is counted
twice, so for a block that keeps its results alive it is a conservative upper bound on what the
driver received.
(The process's ``rchar`` counter is no use here: gRPC reads sockets with ``recvmsg``, which it
does not count.)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

__all__ = ["DriverTrafficMeter"]


def _nbytes(buf: Any) -> int:
    if buf is None:
        return 0
    try:
        return memoryview(buf).nbytes
    except TypeError:
        try:
            return len(buf)
        except TypeError:
            return 0


def _memory_store_bytes(worker: Any) -> int:
    try:
        return int(worker.core_worker.get_local_memory_store_bytes_used())
    except AttributeError:  # not exposed by this Ray version: inline bytes read as 0
        return 0


class DriverTrafficMeter:
    """Context manager counting the bytes the driver receives from and sends to Ray."""

    def __init__(self) -> None:
        self.deserialized_bytes = 0
        self.objects = 0
        self.inline_bytes = 0
        self.sent_bytes = 0
        self.fetched_ids: set[str] = set()
        self._lock = threading.Lock()
        self._worker: Any = None
        self._had_attr = False
        self._start_store = 0

    @property
    def total_bytes(self) -> int:
        """``deserialized_bytes + inline_bytes``: an upper bound on bytes received."""
        return self.deserialized_bytes + self.inline_bytes

    @property
    def both_ways_bytes(self) -> int:
        """``total_bytes + sent_bytes``: what crossed the driver's Ray boundary either way."""
        return self.total_bytes + self.sent_bytes

    def __enter__(self) -> DriverTrafficMeter:
        import ray
        from ray._private import worker as ray_worker

        if not ray.is_initialized():
            raise RuntimeError("DriverTrafficMeter needs an initialised Ray driver")
        worker = ray_worker.global_worker
        original = getattr(worker, "deserialize_objects", None)
        if original is None:
            raise RuntimeError(
                "this Ray version has no Worker.deserialize_objects; the meter cannot count bytes"
            )
        self._had_attr = "deserialize_objects" in worker.__dict__
        meter = self

        def counting(serialized_objects: Any, object_refs: Any, *args: Any, **kwargs: Any) -> Any:
            size = 0
            ids = []
            for item, ref in zip(serialized_objects, object_refs, strict=False):
                size += _nbytes(item[0]) + _nbytes(item[1])
                if ref is not None:
                    ids.append(ref.hex())
            with meter._lock:
                meter.deserialized_bytes += size
                meter.objects += len(ids)
                meter.fetched_ids.update(ids)
            return original(serialized_objects, object_refs, *args, **kwargs)

        worker.deserialize_objects = counting
        self._worker = (worker, original)
        context = worker.get_serialization_context()
        serialize = context.serialize

        def counting_serialize(value: Any) -> Any:
            out = serialize(value)
            with meter._lock:
                meter.sent_bytes += int(getattr(out, "total_bytes", 0) or 0)
            return out

        context.serialize = counting_serialize
        self._context = context
        self._start_store = _memory_store_bytes(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        worker, original = self._worker
        self.inline_bytes = max(0, _memory_store_bytes(worker) - self._start_store)
        with contextlib.suppress(AttributeError):
            del self._context.serialize  # back to the class's method
        if self._had_attr:
            worker.deserialize_objects = original
        else:
            del worker.deserialize_objects
