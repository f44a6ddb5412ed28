"""A reward manager that scores batches in a pool of worker processes, robustly.

Each sample is scored by the user's custom function or by the scorer registered for its
``data_source``. Scoring runs in ``num_workers`` long-lived processes with a per-sample
timeout (a :class:`~polyrl.reward.pool.ScoringPool`): a scorer that hangs, raises, returns
garbage or kills its process yields ``error_reward`` for that sample and bumps a counter in
the metrics; the worker is replaced when needed and the run goes on. A worker killed from
outside costs nothing: the sample it was scoring is scored again by its replacement (only a
second death on it makes it an error); ``recovery/reward_worker_deaths`` counts the deaths.
With ``rescore_after_death=False`` such a death raises
:class:`~polyrl.reward.pool.RewardWorkerDiedError` instead (an RL run that recovers from
nothing, ``trainer.max_restarts=0``, stops there).

``num_workers=0`` scores in the calling process instead. That is meant for debugging
(breakpoints, tracebacks, profilers): exceptions and garbage are still caught, but no
timeout is enforced and a scorer that kills its process kills the caller.

A scorer that hangs on every sample costs a batch about one ``timeout_s``, not one per sample:
when the first samples tried in a batch (one per worker, at least two) all time out and no
sample of the batch has finished, the scorer is taken to be hung and the batch's other
samples are marked as timeouts without being tried. With ``max_failure_fraction`` set, a batch
where more than that fraction of the samples fail raises :class:`RewardFailureError`.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from polyrl.reward._worker import (
    Item,
    Outcome,
    Payload,
    ScorerResolver,
    make_payload,
    score_one,
)
from polyrl.reward.pool import ScoringPool
from polyrl.reward.registry import get_scorer
from polyrl.reward.user_fn import (
    RewardResultError,
    bind_scorer,
    callable_name,
    load_user_function,
)

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.reward.base import ReplicaEndpoints

__all__ = ["RewardFailureError", "RewardManager", "RewardResult"]

logger = logging.getLogger(__name__)

#: The metric counting reward workers that died (since the manager started).
WORKER_DEATHS = "recovery/reward_worker_deaths"

#: Per-sample statuses reported in :attr:`RewardResult.statuses`.
STATUSES = ("ok", "error", "timeout", "garbage")
_METRIC_FOR_STATUS = {
    "error": "reward/errors",
    "timeout": "reward/timeouts",
    "garbage": "reward/garbage",
}
_BUILTIN_MODULE = "polyrl.reward.scorers"


class RewardFailureError(RuntimeError):
    """More of a batch's samples failed to score than ``max_failure_fraction`` allows.

    The message is one line: the fraction, the counts by kind and the first failure (its
    sample index, ``data_source`` and the exception's last line); :attr:`first_failure` holds
    that failure's whole text (a traceback for exceptions).

    Attributes:
        failed: Samples that failed (errors, timeouts and garbage results).
        total: Samples in the batch.
        max_fraction: The limit that was exceeded.
        first_index: Index of the first failed sample.
        first_data_source: Its ``data_source`` (``None`` when the batch has none).
        first_failure: The first failure's full message.
    """

    def __init__(
        self,
        message: str,
        *,
        failed: int = 0,
        total: int = 0,
        max_fraction: float = 0.0,
        first_index: int = -1,
        first_data_source: Any = None,
        first_failure: str = "",
    ):
        super().__init__(message)
        self.failed = failed
        self.total = total
        self.max_fraction = max_fraction
        self.first_index = first_index
        self.first_data_source = first_data_source
        self.first_failure = first_failure

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword attributes survive pickling (a Ray actor's error reaches the driver).
        return (type(self), (str(self),), self.__dict__)


def _summary(message: str) -> str:
    """One line from a failure message: a traceback's last line plus where it was raised."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    if not lines[0].startswith("Traceback"):
        return " ".join(lines)
    where = next((line for line in reversed(lines) if line.startswith("File ")), None)
    return f"{lines[-1]} ({where})" if where else lines[-1]


@dataclass
class RewardResult:
    """Scores for one batch.

    Attributes:
        scores: ``(B,)`` float32 sequence-level rewards (``error_reward`` for failures).
        extras: Per-sample extra metrics from dict results, as float arrays of length B
            (NaN where a sample did not report that key).
        metrics: Aggregates: ``reward/score/{mean,std,min,max}``, counters
            ``reward/errors``, ``reward/timeouts``, ``reward/garbage``,
            ``recovery/reward_worker_deaths`` (worker processes that died, since the manager
            started; with worker processes), per data source
            ``reward/<data_source>/mean``, per extra ``reward/extra/<key>/mean`` and
            ``reward/time_s``.
        statuses: Per-sample status: ``"ok"``, ``"error"``, ``"timeout"`` or ``"garbage"``.
        failures: Failure message by sample index, for samples whose status is not ``ok``.
    """

    scores: torch.Tensor
    extras: dict[str, np.ndarray]
    metrics: dict[str, float]
    statuses: list[str] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)


class RewardManager:
    """Score batches with registered scorers or a custom reward function.

    Args:
        custom_function: ``"path/to/file.py:function"`` (loaded inside each worker by path),
            a picklable module-level callable, or ``None`` to use the scorer registered for
            each sample's ``data_source``. Its parameters are bound by name (see
            :mod:`polyrl.reward.user_fn`).
        num_workers: Worker processes; ``0`` scores in-process (debugging only: no timeout
            is enforced and a crashing scorer takes the caller down with it).
        timeout_s: Per-sample time limit in seconds (``None``: unlimited). A sample over it
            gets ``error_reward`` and its worker is killed and replaced.
        error_reward: Reward for samples whose scoring failed, timed out or returned garbage.
        tokenizer: Used to decode ``responses`` token ids when a batch has no
            ``response_text`` column (special tokens are skipped).
        mp_context: ``"spawn"`` or ``"forkserver"``; how worker processes are started.
        chunk_size: Samples sent to a worker at a time (default: adaptive, at most 32).
        startup_timeout_s: Longest a new worker may take to start before it is an error.
        max_failure_fraction: Largest fraction of a batch's samples that may fail to score
            (error, timeout or garbage) before :meth:`score` raises
            :class:`RewardFailureError` instead of returning (``None``: never raise).
        rescore_after_death: Score a sample whose worker died (killed from outside) again on
            the worker's replacement; ``False``: :meth:`score` raises
            :class:`~polyrl.reward.pool.RewardWorkerDiedError` instead.

    Workers are started in the constructor and reused; call :meth:`close` (or use the
    manager as a context manager) to stop them. Concurrent ``score`` calls from several
    threads are serialised. Workers are daemonic processes, so a scorer cannot start
    ``multiprocessing`` children of its own (``subprocess`` works).

    It is a :class:`~polyrl.reward.base.Scorer` that reads only the batch's usual columns.
    """

    wants_rows = False
    wants_prompts = False

    def __init__(
        self,
        custom_function: str | Callable[..., Any] | None = None,
        num_workers: int = 2,
        timeout_s: float | None = 10.0,
        error_reward: float = 0.0,
        tokenizer: Any = None,
        mp_context: str = "spawn",
        chunk_size: int | None = None,
        startup_timeout_s: float = 120.0,
        max_failure_fraction: float | None = None,
        rescore_after_death: bool = True,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
        if not isinstance(error_reward, int | float) or not math.isfinite(error_reward):
            raise ValueError(f"error_reward must be a finite number, got {error_reward!r}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s!r}")
        if max_failure_fraction is not None and not (
            isinstance(max_failure_fraction, int | float) and 0.0 <= max_failure_fraction <= 1.0
        ):
            raise ValueError(
                f"max_failure_fraction must be in [0, 1] or None, got {max_failure_fraction!r}"
            )

        self.num_workers = num_workers
        self.timeout_s = float(timeout_s) if timeout_s is not None else None
        self.error_reward = float(error_reward)
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.startup_timeout_s = float(startup_timeout_s)
        self.max_failure_fraction = (
            float(max_failure_fraction) if max_failure_fraction is not None else None
        )
        self.has_custom_function = custom_function is not None
        #: The custom function's name, for error messages (``""`` without one).
        self.custom_name = ""
        self._custom_payload: Payload | None = None
        custom_fn = self._resolve_custom(custom_function)
        self._resolver = ScorerResolver(custom_fn) if num_workers == 0 else None

        self._shipped_fns: dict[str, Any] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._pool = (
            ScoringPool(
                num_workers,
                self._custom_payload,
                timeout_s=self.timeout_s,
                startup_timeout_s=self.startup_timeout_s,
                mp_context=mp_context,
                chunk_size=chunk_size,
                rescore_after_death=rescore_after_death,
            )
            if num_workers > 0
            else None
        )

    # ------------------------------------------------------------------ setup

    def _resolve_custom(self, custom_function: Any) -> Callable[..., Any] | None:
        if custom_function is None:
            return None
        if isinstance(custom_function, str):
            custom_function = load_user_function(custom_function)
        elif not callable(custom_function):
            raise TypeError(
                "custom_function must be a 'path/to/file.py:function' string, a callable or "
                f"None, got {type(custom_function).__name__}"
            )
        bind_scorer(custom_function)  # fail now, in the caller, on an unsupported signature
        self.custom_name = callable_name(custom_function)
        if self.num_workers > 0:
            self._custom_payload = make_payload(custom_function)
        return custom_function

    def _ship_scorers(self, data_sources: set[Any]) -> None:
        """Make sure workers score each data source with the scorer registered here."""
        shipped: dict[str, Any] = {}
        updates: dict[str, Payload] = {}
        for source in data_sources:
            fn = get_scorer(source)  # raises KeyError listing the registered sources
            if self._shipped_fns.get(source) is fn:
                continue
            bind_scorer(fn)
            # Built-ins are registered in every worker already; anything else is sent (and a
            # built-in is sent back if a replaced scorer was shipped under its name earlier).
            builtin = getattr(fn, "__module__", None) == _BUILTIN_MODULE
            if self._pool is not None and (not builtin or source in self._pool.scorers):
                try:
                    payload = make_payload(fn)
                except TypeError as exc:
                    raise TypeError(
                        f"the scorer registered for data_source {source!r}: {exc}"
                    ) from None
                updates[source] = payload
            shipped[source] = fn
        # Only once every source could be shipped: a refused batch leaves nothing half-sent.
        self._shipped_fns.update(shipped)
        if self._resolver is not None:
            self._resolver.update(
                {s: self._shipped_fns[s] for s in data_sources if s in self._shipped_fns}
            )
        if self._pool is not None:
            self._pool.add_scorers(updates)

    # ------------------------------------------------------------------ public API

    def score(self, batch: Batch) -> RewardResult:
        """Score a :class:`polyrl.core.batch.Batch`.

        Uses non-tensor columns ``data_source``, ``ground_truth`` (or verl's
        ``reward_model[i]["ground_truth"]``), optional ``extra_info`` and ``prompt_text``,
        and ``response_text``; without ``response_text`` the ``responses`` tensor is
        decoded with the tokenizer, masked by ``response_mask`` (or the response part of
        ``attention_mask``).

        Raises:
            ValueError: If required columns are missing or cannot be derived.
            KeyError: If a ``data_source`` has no registered scorer (and no custom function).
            RewardFailureError: If more than ``max_failure_fraction`` of the samples failed.
        """
        return self._score_items(self._items_from_batch(batch))

    def score_samples(self, samples: Sequence[Mapping[str, Any]]) -> RewardResult:
        """Score a list of dict samples.

        Each sample has ``response`` (or ``response_text`` / ``solution_str``),
        ``ground_truth`` and ``data_source`` (both optional with a custom function), and
        optionally ``prompt`` (or ``prompt_text``) and ``extra_info``.

        Raises:
            ValueError: If a sample is not a mapping or lacks a required key.
            RewardFailureError: If more than ``max_failure_fraction`` of the samples failed.
        """
        if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
            raise ValueError(f"score_samples expects a list of dicts, got {type(samples).__name__}")
        items: list[Item] = []
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping):
                raise ValueError(f"sample {i} must be a dict, got {type(sample).__name__}")
            response = _first_present(sample, ("response", "response_text", "solution_str"))
            if response is _MISSING:
                raise ValueError(
                    f"sample {i} has no 'response' (or 'response_text' / 'solution_str') key; "
                    f"keys: {sorted(map(str, sample))}"
                )
            missing = [k for k in ("data_source", "ground_truth") if k not in sample]
            if missing and not self.has_custom_function:
                raise ValueError(
                    f"sample {i} lacks {missing}, required to pick and run a registered "
                    "scorer (only a custom_function can do without them)"
                )
            prompt = _first_present(sample, ("prompt", "prompt_text"))
            items.append(
                (
                    i,
                    sample.get("data_source"),
                    None if prompt is _MISSING else prompt,
                    response,
                    sample.get("ground_truth"),
                    sample.get("extra_info"),
                )
            )
        return self._score_items(items)

    def attach_rollout(self, client: ReplicaEndpoints) -> None:
        """Nothing: registered scorers and custom functions do not ask the replicas."""

    def close(self) -> None:
        """Stop the worker processes. Idempotent; the manager cannot score afterwards."""
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the current worker processes (changes when workers are replaced)."""
        return self._pool.pids if self._pool is not None else []

    # ------------------------------------------------------------------ batch input

    def _items_from_batch(self, batch: Batch) -> list[Item]:
        non_tensors = getattr(batch, "non_tensors", None)
        tensors = getattr(batch, "tensors", None)
        if non_tensors is None or tensors is None:
            raise TypeError(
                "RewardManager.score expects a polyrl.core.batch.Batch (with .non_tensors and "
                f".tensors); got {type(batch).__name__}. Use score_samples for a list of dicts."
            )
        n = len(batch)
        tensor_keys = set(tensors.keys())

        def column(name: str) -> list[Any] | None:
            if name not in non_tensors:
                return None
            values = list(non_tensors[name])
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} rows, batch has {n}")
            return values

        missing: list[str] = []
        data_sources = column("data_source")
        ground_truths = column("ground_truth")
        if ground_truths is None and "reward_model" in non_tensors:
            reward_model = column("reward_model")
            assert reward_model is not None
            if all(isinstance(r, Mapping) and "ground_truth" in r for r in reward_model):
                ground_truths = [r["ground_truth"] for r in reward_model]
        if not self.has_custom_function:
            if data_sources is None:
                missing.append("data_source")
            if ground_truths is None:
                missing.append("ground_truth (or reward_model[i]['ground_truth'])")
        responses = column("response_text")
        if responses is None:
            if "responses" not in tensor_keys:
                missing.append("response_text (or tensor 'responses' plus a tokenizer)")
            elif self.tokenizer is None:
                missing.append(
                    "response_text (tensor 'responses' is present but no tokenizer was "
                    "given to RewardManager to decode it)"
                )
        if missing:
            raise ValueError(
                f"batch lacks columns needed for scoring: {', '.join(missing)}; it has "
                f"non-tensor columns {sorted(non_tensors)} and tensors {sorted(tensor_keys)}"
            )
        if responses is None:
            responses = self._decode_responses(tensors, tensor_keys)
        prompts = column("prompt_text")
        if prompts is None and self.tokenizer is not None and "prompts" in tensor_keys:
            prompts = self._decode_prompts(tensors, tensor_keys)
        extra_info = column("extra_info")
        return [
            (
                i,
                data_sources[i] if data_sources is not None else None,
                prompts[i] if prompts is not None else None,
                responses[i],
                ground_truths[i] if ground_truths is not None else None,
                extra_info[i] if extra_info is not None else None,
            )
            for i in range(n)
        ]

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
        rows: list[list[int]] = []
        for r in range(ids.shape[0]):
            row = ids[r] if mask is None else ids[r][mask[r].bool()]
            rows.append(row.tolist())
        if hasattr(self.tokenizer, "batch_decode"):
            return list(self.tokenizer.batch_decode(rows, skip_special_tokens=True))
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in rows]

    def _decode_responses(self, tensors: Any, keys: set[str]) -> list[str]:
        responses = tensors["responses"]
        if responses.dim() != 2:
            raise ValueError(f"tensor 'responses' must be (B, R), got {tuple(responses.shape)}")
        width = responses.shape[1]
        mask = None
        if "response_mask" in keys:
            mask = tensors["response_mask"]
        elif "attention_mask" in keys and tensors["attention_mask"].shape[-1] >= width:
            # verl layout: attention_mask covers prompt + response; the response is the tail.
            mask = tensors["attention_mask"][:, -width:]
        if mask is not None and tuple(mask.shape) != tuple(responses.shape):
            raise ValueError(
                f"response mask shape {tuple(mask.shape)} does not match 'responses' "
                f"{tuple(responses.shape)}"
            )
        return self._decode(responses.cpu(), None if mask is None else mask.cpu())

    def _decode_prompts(self, tensors: Any, keys: set[str]) -> list[str]:
        prompts = tensors["prompts"]
        width = prompts.shape[-1]
        mask = None
        if "attention_mask" in keys:
            attention = tensors["attention_mask"]
            total = width + (tensors["responses"].shape[-1] if "responses" in keys else 0)
            if attention.shape[-1] == total:
                mask = attention[:, :width]
        return self._decode(prompts.cpu(), None if mask is None else mask.cpu())

    # ------------------------------------------------------------------ scoring

    def _score_items(self, items: list[Item]) -> RewardResult:
        # One batch at a time: the pool's book-keeping is not shared between callers.
        with self._lock:
            return self._score_items_locked(items)

    def _score_items_locked(self, items: list[Item]) -> RewardResult:
        if self._closed:
            raise RuntimeError("this RewardManager is closed; create a new one to score")
        start = time.perf_counter()
        if not self.has_custom_function:
            self._ship_scorers({item[1] for item in items})
        if self._pool is None:
            assert self._resolver is not None
            outcomes = [score_one(item, self._resolver) for item in items]
        else:
            outcomes = self._pool.run(items)
        self._check_result_types(items, outcomes)
        result = self._assemble(items, outcomes, time.perf_counter() - start)
        self._check_failures(items, result)
        return result

    def _check_result_types(self, items: list[Item], outcomes: list[Outcome]) -> None:
        """Raise :class:`RewardResultError` if a function returned several values for a sample."""
        for item, (status, _, _, message) in zip(items, outcomes, strict=True):
            if status != "wrong_type":
                continue
            name = (
                repr(self.custom_name)
                if self.has_custom_function
                else f"registered for data_source {item[1]!r}"
            )
            what = message.removeprefix("reward function returned ").split("; expected")[0]
            raise RewardResultError(
                f"reward function {name} returned {what} for sample {item[0]}; a per-sample "
                "function must return one number (or a dict with a 'score'); a function that "
                "scores the whole batch must take a 'completions' parameter (TRL style)"
            )

    def _check_failures(self, items: list[Item], result: RewardResult) -> None:
        """Raise :class:`RewardFailureError` if too many of the batch's samples failed."""
        limit = self.max_failure_fraction
        failed = len(result.failures)
        if limit is None or not failed or failed <= limit * len(items):
            return
        position = next(p for p, status in enumerate(result.statuses) if status != "ok")
        index, data_source = items[position][0], items[position][1]
        counts = collections.Counter(result.statuses)
        total = len(items)
        raise RewardFailureError(
            f"reward scoring failed on {failed} of {total} samples ({failed / total:.0%}: "
            f"{counts['error']} errors, {counts['timeout']} timeouts, {counts['garbage']} "
            f"garbage results), more than max_failure_fraction={limit:g} "
            f"(reward.max_failure_fraction) allows; first failure (sample {index}, "
            f"data_source {data_source!r}): {_summary(result.failures[index])}",
            failed=failed,
            total=total,
            max_fraction=limit,
            first_index=index,
            first_data_source=data_source,
            first_failure=result.failures[index],
        )

    def _assemble(self, items: list[Item], outcomes: list[Outcome], elapsed: float) -> RewardResult:
        n = len(items)
        scores = np.full(n, self.error_reward, dtype=np.float64)
        statuses: list[str] = []
        failures: dict[int, str] = {}
        extras: dict[str, np.ndarray] = {}
        for p, (item, (status, score, item_extras, message)) in enumerate(
            zip(items, outcomes, strict=True)
        ):
            statuses.append(status)
            if status == "ok":
                scores[p] = score
                for key, value in item_extras.items():
                    if key not in extras:
                        extras[key] = np.full(n, np.nan, dtype=np.float64)
                    extras[key][p] = value
            else:
                failures[item[0]] = message

        metrics: dict[str, float] = {
            "reward/errors": float(statuses.count("error")),
            "reward/timeouts": float(statuses.count("timeout")),
            "reward/garbage": float(statuses.count("garbage")),
            "reward/time_s": float(elapsed),
        }
        # Since the manager started: a killed worker's item was scored again, so the run lost
        # nothing, but it happened. In-process scoring has no workers to lose: 0, so that a run's
        # metric columns do not depend on reward.num_workers.
        metrics[WORKER_DEATHS] = float(self._pool.deaths) if self._pool is not None else 0.0
        if n:
            metrics.update(
                {
                    "reward/score/mean": float(scores.mean()),
                    "reward/score/std": float(scores.std()),
                    "reward/score/min": float(scores.min()),
                    "reward/score/max": float(scores.max()),
                }
            )
            by_source: dict[str, list[int]] = {}
            for p, item in enumerate(items):
                if item[1] is not None:
                    by_source.setdefault(str(item[1]), []).append(p)
            for source, positions in sorted(by_source.items()):
                metrics[f"reward/{source}/mean"] = float(scores[positions].mean())
            for key, values in extras.items():
                metrics[f"reward/extra/{key}/mean"] = float(np.nanmean(values))
        if failures:
            first = next(iter(failures.items()))
            logger.warning(
                "reward scoring: %d errors, %d timeouts, %d garbage results out of %d samples; "
                "first failure (sample %d): %s",
                statuses.count("error"),
                statuses.count("timeout"),
                statuses.count("garbage"),
                n,
                first[0],
                first[1],
            )
        return RewardResult(
            scores=torch.from_numpy(scores.astype(np.float32)),
            extras=extras,
            metrics=metrics,
            statuses=statuses,
            failures=failures,
        )


_MISSING = object()


def _first_present(sample: Mapping[str, Any], keys: Sequence[str]) -> Any:
    for key in keys:
        if key in sample:
            return sample[key]
    return _MISSING
