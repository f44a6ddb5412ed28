"""How processes on one machine share its CPU cores."""

from __future__ import annotations

import os

__all__ = ["cores_per_process"]


def cores_per_process(processes: int) -> int:
    """Return this process's usable cores divided among ``processes`` peers (at least 1).

    Usable cores are the CPU affinity set where the OS has one (a container or ``taskset`` may
    allow fewer than ``os.cpu_count()``).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity sets on this OS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes))
