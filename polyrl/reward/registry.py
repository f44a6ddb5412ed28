"""Registry of built-in and user scorers, keyed by a sample's ``data_source``.

A scorer has the signature::

    fn(response: str, ground_truth: Any, extra_info: dict | None = None,
       prompt: str | None = None) -> float | dict

and returns either a score or a dict with a ``"score"`` key plus extra numeric metrics.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["SCORERS", "Scorer", "extract_answer", "get_scorer", "register_scorer"]

Scorer = Callable[..., Any]

#: Mapping of every registered ``data_source`` name (aliases included) to its scorer.
SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str, overwrite: bool = False) -> Callable[[Scorer], Scorer]:
    """Register the decorated function as the scorer for one or more ``data_source`` names.

    Args:
        *data_sources: Names (the first is the canonical one, the rest aliases).
        overwrite: Allow replacing an existing registration with a different function.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: If no name is given, a name is empty or not a string, or a name is
            already registered to a different function and ``overwrite`` is false.
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source name, got none")
    for name in data_sources:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"data_source names must be non-empty strings, got {name!r}")

    def decorator(fn: Scorer) -> Scorer:
        if not callable(fn):
            raise TypeError(f"register_scorer expects a callable, got {type(fn).__name__}")
        for name in data_sources:
            existing = SCORERS.get(name)
            if existing is not None and existing is not fn and not overwrite:
                raise ValueError(
                    f"data_source {name!r} is already registered to "
                    f"{getattr(existing, '__qualname__', existing)!r}; pass overwrite=True "
                    "to replace it"
                )
        for name in data_sources:
            SCORERS[name] = fn
        return fn

    return decorator


def get_scorer(data_source: str) -> Scorer:
    """Return the scorer registered for ``data_source``.

    Raises:
        KeyError: If nothing is registered under that name; the message lists the
            registered names.
    """
    _ensure_builtins()
    try:
        return SCORERS[data_source]
    except (KeyError, TypeError):
        known = ", ".join(sorted(SCORERS)) or "(none)"
        raise KeyError(
            f"no scorer registered for data_source {data_source!r}; registered data sources: "
            f"{known}. Register one with @register_scorer({data_source!r}) or pass a "
            "custom_function to the RewardManager."
        ) from None


def _ensure_builtins() -> None:
    # The built-in scorers register themselves on import; importing lazily here keeps
    # `get_scorer` correct even when a caller only imported this module.
    from polyrl.reward import scorers  # noqa: F401


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_answer(response: str | None) -> str | None:
    """Extract the final answer from a model response.

    Returns the content of the last ``<answer>...</answer>`` block if there is one, else
    the text after the last ``####``, else the whole response; always stripped. Returns
    ``None`` for ``None`` or an empty / whitespace-only result.

    Raises:
        TypeError: If ``response`` is neither a string nor ``None``.
    """
    if response is None:
        return None
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    tags = _ANSWER_TAG.findall(response)
    if tags:
        answer = tags[-1]
    elif "####" in response:
        answer = response.rsplit("####", 1)[1]
    else:
        answer = response
    answer = answer.strip()
    return answer or None
