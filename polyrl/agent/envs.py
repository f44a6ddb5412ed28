"""Gym-style environments for the environment loop, with a registry.

An environment has ``reset(seed, **kwargs) -> observation`` and
``step(action_text) -> (observation, reward, done, info)``; either may be ``async``. An
observation is a string, or chat content parts with images for a vision-language policy:
``[{"type": "text", "text": ...}, {"type": "image", "image": <PIL image, PNG bytes, base64 or
a data: URL>}]`` (the environment loop then needs the policy's vision processor). Shipped:

* ``guess_number``: find a hidden integer; each guess gets "higher" / "lower" feedback.
* ``countdown``: reach a target with the given numbers; each candidate expression is checked
  (with the countdown scorer's exact evaluator) and the feedback says what it evaluates to.
* ``swe``: fix the planted bug of a generated Python repository with file, test and shell tools
  run in the sandbox (:mod:`polyrl.agent.swe_env`).
* ``visual_color``: name the colour of a square shown as an image; a wrong answer is shown a
  second image (a small multi-turn image-feedback environment for vision-language models).
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
    "Observation",
    "StepResult",
    "VisualColorEnv",
    "available_envs",
    "create_env",
    "get_env",
    "register_env",
]

#: What the model is shown: text, or chat content parts (text and images).
Observation = str | list[dict[str, Any]]
#: ``(observation, reward, done, info)``.
StepResult = tuple[Observation, float, bool, dict[str, Any]]


class Env(abc.ABC):
    """An environment (one instance per trajectory); observations are text or content parts."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None, **kwargs: Any) -> Observation | Awaitable[Observation]:
        """Start an episode; return the first observation (shown to the model as a user turn)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Apply the model's turn text; return ``(observation, reward, done, info)``."""


#: Environment classes by name.
ENVS: Registry[type[Env]] = Registry(
    "environment",
    base=Env,
    # Imported on first use: it brings the sandbox and the tool-call parser.
    lazy={"swe": "polyrl.agent.swe_env"},
)
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


@register_env("visual_color")
class VisualColorEnv(Env):
    """Name the colour of a square shown as an image; reward 1 when named, 0 otherwise.

    ``reset`` shows a ``size`` x ``size`` square of one of :attr:`COLORS`; a wrong answer is
    shown a second image, ``2 * size`` x ``size`` (the colour beside white, for contrast), so
    the two images fill different numbers of tokens. The last colour name in the model's turn
    is its answer. Rendered with Pillow.
    """

    #: The colours the environment draws from, by name.
    COLORS: dict[str, tuple[int, int, int]] = {
        "red": (220, 30, 30),
        "green": (30, 170, 60),
        "blue": (30, 60, 220),
        "yellow": (235, 210, 40),
    }

    def __init__(self) -> None:
        self.color, self.size, self.max_tries, self.tries = "red", 56, 2, 0

    def _image(self, width: int) -> Any:
        from PIL import Image

        img = Image.new("RGB", (width, self.size), (255, 255, 255))
        img.paste(self.COLORS[self.color], (0, 0, self.size, self.size))
        return img

    def reset(self, seed: int | None = None, **kwargs: Any) -> Observation:
        """Pick the colour (``color``, ``size`` in pixels and ``max_tries`` may be given)."""
        names = sorted(self.COLORS)
        self.color = str(kwargs.get("color", random.Random(seed).choice(names)))
        if self.color not in self.COLORS:
            raise ValueError(f"visual_color: color must be one of {names}, got {self.color!r}")
        self.size = int(kwargs.get("size", 56))
        if not 28 <= self.size <= 1024:
            raise ValueError(f"visual_color: size must be in [28, 1024] pixels, got {self.size}")
        self.max_tries = int(kwargs.get("max_tries", 2))
        if self.max_tries < 1:
            raise ValueError(f"visual_color: max_tries must be >= 1, got {self.max_tries}")
        self.tries = 0
        return [
            {"type": "text", "text": f"What colour is this square? One of {', '.join(names)}."},
            {"type": "image", "image": self._image(self.size)},
        ]

    def step(self, action: str) -> StepResult:
        """Check one answer; a wrong one is shown the colour again beside white."""
        self.tries += 1
        found = re.findall("|".join(self.COLORS), action.lower())
        info: dict[str, Any] = {"tries": self.tries}
        if found and found[-1] == self.color:
            return "Correct!", 1.0, True, {**info, "solved": 1.0}
        info["solved"] = 0.0
        if self.tries >= self.max_tries:
            return f"No tries left; it was {self.color}.", 0.0, True, info
        return (
            [
                {"type": "text", "text": "Not quite. Here it is beside white:"},
                {"type": "image", "image": self._image(2 * self.size)},
            ],
            0.0,
            False,
            info,
        )
