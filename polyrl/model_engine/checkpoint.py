"""Checkpoint directory layout, atomic publication and discovery.

A checkpoint root holds one directory per saved step::

    <root>/global_step_<N>/        # complete checkpoints only (published by one rename)
        COMPLETE                   # JSON marker written last, before the rename
        ...                        # backend files
    <root>/latest                  # text: name of the newest complete step directory
    <root>/.tmp-global_step_<N>-*  # in-progress writes; never read, removed by later saves

Writers fill a hidden temporary directory and publish it with :func:`os.replace`, so a crash at
any moment leaves either no step directory or a complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from typing import Any

__all__ = [
    "COMPLETE_MARKER",
    "CorruptCheckpointError",
    "atomic_write_text",
    "find_latest_checkpoint",
    "is_complete_checkpoint",
    "list_checkpoints",
    "load_checkpoint_file",
    "new_tmp_dir",
    "prune_checkpoints",
    "publish_dir",
    "remove_stale_tmp_dirs",
    "resolve_checkpoint",
    "step_dir_name",
]

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp-"


class CorruptCheckpointError(ValueError):
    """A file of a published checkpoint cannot be read back: it is truncated or damaged."""


def load_checkpoint_file(checkpoint: str, name: str, what: str) -> Any:
    """``torch.load`` one file of a checkpoint on the CPU, naming it if it cannot be read.

    Args:
        checkpoint: the checkpoint directory.
        name: the file's path inside it (``"rng/rank_0.pt"``).
        what: what the file holds, for the message (``"the RNG state"``).

    Raises:
        CorruptCheckpointError: the file is truncated, damaged or not a torch file.
    """
    import pickle

    import torch

    path = os.path.join(checkpoint, name)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint!r} is corrupt: its file {name!r} ({what}) cannot be read "
            f"({type(exc).__name__}: {exc}); resume from another checkpoint or start afresh"
        ) from exc


def step_dir_name(step: int) -> str:
    """``global_step_<step>``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    return f"global_step_{step}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(folder)


def new_tmp_dir(root: str, name: str, token: str) -> str:
    """Path of the hidden temporary directory used while writing ``<root>/<name>``."""
    return os.path.join(root, f"{_TMP_PREFIX}{name}-{token}")


def write_complete_marker(directory: str, info: dict[str, Any]) -> None:
    """Mark ``directory`` as fully written (the last file of a checkpoint)."""
    record = {"time": time.time(), **info}
    atomic_write_text(os.path.join(directory, COMPLETE_MARKER), json.dumps(record, indent=1))


def publish_dir(tmp: str, final: str) -> None:
    """Move a fully written ``tmp`` directory to ``final`` in one rename.

    An existing ``final`` is first renamed aside and deleted afterwards (``rename`` cannot
    replace a non-empty directory).
    """
    _fsync_dir(tmp)
    trash = None
    if os.path.exists(final):
        trash = f"{tmp}.old"
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a published step directory with its completion marker."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete step checkpoints under ``root`` as ``(step, path)``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and is_complete_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(root: str) -> str | None:
    """Newest complete step directory under ``root`` (``None`` if there is none).

    Trusts the ``latest`` pointer when it names a complete checkpoint, else scans.
    """
    pointer = os.path.join(root, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        candidate = os.path.join(root, name)
        if _STEP_RE.match(name) and is_complete_checkpoint(candidate):
            scanned = list_checkpoints(root)
            # A newer complete directory may exist if a crash hit between publish and pointer.
            if not scanned or scanned[-1][1] == candidate:
                return candidate
            return scanned[-1][1]
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """Return the complete step directory named by a step directory or a checkpoint root."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path {path!r} does not exist")
    if is_complete_checkpoint(path):
        return path
    if _STEP_RE.match(os.path.basename(os.path.normpath(path))):
        raise FileNotFoundError(
            f"{path!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker)"
        )
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint (global_step_<N>) under {path!r}")
    return latest


def remove_stale_tmp_dirs(root: str, keep: str | None = None) -> None:
    """Delete leftovers of interrupted saves (hidden ``.tmp-*`` directories)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(_TMP_PREFIX) and path != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def prune_checkpoints(root: str, max_to_keep: int) -> None:
    """Keep only the newest ``max_to_keep`` complete checkpoints (0 keeps all)."""
    if max_to_keep <= 0:
        return
    found = list_checkpoints(root)
    for _, path in found[:-max_to_keep]:
        # Rename first: a crash mid-delete must not leave a marked-complete partial directory.
        doomed = new_tmp_dir(root, os.path.basename(path), "deleting-" + uuid.uuid4().hex[:8])
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
