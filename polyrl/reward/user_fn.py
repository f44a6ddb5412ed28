"""Loading user reward functions by path and calling them with the arguments they accept.

Two common conventions both work because arguments are passed by parameter *name*::

    def compute_reward(prompt, response): ...                      # simple style
    def compute_score(data_source, solution_str, ground_truth, extra_info=None): ...  # verl

Supported names: ``prompt``, ``response`` (alias ``solution_str``), ``ground_truth``,
``data_source`` and ``extra_info``; a ``**kwargs`` parameter receives all of them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import math
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SUPPORTED_ARGUMENTS",
    "GarbageResultError",
    "RewardFunctionError",
    "RewardResultError",
    "ScorerBinding",
    "WrongResultTypeError",
    "bind_scorer",
    "call_scorer",
    "callable_name",
    "describe_value",
    "load_user_function",
    "normalize_result",
]

#: Parameter names a reward function may declare, and what each receives.
SUPPORTED_ARGUMENTS: dict[str, str] = {
    "prompt": "the prompt text (None when unavailable)",
    "response": "the decoded response text",
    "solution_str": "alias of response (verl convention)",
    "ground_truth": "the sample's ground truth",
    "data_source": "the sample's data_source",
    "extra_info": "the sample's extra_info dict (or None)",
}


#: Prefix of the module names :func:`load_user_function` gives the files it imports.
USER_MODULE_PREFIX = "polyrl_user_fn_"


class GarbageResultError(ValueError):
    """A reward function returned something that is not a finite score or a score dict."""


class WrongResultTypeError(GarbageResultError):
    """A per-sample reward function returned several values (a list, tuple or array).

    Unlike ``None``, NaN or a string (a garbage score for one sample, counted and bounded by
    ``max_failure_fraction``), this is a mistake in the function itself, most often a batched
    function that was not recognised as one: the reward manager stops the run with a
    :class:`RewardResultError`.
    """


class RewardFunctionError(Exception):
    """A user reward function cannot be loaded or called as given: a user error.

    What :func:`load_user_function` and :func:`bind_scorer` raise is also an instance of the
    built-in type the failure corresponds to (``ImportError``, ``AttributeError``,
    ``TypeError``, ``ValueError`` or ``FileNotFoundError``).
    """


class RewardResultError(RewardFunctionError, TypeError):
    """A reward function returned the wrong type or number of values: a user error.

    The message names the function and what it returned.
    """


class _SpecError(RewardFunctionError, ValueError):
    pass


class _FileNotFound(RewardFunctionError, FileNotFoundError):
    pass


class _ImportFailed(RewardFunctionError, ImportError):
    pass


class _NoSuchFunction(RewardFunctionError, AttributeError):
    pass


class _BadSignature(RewardFunctionError, TypeError):
    pass


def load_user_function(spec: str) -> Callable[..., Any]:
    """Load ``"path/to/file.py:function_name"`` and return the function.

    The file is imported as a fresh module (named after its absolute path so two files
    with the same name do not collide) and registered in ``sys.modules``. The returned
    callable carries the spec in ``__polyrl_spec__`` so it can be re-loaded by path in
    worker processes instead of being pickled.

    Raises:
        RewardFunctionError: For each failure below; it is also an instance of that type.
        ValueError: If ``spec`` is not of the form ``"path.py:function"``.
        FileNotFoundError: If the file does not exist.
        ImportError: If executing the file fails.
        AttributeError: If the file defines no such name.
        TypeError: If the name is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise _SpecError(
            f"user function spec must look like 'path/to/file.py:function_name', got {spec!r}"
        )
    path, _, name = spec.rpartition(":")
    if not path or not name or not name.isidentifier():
        raise _SpecError(
            f"user function spec must look like 'path/to/file.py:function_name' with a valid "
            f"Python identifier after the last ':', got {spec!r}"
        )
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise _FileNotFound(f"reward function file {path!r} (from spec {spec!r}) not found")

    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    module_name = f"{USER_MODULE_PREFIX}{digest}"
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__file__", None) != path:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise _ImportFailed(f"cannot import reward function file {path!r}: not a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(module_name, None)
            raise _ImportFailed(
                f"importing reward function file {path!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    if not hasattr(module, name):
        available = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
        )
        raise _NoSuchFunction(
            f"reward function file {path!r} has no attribute {name!r}; callables defined "
            f"there: {', '.join(available) or '(none)'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise _BadSignature(
            f"{name!r} in {path!r} is a {type(fn).__name__}, not a callable reward function"
        )
    try:
        fn.__polyrl_spec__ = f"{path}:{name}"
    except (AttributeError, TypeError):
        pass  # builtins / slotted callables cannot take attributes; they get pickled instead
    return fn


@dataclass(frozen=True)
class ScorerBinding:
    """How to call one reward function: which named arguments it takes.

    Attributes:
        fn: The function.
        names: Supported argument names it declares (passed by keyword).
        positional: Supported names of positional-only parameters, passed positionally.
        takes_all: True if it has ``**kwargs`` (it receives every supported argument).
    """

    fn: Callable[..., Any]
    names: tuple[str, ...]
    positional: tuple[str, ...]
    takes_all: bool

    def __call__(self, values: Mapping[str, Any]) -> Any:
        """Call the function with the subset of ``values`` it accepts."""
        args = [values[n] for n in self.positional]
        if self.takes_all:
            kwargs = {k: v for k, v in values.items() if k not in self.positional}
        else:
            kwargs = {n: values[n] for n in self.names}
        return self.fn(*args, **kwargs)


def bind_scorer(fn: Callable[..., Any]) -> ScorerBinding:
    """Inspect ``fn``'s signature and decide which arguments to pass it by name.

    Raises:
        TypeError: If ``fn`` is not callable, its signature cannot be inspected, or it
            requires a parameter that is not one of :data:`SUPPORTED_ARGUMENTS` (it is also
            a :class:`RewardFunctionError`).
    """
    if not callable(fn):
        raise _BadSignature(f"reward function must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise _BadSignature(
            f"cannot inspect the signature of reward function {fn!r}: {exc}"
        ) from exc

    names: list[str] = []
    positional: list[str] = []
    takes_all = False
    label = getattr(fn, "__qualname__", repr(fn))
    for param in sig.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            takes_all = True
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        known = param.name in SUPPORTED_ARGUMENTS
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            if known and len(positional) == _index_of(sig, param):
                positional.append(param.name)
                continue
            if param.default is inspect.Parameter.empty:
                raise _BadSignature(
                    f"reward function {label} has positional-only parameter {param.name!r} "
                    "that cannot be supplied; supported parameter names: "
                    f"{', '.join(SUPPORTED_ARGUMENTS)}"
                )
            continue  # optional and unsupported: left to its default
        if known:
            names.append(param.name)
        elif param.default is inspect.Parameter.empty:
            raise _BadSignature(
                f"reward function {label} requires parameter {param.name!r}, which the reward "
                f"manager cannot supply; supported parameter names: "
                f"{', '.join(SUPPORTED_ARGUMENTS)} (or accept **kwargs)"
            )
    return ScorerBinding(fn, tuple(names), tuple(positional), takes_all)


def _index_of(sig: inspect.Signature, param: inspect.Parameter) -> int:
    return list(sig.parameters).index(param.name)


# Weak keys so that caching a binding never keeps a short-lived function alive.
_BINDINGS: weakref.WeakKeyDictionary[Any, ScorerBinding] = weakref.WeakKeyDictionary()


def call_scorer(
    fn: Callable[..., Any] | ScorerBinding,
    *,
    prompt: str | None,
    response: str,
    ground_truth: Any,
    data_source: str | None,
    extra_info: dict | None,
) -> Any:
    """Call a reward function, passing only the parameters it accepts by name.

    ``fn`` may be a plain callable (its :class:`ScorerBinding` is computed once and cached)
    or a precomputed binding. The raw result is returned; see :func:`normalize_result`.

    Raises:
        TypeError: If ``fn`` requires a parameter that cannot be supplied.
    """
    if isinstance(fn, ScorerBinding):
        binding = fn
    else:
        try:
            binding = _BINDINGS.get(fn)
        except TypeError:  # not weak-referenceable or not hashable: bind every time
            binding = None
        if binding is None:
            binding = bind_scorer(fn)
            try:
                _BINDINGS[fn] = binding
            except TypeError:
                pass
    values = {
        "prompt": prompt,
        "response": response,
        "solution_str": response,
        "ground_truth": ground_truth,
        "data_source": data_source,
        "extra_info": extra_info,
    }
    return binding(values)


def _to_float(value: Any) -> float | None:
    """Convert bool/int/float/numpy or torch scalars to float; None for anything else."""
    if isinstance(value, bool | int | float):
        return float(value)
    # numpy scalars, 0-d numpy arrays and 0-d torch tensors all expose .item() and shape ().
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, bool | int | float):
            return float(item)
    return None


def normalize_result(result: Any) -> tuple[float, dict[str, float]]:
    """Normalise a reward function's return value to ``(score, extras)``.

    Accepted: a finite bool/int/float/numpy/torch scalar, or a dict with a finite scalar
    ``"score"`` plus optional extra metrics. Extra values that are numeric scalars are kept
    as floats (bools become 0/1); non-numeric extras such as strings are dropped.

    Raises:
        GarbageResultError: For anything else (None, str, NaN/inf, dict without ``score``).
    """
    if isinstance(result, Mapping):
        if "score" not in result:
            raise GarbageResultError(
                f"reward function returned a dict without a 'score' key (keys: "
                f"{sorted(map(str, result))})"
            )
        score = _to_float(result["score"])
        if score is None or not math.isfinite(score):
            raise GarbageResultError(
                f"reward function returned a non-finite or non-numeric score {result['score']!r}"
            )
        extras: dict[str, float] = {}
        for key, value in result.items():
            if key == "score":
                continue
            as_float = _to_float(value)
            if as_float is not None:
                extras[str(key)] = as_float
        return score, extras
    score = _to_float(result)
    if score is None or not math.isfinite(score):
        error = WrongResultTypeError if _several_values(result) else GarbageResultError
        raise error(
            f"reward function returned {describe_value(result)}; expected a finite "
            "number or a dict with a 'score'"
        )
    return score, {}


def callable_name(fn: Any) -> str:
    """Return a function's display name: ``__name__`` (through ``functools.partial``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _several_values(value: Any) -> bool:
    """Tell whether ``value`` is a list, tuple, set or array of 1+ dimensions (many values)."""
    if isinstance(value, list | tuple | set | frozenset):
        return True
    shape = getattr(value, "shape", None)
    return isinstance(shape, tuple) and len(shape) > 0


def describe_value(value: Any, limit: int = 200) -> str:
    """Say what ``value`` is, for error messages: ``a list of 3 values ([1, 0, 1])``."""
    shown = repr(value)
    if len(shown) > limit:
        shown = shown[:limit] + "..."
    if isinstance(value, list | tuple | set | dict):
        return f"a {type(value).__name__} of {len(value)} values ({shown})"
    if value is None:
        return "None"
    return f"{type(value).__name__} {shown}"
