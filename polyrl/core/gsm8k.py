"""GSM8K answers: the final number of a response, and its exact match with the ground truth.

Shared by the ``gsm8k`` reward scorers (:mod:`polyrl.reward.scorers`) and the GSM8K answer-check
tool of the agent loops (:mod:`polyrl.agent.tools`), which sit in layers that may not import
each other.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["gsm8k_extract", "gsm8k_score"]

_GSM8K_STRICT = re.compile(r"####\s*(-?[$0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
# Like verl, only the tail of a long response is searched so a stray "####" early in a
# rambling answer does not count.
_GSM8K_TAIL_CHARS = 300


def _clean_number(text: str) -> str | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    return cleaned if re.fullmatch(r"-?\d+(?:\.\d+)?", cleaned) else None


def gsm8k_extract(response: str, method: str = "strict") -> str | None:
    """Extract the final number from a GSM8K-style response.

    ``strict``: the number after the last ``####`` (commas and ``$`` removed).
    ``flexible``: the last number anywhere in the response.

    Raises:
        ValueError: If ``method`` is not ``"strict"`` or ``"flexible"``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    tail = response[-_GSM8K_TAIL_CHARS:]
    pattern = _GSM8K_STRICT if method == "strict" else _GSM8K_FLEXIBLE
    for candidate in reversed(pattern.findall(tail)):
        cleaned = _clean_number(candidate)
        if cleaned is not None:
            return cleaned
        if method == "strict":
            return None
    return None


def _gsm8k_ground_truth(ground_truth: Any) -> Decimal:
    text = str(ground_truth) if isinstance(ground_truth, int | float) else ground_truth
    if isinstance(text, str):
        if "####" in text:
            text = text.rsplit("####", 1)[1]
        cleaned = _clean_number(text)
        if cleaned is not None:
            return Decimal(cleaned)
    raise ValueError(
        "gsm8k: ground_truth must be a number, a numeric string, or a solution ending in "
        f"'#### <number>', got {ground_truth!r}"
    )


def gsm8k_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
) -> float:
    """Exact numeric match of the GSM8K answer.

    ``extra_info["method"]`` (``"strict"`` / ``"flexible"``) overrides ``method``; see
    :func:`gsm8k_extract`. A wrong but extractable answer earns ``format_score``.

    Raises:
        ValueError: If ``ground_truth`` holds no number or ``method`` is unknown.
    """
    expected = _gsm8k_ground_truth(ground_truth)
    if extra_info and extra_info.get("method") is not None:
        method = extra_info["method"]
    answer = gsm8k_extract(response, method)
    if answer is None:
        return 0.0
    try:
        return 1.0 if Decimal(answer) == expected else float(format_score)
    except InvalidOperation:
        return 0.0
