"""Dispatch modes: how a worker-group call's arguments reach the ranks and how results come back.

A worker method is marked with :func:`register`; the :class:`~polyrl.controller.WorkerGroup`
binds it so the driver calls ``group.compute_log_prob(batch)`` as if it were local. The
``dispatch`` mode decides what each rank receives and how the per-rank results are collected:

``Dispatch.ONE_TO_ALL``
    every rank gets the same arguments; the result is the list of per-rank results.
``Dispatch.ALL_TO_ALL``
    every argument is a sequence with one item per rank; rank ``i`` gets item ``i``; the result
    is the list of per-rank results.
``Dispatch.RANK_ZERO``
    only rank 0 runs the method; the result is its return value.
``Dispatch.DP_COMPUTE``
    every :class:`~polyrl.core.batch.Batch` arg is padded to a multiple of the data-parallel size
    and split into equal contiguous shards; data-parallel rank ``d`` gets shard ``d`` (every rank
    of that data-parallel group gets the same shard). A future of an earlier ``DP_COMPUTE`` call
    is split the same way without visiting the driver; an argument whose type defines
    ``__dp_chunks__(self, n)`` (row references such as a transfer-queue ``BatchMeta``) is cut by
    that method, unpadded, and each rank fetches its own rows; every other argument (other
    futures included) is broadcast whole. The results
    of the *collect* rank of each data-parallel group are concatenated in order and the padding
    rows dropped, so the caller gets one output row per input row, in the input order.
``Dispatch.DP_COMPUTE_METRIC``
    dispatched like ``DP_COMPUTE``; each collect rank returns a ``dict`` of metrics and the
    dicts are reduced: numbers (and 1-element tensors) are averaged over data-parallel ranks,
    lists are concatenated. Shards include the padding rows, so a metric averaged per shard
    weighs them like real rows; return per-row lists when that matters.

Meshes: by default every rank is its own data-parallel rank. A worker that shards its model
(e.g. ``dp x tp``) declares a named mesh with :meth:`Worker.register_mesh` and the method names it
with ``@register(dispatch=Dispatch.DP_COMPUTE, mesh="train")``. Ranks are laid out row-major over
the mesh dimensions (like :func:`torch.distributed.device_mesh.init_device_mesh`); every rank of
a data-parallel group receives that group's shard, and only the rank whose other mesh coordinates
are all 0 (the collect rank) returns its result -- the other ranks' results are dropped on the
worker and never travel.

Padding: the rows added to make the length divide are copies of the first rows. The padded rows
are dropped from the end of the gathered result, which assumes the method returns, per shard,
``k`` output rows per input row in input order (``k = 1`` for ``compute_log_prob``, ``k = n`` for a
method that samples ``n`` responses per prompt with ``repeat_interleave`` order). A shard whose
length is not a whole multiple of its input shard length cannot be unpadded and raises
:class:`~polyrl.controller.errors.DispatchError` -- pass a Batch whose length divides the
data-parallel size in that case.

User-defined modes: build a :class:`DispatchMode` from two functions and register it under a
name with :func:`register_dispatch_mode`; then ``@register(dispatch="my_mode")``.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import numpy as np
import torch

from polyrl.controller.errors import DispatchError
from polyrl.core.batch import Batch
from polyrl.core.registry import Registry

__all__ = [
    "DISPATCH_MODES",
    "DataParallelLayout",
    "Dispatch",
    "DispatchContext",
    "DispatchMode",
    "Execute",
    "MethodSpec",
    "available_dispatch_modes",
    "get_dispatch_mode",
    "register",
    "register_dispatch_mode",
]

F = TypeVar("F", bound=Callable[..., Any])

#: Per-rank call: ``(args, kwargs)``, or ``None`` when the rank is not called.
RankCall = tuple[tuple[Any, ...], dict[str, Any]] | None

_REGISTER_ATTR = "__polyrl_register__"


class Dispatch(enum.StrEnum):
    """Built-in dispatch modes (see the module docstring)."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(enum.StrEnum):
    """Which ranks run a method: all that the dispatch mode addresses, or rank 0 only."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DataParallelLayout:
    """How the ranks of a group map onto data-parallel groups for one mesh.

    Attributes:
        dp_size: number of data-parallel groups (number of shards).
        dp_rank: data-parallel index of every global rank (``len == world_size``).
        collect_rank: the global rank whose result is kept, per data-parallel index.
        mesh: the mesh name, ``None`` for the default "one rank, one shard" layout.
    """

    dp_size: int
    dp_rank: tuple[int, ...]
    collect_rank: tuple[int, ...]
    mesh: str | None = None

    @staticmethod
    def flat(world_size: int) -> DataParallelLayout:
        """Every rank is its own data-parallel rank and returns its result."""
        ranks = tuple(range(world_size))
        return DataParallelLayout(world_size, ranks, ranks, None)

    @staticmethod
    def from_rank_infos(mesh: str, infos: Sequence[tuple[int, int, bool]]) -> DataParallelLayout:
        """Build and validate a layout from ``(dp_rank, dp_size, is_collect)`` per global rank."""
        if not infos:
            raise DispatchError(f"mesh {mesh!r}: no ranks reported dispatch info")
        sizes = {size for _, size, _ in infos}
        if len(sizes) != 1:
            raise DispatchError(
                f"mesh {mesh!r}: ranks disagree on the data-parallel size: {sorted(sizes)}"
            )
        dp_size = sizes.pop()
        collect: dict[int, int] = {}
        for rank, (dp_rank, _, is_collect) in enumerate(infos):
            if not 0 <= dp_rank < dp_size:
                raise DispatchError(
                    f"mesh {mesh!r}: rank {rank} has dp_rank {dp_rank}, expected 0..{dp_size - 1}"
                )
            if is_collect:
                if dp_rank in collect:
                    raise DispatchError(
                        f"mesh {mesh!r}: ranks {collect[dp_rank]} and {rank} are both the collect "
                        f"rank of data-parallel group {dp_rank}; exactly one is expected"
                    )
                collect[dp_rank] = rank
        missing = sorted(set(range(dp_size)) - set(collect))
        if missing:
            raise DispatchError(
                f"mesh {mesh!r}: data-parallel groups {missing} have no collect rank"
            )
        return DataParallelLayout(
            dp_size,
            tuple(info[0] for info in infos),
            tuple(collect[d] for d in range(dp_size)),
            mesh,
        )


@dataclass(frozen=True)
class DispatchContext:
    """What a dispatch or collect function knows about the call.

    Attributes:
        world_size: number of ranks in the group.
        method: the (role-qualified) method name, for error messages.
        layout: the data-parallel layout of the method's mesh.
    """

    world_size: int
    method: str
    layout: DataParallelLayout
    # Backend hook that runs a function on the cluster (never in the driver for Ray) and returns
    # handles; dropped when the context is pickled into a remote collect task.
    _apply: Callable[..., list[Any]] | None = field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (DispatchContext, (self.world_size, self.method, self.layout, None))

    def apply_remote(
        self, fn: Callable[..., Any], inputs: Sequence[Any], num_returns: int
    ) -> list[Any]:
        """Run ``fn(*inputs)`` next to the data and return ``num_returns`` handles to its results.

        ``inputs`` may hold backend handles (resolved before ``fn`` runs). Used to re-split or
        gather futures without fetching them into the driver.
        """
        if self._apply is None:
            raise DispatchError("apply_remote is only available while dispatching a call")
        return self._apply(fn, list(inputs), num_returns)


class DispatchMode:
    """A named pair of functions: how to dispatch arguments and how to collect results.

    Args:
        name: registry name.
        dispatch_fn: ``(ctx, args, kwargs) -> list`` with one entry per rank: ``(args, kwargs)``
            for that rank, or ``None`` to skip it. Arguments may be
            :class:`~polyrl.controller.futures.ControllerFuture` objects; a future placed in a
            rank's top-level arguments is resolved (to its collected value) on the worker.
        collect_fn: ``(ctx, results) -> value`` where ``results`` are the return values of the
            called ranks, in rank order.
    """

    def __init__(
        self,
        name: str,
        dispatch_fn: Callable[[DispatchContext, tuple[Any, ...], dict[str, Any]], list[RankCall]],
        collect_fn: Callable[[DispatchContext, list[Any]], Any],
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"dispatch mode name must be a non-empty str, got {name!r}")
        if not callable(dispatch_fn) or not callable(collect_fn):
            raise TypeError(f"dispatch mode {name!r}: dispatch_fn and collect_fn must be callable")
        self.name = name
        self._dispatch_fn = dispatch_fn
        self._collect_fn = collect_fn

    # -- overridable protocol (built-in modes specialise these) -------------------------------
    def dispatch(
        self, ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[RankCall], list[bool], dict[str, Any]]:
        """Per-rank calls, which ranks' results the collect needs, and extra future state."""
        calls = self._dispatch_fn(ctx, args, kwargs)
        if not isinstance(calls, list) or len(calls) != ctx.world_size:
            raise DispatchError(
                f"{ctx.method}: dispatch mode {self.name!r} must return a list with one entry per "
                f"rank ({ctx.world_size}), got {type(calls).__name__}"
                + (f" of length {len(calls)}" if isinstance(calls, list) else "")
            )
        for rank, call in enumerate(calls):
            if call is None:
                continue
            if (
                not isinstance(call, tuple)
                or len(call) != 2
                or not isinstance(call[0], tuple)
                or not isinstance(call[1], dict)
            ):
                raise DispatchError(
                    f"{ctx.method}: dispatch mode {self.name!r} returned {call!r} for rank {rank}; "
                    "expected (args_tuple, kwargs_dict) or None"
                )
        return calls, [c is not None for c in calls], {}

    def collect(self, ctx: DispatchContext, results: list[Any], state: Mapping[str, Any]) -> Any:
        """Combine the kept per-rank results into the call's return value."""
        return self._collect_fn(ctx, results)

    def future_kind(self) -> str:
        """Which future class represents a non-blocking result of this mode."""
        return "generic"

    def allows_rank_zero_execute(self) -> bool:
        """Whether ``execute=Execute.RANK_ZERO`` makes sense with this mode."""
        return True

    def __repr__(self) -> str:
        return f"DispatchMode({self.name!r})"


# ----------------------------------------------------------------------------------------------
# Helpers shared by dispatch, futures and remote gather/split tasks (module level: picklable)
# ----------------------------------------------------------------------------------------------
def _is_future(value: Any) -> bool:
    from polyrl.controller.futures import ControllerFuture

    return isinstance(value, ControllerFuture)


def split_batch(batch: Batch, n: int) -> tuple[list[Batch], tuple[int, int]]:
    """Pad ``batch`` to a multiple of ``n`` and cut it into ``n`` equal shards.

    Returns the shards and the pad info ``(pad_size, padded_shard_len)``.
    """
    if len(batch) == 0:
        raise DispatchError(f"cannot split an empty Batch across {n} data-parallel ranks")
    padded, pad = batch.pad_to_multiple(n)
    return padded.chunk(n), (pad, len(padded) // n)


def _concat(parts: list[Any], method: str) -> Any:
    if all(p is None for p in parts):
        return None
    first = parts[0]
    if isinstance(first, Batch):
        return Batch.concat(parts)
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    if isinstance(first, list | tuple):
        return [x for p in parts for x in p]
    raise DispatchError(
        f"{method}: DP_COMPUTE results must be Batch, torch.Tensor, numpy array or list (one row "
        f"per input row) to be concatenated, got {type(first).__name__}"
    )


def _rows(value: Any) -> int:
    if isinstance(value, Batch):
        return len(value)
    if isinstance(value, torch.Tensor | np.ndarray):
        return int(value.shape[0])
    return len(value)


def gather_shards(pad_info: tuple[int, int | None], method: str, *shards: Any) -> Any:
    """Concatenate per-data-parallel-rank results in order and drop the padding rows."""
    pad, unit = pad_info
    out = _concat(list(shards), method)
    if out is None or pad == 0:
        return out
    lengths = [_rows(s) for s in shards]
    if unit is None or unit <= 0 or any(length % unit for length in lengths):
        raise DispatchError(
            f"{method}: cannot drop {pad} padding rows: result shard lengths {lengths} are not "
            f"whole multiples of the padded input shard length {unit}; return k rows per input "
            "row, or pass a Batch whose length divides the data-parallel size"
        )
    ratios = {length // unit for length in lengths}
    if len(ratios) != 1:
        raise DispatchError(
            f"{method}: result shards have different rows-per-input ratios {sorted(ratios)} "
            f"(lengths {lengths}, input shard length {unit}); cannot locate the padding rows"
        )
    drop = pad * ratios.pop()
    if isinstance(out, Batch):
        return out.unpad(drop)
    return out[: len(out) - drop] if drop else out


def resplit_shards(
    n: int, pad_info: tuple[int, int | None], method: str, *shards: Any
) -> list[Any]:
    """Re-cut the shards of a DP result into ``n`` shards (+ new pad info as the last item)."""
    whole = gather_shards(pad_info, method, *shards)
    return split_value(n, method, whole)


def split_value(n: int, method: str, value: Any) -> list[Any]:
    """Split a Batch value into ``n`` shards (+ pad info as the last item), for remote use."""
    if not isinstance(value, Batch):
        raise DispatchError(
            f"{method}: a data-parallel argument resolved to {type(value).__name__}, expected a "
            "Batch"
        )
    shards, info = split_batch(value, n)
    return [*shards, info]


def _is_number(value: Any) -> bool:
    if isinstance(value, numbers.Number):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, np.ndarray) and value.size == 1


def reduce_metrics(method: str, dicts: list[Any]) -> dict[str, Any]:
    """Reduce per-rank metric dicts: mean of numbers, concatenation of lists."""
    for i, d in enumerate(dicts):
        if not isinstance(d, Mapping):
            raise DispatchError(
                f"{method}: DP_COMPUTE_METRIC expects every collect rank to return a dict of "
                f"metrics; result {i} is {type(d).__name__}"
            )
    keys: list[str] = []
    for d in dicts:
        keys.extend(k for k in d if k not in keys)
    out: dict[str, Any] = {}
    for key in keys:
        values = [d[key] for d in dicts if key in d]
        if all(isinstance(v, list | tuple) for v in values):
            out[key] = [x for v in values for x in v]
        elif all(_is_number(v) for v in values):
            floats = [float(v.item() if hasattr(v, "item") else v) for v in values]
            out[key] = math.fsum(floats) / len(floats)
        else:
            raise DispatchError(
                f"{method}: metric {key!r} has values of types "
                f"{sorted({type(v).__name__ for v in values})}; expected numbers or lists"
            )
    return out


# ----------------------------------------------------------------------------------------------
# Built-in modes
# ----------------------------------------------------------------------------------------------
def _broadcast_value(ctx: DispatchContext, value: Any) -> Any:
    """Return what every addressed rank receives whole: a future becomes a handle to its value."""
    if _is_future(value):
        return value._value_handle()
    return value


class _OneToAll(DispatchMode):
    def __init__(self) -> None:
        super().__init__(Dispatch.ONE_TO_ALL.value, lambda *a: [], lambda *a: None)

    def dispatch(self, ctx, args, kwargs):  # noqa: D102
        args = tuple(_broadcast_value(ctx, a) for a in args)
        kwargs = {k: _broadcast_value(ctx, v) for k, v in kwargs.items()}
        calls: list[RankCall] = [(args, kwargs) for _ in range(ctx.world_size)]
        return calls, [True] * ctx.world_size, {}

    def collect(self, ctx, results, state):  # noqa: D102
        return list(results)

    def future_kind(self) -> str:  # noqa: D102
        return "per_rank"


class _RankZero(_OneToAll):
    def __init__(self) -> None:
        DispatchMode.__init__(self, Dispatch.RANK_ZERO.value, lambda *a: [], lambda *a: None)

    def dispatch(self, ctx, args, kwargs):  # noqa: D102
        calls, _, state = super().dispatch(ctx, args, kwargs)
        calls = [calls[0]] + [None] * (ctx.world_size - 1)
        return calls, [True] + [False] * (ctx.world_size - 1), state

    def collect(self, ctx, results, state):  # noqa: D102
        return results[0]

    def future_kind(self) -> str:  # noqa: D102
        return "generic"


class _AllToAll(DispatchMode):
    def __init__(self) -> None:
        super().__init__(Dispatch.ALL_TO_ALL.value, lambda *a: [], lambda *a: None)

    def _per_rank(self, ctx: DispatchContext, name: str, value: Any) -> list[Any]:
        from polyrl.controller.futures import PerRankFuture

        n = ctx.world_size
        if isinstance(value, PerRankFuture):
            handles = value._rank_handles()
            if len(handles) != n:
                raise DispatchError(
                    f"{ctx.method}: ALL_TO_ALL argument {name} is a per-rank future with "
                    f"{len(handles)} results, expected one per rank ({n})"
                )
            return handles
        if _is_future(value):
            raise DispatchError(
                f"{ctx.method}: ALL_TO_ALL argument {name} is a {type(value).__name__}; only "
                "futures of ONE_TO_ALL/ALL_TO_ALL calls (one result per rank) can be passed"
            )
        if not isinstance(value, list | tuple) or len(value) != n:
            is_seq = isinstance(value, list | tuple)
            got = f"length {len(value)}" if is_seq else type(value).__name__
            raise DispatchError(
                f"{ctx.method}: ALL_TO_ALL argument {name} must be a list or tuple with one item "
                f"per rank ({n}), got {got}"
            )
        return list(value)

    def dispatch(self, ctx, args, kwargs):  # noqa: D102
        per_args = [self._per_rank(ctx, f"#{i}", a) for i, a in enumerate(args)]
        per_kwargs = {k: self._per_rank(ctx, repr(k), v) for k, v in kwargs.items()}
        calls: list[RankCall] = [
            (tuple(a[r] for a in per_args), {k: v[r] for k, v in per_kwargs.items()})
            for r in range(ctx.world_size)
        ]
        return calls, [True] * ctx.world_size, {}

    def collect(self, ctx, results, state):  # noqa: D102
        return list(results)

    def future_kind(self) -> str:  # noqa: D102
        return "per_rank"


class _DPCompute(DispatchMode):
    def __init__(self, name: str = Dispatch.DP_COMPUTE.value) -> None:
        super().__init__(name, lambda *a: [], lambda *a: None)

    def allows_rank_zero_execute(self) -> bool:  # noqa: D102
        return False

    def _split(
        self, ctx: DispatchContext, value: Any, pad_infos: list[Any], cache: dict[int, list[Any]]
    ) -> list[Any] | None:
        """Per-dp-index pieces of ``value``, or ``None`` when it is broadcast."""
        from polyrl.controller.futures import ShardedFuture

        n = ctx.layout.dp_size
        if isinstance(value, Batch):
            if id(value) not in cache:
                shards, info = split_batch(value, n)
                cache[id(value)] = shards
                pad_infos.append(("batch", len(value), info))
            return cache[id(value)]
        if isinstance(value, ShardedFuture):
            handles, info = value._shards_for(ctx, n)
            pad_infos.append(("future", None, info))
            return handles
        # Row references (e.g. a transfer-queue BatchMeta) cut themselves into n pieces; each
        # rank fetches its own rows, so nothing is padded and nothing is dropped afterwards.
        chunks = getattr(type(value), "__dp_chunks__", None)
        if chunks is not None:
            if id(value) not in cache:
                cache[id(value)] = list(chunks(value, n))
                pad_infos.append(("refs", len(value), (0, None)))
            return cache[id(value)]
        return None

    def dispatch(self, ctx, args, kwargs):  # noqa: D102
        layout = ctx.layout
        pad_infos: list[Any] = []
        cache: dict[int, list[Any]] = {}
        split_args = [self._split(ctx, a, pad_infos, cache) for a in args]
        split_kwargs = {k: self._split(ctx, v, pad_infos, cache) for k, v in kwargs.items()}
        lengths = {length for kind, length, _ in pad_infos if kind in ("batch", "refs")}
        if len(lengths) > 1:
            raise DispatchError(
                f"{ctx.method}: DP_COMPUTE Batch arguments have different lengths "
                f"{sorted(lengths)}; all split arguments must describe the same rows"
            )
        bcast_args = [
            None if s is not None else _broadcast_value(ctx, a)
            for a, s in zip(args, split_args, strict=True)
        ]
        bcast_kwargs = {
            k: (None if split_kwargs[k] is not None else _broadcast_value(ctx, v))
            for k, v in kwargs.items()
        }
        calls: list[RankCall] = []
        for rank in range(ctx.world_size):
            d = layout.dp_rank[rank]
            rank_args = tuple(
                s[d] if s is not None else b for s, b in zip(split_args, bcast_args, strict=True)
            )
            rank_kwargs = {
                k: (split_kwargs[k][d] if split_kwargs[k] is not None else bcast_kwargs[k])
                for k in kwargs
            }
            calls.append((rank_args, rank_kwargs))
        keep = [False] * ctx.world_size
        for rank in layout.collect_rank:
            keep[rank] = True
        pad_info = pad_infos[0][2] if pad_infos else (0, None)
        return calls, keep, {"pad_info": pad_info}

    def collect(self, ctx, results, state):  # noqa: D102
        return gather_shards(state["pad_info"], ctx.method, *results)

    def future_kind(self) -> str:  # noqa: D102
        return "sharded"


class _DPComputeMetric(_DPCompute):
    def __init__(self) -> None:
        super().__init__(Dispatch.DP_COMPUTE_METRIC.value)

    def collect(self, ctx, results, state):  # noqa: D102
        return reduce_metrics(ctx.method, list(results))

    def future_kind(self) -> str:  # noqa: D102
        return "generic"


#: Dispatch modes by name: the built-in :class:`Dispatch` members and user modes.
DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")
for _mode in (_OneToAll(), _AllToAll(), _RankZero(), _DPCompute(), _DPComputeMetric()):
    DISPATCH_MODES.add(_mode.name, _mode)
_BUILTIN_NAMES = frozenset(DISPATCH_MODES.names())
available_dispatch_modes = DISPATCH_MODES.names


def register_dispatch_mode(
    name: str | DispatchMode,
    dispatch_fn: Callable[[DispatchContext, tuple[Any, ...], dict[str, Any]], list[RankCall]]
    | None = None,
    collect_fn: Callable[[DispatchContext, list[Any]], Any] | None = None,
    *,
    overwrite: bool = False,
) -> DispatchMode:
    """Register a user dispatch mode under a name and return it.

    Call either with a ready :class:`DispatchMode` or with ``name, dispatch_fn, collect_fn``.
    Built-in names cannot be replaced; an existing user name needs ``overwrite=True``.
    """
    if isinstance(name, DispatchMode):
        if dispatch_fn is not None or collect_fn is not None:
            raise TypeError("pass either a DispatchMode or name + dispatch_fn + collect_fn")
        mode = name
    else:
        if dispatch_fn is None or collect_fn is None:
            raise TypeError(
                f"register_dispatch_mode({name!r}): dispatch_fn and collect_fn are required"
            )
        mode = DispatchMode(name, dispatch_fn, collect_fn)
    if mode.name in _BUILTIN_NAMES:
        raise ValueError(f"dispatch mode {mode.name!r} is built in and cannot be replaced")
    DISPATCH_MODES.add(mode.name, mode, overwrite=overwrite)
    return mode


def get_dispatch_mode(mode: Dispatch | str | DispatchMode) -> DispatchMode:
    """Resolve a :class:`Dispatch` member, a registered name or a mode object."""
    if isinstance(mode, DispatchMode):
        return mode
    key = mode.value if isinstance(mode, Dispatch) else mode
    if not isinstance(key, str):
        raise TypeError(f"dispatch must be a Dispatch, a mode name or a DispatchMode, got {mode!r}")
    return DISPATCH_MODES.get(key)


@dataclass(frozen=True)
class MethodSpec:
    """What :func:`register` recorded on a worker method."""

    dispatch: Dispatch | str | DispatchMode
    execute: Execute
    blocking: bool
    mesh: str | None


@overload
def register(func: F) -> F: ...


@overload
def register(
    func: None = None,
    *,
    dispatch: Dispatch | str | DispatchMode = ...,
    execute: Execute | str = ...,
    blocking: bool = ...,
    mesh: str | None = ...,
) -> Callable[[F], F]: ...


def register(
    func: F | None = None,
    *,
    dispatch: Dispatch | str | DispatchMode = Dispatch.ONE_TO_ALL,
    execute: Execute | str = Execute.ALL,
    blocking: bool = True,
    mesh: str | None = None,
) -> F | Callable[[F], F]:
    """Mark a :class:`~polyrl.controller.Worker` method as callable through a worker group.

    Args:
        func: the method, when used bare as ``@register``.
        dispatch: how arguments are split and results collected (a :class:`Dispatch`, the name of
            a mode registered with :func:`register_dispatch_mode`, or a :class:`DispatchMode`).
        execute: ``Execute.ALL`` (every rank the mode addresses) or ``Execute.RANK_ZERO``.
        blocking: ``True``: the bound call returns the collected value. ``False``: it returns a
            :class:`~polyrl.controller.futures.ControllerFuture` that can be passed straight into
            the next call (the data stays on the workers).
        mesh: name of the mesh (declared by the worker with :meth:`Worker.register_mesh`) that
            defines the data-parallel layout for ``DP_COMPUTE`` modes.

    Usable bare (``@register``) or with arguments (``@register(dispatch=...)``).
    """
    if isinstance(dispatch, Dispatch | DispatchMode):
        pass
    elif isinstance(dispatch, str):
        try:
            dispatch = Dispatch(dispatch)
        except ValueError:
            pass  # a user mode; resolved when the group binds the method
    else:
        raise TypeError(
            "register: dispatch must be a Dispatch, a mode name or a DispatchMode, got "
            f"{dispatch!r}"
        )
    try:
        execute = Execute(execute)
    except ValueError:
        raise ValueError(
            f"register: execute must be one of {[e.value for e in Execute]}, got {execute!r}"
        ) from None
    if not isinstance(blocking, bool):
        raise TypeError(f"register: blocking must be a bool, got {blocking!r}")
    if mesh is not None and (not isinstance(mesh, str) or not mesh):
        raise TypeError(f"register: mesh must be a non-empty str or None, got {mesh!r}")
    data_parallel = (Dispatch.DP_COMPUTE, Dispatch.DP_COMPUTE_METRIC)
    if execute is Execute.RANK_ZERO and dispatch in data_parallel:
        raise ValueError(
            f"register: execute=RANK_ZERO cannot be combined with {dispatch.value} (data-parallel "
            "modes need every data-parallel rank)"
        )
    spec = MethodSpec(dispatch, execute, blocking, mesh)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register must decorate a function, got {fn!r}")
        setattr(fn, _REGISTER_ATTR, spec)
        return fn

    if func is not None:
        return decorate(func)
    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every method of ``cls`` (including inherited ones) marked with :func:`register`."""
    out: dict[str, MethodSpec] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attr = getattr(cls, name, None)
        spec = getattr(attr, _REGISTER_ATTR, None)
        if isinstance(spec, MethodSpec):
            out[name] = spec
    return out
