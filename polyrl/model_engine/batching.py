"""Micro-batch planning and padding removal for the model engine.

Three pieces:

* **Balancing across data-parallel ranks** (:func:`balance_rows_across_ranks`,
  :func:`balance_batch_for_dp`): reorder a mini-batch so that splitting it into ``dp_size`` equal
  row chunks gives every rank about the same number of tokens.
* **Micro-batch plans** (:func:`plan_micro_batches`): which rows go into which micro-batch, either
  fixed ``micro_batch_size`` rows or groups under a token budget.  Every rank must run the same
  number of micro-batches (each forward/backward of a sharded model is a collective), so plans are
  built for an exact count ``k`` agreed by all ranks beforehand (:func:`min_micro_batches`).
* **Layouts** (:class:`MicroBatchLayout`): gather a micro-batch's real tokens into a compact
  "compute" tensor (rows trimmed to the longest sequence, or all sequences packed into one row)
  and scatter per-token results back to the batch's own ``(rows, T)`` layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyrl.core.balance import balance_rows_across_ranks

__all__ = [
    "MicroBatchLayout",
    "balance_batch_for_dp",
    "balance_rows_across_ranks",
    "group_token_costs",
    "min_micro_batches",
    "plan_micro_batches",
    "plan_rank_micro_batches",
    "row_spans",
]


def row_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start index and length of each row's single run of real tokens.

    Raises ``ValueError`` if a row's ``attention_mask`` ones are not contiguous (padding may sit on
    the left, the right or both sides, but not in between) or if a row has no real token.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be (B, T), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    if mask.shape[0] == 0:
        return lengths.new_zeros(0), lengths
    if bool((lengths == 0).any()):
        row = int(torch.nonzero(lengths == 0)[0, 0])
        raise ValueError(f"row {row} of attention_mask has no real token (all padding)")
    t = mask.shape[1]
    starts = torch.argmax(mask.int(), dim=1)
    last = t - 1 - torch.argmax(mask.flip(1).int(), dim=1)
    holes = (last - starts + 1) != lengths
    if bool(holes.any()):
        row = int(torch.nonzero(holes)[0, 0])
        raise ValueError(
            f"row {row} of attention_mask has padding between real tokens; each row must hold "
            "one contiguous run of ones"
        )
    return starts, lengths


def balance_batch_for_dp(batch, dp_size: int):  # noqa: ANN001, ANN201 - Batch is imported lazily
    """Reorder ``batch`` so ``batch.chunk(dp_size)`` gives ranks balanced token counts.

    Token counts come from ``attention_mask``.  Returns ``(reordered_batch, permutation)`` where
    ``reordered[i] = batch[permutation[i]]``.
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    groups = balance_rows_across_ranks(lengths, dp_size)
    perm = [i for g in groups for i in g]
    return batch.reorder(perm), perm


def _group_cost(lengths: Sequence[int], rows: Sequence[int], packed: bool) -> int:
    if not rows:
        return 0
    if packed:
        return sum(int(lengths[i]) for i in rows)
    return len(rows) * max(int(lengths[i]) for i in rows)


def _greedy_groups(lengths: Sequence[int], budget: int, packed: bool) -> list[list[int]]:
    """Fewest groups under ``budget`` found greedily (longest rows first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    if packed:
        # First-fit decreasing bin packing.
        bins: list[list[int]] = []
        loads: list[int] = []
        for i in order:
            length = int(lengths[i])
            for b, load in enumerate(loads):
                if load + length <= budget:
                    bins[b].append(i)
                    loads[b] += length
                    break
            else:
                bins.append([i])
                loads.append(length)
        return bins
    # Trimmed rows: a group costs rows * longest; in descending order the first row is the longest,
    # so filling consecutive runs is optimal for this cost.
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * int(lengths[groups[-1][0]]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def group_token_costs(lengths: Sequence[int], group_size: int, packed: bool) -> list[int]:
    """Tokens each group of ``group_size`` consecutive rows costs in one micro-batch.

    Packed: the group's token sum; trimmed rows: ``group_size`` times its longest row (every row
    of a micro-batch is trimmed to the same width).  Raises ``ValueError`` when the rows do not
    split into whole groups.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if len(lengths) % group_size:
        raise ValueError(
            f"{len(lengths)} rows do not split into groups of {group_size} consecutive rows"
        )
    groups = [lengths[i : i + group_size] for i in range(0, len(lengths), group_size)]
    if packed:
        return [sum(int(x) for x in g) for g in groups]
    return [group_size * max(int(x) for x in g) for g in groups]


def _units(
    lengths: Sequence[int],
    group_size: int,
    dynamic: bool,
    micro_batch_size: int,
    max_tokens: int,
    packed: bool,
) -> tuple[list[int], int, int]:
    """Lengths, micro_batch_size and max_tokens of a plan over whole row groups."""
    costs = group_token_costs(lengths, group_size, packed)
    if dynamic and costs and max(costs) > max_tokens:
        raise ValueError(
            f"a group of {group_size} rows that must share a micro-batch needs {max(costs)} "
            f"tokens, more than max_tokens_per_micro_batch={max_tokens}; raise the budget"
        )
    if packed:
        return costs, micro_batch_size, max_tokens
    # A trimmed group stands for group_size rows of its longest length: units * longest must
    # stay within max_tokens / group_size.
    units = [c // group_size for c in costs]
    return units, max(1, micro_batch_size // group_size), max_tokens // group_size


def _expand(plan: list[list[int]], group_size: int) -> list[list[int]]:
    return [
        [u * group_size + j for u in sorted(units) for j in range(group_size)] for units in plan
    ]


def min_micro_batches(
    lengths: Sequence[int],
    *,
    dynamic: bool,
    micro_batch_size: int = 1,
    max_tokens: int = 0,
    packed: bool = False,
    group_size: int = 1,
) -> int:
    """Smallest number of micro-batches this rank needs for its rows (0 for no rows).

    ``group_size > 1``: each run of ``group_size`` consecutive rows (a DPO pair, ...) must sit
    in one micro-batch.
    """
    if group_size != 1:
        units, mbs, budget = _units(
            lengths, group_size, dynamic, micro_batch_size, max_tokens, packed
        )
        return min_micro_batches(
            units, dynamic=dynamic, micro_batch_size=mbs, max_tokens=budget, packed=packed
        )
    n = len(lengths)
    if n == 0:
        return 0
    if not dynamic:
        return -(-n // micro_batch_size)
    longest = max(int(x) for x in lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds max_tokens_per_micro_batch={max_tokens}; "
            "raise the budget to at least the longest sequence"
        )
    return len(_greedy_groups(lengths, max_tokens, packed))


def plan_micro_batches(
    lengths: Sequence[int],
    k: int,
    *,
    dynamic: bool,
    micro_batch_size: int = 1,
    max_tokens: int = 0,
    packed: bool = False,
    group_size: int = 1,
) -> list[list[int]]:
    """Exactly ``k`` micro-batches (lists of row indices) covering every row once.

    ``k`` must be at least :func:`min_micro_batches` for these rows.  When there are fewer rows
    than ``k`` the trailing micro-batches are empty lists (the engine runs a zero-weight dummy
    forward/backward for them so collectives stay matched across ranks).

    Fixed mode keeps the row order and cuts ``micro_batch_size`` rows at a time.  Dynamic mode
    starts from greedy groups under ``max_tokens`` and splits the costliest group in two until
    there are ``k`` groups; splitting never raises a group's cost, so the budget still holds.

    ``group_size > 1`` plans whole groups of ``group_size`` consecutive rows (the rows of a
    preference pair, whose loss reads both) and keeps each group's rows adjacent and in order.
    """
    if group_size != 1:
        units, mbs, budget = _units(
            lengths, group_size, dynamic, micro_batch_size, max_tokens, packed
        )
        plan = plan_micro_batches(
            units, k, dynamic=dynamic, micro_batch_size=mbs, max_tokens=budget, packed=packed
        )
        return _expand(plan, group_size)
    n = len(lengths)
    need = min_micro_batches(
        lengths,
        dynamic=dynamic,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        packed=packed,
    )
    if k < need:
        raise ValueError(f"{n} rows need at least {need} micro-batches, asked for {k}")
    if not dynamic:
        groups = [
            list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)
        ]
        # Spread rows over extra micro-batches rather than leaving ranks idle.
        while len(groups) < k and any(len(g) > 1 for g in groups):
            big = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
            g = groups.pop(big)
            half = (len(g) + 1) // 2
            groups[big:big] = [g[:half], g[half:]]
    else:
        groups = _greedy_groups(lengths, max_tokens, packed) if n else []
        while len(groups) < k and any(len(g) > 1 for g in groups):
            big = max(
                (j for j in range(len(groups)) if len(groups[j]) > 1),
                key=lambda j: (_group_cost(lengths, groups[j], packed), -j),
            )
            g = groups.pop(big)
            if packed:
                # Alternate rows (already longest-first) so the halves carry similar token sums.
                halves = [g[0::2], g[1::2]]
            else:
                half = (len(g) + 1) // 2
                halves = [g[:half], g[half:]]
            groups[big:big] = halves
    groups += [[] for _ in range(k - len(groups))]
    return groups


def plan_rank_micro_batches(
    lengths: Sequence[int],
    world_size: int,
    *,
    dynamic: bool,
    micro_batch_size: int = 1,
    max_tokens: int = 0,
    packed: bool = False,
    group_size: int = 1,
) -> list[list[int]]:
    """Plan this rank's micro-batches; every rank gets the same count (collective).

    The ranks agree on the count, the largest :func:`min_micro_batches` (and on any row or group
    over the token budget, so all raise together) before anyone starts a collective forward.
    ``group_size``: runs of that many consecutive rows stay in one micro-batch.
    """
    kwargs = {
        "dynamic": dynamic,
        "micro_batch_size": micro_batch_size,
        "max_tokens": max_tokens,
        "packed": packed,
        "group_size": group_size,
    }
    # What must fit the budget at once: a row, or a whole group of rows.
    costs = lengths if group_size == 1 else group_token_costs(lengths, group_size, packed)
    longest = max(costs, default=0)
    over = dynamic and longest > max_tokens
    k_local = 0 if over else min_micro_batches(lengths, **kwargs)
    stats = torch.tensor([k_local, longest], dtype=torch.int64)
    if world_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    k, global_longest = (int(x) for x in stats.tolist())
    if dynamic and global_longest > max_tokens:
        what = "a sequence" if group_size == 1 else f"a group of {group_size} rows"
        raise ValueError(
            f"{what} of {global_longest} tokens exceeds "
            f"max_tokens_per_micro_batch={max_tokens}; raise the budget to at least the longest "
            "sequence" + ("" if group_size == 1 else " group (the rows that share a loss)")
        )
    return plan_micro_batches(lengths, max(k, 1), **kwargs)


@dataclass
class MicroBatchLayout:
    """Index maps between a micro-batch's ``(b, T)`` layout and its compact compute layout.

    Attributes:
        mode: ``"identity"`` (compute on the padded rows as given), ``"trim"`` (each row
            left-aligned and trimmed to the longest row) or ``"pack"`` (all rows concatenated
            into a single row).
        batch_shape: ``(b, T)`` of the micro-batch's own columns.
        compute_shape: ``(R, W)`` of the compute tensors.
        src: flat indices into ``b * T`` of every real token.
        dst: flat indices into ``R * W`` where each of those tokens sits in the compute layout.
        starts: per-row index of the first real token in the ``(b, T)`` layout.
        lengths: per-row number of real tokens.
    """

    mode: str
    batch_shape: tuple[int, int]
    compute_shape: tuple[int, int]
    src: torch.Tensor
    dst: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def build(cls, attention_mask: torch.Tensor, mode: str) -> MicroBatchLayout:
        """Layout for a micro-batch whose padding is described by ``attention_mask`` ``(b, T)``."""
        if mode not in ("identity", "trim", "pack"):
            raise ValueError(f"layout mode must be 'identity', 'trim' or 'pack', got {mode!r}")
        starts, lengths = row_spans(attention_mask)
        b, t = attention_mask.shape
        device = attention_mask.device
        # Rank of each real token inside its row (0 .. length-1), row by row.
        row_of_tok = torch.repeat_interleave(torch.arange(b, device=device), lengths)
        offsets = torch.cumsum(lengths, 0) - lengths
        rank_in_row = torch.arange(row_of_tok.numel(), device=device) - offsets[row_of_tok]
        src = row_of_tok * t + starts[row_of_tok] + rank_in_row
        if mode == "identity":
            shape = (b, t)
            dst = src
        elif mode == "trim":
            width = int(lengths.max()) if b else 0
            shape = (b, width)
            dst = row_of_tok * width + rank_in_row
        else:
            shape = (1, int(lengths.sum()))
            dst = torch.arange(row_of_tok.numel(), device=device)
        return cls(mode, (b, t), shape, src, dst, starts, lengths)

    def to_compute(self, column: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """Gather a per-token ``(b, T)`` column into the compute layout (``fill`` elsewhere)."""
        if tuple(column.shape[:2]) != self.batch_shape:
            raise ValueError(
                f"column shape {tuple(column.shape)} does not match the micro-batch "
                f"{self.batch_shape}"
            )
        if self.mode == "identity":
            return column
        flat = column.reshape(self.batch_shape[0] * self.batch_shape[1], *column.shape[2:])
        out = flat.new_full(
            (self.compute_shape[0] * self.compute_shape[1], *column.shape[2:]), fill
        )
        out[self.dst] = flat[self.src]
        return out.view(*self.compute_shape, *column.shape[2:])

    def compute_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """Attention mask for the compute layout (``None`` when packed: position ids separate)."""
        if self.mode == "identity":
            return attention_mask
        if self.mode == "pack":
            return None
        out = torch.zeros(
            self.compute_shape[0] * self.compute_shape[1],
            dtype=attention_mask.dtype,
            device=attention_mask.device,
        )
        out[self.dst] = 1
        return out.view(self.compute_shape)

    def to_batch(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter a per-token compute-layout tensor ``(R, W, ...)`` back to ``(b, T, ...)``.

        Padding positions are 0.  Differentiable with respect to ``values``.
        """
        if tuple(values.shape[:2]) != self.compute_shape:
            raise ValueError(
                f"values shape {tuple(values.shape)} does not match the compute layout "
                f"{self.compute_shape}"
            )
        rest = values.shape[2:]
        n = self.compute_shape[0] * self.compute_shape[1]
        if self.mode == "identity":
            flat = values.reshape(n, *rest)
            keep = torch.zeros(n, dtype=torch.bool, device=values.device)
            keep[self.src] = True
            keep = keep.view(n, *([1] * len(rest)))
            out = torch.where(keep, flat, torch.zeros((), dtype=values.dtype, device=values.device))
            return out.view(*self.batch_shape, *rest)
        flat = values.reshape(n, *rest)
        out = flat.new_zeros(self.batch_shape[0] * self.batch_shape[1], *rest)
        out = out.index_copy(0, self.src, flat.index_select(0, self.dst))
        return out.view(*self.batch_shape, *rest)

    def first_token_mask(self) -> torch.Tensor:
        """``(b, T)`` bool mask of each row's first real token (it has no causal prediction)."""
        b, t = self.batch_shape
        mask = torch.zeros(b, t, dtype=torch.bool, device=self.starts.device)
        if b:
            mask[torch.arange(b, device=self.starts.device), self.starts] = True
        return mask

    def check_packable(self, compute_position_ids: torch.Tensor) -> None:
        """Ensure packed sequences stay separable by their position ids.

        Attention implementations find packed-sequence boundaries where a position id does not
        follow the previous one by +1.  So inside a sequence ids must count up by 1, and a
        sequence must not continue its predecessor's count.
        """
        if self.mode != "pack":
            return
        pos = compute_position_ids.reshape(-1)
        if pos.numel() < 2:
            return
        step_one = (pos[1:] - pos[:-1]) == 1
        boundary = torch.zeros_like(step_one)
        ends = torch.cumsum(self.lengths, 0)[:-1] - 1
        boundary[ends] = True
        if bool((step_one == boundary).any()):
            raise ValueError(
                "cannot pack these sequences: packing needs position_ids that count up by 1 "
                "within each sequence and restart (e.g. at 0) for the next one; fix position_ids "
                "or turn off pack_sequences"
            )
