"""Pluggable samplers: which ready samples a consumer gets, in which order.

A sampler sees the samples that are ready for a consumer (all requested fields produced, not
yet given to that consumer), in ascending id order, and returns the ids to hand out or None if it
cannot serve the request yet. Register new ones with :func:`register_sampler`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polyrl.core.registry import Registry
from polyrl.transfer.base import SampleInfo, Sampler

__all__ = [
    "GroupSampler",
    "LengthBalancedSampler",
    "SAMPLERS",
    "SequentialSampler",
    "get_sampler",
    "register_sampler",
    "registered_samplers",
]

#: Sampler factories by name, called with the sampler's keyword arguments.
SAMPLERS: Registry[Callable[..., Sampler]] = Registry("sampler")
register_sampler = SAMPLERS.register
registered_samplers = SAMPLERS.names


def get_sampler(name: str | Sampler, **kwargs: Any) -> Sampler:
    """Build the sampler registered as ``name`` with ``kwargs`` (a Sampler is returned as is)."""
    if not isinstance(name, str):
        if kwargs:
            raise ValueError(
                f"sampler arguments {sorted(kwargs)} are only accepted with a sampler name, "
                "not with a sampler object"
            )
        if not callable(getattr(name, "select", None)):
            raise TypeError(
                f"sampler must be a registered name or an object with a select() method, got "
                f"{type(name).__name__}"
            )
        return name
    factory = SAMPLERS.get(name)
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise TypeError(f"sampler {name!r}: bad arguments {sorted(kwargs)}: {exc}") from None


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


@register_sampler("sequential")
class SequentialSampler:
    """Lowest sample ids first."""

    def select(self, ready: Sequence[SampleInfo], batch_size: int | None) -> list[int] | None:
        """Return the ``batch_size`` lowest ready ids (all of them for None)."""
        if batch_size is None:
            return [s.sample_id for s in ready]
        if len(ready) < batch_size:
            return None
        return [s.sample_id for s in ready[:batch_size]]


def _complete_groups(ready: Sequence[SampleInfo], group_size: int) -> list[list[int]]:
    """Whole groups among ``ready`` (each with ``group_size`` members), by lowest member id."""
    members: dict[str, list[int]] = {}
    for s in ready:
        if s.group is None:
            raise ValueError(
                f"the group sampler needs a group id for every sample; sample {s.sample_id} has "
                "none (put a group column, 'uid' by default, with the samples)"
            )
        members.setdefault(s.group, []).append(s.sample_id)
    groups = []
    for gid, ids in members.items():
        if len(ids) > group_size:
            raise ValueError(
                f"group {gid!r} has {len(ids)} ready samples {ids[:8]}, more than "
                f"group_size={group_size}; check the group ids and group_size"
            )
        if len(ids) == group_size:
            groups.append(ids)  # ids come in ascending order because ``ready`` does
    groups.sort(key=lambda ids: ids[0])
    return groups


@register_sampler("group")
class GroupSampler:
    """Whole groups only (all ``group_size`` members ready), ordered by their lowest id.

    Never splits a group: ``batch_size`` must be a multiple of ``group_size``.
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = _positive(group_size, "group sampler: group_size")

    def select(self, ready: Sequence[SampleInfo], batch_size: int | None) -> list[int] | None:
        """Return whole groups totalling ``batch_size`` samples (all complete ones for None)."""
        if batch_size is not None and batch_size % self.group_size:
            raise ValueError(
                f"group sampler: batch_size={batch_size} is not a multiple of "
                f"group_size={self.group_size}; a batch must hold whole groups"
            )
        groups = _complete_groups(ready, self.group_size)
        if batch_size is not None:
            need = batch_size // self.group_size
            if len(groups) < need:
                return None
            groups = groups[:need]
        return [i for ids in groups for i in ids]


@register_sampler("length_balanced")
class LengthBalancedSampler:
    """Picks like ``sequential`` (or ``group`` with ``group_size``), then balances tokens per rank.

    The chosen samples are reordered so that ``meta.chunk(dp_size)`` gives every rank the same
    number of samples and about the same number of tokens (greedy longest-first). The number of
    samples served is a multiple of ``dp_size``.
    """

    def __init__(self, dp_size: int, group_size: int | None = None) -> None:
        self.dp_size = _positive(dp_size, "length_balanced sampler: dp_size")
        self.group_size = (
            None if group_size is None else _positive(group_size, "length_balanced: group_size")
        )

    def select(self, ready: Sequence[SampleInfo], batch_size: int | None) -> list[int] | None:
        """Return the picked ids reordered into ``dp_size`` balanced contiguous pieces."""
        if batch_size is not None and batch_size % self.dp_size:
            raise ValueError(
                f"length_balanced sampler: batch_size={batch_size} is not a multiple of "
                f"dp_size={self.dp_size}; every rank must get the same number of samples"
            )
        if self.group_size is None:
            picked = SequentialSampler().select(ready, batch_size)
            if picked is None:
                return None
            picked = picked[: len(picked) - len(picked) % self.dp_size]
        else:
            if batch_size is not None:
                picked = GroupSampler(self.group_size).select(ready, batch_size)
                if picked is None:
                    return None
            else:
                groups = _complete_groups(ready, self.group_size)
                # Drop trailing groups until the total splits evenly over the ranks.
                while groups and (len(groups) * self.group_size) % self.dp_size:
                    groups.pop()
                picked = [i for ids in groups for i in ids]
        if not picked:
            return picked
        from polyrl.core.balance import balance_rows_across_ranks

        length = {s.sample_id: s.length for s in ready}
        ranks = balance_rows_across_ranks([length[i] for i in picked], self.dp_size)
        return [picked[pos] for rank in ranks for pos in rank]
