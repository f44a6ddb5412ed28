"""Shared-memory segments: how a large block travels from its producer to readers on one host.

A producer writes a sealed block (every column of one put) into a segment, a file in
``/dev/shm`` that it keeps mapped; what travels through the controller and the storage unit is
a :class:`ShmBlock`, a small picklable descriptor (path, generation, column layout), never an
``ObjectRef``, so those messages cost Ray no reference bookkeeping. Readers on the same host map
the file read-only and get numpy views: one copy in all (the producer's), as with Ray's object
store, but into pages the producer mapped before, so steady-state puts take no page faults.

Who may overwrite a segment is decided by ``flock``. The storage unit holding the block and
every reader holding a view of it keep a *shared* lock: the lock lives on the mapping's own
file descriptor, so it is released when the last numpy/torch view of the mapping is garbage,
or when the process dies. The producer reuses a segment only after taking the *exclusive* lock
without waiting, i.e. when nobody maps it any more; until the storage unit has adopted a block,
the producer keeps it out of reuse itself (:meth:`SegmentPool.settle`). Each write bumps the
segment's generation (in its header); a reader checks it under its shared lock, so a stale
descriptor (a cleared partition whose segment was reused) is detected, never read.

Segments are named ``polyrl-tq-<pid>-<random>``; the producer removes its files at exit (the
storage units' mappings keep the data they hold) and :func:`sweep_segments` removes those of
producers that died without doing so: Ray kills its workers without running their exit
handlers, so a new pool, a new queue and a closing queue each sweep, and so should a driver
after ``ray.shutdown()``.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyrl.core.shm import shm_root, sweep_dead
from polyrl.transfer._core import Column

__all__ = [
    "SEGMENT_PREFIX",
    "SegmentPool",
    "ShmBlock",
    "map_block",
    "segment_pool",
    "sweep_segments",
]

#: File-name prefix of segments; the producing process's pid follows it.
SEGMENT_PREFIX = "polyrl-tq-"
#: Environment variable naming where segments are created (default ``/dev/shm``).
SEGMENT_DIR_ENV = "POLYRL_TRANSFER_SHM_DIR"
#: Set to ``0`` to turn segments off (large blocks then go through Ray's object store).
SEGMENT_ENABLE_ENV = "POLYRL_TRANSFER_SHM"

_MAGIC = b"PRLTQSG1"
_HEADER = 64  # magic (8) + generation (8), padded so that columns start 64-byte aligned
_ALIGN = 64
_KEEP_IDLE = 4  # free segments kept for reuse beyond what a put needs; more are removed


# (name, kind, offset, nbytes, numpy dtype str, shape, dtype_name) of one column in a segment
_ColumnLayout = tuple[str, str, int, int, str, tuple[int, ...], str | None]


@dataclass(frozen=True)
class ShmBlock:
    """Where a sealed block lies: a segment file on ``node`` and its columns' layout.

    Attributes:
        path: the segment file.
        generation: the write this block is; a reader finding another one reads nothing.
        node: the Ray node id the file is valid on.
        rows: rows of every column.
        columns: per field ``(name, kind, offset, nbytes, numpy dtype str, shape, dtype_name)``;
            ``"o"`` columns are pickled object arrays (``dtype``/``shape`` unused).
    """

    path: str
    generation: int
    node: str
    rows: int
    columns: tuple[_ColumnLayout, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        """The block's fields."""
        return tuple(c[0] for c in self.columns)


class _Segment:
    """One segment file of this process, mapped read-write for as long as the pool keeps it."""

    def __init__(self, root: Path, size: int) -> None:
        self.path = root / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.size = size
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later.
            os.posix_fallocate(self.fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, size, flags=flags)
        except BaseException:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            raise
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.bytes[:8] = np.frombuffer(_MAGIC, dtype=np.uint8)
        self.generation = 0
        self.busy = False  # written, not yet adopted by its storage unit

    def try_lock_exclusive(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.bytes = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: the mapping dies with it
            pass
        os.close(self.fd)


def _round_size(nbytes: int) -> int:
    """Segment size for ``nbytes``: rounded up to 1/8 of its power of two (at most 12.5% slack)."""
    step = max(1 << 16, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


def _layout(cols: Mapping[str, Column]) -> tuple[list[_ColumnLayout], dict[str, bytes], int]:
    """Each column's place in a segment, the pickled object columns, and the bytes needed."""
    columns: list[_ColumnLayout] = []
    pickled: dict[str, bytes] = {}
    offset = _HEADER
    for name, (kind, arr, dtype_name) in cols.items():
        if kind == "t":
            nbytes = int(arr.nbytes)
            shape = tuple(int(d) for d in arr.shape)
            columns.append((name, kind, offset, nbytes, arr.dtype.str, shape, dtype_name))
        else:
            pickled[name] = pickle.dumps(arr, protocol=pickle.HIGHEST_PROTOCOL)
            nbytes = len(pickled[name])
            columns.append((name, kind, offset, nbytes, "|O", (int(arr.shape[0]),), None))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return columns, pickled, offset


class SegmentPool:
    """A process's segments: writes sealed blocks into free ones, creating more as needed.

    Thread-safe. Use :func:`segment_pool` for the process-wide pool.

    Args:
        root: directory of the segment files (a tmpfs such as ``/dev/shm``).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        sweep_dead(root, SEGMENT_PREFIX)

    def seal(self, cols: Mapping[str, Column], node: str) -> tuple[ShmBlock, _Segment] | None:
        """Write every column into a segment; return its descriptor and the segment.

        The segment stays out of reuse until :meth:`settle` (call it once the storage unit has
        adopted the block, or the put failed). Returns None when no room is left in the
        directory (the caller then goes through Ray's object store).
        """
        columns, pickled, need = _layout(cols)
        with self._lock:
            seg = self._acquire(need)
            if seg is None:
                return None
            try:
                for name, kind, offset, nbytes, _, shape, _ in columns:
                    dst = seg.bytes[offset : offset + nbytes]
                    if kind == "o":
                        dst[:] = np.frombuffer(pickled[name], dtype=np.uint8)
                    elif nbytes:
                        arr = cols[name][1]
                        np.copyto(dst.view(arr.dtype).reshape(shape), arr, casting="no")
                seg.generation += 1
                seg.bytes[8:16] = np.frombuffer(
                    seg.generation.to_bytes(8, "little"), dtype=np.uint8
                )
                seg.busy = True
            finally:
                seg.unlock()
        rows = columns[0][5][0] if columns else 0
        return ShmBlock(str(seg.path), seg.generation, node, rows, tuple(columns)), seg

    def settle(self, segment: _Segment) -> None:
        """Let ``segment`` be reused once nobody maps it (its block was adopted, or dropped)."""
        with self._lock:
            segment.busy = False

    def _acquire(self, need: int) -> _Segment | None:
        """Return a free segment of at least ``need`` bytes, locked exclusively (holds _lock)."""
        free = [s for s in self._segments if not s.busy and s.try_lock_exclusive()]
        fits = [s for s in free if need <= s.size <= 2 * _round_size(need)]
        chosen = min(fits, key=lambda s: s.size) if fits else None
        idle = sorted((s for s in free if s is not chosen), key=lambda s: -s.size)
        for extra in idle[_KEEP_IDLE:]:  # too many idle segments: give their memory back
            self._segments.remove(extra)
            extra.remove()
        for s in idle[:_KEEP_IDLE]:
            s.unlock()
        if chosen is not None:
            return chosen
        try:
            seg = _Segment(self.root, _round_size(need))
        except OSError:
            return None
        seg.try_lock_exclusive()
        self._segments.append(seg)
        return seg

    def nbytes(self) -> int:
        """Bytes of shared memory this pool holds (in use and idle)."""
        with self._lock:
            return sum(s.size for s in self._segments)

    def close(self) -> None:
        """Remove every segment file (readers' mappings keep the data they map)."""
        with self._lock:
            for seg in self._segments:
                seg.remove()
            self._segments.clear()


_POOLS: dict[str, SegmentPool] = {}
_POOLS_LOCK = threading.Lock()
_ALL_POOLS: weakref.WeakSet[SegmentPool] = weakref.WeakSet()


def segment_pool() -> SegmentPool | None:
    """Return this process's pool, or None when segments are off or no shared directory exists."""
    if os.environ.get(SEGMENT_ENABLE_ENV, "1") == "0":
        return None
    root = shm_root(SEGMENT_DIR_ENV)
    if root is None:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get(str(root))
        if pool is None:
            pool = _POOLS[str(root)] = SegmentPool(root)
            _ALL_POOLS.add(pool)
        return pool


@atexit.register
def _remove_all() -> None:  # the files are RAM: do not leave them behind
    for pool in list(_ALL_POOLS):
        pool.close()


def sweep_segments(wait_s: float = 0.0) -> int:
    """Remove the segment files of processes that are gone; return how many were removed.

    Args:
        wait_s: keep sweeping for up to this many seconds while files of dying processes
            remain (Ray's workers exit a moment after ``ray.shutdown()`` returns).
    """
    root = shm_root(SEGMENT_DIR_ENV)
    if root is None:
        return 0
    removed = sweep_dead(root, SEGMENT_PREFIX)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _foreign_segments(root):
        time.sleep(0.1)
        removed += sweep_dead(root, SEGMENT_PREFIX)
    return removed


def _foreign_segments(root: Path) -> list[Path]:
    mine = f"{SEGMENT_PREFIX}{os.getpid()}-"
    return [p for p in root.glob(SEGMENT_PREFIX + "*") if not p.name.startswith(mine)]


def map_block(block: ShmBlock, fields: Sequence[str] | None = None) -> dict[str, Column] | None:
    """Map ``block`` copy-on-write and return its columns (numpy views; objects unpickled).

    The views hold a shared lock on the segment for as long as any of them lives, so the
    producer cannot reuse it under them. Returns None when the block is gone: the file was
    removed (its producer exited) or reused for a later block (the generation differs).
    """
    try:
        fd = os.open(block.path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        size = os.fstat(fd).st_size
        # The mapping dups ``fd``: the lock lives on while the mapping (and so any view) does.
        # Copy-on-write: reads share the segment's pages; a reader writing in place (torch
        # ops with ``_``) gets private copies of the pages it touches instead of a SIGSEGV or
        # a change other readers would see.
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    raw = np.frombuffer(mapped, dtype=np.uint8)
    header = raw[:_HEADER].tobytes()
    if header[:8] != _MAGIC or int.from_bytes(header[8:16], "little") != block.generation:
        return None
    wanted = None if fields is None else set(fields)
    out: dict[str, Column] = {}
    for name, kind, offset, nbytes, dtype, shape, dtype_name in block.columns:
        if wanted is not None and name not in wanted:
            continue
        if kind == "o":
            out[name] = ("o", pickle.loads(raw[offset : offset + nbytes]), None)
        else:
            arr = np.ndarray(shape, dtype=np.dtype(dtype), buffer=mapped, offset=offset)
            out[name] = ("t", arr, dtype_name)
    return out
