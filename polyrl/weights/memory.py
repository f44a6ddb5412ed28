"""Process memory probes for weight transfers (Linux ``/proc``): RSS now, peak, peak reset.

``tracemalloc`` does not see torch allocations, so transfers measure their memory as the
process's resident set: ``reset_peak_rss`` (writing ``5`` to ``/proc/self/clear_refs``) sets the
high-water mark ``VmHWM`` back to the current RSS; after the transfer ``VmHWM - rss_before`` is
the peak extra memory it caused (shared-memory pages it touched included).
"""

from __future__ import annotations

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes"]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``None`` off Linux)."""
    return _status_kb("VmRSS")


def peak_rss_bytes() -> int | None:
    """Peak resident set size (``VmHWM``) since start or the last :func:`reset_peak_rss`."""
    return _status_kb("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
