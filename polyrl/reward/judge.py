"""Generative judge: a language model reads a response and its verdict becomes a score.

This module holds the pure parts: the prompt (:func:`format_judge_prompt`) and the verdict
parser (:func:`parse_verdict`). The trainer sends the prompts to a rollout server (the policy's
own replicas, or another OpenAI-compatible server) and counts the verdicts that do not parse:
they score 0 and are reported as ``reward/judge_parse_failures``, never dropped silently.

Verdict formats (``reward.judge_parse``):

* ``yes_no``: the last standalone ``YES`` or ``NO`` (any case) decides: 1 or 0;
* ``number``: the last number in the verdict, divided by ``judge_max_score`` (so a 0-10 grade
  becomes 0-1), clipped to [0, 1];
* a regular expression (any other string): its last match's first group (or the whole match)
  is read as ``yes``/``no``/``true``/``false`` or as a number, as above.
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

__all__ = [
    "JUDGE_FIELDS",
    "JUDGE_PARSERS",
    "check_template",
    "format_judge_prompt",
    "parse_verdict",
]

#: The fields a judge template may use.
JUDGE_FIELDS = ("prompt", "response", "ground_truth")
#: Built-in verdict parsers (any other value of ``judge_parse`` is a regular expression).
JUDGE_PARSERS = ("yes_no", "number")

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_WORDS = {"yes": 1.0, "true": 1.0, "correct": 1.0, "no": 0.0, "false": 0.0, "incorrect": 0.0}


def check_template(template: str) -> None:
    """Raise ``ValueError`` if ``template`` uses a field other than :data:`JUDGE_FIELDS`."""
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None and field not in JUDGE_FIELDS:
            raise ValueError(
                f"judge template field {{{field}}} is unknown; the fields are "
                f"{', '.join('{' + f + '}' for f in JUDGE_FIELDS)} (write {{{{ and }}}} for braces)"
            )


def format_judge_prompt(template: str, prompt: Any, response: str, ground_truth: Any) -> str:
    """Fill ``template``'s ``{prompt}``, ``{response}`` and ``{ground_truth}``.

    ``prompt`` may be chat messages: their contents are joined by newlines.

    Raises:
        ValueError: If the template uses another field.
    """
    check_template(template)
    if isinstance(prompt, list | tuple):
        prompt = "\n".join(
            str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt
        )
    return template.format(
        prompt="" if prompt is None else str(prompt),
        response=response,
        ground_truth="" if ground_truth is None else str(ground_truth),
    )


def _read(text: str, max_score: float) -> float | None:
    word = _WORDS.get(text.strip().lower())
    if word is not None:
        return word
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1])
    if not math.isfinite(value):
        return None
    return min(max(value / max_score, 0.0), 1.0)


def parse_verdict(verdict: str, parse: str = "yes_no", max_score: float = 1.0) -> float | None:
    """Read a judge's verdict as a score in [0, 1]; ``None`` when it does not parse.

    See the module docstring for ``parse``; ``max_score`` scales numbers (``number`` and
    regular expressions).

    Raises:
        ValueError: If ``max_score`` is not positive or ``parse`` is an invalid expression.
    """
    if not max_score > 0:
        raise ValueError(f"max_score must be > 0, got {max_score!r}")
    if not isinstance(verdict, str):
        return None
    if parse == "yes_no":
        found = _YES_NO.findall(verdict)
        return (1.0 if found[-1].lower() == "yes" else 0.0) if found else None
    if parse == "number":
        numbers = _NUMBER.findall(verdict)
        return _read(numbers[-1], max_score) if numbers else None
    try:
        pattern = re.compile(parse)
    except re.error as exc:
        raise ValueError(f"judge parse expression {parse!r} is invalid: {exc}") from None
    matches = list(pattern.finditer(verdict))
    if not matches:
        return None
    last = matches[-1]
    return _read(last.group(1) if pattern.groups else last.group(0), max_score)
