"""Gym-style text environments for the environment loop, with a registry.

An environment has ``reset(seed, **kwargs) -> observation`` and
``step(action_text) -> (observation, reward, done, info)``; either may be ``async``. Shipped:

* ``guess_number``: find a hidden integer; each guess gets "higher" / "lower" feedback.
* ``countdown``: reach a target with the given numbers; each candidate expression is checked
  (with the countdown scorer's exact evaluator) and the feedback says what it evaluates to.
"""

from __future__ import annotations

import abc
import random
import re
from collections.abc import Awaitable
from typing import Any

from polyrl.core.registry import Registry

__all__ = [
    "ENVS",
    "CountdownEnv",
    "Env",
    "GuessNumberEnv",
    "StepResult",
    "available_envs",
    "create_env",
    "get_env",
    "register_env",
]

#: ``(observation, reward, done, info)``.
StepResult = tuple[str, float, bool, dict[str, Any]]


class Env(abc.ABC):
    """A text environment (one instance per trajectory)."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None, **kwargs: Any) -> str | Awaitable[str]:
        """Start an episode; return the first observation (shown to the model as a user turn)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Apply the model's turn text; return ``(observation, reward, done, info)``."""


#: Environment classes by name.
ENVS: Registry[type[Env]] = Registry("environment", base=Env)
register_env = ENVS.register
available_envs = ENVS.names
get_env = ENVS.get


def create_env(name: str, **kwargs: Any) -> Env:
    """Instantiate the environment registered under ``name``."""
    return get_env(name)(**kwargs)


_INT = re.compile(r"-?\d+")


@register_env("guess_number")
class GuessNumberEnv(Env):
    """Guess a hidden integer in ``[low, high]``; reward 1 when found, 0 otherwise.

    The last integer in the model's turn is its guess; a turn without one is told so and
    still uses up a guess.
    """

    def __init__(self) -> None:
        self.secret = 0
        self.low, self.high, self.max_guesses, self.guesses = 1, 100, 7, 0

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Pick the secret (``low``, ``high``, ``max_guesses`` and ``secret`` may be given)."""
        self.low = int(kwargs.get("low", 1))
        self.high = int(kwargs.get("high", 100))
        if self.low > self.high:
            raise ValueError(f"guess_number: low={self.low} is above high={self.high}")
        self.max_guesses = int(kwargs.get("max_guesses", 7))
        if self.max_guesses < 1:
            raise ValueError(f"guess_number: max_guesses must be >= 1, got {self.max_guesses}")
        rng = random.Random(seed)
        self.secret = int(kwargs.get("secret", rng.randint(self.low, self.high)))
        self.guesses = 0
        return (
            f"I am thinking of a whole number between {self.low} and {self.high}. You have "
            f"{self.max_guesses} guesses. Reply with one number."
        )

    def step(self, action: str) -> StepResult:
        """Score one guess."""
        self.guesses += 1
        left = self.max_guesses - self.guesses
        found = _INT.findall(action)
        info: dict[str, Any] = {"guesses": self.guesses}
        if not found:
            obs = "That is not a number. Reply with one whole number."
        else:
            guess = int(found[-1])
            if guess == self.secret:
                return "Correct!", 1.0, True, {**info, "solved": 1.0}
            obs = "Higher." if guess < self.secret else "Lower."
        info["solved"] = 0.0
        if left <= 0:
            return obs + f" No guesses left; it was {self.secret}.", 0.0, True, info
        return obs + f" {left} guesses left.", 0.0, False, info


@register_env("countdown")
class CountdownEnv(Env):
    """Reach ``target`` using each of ``numbers`` once with ``+ - * /`` and parentheses.

    Each turn's last line (or an ``<answer>...</answer>`` block) is a candidate expression; the
    environment evaluates it exactly and reports the value. Reward 1 on a correct expression.
    """

    def __init__(self) -> None:
        self.target, self.numbers, self.max_tries, self.tries = 0, [], 4, 0

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Set the puzzle (``target`` and ``numbers``, or generated from ``seed``)."""
        rng = random.Random(seed)
        if "numbers" in kwargs:
            self.numbers = [int(n) for n in kwargs["numbers"]]
            if "target" not in kwargs:
                raise ValueError("countdown: give 'target' together with 'numbers'")
            self.target = int(kwargs["target"])
        else:
            a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 10)
            self.numbers, self.target = [a, b, c], (a + b) * c
        self.max_tries = int(kwargs.get("max_tries", 4))
        self.tries = 0
        return (
            f"Using the numbers {self.numbers}, each exactly once, and + - * / ( ), make "
            f"{self.target}. Reply with the expression."
        )

    def step(self, action: str) -> StepResult:
        """Check one candidate expression."""
        from polyrl.core.expressions import ExpressionError, evaluate_expression

        self.tries += 1
        m = re.search(r"<answer>(.*?)</answer>", action, re.DOTALL)
        lines = [ln for ln in action.strip().splitlines() if ln.strip()]
        text = m.group(1) if m else (lines[-1] if lines else "")
        text = text.split("=")[0]
        # The longest arithmetic run in it: "I think 4 * 6 + 1" checks "4 * 6 + 1".
        runs = [r.strip() for r in re.findall(r"[\d+\-*/() ]+", text) if re.search(r"\d", r)]
        text = max(runs, key=len) if runs else text.strip()
        info: dict[str, Any] = {"tries": self.tries, "solved": 0.0}
        try:
            value, used = evaluate_expression(text)
        except ExpressionError as exc:
            obs = f"That is not a valid expression ({exc})."
        else:
            shown = str(value.numerator) if value.denominator == 1 else str(value)
            if sorted(used) != sorted(self.numbers):
                obs = f"{text} = {shown}, but you must use each of {self.numbers} exactly once."
            elif value == self.target:
                return "Correct!", 1.0, True, {**info, "solved": 1.0}
            else:
                obs = f"{text} = {shown}, not {self.target}."
        if self.tries >= self.max_tries:
            return obs + " No tries left.", 0.0, True, info
        return obs + " Try again.", 0.0, False, info
