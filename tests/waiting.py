"""Wait for a state instead of sleeping: a sleep flakes under load, or passes by luck."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    check: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.01
) -> T:
    """Poll ``check`` until it returns something true, and return that; fail after ``timeout``.

    ``what`` names the awaited state in the failure message.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(interval)
