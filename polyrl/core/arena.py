"""Shared arenas: a replica's staging memory that a same-host sender writes into directly.

The ``shm`` transport's bucket path copies every byte twice: the sender packs it into a shared
bucket, the replica copies it out into its shadow. When the replica's shadows themselves live in
a shared-memory file (a :class:`SharedArena` under ``/dev/shm``), the sender maps that file and
copies each tensor straight into its shadow (:class:`ArenaWriter`): one copy, no bucket.
The replica still decides everything that matters for atomicity: the arena holds *shadows*
only, swapped in at commit, so an interrupted transfer leaves the serving weights untouched.

Arena files are named ``polyrl-arena-<pid>-<random>``; a replica removes its own when their
tensors are released, and :func:`sweep_dead` removes those of processes that died
without doing so (a killed replica's memory would otherwise stay in ``/dev/shm``).
"""

from __future__ import annotations

import atexit
import mmap
import os
import uuid
import weakref
import zlib
from pathlib import Path

import torch

from polyrl.core.errors import WeightTransferError
from polyrl.core.shm import shm_root, sweep_dead

__all__ = [
    "ARENA_PREFIX",
    "ArenaWriter",
    "SharedArena",
    "arena_of",
    "default_arena_root",
    "sweep_dead",
]

#: File-name prefix of arenas; the creating process's pid follows it.
ARENA_PREFIX = "polyrl-arena-"
#: Environment variable naming where arenas are created (default ``/dev/shm``).
ARENA_DIR_ENV = "POLYRL_WEIGHTS_ARENA_DIR"

_LIVE: weakref.WeakSet[SharedArena] = weakref.WeakSet()


def default_arena_root() -> Path | None:
    """Where arenas go: ``$POLYRL_WEIGHTS_ARENA_DIR``, else ``/dev/shm``; ``None`` if neither."""
    return shm_root(ARENA_DIR_ENV)


class SharedArena:
    """One shared-memory file, mapped once, cut into tensors by offset.

    The pages are reserved up front (``posix_fallocate``), so a full ``/dev/shm`` is an error
    here and not a ``SIGBUS`` at the first write; the mapping is populated at creation, so the
    replica takes no page faults when it later reads the tensors.

    Args:
        nbytes: the arena's size.
        root: its directory (default :func:`default_arena_root`).

    Raises:
        WeightTransferError: no shared-memory directory, or not enough room in it.
    """

    def __init__(self, nbytes: int, root: Path | None = None):
        root = root or default_arena_root()
        if root is None:
            raise WeightTransferError(
                "no writable /dev/shm for a shared arena (set POLYRL_WEIGHTS_ARENA_DIR)"
            )
        sweep_dead(root, ARENA_PREFIX)
        self.nbytes = max(1, int(nbytes))
        self.path = root / f"{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            except OSError as exc:
                raise WeightTransferError(
                    f"cannot reserve {self.nbytes} bytes of shared memory in {root}: {exc}"
                ) from exc
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, self.nbytes, flags=flags)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps the file's pages
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
        self.base = self._bytes.data_ptr()
        self._unlinked = False
        _LIVE.add(self)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Return the tensor of ``shape``/``dtype`` starting ``offset`` bytes into the arena."""
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"[{offset}, {offset + size}) is outside the arena of {self.nbytes}")
        return self._bytes[offset : offset + size].view(dtype).view(shape)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage lies in this arena."""
        ptr = tensor.data_ptr()
        return tensor.device.type == "cpu" and self.base <= ptr < self.base + self.nbytes

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of ``tensor``'s first element in the arena."""
        return tensor.data_ptr() - self.base

    def unlink(self) -> None:
        """Remove the file's name; its memory is freed once the last tensor view is gone."""
        if not self._unlinked:
            self._unlinked = True
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:
        self.unlink()


def arena_of(tensor: torch.Tensor) -> SharedArena | None:
    """Return the live arena of this process that holds ``tensor``'s memory, or ``None``."""
    if tensor.device.type != "cpu":
        return None
    for arena in list(_LIVE):
        if not arena._unlinked and arena.contains(tensor):
            return arena
    return None


@atexit.register
def _unlink_all() -> None:  # at interpreter exit: do not leave model-sized files in /dev/shm
    for arena in list(_LIVE):
        arena.unlink()


class ArenaWriter:
    """A sender's handle on one replica's arena: copies tensors straight into it.

    The arena is mapped once, populated, and kept mapped across transfers (the replica keeps
    its arenas for its shadows, alternating two), so an update takes no page faults and copies
    at memory bandwidth; a dtype cast or a device-to-host move happens inside that one copy.
    The mapped pages are the replica's shadow memory: they show in this process's resident set
    (as shared memory, :attr:`nbytes`) but are not allocated by it. The transport drops a
    writer whose arena the replica has released (:attr:`stale`).
    """

    def __init__(self, path: str):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise WeightTransferError(f"cannot open the replica's arena {path!r}: {exc}") from exc
        try:
            self.nbytes = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map: mmap.mmap | None = mmap.mmap(fd, self.nbytes, flags=flags)
        finally:
            os.close(fd)
        self.path = path
        self._bytes: torch.Tensor | None = torch.frombuffer(
            self._map, dtype=torch.uint8, count=self.nbytes
        )

    @property
    def stale(self) -> bool:
        """Whether the replica has released the arena (its file name is gone)."""
        return not os.path.exists(self.path)

    def write(
        self, offset: int, src: torch.Tensor, dtype: torch.dtype, checksum: bool = False
    ) -> int | None:
        """Copy the flat ``src`` as ``dtype`` to ``offset``; return its CRC32 if asked.

        Raises:
            WeightTransferError: the write would leave the arena, or the writer is closed.
        """
        if self._bytes is None:
            raise WeightTransferError(f"the arena writer of {self.path} is closed")
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = src.numel() * size
        if offset < 0 or offset + nbytes > self.nbytes:
            raise WeightTransferError(
                f"write of {nbytes} bytes at {offset} leaves the arena {self.path} "
                f"({self.nbytes} bytes)"
            )
        dst = self._bytes[offset : offset + nbytes]
        dst.view(dtype).copy_(src.reshape(-1))  # one copy: casts and device->host on the way
        if not checksum:
            return None
        return zlib.crc32(memoryview(dst.numpy())) & 0xFFFFFFFF

    def close(self) -> None:
        """Unmap the arena (its memory is freed once the replica has dropped it too)."""
        self._bytes = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: the mapping dies with it
                pass
            self._map = None
