"""A :class:`WeightTarget` for backends that reload weights from a safetensors directory (vLLM).

vLLM has no streaming weight interface polyrl can write into: its weights change only through
its reload path (``reload_weights(..., is_checkpoint_format=True)``, which re-runs the
checkpoint-to-kernel processing; see :mod:`polyrl.rollout.vllm_ext`), reached by the backend's
``update_weights(path, version)``. :class:`SafetensorsDirTarget` makes every transport (``shm``,
``dist``, ``disk``) work for such a backend:

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

from polyrl.core.shm import sweep_dead
from polyrl.models.loader import checkpoint_shapes
from polyrl.weights.base import WeightTransferError
from polyrl.weights.receiver import WeightTarget

__all__ = ["STAGING_DIR_ENV", "SafetensorsDirTarget", "default_staging_root"]

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
_LM_HEAD = "lm_head.weight"
_STAGE_PREFIX = "polyrl-stage-"

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


class SafetensorsDirTarget(WeightTarget):
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
        self.backend = backend
        self.run = run
        self.staging_root = Path(staging_root) if staging_root else default_staging_root()
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._transfer: str | None = None
        self._dir: Path | None = None
        self._files: dict[str, _Staged] = {}
        self._paused = False
        self.directory_of_last_commit: str | None = None

    # ----------------------------------------------------------------------------- helpers

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes the serving model takes (from the backend's checkpoint)."""
        if self._expected is None:
            self._expected = checkpoint_shapes(self.backend.model_dir)
        return self._expected

    def _allowed_extra(self, name: str) -> bool:
        # A sender may include the tied output head that HF checkpoints leave out.
        return name == _LM_HEAD and any(n.endswith("embed_tokens.weight") for n in self.expected())

    def _cleanup(self) -> None:
        """Drop the mappings and the staging directory (the transfer is over)."""
        self._files = {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._transfer = None

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.run(self.backend.resume())

    # ---------------------------------------------------------------------------- protocol

    def current_version(self) -> int:
        """Return the backend's version."""
        return int(self.backend.weight_version)

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
        if inflight == "abort":
            self.run(self.backend.abort(None))
        elif inflight == "pause" and not self._paused:
            self.run(self.backend.pause())
            self._paused = True

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
            want = self.expected().get(name)
            if want is None and not self._allowed_extra(name):
                raise WeightTransferError(
                    f"unknown tensor {name!r}: the serving model has no such weight "
                    f"(expected names like {sorted(self.expected())[:3]})"
                )
            if want is not None and tuple(want) != tuple(shape):
                raise WeightTransferError(
                    f"tensor {name!r} has shape {list(shape)}, the serving model expects "
                    f"{list(want)}"
                )
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
            missing = sorted(set(self.expected()) - set(names))
        try:
            if missing:
                raise WeightTransferError(
                    f"{len(missing)} tensor(s) missing from weight transfer {transfer_id}: "
                    f"{missing[:8]}; the old weights keep serving"
                )
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
