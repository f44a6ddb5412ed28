"""Shared-memory housekeeping used by the services that put data in ``/dev/shm``.

Files under ``/dev/shm`` are RAM: what a killed process left there stays until someone removes
it. Every service names its files ``<prefix><pid>-<random>`` so that :func:`sweep_dead` can
remove those of processes that are gone.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["shm_root", "sweep_dead"]


def shm_root(env_var: str) -> Path | None:
    """Where shared files go: ``$env_var`` when set, else ``/dev/shm``; None if not writable."""
    env = os.environ.get(env_var)
    root = Path(env) if env else Path("/dev/shm")
    if root.is_dir() and os.access(root, os.W_OK | os.X_OK):
        return root
    return None


def sweep_dead(root: Path, prefix: str) -> int:
    """Remove ``<root>/<prefix><pid>-...`` files or directories whose process ``pid`` is gone.

    Returns how many entries were removed.
    """
    removed = 0
    for path in root.glob(prefix + "*"):
        try:
            pid = int(path.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:  # alive, another user's
            pass
    return removed
