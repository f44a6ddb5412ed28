"""Splitting rows over data-parallel ranks with balanced token counts."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balance_rows_across_ranks"]


def balance_rows_across_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split row indices into ``dp_size`` groups of equal size with balanced token sums.

    Greedy longest-first: each row goes to the lightest group that still has room.  Requires
    ``len(lengths) % dp_size == 0`` (ranks must see the same number of rows).  Each group's rows
    come back in ascending order.
    """
    n = len(lengths)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if n % dp_size:
        raise ValueError(
            f"cannot split {n} rows evenly over {dp_size} data-parallel ranks; pad the batch "
            "to a multiple of the dp size (Batch.pad_to_multiple)"
        )
    cap = n // dp_size
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, g) for g in range(dp_size)]
    groups: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < cap:
            heapq.heappush(heap, (load + int(lengths[i]), g))
    return [sorted(g) for g in groups]
