"""Several weighted reward functions, per-sample (verl style) or batched (TRL style).

A reward function is one of:

* **per-sample** (verl style), called once per response with the arguments it names from
  :data:`~polyrl.reward.user_fn.SUPPORTED_ARGUMENTS`::

      def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

  It runs in the sandboxed worker pool of a :class:`~polyrl.reward.manager.RewardManager`
  (a per-sample timeout; a crash or a hang costs one sample).

* **batched** (TRL style), called once per step with the whole batch::

      def reward(prompts, completions, completion_ids, **columns) -> list[float | None]

  It is recognised by a parameter named ``prompts``, ``completions`` or ``completion_ids``.
  ``prompts`` holds each row's prompt as the dataset gave it (a string, or a list of chat
  messages), repeated for each of the prompt's ``rollout.n`` responses; ``completions`` holds
  the decoded responses: strings for string prompts, ``[{"role": "assistant", "content":
  text}]`` for chat prompts (as TRL's ``GRPOTrainer``); ``completion_ids`` the response token
  ids; and every other column of the dataset row comes as a keyword argument holding one value
  per response. A function without ``**kwargs`` gets only the columns it names. ``None`` (or
  NaN) in the returned list means "no reward from this function for that sample".

  Batched functions run in the process that scores the step (the driver, or with
  ``transfer.enable`` each rollout worker), not in the worker pool: like TRL, they may keep
  state, batch calls to a model or an API, and see the whole group. There is no timeout. An
  exception fails every sample of the batch for that function: with
  ``reward.max_failure_fraction`` below 1 the run stops with a
  :class:`~polyrl.reward.manager.RewardFailureError`; at 1 the samples get
  ``reward.error_reward`` for that function and ``reward/errors`` counts them.

Each function's value is multiplied by its weight (default 1.0) and the products are summed,
skipping ``None`` (TRL's ``nansum``); a sample for which every function returned ``None``
scores 0 and is counted in ``reward/unscored``. Per function, ``rewards/<name>/mean`` and
``rewards/<name>/std`` are reported over the samples it scored (TRL's names).

A function that returns the wrong thing (a batched function: not a list, a list of the wrong
length, or values that are not numbers or ``None``; a per-sample function: a list) raises
:class:`~polyrl.reward.user_fn.RewardResultError` at the first step, naming the function and
what it returned. Signature problems are found when the functions are resolved
(:func:`resolve_reward_functions`), before training starts.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyrl.reward.user_fn import (
    RewardFunctionError,
    RewardResultError,
    bind_scorer,
    callable_name,
    describe_value,
    load_user_function,
)

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.reward.base import ReplicaEndpoints
    from polyrl.reward.manager import RewardResult

__all__ = [
    "BATCHED_ARGUMENTS",
    "RewardFunction",
    "RewardFunctionsManager",
    "is_batched",
    "resolve_reward_functions",
]

logger = logging.getLogger(__name__)

#: Parameter names that mark a reward function as batched (TRL style), and what they receive.
BATCHED_ARGUMENTS: dict[str, str] = {
    "prompts": "each row's prompt as the dataset gave it (a string or chat messages)",
    "completions": "the decoded responses (strings, or [assistant message] for chat prompts)",
    "completion_ids": "the response token ids",
}


class _NotCallable(RewardFunctionError, TypeError):
    pass


class _BadSignature(RewardFunctionError, TypeError):
    pass


class _BadWeights(RewardFunctionError, ValueError):
    pass


def is_batched(fn: Callable[..., Any]) -> bool:
    """Tell whether ``fn`` names a parameter of :data:`BATCHED_ARGUMENTS` (TRL style)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in BATCHED_ARGUMENTS)


@dataclass(frozen=True)
class RewardFunction:
    """One resolved reward function.

    Attributes:
        name: Its display name (``rewards/<name>/mean``), unique within the list.
        fn: The callable (for a ``"file.py:function"`` spec, loaded from it).
        weight: Its weight in the sum.
        batched: True for a TRL-style function called once per batch.
        spec: The ``"file.py:function"`` it was loaded from (``""`` otherwise); worker
            processes re-load it from there instead of unpickling it.
        names: Batched: the keyword arguments it declares (``takes_all``: it has ``**kwargs``).
        takes_all: Batched: it accepts every column as a keyword argument.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False
    spec: str = ""
    names: tuple[str, ...] = ()
    takes_all: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        # A function loaded from a file lives in a module no other process can import.
        if self.spec:
            return (_reload, (self.spec, self.name, self.weight))
        return (RewardFunction, tuple(getattr(self, f) for f in self.__dataclass_fields__))

    def call(
        self,
        prompts: list[Any],
        completions: list[Any],
        ids: list[list[int]],
        columns: Mapping[str, list[Any]],
    ) -> Any:
        """Call a batched function with the batch (see the module docstring)."""
        values: dict[str, Any] = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": ids,
            **{k: v for k, v in columns.items() if k not in BATCHED_ARGUMENTS},
        }
        if not self.takes_all:
            values = {k: v for k, v in values.items() if k in self.names}
        return self.fn(**values)


def _reload(spec: str, name: str, weight: float) -> RewardFunction:
    (resolved,) = resolve_reward_functions(spec, [weight])
    return RewardFunction(**{**resolved.__dict__, "name": name})


def _check_batched_signature(
    fn: Callable[..., Any], name: str, columns: Sequence[str] | None
) -> tuple[tuple[str, ...], bool]:
    params = inspect.signature(fn).parameters.values()
    names: list[str] = []
    takes_all = False
    for p in params:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            takes_all = True
        elif p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
                raise _BadSignature(
                    f"reward function {name!r} has positional-only parameter {p.name!r}; a "
                    "batched reward function receives everything by keyword (prompts=, "
                    "completions=, completion_ids= and the dataset's columns)"
                )
        else:
            names.append(p.name)
    known = set(BATCHED_ARGUMENTS) | set(columns or ())
    for p in params:
        if (
            p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.default is inspect.Parameter.empty
            and p.name not in known
            and columns is not None
        ):
            raise _BadSignature(
                f"reward function {name!r} requires parameter {p.name!r}, which is neither one "
                f"of {', '.join(BATCHED_ARGUMENTS)} nor a column of the dataset (columns: "
                f"{', '.join(sorted(columns)) or '(none)'}); give it a default or accept "
                "**kwargs"
            )
    return tuple(names), takes_all


def resolve_reward_functions(
    reward_funcs: Any,
    reward_weights: Sequence[float] | None = None,
    columns: Sequence[str] | None = None,
    pickled: bool = False,
) -> list[RewardFunction]:
    """Check and resolve reward functions before training starts.

    Args:
        reward_funcs: One function or a list of them; each a callable, a registered scorer's
            name or a ``"path/to/file.py:function"`` spec.
        reward_weights: One weight per function (default 1.0 each).
        columns: The dataset's columns other than the prompt, when known: a batched function
            that requires anything else is refused here.
        pickled: Per-sample functions will be sent to worker processes: refuse here one that
            cannot be (a lambda or a nested function; a ``"file.py:function"`` spec always can).

    Raises:
        RewardFunctionError: (also a ``TypeError``, ``ValueError``, ``KeyError``...) naming the
            function: not callable, an unknown scorer, a file or function that cannot be
            loaded, a signature whose required parameters cannot be supplied, or weights that
            do not match the functions.
    """
    from polyrl.reward.registry import SCORERS, get_scorer

    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    if not funcs:
        raise _BadWeights("reward_funcs is empty; give at least one reward function")
    if reward_weights is None:
        weights = [1.0] * len(funcs)
    else:
        weights = list(reward_weights)
        if len(weights) != len(funcs):
            raise _BadWeights(
                f"reward_weights has {len(weights)} values for {len(funcs)} reward functions"
            )
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise _BadWeights(f"reward_weights must be finite numbers, got {w!r}")
    resolved: list[RewardFunction] = []
    seen: dict[str, int] = {}
    for position, (item, weight) in enumerate(zip(funcs, weights, strict=True)):
        spec = ""
        if isinstance(item, str) and ":" in item:
            spec = item
            fn = load_user_function(item)
            name = callable_name(fn)
        elif isinstance(item, str):
            if item not in SCORERS:
                raise _UnknownScorer(
                    f"reward function {item!r} is neither a 'path/to/file.py:function' spec nor "
                    f"a registered scorer: {SCORERS.unknown_message(item)}"
                )
            fn, name = get_scorer(item), item
        elif callable(item):
            fn, name = item, callable_name(item)
        else:
            raise _NotCallable(
                f"reward function #{position} must be a callable, a scorer name or a "
                f"'file.py:function' spec, got {describe_value(item)}"
            )
        count = seen.get(name, 0)
        seen[name] = count + 1
        if count:
            name = f"{name}_{count + 1}"
        if is_batched(fn):
            names, takes_all = _check_batched_signature(fn, name, columns)
            resolved.append(RewardFunction(name, fn, float(weight), True, spec, names, takes_all))
        else:
            try:
                bind_scorer(fn)
            except RewardFunctionError as exc:
                raise _BadSignature(
                    f"reward function {name!r}: {exc}; a batched (TRL-style) function takes "
                    "'completions' (and optionally 'prompts', 'completion_ids', dataset "
                    "columns or **kwargs)"
                ) from None
            if pickled and not spec:
                from polyrl.reward._worker import make_payload

                try:
                    make_payload(fn)
                except TypeError as exc:
                    raise _BadSignature(
                        f"reward function {name!r} (per-sample, scored in reward worker "
                        f"processes): {exc}"
                    ) from None
            resolved.append(RewardFunction(name, fn, float(weight), False, spec))
    return resolved


class _UnknownScorer(RewardFunctionError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0])


def _completion(prompt: Any, text: str) -> Any:
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


class RewardFunctionsManager:
    """Scores batches with several weighted reward functions (see the module docstring).

    Per-sample functions each get a :class:`~polyrl.reward.manager.RewardManager` (its own
    worker pool of ``num_workers`` processes); batched ones are called here. It is a
    :class:`~polyrl.reward.base.Scorer`, like the manager.

    The batch's non-tensor columns read: ``response_text``, ``source_row`` (the dataset row as
    given: prompt and columns), ``completion_ids`` (lists of token ids), and for the per-sample
    functions ``data_source``, ``ground_truth`` and ``extra_info``.
    """

    #: Tells the rollout producer to put ``source_row`` and ``completion_ids`` on the batch.
    wants_rows = True
    wants_prompts = False

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        *,
        prompt_key: str = "prompt",
        num_workers: int = 1,
        timeout_s: float | None = 10.0,
        error_reward: float = 0.0,
        max_failure_fraction: float | None = None,
        rescore_after_death: bool = True,
    ) -> None:
        from polyrl.reward.manager import RewardManager

        self.functions = list(functions)
        self.prompt_key = prompt_key
        self.error_reward = float(error_reward)
        self.max_failure_fraction = max_failure_fraction
        self._managers: dict[int, RewardManager] = {}
        try:
            for k, f in enumerate(self.functions):
                if not f.batched:
                    self._managers[k] = RewardManager(
                        custom_function=f.spec or f.fn,
                        num_workers=num_workers,
                        timeout_s=timeout_s,
                        error_reward=error_reward,
                        max_failure_fraction=max_failure_fraction,
                        rescore_after_death=rescore_after_death,
                    )
        except BaseException:
            self.close()
            raise

    def attach_rollout(self, client: ReplicaEndpoints) -> None:
        """Nothing: reward functions do not ask the replicas."""

    def close(self) -> None:
        """Stop the per-sample functions' worker pools."""
        for manager in self._managers.values():
            manager.close()

    def __enter__(self) -> RewardFunctionsManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, batch: Batch) -> RewardResult:
        """Score every row of ``batch`` with every function and sum the weighted values."""
        import numpy as np
        import torch

        from polyrl.reward.manager import WORKER_DEATHS, RewardResult

        start = time.perf_counter()
        n = len(batch)
        nt = batch.non_tensors
        texts = [str(t) for t in nt["response_text"]]
        rows = list(nt["source_row"]) if "source_row" in nt else [{} for _ in range(n)]
        ids = [list(map(int, x)) for x in nt["completion_ids"]] if "completion_ids" in nt else []
        values = np.full((n, len(self.functions)), np.nan, dtype=np.float64)
        metrics: dict[str, float] = {
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
            "reward/garbage": 0.0,
        }
        statuses = ["ok"] * n
        failures: dict[int, str] = {}
        extras: dict[str, np.ndarray] = {}
        batched = [k for k, f in enumerate(self.functions) if f.batched]
        if batched:
            prompts = [row.get(self.prompt_key) for row in rows]
            completions = [_completion(p, t) for p, t in zip(prompts, texts, strict=True)]
            keys = sorted({k for row in rows for k in row if k != self.prompt_key})
            columns = {k: [row.get(k) for row in rows] for k in keys}
        for k, f in enumerate(self.functions):
            if f.batched:
                values[:, k] = self._call_batched(
                    f, prompts, completions, ids, columns, n, statuses, failures, metrics
                )
            else:
                result = self._managers[k].score(batch)
                values[:, k] = result.scores.numpy().astype(np.float64)
                for key in ("reward/errors", "reward/timeouts", "reward/garbage"):
                    metrics[key] += result.metrics.get(key, 0.0)
                if WORKER_DEATHS in result.metrics:
                    deaths = metrics.get(WORKER_DEATHS, 0.0) + result.metrics[WORKER_DEATHS]
                    metrics[WORKER_DEATHS] = deaths
                for p, status in enumerate(result.statuses):
                    if status != "ok" and statuses[p] == "ok":
                        statuses[p] = status
                for index, message in result.failures.items():
                    failures.setdefault(index, f"{f.name}: {message}")
                for key, extra in result.extras.items():
                    extras.setdefault(key, extra)
        weights = np.array([f.weight for f in self.functions], dtype=np.float64)
        unscored = np.isnan(values).all(axis=1)
        scores = np.nansum(values * weights, axis=1)
        if unscored.any():
            logger.warning(
                "every reward function returned None for %d of %d samples (they score 0); "
                "first: sample %d",
                int(unscored.sum()),
                n,
                int(np.flatnonzero(unscored)[0]),
            )
        for k, f in enumerate(self.functions):
            column = values[:, k]
            scored = column[~np.isnan(column)]
            metrics[f"rewards/{f.name}/mean"] = float(scored.mean()) if scored.size else math.nan
            metrics[f"rewards/{f.name}/std"] = float(scored.std()) if scored.size else math.nan
        metrics["reward/unscored"] = float(unscored.sum())
        metrics["reward/time_s"] = time.perf_counter() - start
        if n:
            metrics.update(
                {
                    "reward/score/mean": float(scores.mean()),
                    "reward/score/std": float(scores.std()),
                    "reward/score/min": float(scores.min()),
                    "reward/score/max": float(scores.max()),
                }
            )
        return RewardResult(
            scores=torch.from_numpy(scores.astype(np.float32)),
            extras=extras,
            metrics=metrics,
            statuses=statuses,
            failures=failures,
        )

    def _call_batched(
        self,
        f: RewardFunction,
        prompts: list[Any],
        completions: list[Any],
        ids: list[list[int]],
        columns: Mapping[str, list[Any]],
        n: int,
        statuses: list[str],
        failures: dict[int, str],
        metrics: dict[str, float],
    ) -> list[float]:
        from polyrl.reward.manager import RewardFailureError, _summary

        try:
            out = f.call(prompts, completions, ids, columns)
        except Exception:
            import traceback

            text = traceback.format_exc(limit=-3)
            limit = self.max_failure_fraction
            if n and (limit is None or limit < 1.0):
                raise RewardFailureError(
                    f"reward function {f.name!r} raised on a batch of {n} samples (all fail, more "
                    f"than max_failure_fraction={limit if limit is not None else 0:g} "
                    f"(reward.max_failure_fraction) allows): {_summary(text)}",
                    failed=n,
                    total=n,
                    max_fraction=limit or 0.0,
                    first_index=0,
                    first_failure=text,
                ) from None
            logger.warning(
                "reward function %r raised; its %d samples get error_reward: %s",
                f.name,
                n,
                _summary(text),
            )
            metrics["reward/errors"] += n
            for p in range(n):
                statuses[p] = "error"
                failures.setdefault(p, f"{f.name}: {text}")
            return [self.error_reward] * n
        return _check_batched_result(f.name, out, n)


def _check_batched_result(name: str, out: Any, n: int) -> list[float]:
    """Return a batched function's values as floats (NaN for None); raise if malformed."""
    if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence):
        tolist = getattr(out, "tolist", None)
        if callable(tolist) and getattr(out, "ndim", 0) == 1:
            out = tolist()  # a 1-D numpy array or tensor
        else:
            raise RewardResultError(
                f"reward function {name!r} returned {describe_value(out)} for a batch of {n} "
                "completions; a batched (TRL-style) function must return a list with one "
                "number (or None) per completion"
            )
    if len(out) != n:
        raise RewardResultError(
            f"reward function {name!r} returned a {type(out).__name__} of {len(out)} values for "
            f"a batch of {n} completions; it must return one number (or None) per completion"
        )
    values: list[float] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
            continue
        as_float: float | None = None
        if isinstance(v, bool | int | float):
            as_float = float(v)
        elif getattr(v, "shape", None) == () and callable(getattr(v, "item", None)):
            item = v.item()
            as_float = float(item) if isinstance(item, bool | int | float) else None
        if as_float is None or math.isinf(as_float):
            raise RewardResultError(
                f"reward function {name!r} returned {describe_value(v)} for completion {i} of "
                f"{n}; each value must be a finite number or None"
            )
        values.append(as_float)
    return values
