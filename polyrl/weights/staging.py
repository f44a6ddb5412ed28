""":class:`WeightTarget` s for backends that reload whole checkpoints (vLLM).

vLLM has no streaming weight interface polyrl can write into: its weights change only through
its reload path (``reload_weights(..., is_checkpoint_format=True)``, which re-runs the
checkpoint-to-kernel processing; see :mod:`polyrl.rollout.vllm_ext`). Two targets make every
transport (``shm``, ``dist``, ``disk``) work for such a backend; both check the tensors against
the serving checkpoint (unknown names and wrong shapes are refused as they arrive, missing ones
at commit, all named), apply the sender's in-flight policy, and switch with one backend call:

* :class:`SharedArenaTarget` (vLLM's default, ``weight_load="memory"``) receives into one
  shared-memory arena laid out from the checkpoint and hands it to the backend's
  ``load_weights(pairs, version)``, whose workers map the arena and read the tensors in place:
  no file, no copy between receive and vLLM's own reload. It offers the arena to same-host
  senders too (``direct``), which then write each tensor straight into it.
* :class:`SafetensorsDirTarget` (``weight_load="disk"``) stages a safetensors directory for
  the backend's ``update_weights(path, version)``:

* at ``begin`` it makes a fresh staging directory (default: under ``/dev/shm``, i.e. memory);
* each tensor gets its own safetensors file there, created at its full size and memory-mapped;
  :meth:`destination` hands the receiver the mapped data region, so every chunk is copied
  **once**, from the transport straight into the file, and the mapping is dropped as soon as
  the tensor is complete (:meth:`tensor_done`): this process never holds more than the tensors
  being filled, the directory holds the model once (like the native engine's shadows);
* at ``commit`` it checks the set against the serving checkpoint (unknown names and wrong
  shapes are refused as they arrive, missing ones at commit, all named) and calls
  ``update_weights(directory, version)`` once -- one reload, so the switch is atomic from vLLM's
  point of view -- then removes the directory;
* an aborted, superseded, stalled or failed transfer removes the directory and never calls the
  reload: the old weights keep serving.

Tied embeddings: the sender sends the embedding once (``named_tensors`` skips tied copies);
the worker extension yields it again as ``lm_head.weight`` for vLLM's separately packed head.
Staging is always atomic here: ``inplace`` is treated as ``staged``.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.core.arena import SharedArena, default_arena_root
from polyrl.core.dtypes import DTYPE_SIZES
from polyrl.core.shm import sweep_dead
from polyrl.models.loader import (
    checkpoint_dtypes,
    checkpoint_shapes,
    missing_weights,
    weight_mismatch,
)
from polyrl.weights.base import WeightTransferError, dtype_from_name, dtype_name
from polyrl.weights.receiver import WeightTarget

__all__ = [
    "STAGING_DIR_ENV",
    "SafetensorsDirTarget",
    "SharedArenaTarget",
    "default_staging_root",
]

#: Environment variable naming where staging directories are made (default ``/dev/shm``).
STAGING_DIR_ENV = "POLYRL_WEIGHTS_STAGING_DIR"

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_STAGE_PREFIX = "polyrl-stage-"
_ALIGN = 64  # bytes: every tensor of an arena starts on a cache line

#: ``run(coroutine)``: run a backend coroutine on the server's event loop from a worker thread.
RunCoroutine = Callable[[Coroutine[Any, Any, Any]], Any]


def default_staging_root() -> Path:
    """Return where staging directories go.

    ``$POLYRL_WEIGHTS_STAGING_DIR``, else ``/dev/shm``, else the temporary directory.
    """
    env = os.environ.get(STAGING_DIR_ENV)
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


class _Staged:
    """One tensor's file: its mapping (dropped once complete) and its size."""

    __slots__ = ("mapping", "nbytes", "tensor")

    def __init__(self, mapping: mmap.mmap | None, tensor: torch.Tensor, nbytes: int):
        self.mapping = mapping
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = nbytes


class _CheckpointTarget(WeightTarget):
    """What both targets share: the serving checkpoint's names, the in-flight policy."""

    def __init__(self, backend: Any, run: RunCoroutine):
        self.backend = backend
        self.run = run
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._transfer: str | None = None
        self._paused = False

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes the serving model takes (from the backend's checkpoint)."""
        if self._expected is None:
            self._expected = checkpoint_shapes(self.backend.model_dir)
        return self._expected

    def _refuse_misfit(self, name: str, shape: tuple[int, ...]) -> None:
        problem = weight_mismatch(self.expected(), name, shape)
        if problem is not None:
            raise WeightTransferError(problem)

    def _refuse_incomplete(self, transfer_id: str, names: Sequence[str]) -> None:
        missing = missing_weights(self.expected(), names)
        if missing:
            raise WeightTransferError(
                f"{len(missing)} tensor(s) missing from weight transfer {transfer_id}: "
                f"{missing[:8]}; the old weights keep serving"
            )

    def _apply_inflight(self, inflight: str) -> None:
        if inflight == "abort":
            self.run(self.backend.abort(None))
        elif inflight == "pause" and not self._paused:
            self.run(self.backend.pause())
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.run(self.backend.resume())

    def current_version(self) -> int:
        """Return the backend's version."""
        return int(self.backend.weight_version)


class SharedArenaTarget(_CheckpointTarget):
    """Receive a transfer into a shared-memory arena; load it with one ``load_weights`` call.

    The arena holds every checkpoint tensor once, at an offset fixed by the checkpoint's names
    and shapes, in the backend's serving dtype (``backend.serving_dtype()``; the checkpoint's
    for ``auto`` and for tensors that are not floating point; the receiver converts a
    different wire dtype while copying). It is made at the first ``begin`` and kept for the
    next transfers (like the native engine's shadows: the model's size in ``/dev/shm``). At
    ``commit`` the backend gets views of it, which its ``load_weights`` hands to vLLM's workers
    by the arena's file name, so they read them in place. A tensor outside the checkpoint that
    is still accepted (a tied ``lm_head.weight``) goes to a temporary instead.

    Args:
        backend: a rollout backend with ``async load_weights(pairs, version)``,
            ``weight_version``, ``async abort(ids)``, ``async pause()``/``resume()`` and
            ``model_dir`` (its checkpoint).
        run: runs one of the backend's coroutines on the server's event loop.
        arena_root: where the arena is made (default
            :func:`polyrl.core.arena.default_arena_root`).
    """

    def __init__(
        self,
        backend: Any,
        run: RunCoroutine,
        arena_root: str | os.PathLike[str] | None = None,
    ):
        super().__init__(backend, run)
        self.arena_root = Path(arena_root) if arena_root else None
        self._arena: SharedArena | None = None
        self._slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._extras: dict[str, torch.Tensor] = {}

    def _dtype_of(self, name: str, checkpoint: dict[str, str]) -> torch.dtype:
        stored = checkpoint.get(name, "float32")
        serving = getattr(self.backend, "serving_dtype", None)
        want = serving() if callable(serving) else "auto"
        if want == "auto" or not dtype_from_name(stored).is_floating_point:
            return dtype_from_name(stored)
        return dtype_from_name(want)

    def _ensure_arena(self) -> None:
        """Lay the checkpoint out in an arena (once)."""
        if self._arena is not None:
            return
        checkpoint = checkpoint_dtypes(self.backend.model_dir)
        slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        total = 0
        for name, shape in self.expected().items():
            dtype = self._dtype_of(name, checkpoint)
            numel = 1
            for d in shape:
                numel *= d
            slots[name] = (total, tuple(shape), dtype)
            total += -(-numel * DTYPE_SIZES.get(dtype_name(dtype), 8) // _ALIGN) * _ALIGN
        root = self.arena_root or default_arena_root()
        self._arena = SharedArena(total, root)
        self._slots = slots

    def begin(self, transfer_id: str, mode: str, inflight: str) -> None:
        """Make the arena (first time); apply the in-flight policy."""
        with self._lock:
            self._ensure_arena()
            self._extras = {}
            self._transfer = transfer_id
        self._apply_inflight(inflight)

    def destination(
        self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Return ``name``'s place in the arena (a temporary for an accepted extra)."""
        with self._lock:
            if transfer_id != self._transfer or self._arena is None:
                raise WeightTransferError(f"transfer {transfer_id} is not in progress")
            self._refuse_misfit(name, shape)
            slot = self._slots.get(name)
            if slot is not None:
                return self._arena.view(*slot)
            extra = self._extras.get(name)
            if extra is None:
                extra = self._extras[name] = torch.empty(shape, dtype=dtype)
            return extra

    def commit(self, transfer_id: str, names: Sequence[str], version: int) -> int:
        """Check the set, hand it to the backend's ``load_weights`` in one call."""
        with self._lock:
            if transfer_id != self._transfer or self._arena is None:
                raise WeightTransferError(f"transfer {transfer_id} is not in progress")
            arena, slots, extras = self._arena, self._slots, self._extras
        try:
            self._refuse_incomplete(transfer_id, names)
            pairs = [
                (n, arena.view(*slots[n]) if n in slots else extras[n])
                for n in dict.fromkeys(names)
            ]
            new = self.run(self.backend.load_weights(pairs, None if version < 0 else version))
        finally:
            with self._lock:
                if self._transfer == transfer_id:
                    self._transfer = None
                    self._extras = {}
            self._resume()
        return int(new)

    def abort(self, transfer_id: str, reason: str) -> None:
        """Forget the transfer; the backend is never called (the arena is kept for the next)."""
        with self._lock:
            if transfer_id != self._transfer:
                return
            self._transfer = None
            self._extras = {}
        self._resume()

    def held_bytes(self) -> int:
        """Bytes of the arena (kept across transfers) and of temporaries."""
        with self._lock:
            arena = 0 if self._arena is None else self._arena.nbytes
            return arena + sum(t.numel() * t.element_size() for t in self._extras.values())

    def shared_layout(self, transfer_id: str) -> dict[str, Any] | None:
        """Offer the arena to a same-host sender: ``{"path", "size", "tensors"}``."""
        with self._lock:
            if transfer_id != self._transfer or self._arena is None:
                return None
            return {
                "path": str(self._arena.path),
                "size": self._arena.nbytes,
                "tensors": {
                    name: [offset, list(shape), dtype_name(dtype)]
                    for name, (offset, shape, dtype) in self._slots.items()
                },
            }

    def close(self) -> None:
        """Remove the arena's file (its memory goes with the last view)."""
        with self._lock:
            if self._arena is not None:
                self._arena.unlink()
            self._arena = None


class SafetensorsDirTarget(_CheckpointTarget):
    """Stage a transfer as a safetensors directory, then reload it with one backend call.

    Args:
        backend: a rollout backend with ``async update_weights(path, version)``,
            ``weight_version``, ``async abort(ids)``, ``async pause()``/``resume()`` and
            ``model_dir`` (its checkpoint: the expected names and shapes).
        run: runs one of the backend's coroutines on the server's event loop and returns its
            result (the receiver calls targets from worker threads).
        staging_root: where staging directories are made (default
            :func:`default_staging_root`).
    """

    def __init__(
        self,
        backend: Any,
        run: RunCoroutine,
        staging_root: str | os.PathLike[str] | None = None,
    ):
        super().__init__(backend, run)
        self.staging_root = Path(staging_root) if staging_root else default_staging_root()
        self._dir: Path | None = None
        self._files: dict[str, _Staged] = {}
        self.directory_of_last_commit: str | None = None

    # ----------------------------------------------------------------------------- helpers

    def _cleanup(self) -> None:
        """Drop the mappings and the staging directory (the transfer is over)."""
        self._files = {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._transfer = None

    # ---------------------------------------------------------------------------- protocol

    def begin(self, transfer_id: str, mode: str, inflight: str) -> None:
        """Make a fresh staging directory; apply the in-flight policy."""
        with self._lock:
            if self._transfer is not None:
                self._cleanup()
            self.expected()  # fail now, not at the first bucket, if the checkpoint is unreadable
            self.staging_root.mkdir(parents=True, exist_ok=True)
            sweep_dead(self.staging_root, _STAGE_PREFIX)  # dirs of servers that died mid-transfer
            prefix = f"{_STAGE_PREFIX}{os.getpid()}-{transfer_id[:12]}-"
            self._dir = Path(tempfile.mkdtemp(prefix=prefix, dir=self.staging_root))
            self._transfer = transfer_id
        self._apply_inflight(inflight)

    def destination(
        self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Create ``name``'s safetensors file at full size; return its mapped data region."""
        with self._lock:
            if transfer_id != self._transfer or self._dir is None:
                raise WeightTransferError(f"transfer {transfer_id} is not in progress")
            if name in self._files:
                staged = self._files[name]
                if staged.tensor is None:
                    raise WeightTransferError(f"tensor {name!r} arrived twice in one transfer")
                return staged.tensor
            self._refuse_misfit(name, shape)
            code = _ST_DTYPES.get(dtype)
            if code is None:
                raise WeightTransferError(
                    f"tensor {name!r}: dtype {dtype} cannot be staged as safetensors; expected "
                    f"one of {[str(d) for d in _ST_DTYPES]}"
                )
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            header = json.dumps(
                {name: {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}}
            ).encode()
            header += b" " * (-len(header) % 8)  # data then starts 8-byte aligned
            start = 8 + len(header)
            path = self._dir / f"{len(self._files):06d}.safetensors"
            with open(path, "w+b") as f:
                f.write(struct.pack("<Q", len(header)) + header)
                f.truncate(start + nbytes)
                mapping = mmap.mmap(f.fileno(), start + nbytes) if nbytes else None
            if mapping is None:
                tensor = torch.empty(shape, dtype=dtype)
            else:
                flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
                tensor = flat.view(dtype).view(shape)
            self._files[name] = _Staged(mapping, tensor, nbytes)
            return tensor

    def tensor_done(self, transfer_id: str, name: str) -> None:
        """Drop the mapping of a complete tensor (its bytes stay in the file)."""
        with self._lock:
            staged = self._files.get(name)
            if staged is not None and transfer_id == self._transfer:
                staged.tensor = None
                staged.mapping = None  # unmapped once the receiver drops its view too

    def commit(self, transfer_id: str, names: Sequence[str], version: int) -> int:
        """Check the set, reload it with one ``update_weights`` call, remove the directory."""
        with self._lock:
            if transfer_id != self._transfer or self._dir is None:
                raise WeightTransferError(f"transfer {transfer_id} is not in progress")
            directory = self._dir
        try:
            self._refuse_incomplete(transfer_id, names)
            with self._lock:
                self._files = {}  # every mapping dropped before vLLM reads the files
            self.directory_of_last_commit = str(directory)
            new = self.run(
                self.backend.update_weights(str(directory), None if version < 0 else version)
            )
        finally:
            with self._lock:
                if self._transfer == transfer_id:
                    self._cleanup()
            self._resume()
        return int(new)

    def abort(self, transfer_id: str, reason: str) -> None:
        """Remove the staging directory; the reload is never called."""
        with self._lock:
            if transfer_id != self._transfer:
                return
            self._cleanup()
        self._resume()

    def held_bytes(self) -> int:
        """Bytes staged in the directory for the transfer in progress."""
        with self._lock:
            return sum(s.nbytes for s in self._files.values())
