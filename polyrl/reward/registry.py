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

from polyrl.core.registry import Registry

__all__ = ["SCORERS", "Scorer", "extract_answer", "get_scorer", "register_scorer"]

Scorer = Callable[..., Any]

#: Every registered ``data_source`` name (aliases included) to its scorer. The built-in scorers
#: (:mod:`polyrl.reward.scorers`) register themselves when ``polyrl.reward`` is imported.
SCORERS: Registry[Scorer] = Registry(
    "scorer",
    hint="register one with @register_scorer(data_source) or pass a custom_function to the "
    "RewardManager",
)
get_scorer = SCORERS.get


def register_scorer(*data_sources: str, overwrite: bool = False) -> Callable[[Scorer], Scorer]:
    """Register the decorated function as the scorer for one or more ``data_source`` names.

    Args:
        *data_sources: Names (the first is the canonical one, the rest aliases).
        overwrite: Allow replacing an existing registration with a different function.

    Returns:
        A decorator that registers the function (under every name or, on an error, none) and
        returns it unchanged.

    Raises:
        ValueError: If no name is given, a name is empty or not a string, or a name is
            already registered to a different function and ``overwrite`` is false.
        TypeError: If the decorated object is not callable.
    """
    register = SCORERS.register(*data_sources, overwrite=overwrite)

    def decorator(fn: Scorer) -> Scorer:
        if not callable(fn):
            raise TypeError(f"register_scorer expects a callable, got {type(fn).__name__}")
        return register(fn)

    return decorator


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
