"""Built-in rule-based scorers: arithmetic, countdown, string tasks, GSM8K, MATH, DAPO math.

Every scorer follows the registry signature ``fn(response, ground_truth, extra_info=None,
prompt=None)`` and is pure Python except ``math``, which uses the ``math-verify`` library.
"""

from __future__ import annotations

import logging
import operator
import re
import threading
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from polyrl.core.expressions import ExpressionError, evaluate_expression
from polyrl.core.gsm8k import gsm8k_extract, gsm8k_score
from polyrl.reward.registry import extract_answer, register_scorer

__all__ = [
    "ExpressionError",
    "arithmetic_score",
    "countdown_score",
    "dapo_extract",
    "dapo_normalize",
    "evaluate_expression",
    "gsm8k_extract",
    "gsm8k_score",
    "math_dapo_score",
    "math_score",
    "set_math_verify_timeout",
    "string_reverse_score",
    "string_sort_score",
    "visual_count_score",
]


# --------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------

# A number with optional thousands separators and decimals; decimals are matched so that
# "19.5" is read as one non-integer rather than as the integer 5.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _parse_int_ground_truth(ground_truth: Any, task: str) -> int:
    if isinstance(ground_truth, bool):
        raise ValueError(f"{task}: ground_truth must be an integer string like '19', got a bool")
    if isinstance(ground_truth, int):
        return ground_truth
    if isinstance(ground_truth, str):
        text = ground_truth.strip().replace(",", "")
        if re.fullmatch(r"[-+]?\d+", text):
            return int(text)
    raise ValueError(
        f"{task}: ground_truth must be an integer or an integer string like '19' or '-3', "
        f"got {ground_truth!r}"
    )


def _last_integer(text: str) -> int | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    value = Decimal(matches[-1].replace(",", ""))
    if value != value.to_integral_value():
        return None
    return int(value)


@register_scorer("arithmetic")
def arithmetic_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """Exact match of the integer answer.

    The answer is taken with :func:`extract_answer`, then its last number; a non-integer
    last number (``"19.5"``) is wrong, ``"19.0"`` counts as ``19``.

    Raises:
        ValueError: If ``ground_truth`` is not an integer or an integer string.
    """
    expected = _parse_int_ground_truth(ground_truth, "arithmetic")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got = _last_integer(answer)
    return 1.0 if got is not None and got == expected else 0.0


@register_scorer("visual_count")
def visual_count_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """Exact match of the count of the ``visual_count`` task (its last integer, as arithmetic).

    Raises:
        ValueError: If ``ground_truth`` is not an integer or an integer string.
    """
    expected = _parse_int_ground_truth(ground_truth, "visual_count")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got = _last_integer(answer)
    return 1.0 if got is not None and got == expected else 0.0


# --------------------------------------------------------------------------------------
# countdown: a tokenizer + recursive-descent parser over integers, + - * / and parentheses
# --------------------------------------------------------------------------------------


def _countdown_ground_truth(ground_truth: Any) -> tuple[int, list[int]]:
    if (
        not isinstance(ground_truth, Mapping)
        or "target" not in ground_truth
        or ("numbers" not in ground_truth)
    ):
        raise ValueError(
            "countdown: ground_truth must be a dict {'target': int, 'numbers': [int, ...]}, "
            f"got {ground_truth!r}"
        )
    try:
        target = _as_int(ground_truth["target"])
        numbers = [_as_int(x) for x in ground_truth["numbers"]]
    except (TypeError, ValueError):
        raise ValueError(
            "countdown: ground_truth 'target' must be an int and 'numbers' a list of ints, "
            f"got {ground_truth!r}"
        ) from None
    return target, numbers


def _as_int(x: Any) -> int:
    if isinstance(x, bool):
        raise TypeError("bool is not an integer here")
    if isinstance(x, str):
        return int(x.strip())
    # Accepts int and numpy integers, rejects floats (TypeError).
    return operator.index(x)


@register_scorer("countdown")
def countdown_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
    *,
    format_score: float = 0.0,
) -> dict[str, Any]:
    """Score a countdown answer: an expression using each given number exactly once.

    The expression comes from :func:`extract_answer`; a trailing ``= <target>`` is allowed
    (any other right-hand side makes the answer malformed). ``extra_info["format_score"]``,
    when present, overrides ``format_score``: the credit for a well-formed but wrong
    expression.

    Returns:
        ``{"score": 1.0 if correct, format_score if a valid expression but wrong, else
        0.0, "valid_expr": bool}``.

    Raises:
        ValueError: If ``ground_truth`` is not ``{"target": int, "numbers": [int, ...]}``.
    """
    target, numbers = _countdown_ground_truth(ground_truth)
    if extra_info and extra_info.get("format_score") is not None:
        format_score = float(extra_info["format_score"])
    answer = extract_answer(response)
    if answer is None:
        return {"score": 0.0, "valid_expr": False}
    expression = answer
    if "=" in answer:
        lhs, _, rhs = answer.partition("=")
        # Only "<expr> = <target>" is accepted; anything else after '=' is malformed.
        claimed = rhs.strip().rstrip(".").strip()
        if not re.fullmatch(r"-?\d{1,18}", claimed) or int(claimed) != target:
            return {"score": 0.0, "valid_expr": False}
        expression = lhs
    try:
        value, used = evaluate_expression(expression)
    except ExpressionError:
        return {"score": 0.0, "valid_expr": False}
    correct = value == target and sorted(used) == sorted(numbers)
    return {"score": 1.0 if correct else float(format_score), "valid_expr": True}


# --------------------------------------------------------------------------------------
# string tasks
# --------------------------------------------------------------------------------------


def _string_match(response: str, ground_truth: Any, task: str) -> float:
    if not isinstance(ground_truth, str):
        raise ValueError(f"{task}: ground_truth must be a str, got {type(ground_truth).__name__}")
    answer = extract_answer(response)
    return 1.0 if answer is not None and answer == ground_truth.strip() else 0.0


@register_scorer("string_reverse")
def string_reverse_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """Exact match of the extracted answer with the reversed string in ``ground_truth``."""
    return _string_match(response, ground_truth, "string_reverse")


@register_scorer("string_sort")
def string_sort_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """Exact match of the extracted answer with the sorted string in ``ground_truth``."""
    return _string_match(response, ground_truth, "string_sort")


# --------------------------------------------------------------------------------------
# GSM8K (the answer check itself is polyrl.core.gsm8k, shared with the agent's tool)
# --------------------------------------------------------------------------------------


@register_scorer("gsm8k", "openai/gsm8k")
def gsm8k_strict_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """GSM8K with strict ``#### <number>`` extraction (see :func:`gsm8k_score`)."""
    return gsm8k_score(response, ground_truth, extra_info, prompt, method="strict")


@register_scorer("gsm8k_flexible")
def gsm8k_flexible_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> float:
    """GSM8K taking the last number in the response (see :func:`gsm8k_score`)."""
    return gsm8k_score(response, ground_truth, extra_info, prompt, method="flexible")


# --------------------------------------------------------------------------------------
# MATH via math-verify
# --------------------------------------------------------------------------------------

# math-verify guards parse/verify with signal.alarm, which only works in a process's main
# thread (elsewhere it raises ValueError). This timeout is used only in the main thread;
# reward workers disable it because the RewardManager kills a worker that overruns.
_math_verify_timeout_s: int | None = 5
_math_verify_logging_configured = False


def set_math_verify_timeout(seconds: int | None) -> None:
    """Set math-verify's own (signal-based) timeout, used only in the main thread.

    ``None`` or ``0`` disables it; reward worker processes do that because the
    ``RewardManager`` enforces its own per-sample timeout by killing the worker.

    Raises:
        ValueError: If ``seconds`` is negative or not an integer.
    """
    global _math_verify_timeout_s
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int)):
        raise ValueError(
            f"math-verify timeout must be an int number of seconds or None, got {seconds!r}"
        )
    if seconds is not None and seconds < 0:
        raise ValueError(f"math-verify timeout must be >= 0, got {seconds}")
    _math_verify_timeout_s = seconds or None


def _effective_math_timeout() -> int | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return _math_verify_timeout_s


class _DropTimeoutDisabledWarning(logging.Filter):
    # math-verify warns once per module when its timeout is off; we disable it on purpose.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _math_verify():
    global _math_verify_logging_configured
    import math_verify  # imported lazily: it pulls in sympy (~1 s)

    if not _math_verify_logging_configured:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _math_verify_logging_configured = True
    return math_verify


def _answer_list(task: str, ground_truth: Any) -> list[str]:
    """Return the acceptable answers of a math ground truth (one, or a list), as strings.

    Raises:
        ValueError: a bool, ``None``, an empty list, or an entry that is not a non-empty
            string or number; the message starts with ``task``.
    """
    if isinstance(ground_truth, bool) or ground_truth is None:
        raise ValueError(f"{task}: ground_truth must be a str or number, got {ground_truth!r}")
    golds = list(ground_truth) if isinstance(ground_truth, list | tuple) else [ground_truth]
    if not golds:
        raise ValueError(f"{task}: ground_truth is an empty list")
    for gold in golds:
        valid = isinstance(gold, str | int | float) and not isinstance(gold, bool)
        if not valid or not str(gold).strip():
            raise ValueError(
                f"{task}: each ground_truth must be a non-empty str or number, got {gold!r}"
            )
    return [str(gold) for gold in golds]


def _parse_gold(mv: Any, gold: str, timeout: int | None) -> list:
    text = gold.strip()
    if "\\boxed" not in text and "$" not in text:
        # Bare answers like "\dfrac{3}{4}" or "B" only parse reliably inside \boxed{}.
        text = f"\\boxed{{{text}}}"
    return mv.parse(text, parsing_timeout=timeout)


@register_scorer(
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
)
def math_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> dict[str, float]:
    r"""Mathematical equivalence of the final answer via ``math-verify``.

    ``ground_truth`` is a LaTeX answer (``"\frac{1}{2}"``), a full solution containing
    ``\boxed{...}``, a number, or a list of acceptable answers. The response is parsed
    ``\boxed{}``-aware; if it has ``<answer>`` tags only their content is used.

    Returns:
        ``{"score": 1.0 or 0.0, "answer_found": 1.0 if an answer was parsed else 0.0}``.

    Raises:
        ValueError: If ``ground_truth`` is empty or math-verify cannot parse it.
    """
    golds = _answer_list("math", ground_truth)
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")

    mv = _math_verify()
    timeout = _effective_math_timeout()
    parsed_golds = []
    for gold in golds:
        parsed = _parse_gold(mv, gold, timeout)
        if not parsed:
            raise ValueError(f"math: math-verify could not parse ground_truth {gold!r}")
        parsed_golds.append(parsed)

    tagged = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL | re.IGNORECASE)
    text = tagged[-1] if tagged else response
    pred = mv.parse(text, parsing_timeout=timeout)
    if not pred:
        return {"score": 0.0, "answer_found": 0.0}
    correct = any(mv.verify(gold, pred, timeout_seconds=timeout) for gold in parsed_golds)
    return {"score": 1.0 if correct else 0.0, "answer_found": 1.0}


# --------------------------------------------------------------------------------------
# DAPO math (DAPO-Math-17k's "Answer: ..." convention)
# --------------------------------------------------------------------------------------

# Only the tail of a response is searched: the answer line ends it, and a pathological
# response must not cost quadratic regex time.
_DAPO_TAIL_CHARS = 600
_DAPO_ANSWER = re.compile(r"Answer\s*:\s*(.+)", re.IGNORECASE)
# Wrappers and words a final answer often carries that do not change its value.
_DAPO_STRIP = (
    (re.compile(r"\\text\{\s*([^{}]*)\}"), r"\1"),
    (re.compile(r"\\(?:mathrm|textbf|mathbf)\{\s*([^{}]*)\}"), r"\1"),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ "), ""),
    (re.compile(r"\^\{?\\circ\}?|°"), ""),
    (re.compile(r"\s+"), ""),
)


def _dapo_boxed(text: str) -> str | None:
    r"""Return the content of the last ``\boxed{...}`` (braces balanced), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def dapo_normalize(answer: str) -> str:
    r"""Canonical form of a final answer for exact comparison (DAPO-style).

    Drops ``$``, a surrounding ``\boxed{}``, ``\text{}`` wrappers, spacing commands and all
    white space, degree signs, a trailing full stop, thousands separators in plain numbers, and
    trailing zeros of decimals (``2.50`` -> ``2.5``, ``3.0`` -> ``3``).
    """
    text = answer.strip().replace("$", "")
    boxed = _dapo_boxed(text)
    if boxed is not None:
        text = boxed
    for pattern, repl in _DAPO_STRIP:
        text = pattern.sub(repl, text)
    text = text.rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    if re.fullmatch(r"[-+]?\d+\.\d+", text):
        text = text.rstrip("0").rstrip(".")
    return text


def dapo_extract(response: str) -> str | None:
    r"""Return a response's final answer: after its last ``Answer:``, else its last ``\boxed{}``."""
    tail = response[-_DAPO_TAIL_CHARS:]
    found = _DAPO_ANSWER.findall(tail)
    if found:
        answer = found[-1].strip()
        return answer or None
    return _dapo_boxed(tail)


@register_scorer("math_dapo", "BytedTsinghua-SIA/DAPO-Math-17k", "aime24", "aime25")
def math_dapo_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> dict[str, float]:
    r"""DAPO's math reward: +1 for a correct final answer, -1 otherwise.

    The answer is read from the last ``Answer: ...`` line of the response (DAPO-Math-17k's
    prompt asks for one), else from its last ``\boxed{}``; it is correct when its
    :func:`dapo_normalize` form equals that of ``ground_truth`` (or of any entry of a list).

    Returns:
        ``{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "answer_found": 1.0 or 0.0}``.

    Raises:
        ValueError: ``ground_truth`` is empty, a bool or not a string/number (list).
        TypeError: ``response`` is not a string.
    """
    normalized = [dapo_normalize(gold) for gold in _answer_list("math_dapo", ground_truth)]
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    answer = dapo_extract(response)
    if answer is None:
        return {"score": -1.0, "acc": 0.0, "answer_found": 0.0}
    correct = dapo_normalize(answer) in normalized
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "answer_found": 1.0}
