"""Rewards: registered scorers (rule-based and code execution), user functions, a manager.

What the trainer needs of any scorer is the :class:`~polyrl.reward.base.Scorer` Protocol.

``RewardManager`` / ``RewardResult`` / ``RewardFailureError`` are imported lazily so that
reward worker processes, which import this package, do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyrl.reward.base import ReplicaEndpoints, Scorer
from polyrl.reward.code_exec import code_score, extract_program
from polyrl.reward.registry import SCORERS, extract_answer, get_scorer, register_scorer
from polyrl.reward.scorers import (
    ExpressionError,
    arithmetic_score,
    countdown_score,
    evaluate_expression,
    gsm8k_extract,
    gsm8k_score,
    math_score,
    set_math_verify_timeout,
    string_reverse_score,
    string_sort_score,
)
from polyrl.reward.user_fn import (
    GarbageResultError,
    RewardFunctionError,
    RewardResultError,
    bind_scorer,
    call_scorer,
    load_user_function,
    normalize_result,
)

if TYPE_CHECKING:
    from polyrl.reward.manager import RewardFailureError, RewardManager, RewardResult

__all__ = [
    "SCORERS",
    "ExpressionError",
    "GarbageResultError",
    "RewardFailureError",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "RewardResultError",
    "ReplicaEndpoints",
    "Scorer",
    "arithmetic_score",
    "bind_scorer",
    "call_scorer",
    "code_score",
    "countdown_score",
    "evaluate_expression",
    "extract_answer",
    "extract_program",
    "get_scorer",
    "gsm8k_extract",
    "gsm8k_score",
    "load_user_function",
    "math_score",
    "normalize_result",
    "register_scorer",
    "set_math_verify_timeout",
    "string_reverse_score",
    "string_sort_score",
]


def __getattr__(name: str) -> Any:
    if name in ("RewardFailureError", "RewardManager", "RewardResult"):
        from polyrl.reward import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'polyrl.reward' has no attribute {name!r}")
