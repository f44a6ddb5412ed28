"""Synthetic RL tasks with rule-checkable answers, in a decorator registry.

Every task is a function ``generate(num, seed, split="train", **kwargs) -> list[row]`` that is
deterministic for ``(seed, split, kwargs)``; its first ``k`` rows do not depend on ``num``.
Prompts are deliberately short (the demo trains a tiny random-init model on CPU): by default
(``style="short"``) they read like ``"12+7="``; ``style="instruct"`` spells out the task and asks
for the final answer after ``####``.  No system prompt is added.

Command line::

    python -m polyrl.data.tasks arithmetic --out data/arith --num-train 2000 --num-test 200 \
        --seed 0 --kwargs '{"max_digits": 2}'
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import string
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from polyrl.core.registry import Registry
from polyrl.data.io import write_rows
from polyrl.data.schema import make_row


class TaskFn(Protocol):
    """Signature of a task generator."""

    def __call__(self, num: int, seed: int, split: str = "train", **kwargs: Any) -> list[dict]:
        """Return ``num`` rows, deterministic for ``seed``/``split``/``kwargs``."""
        ...


TASKS: Registry[TaskFn] = Registry("task")
"""Registered task generators by name."""
register_task = TASKS.register
get_task = TASKS.get

STYLES: tuple[str, ...] = ("short", "instruct")
ANSWER_INSTRUCTION = "Give the final answer after ####."


def generate(name: str, num: int, seed: int, split: str = "train", **kwargs: Any) -> list[dict]:
    """Generate ``num`` rows of task ``name`` (see :func:`get_task`)."""
    return get_task(name)(num, seed, split, **kwargs)


def _rng(task: str, seed: int, split: str) -> random.Random:
    # A string seed goes through SHA-512, so streams are stable across runs and processes
    # (unlike hash()) and the train/test streams of one seed are unrelated.
    return random.Random(f"polyrl/{task}/{split}/{seed}")


def _check_common(num: int, seed: int, split: str, style: str) -> None:
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be a non-negative integer, got {num!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must be a non-empty string, got {split!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def _check_range(lo_name: str, lo: int, hi_name: str, hi: int, minimum: int) -> None:
    for n, v in ((lo_name, lo), (hi_name, hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{n} must be an integer >= {minimum}, got {v!r}")
    if lo > hi:
        raise ValueError(f"{lo_name} ({lo}) must be <= {hi_name} ({hi})")


def _operand(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


@register_task("arithmetic")
def arithmetic(
    num: int,
    seed: int,
    split: str = "train",
    *,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: str = "+-*",
    allow_negative: bool = False,
    style: str = "short",
) -> list[dict]:
    """Generate ``a op b`` problems, e.g. prompt ``"12+7="`` with ground truth ``"19"``.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        min_digits: Fewest digits per operand (1-digit operands include 0).
        max_digits: Most digits per operand.
        ops: Operators to draw from, a subset of ``"+-*"``.
        allow_negative: When false, subtraction puts the larger operand first.
        style: ``"short"`` (``"12+7="``) or ``"instruct"``.
    """
    _check_common(num, seed, split, style)
    _check_range("min_digits", min_digits, "max_digits", max_digits, 1)
    if not ops or not set(ops) <= set("+-*") or len(set(ops)) != len(ops):
        raise ValueError(f"ops must be distinct characters from '+-*', got {ops!r}")
    rng = _rng("arithmetic", seed, split)
    rows = []
    for index in range(num):
        a = _operand(rng, rng.randint(min_digits, max_digits))
        b = _operand(rng, rng.randint(min_digits, max_digits))
        op = rng.choice(ops)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        if style == "short":
            prompt = f"{a}{op}{b}="
        else:
            prompt = f"What is {a} {op} {b}? {ANSWER_INSTRUCTION}"
        rows.append(
            make_row(
                "arithmetic",
                prompt,
                str(result),
                ability="math",
                extra_info={"split": split, "index": index, "expression": f"{a}{op}{b}"},
            )
        )
    return rows


PAIR_ERRORS: tuple[str, ...] = ("extra_digit", "last_digit")


@register_task("arithmetic_pairs")
def arithmetic_pairs(
    num: int,
    seed: int,
    split: str = "train",
    *,
    wrong: str = "extra_digit",
    min_digits: int = 1,
    max_digits: int = 2,
    ops: str = "+",
    allow_negative: bool = False,
    style: str = "short",
) -> list[dict]:
    """Preference pairs on :func:`arithmetic` problems: a correct and an incorrect answer.

    Each row is an ``arithmetic`` row (so it still trains RL and SFT) plus ``chosen`` (the
    correct answer) and ``rejected`` (a wrong answer differing from it only in its digits), the
    columns of TRL's preference format.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        wrong: how the wrong answer is made: ``"extra_digit"`` appends a random digit to the
            correct answer (``"19"`` vs ``"194"``: learnable without arithmetic, since the
            wrong answer runs on past the right end; a nano model learns it in a few steps),
            ``"last_digit"`` replaces its last digit (``"19"`` vs ``"17"``: learning it means
            learning the sum's last digit).
        min_digits: Fewest digits per operand.
        max_digits: Most digits per operand.
        ops: Operators to draw from (default: addition only).
        allow_negative: When false, subtraction puts the larger operand first.
        style: ``"short"`` or ``"instruct"`` prompts.
    """
    if wrong not in PAIR_ERRORS:
        raise ValueError(f"wrong must be one of {PAIR_ERRORS}, got {wrong!r}")
    rows = arithmetic(
        num,
        seed,
        split,
        min_digits=min_digits,
        max_digits=max_digits,
        ops=ops,
        allow_negative=allow_negative,
        style=style,
    )
    rng = _rng("arithmetic_pairs", seed, split)
    for row in rows:
        answer = str(row["reward_model"]["ground_truth"])
        if wrong == "extra_digit":
            bad = answer + str(rng.randint(0, 9))
        else:
            last = int(answer[-1])
            bad = answer[:-1] + str(rng.choice([d for d in range(10) if d != last]))
        row["chosen"] = answer
        row["rejected"] = bad
    return rows


def _countdown_puzzle(
    rng: random.Random, count: int, max_number: int, max_target: int
) -> tuple[list[int], int, str]:
    """Draw numbers and fold them with random exact integer ops into one target."""
    for _ in range(10_000):
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea), (b, eb) = pool[i], pool[j]
            choices = ["+", "*"]
            if a > b:
                choices.append("-")
            if b > 1 and a % b == 0:
                choices.append("/")
            op = rng.choice(choices)
            value = a + b if op == "+" else a * b if op == "*" else a - b if op == "-" else a // b
            pool = [p for k, p in enumerate(pool) if k not in (i, j)]
            pool.append((value, f"({ea}{op}{eb})"))
        target, expression = pool[0]
        if 1 <= target <= max_target:
            return numbers, target, expression[1:-1]
    raise ValueError(
        f"could not build a countdown target <= max_target={max_target} from {count} numbers "
        f"up to {max_number}; raise max_target"
    )


@register_task("countdown")
def countdown(
    num: int,
    seed: int,
    split: str = "train",
    *,
    min_numbers: int = 3,
    max_numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    style: str = "short",
) -> list[dict]:
    """Reach a target by combining every given number exactly once with ``+ - * /``.

    The target is the value of a random expression over the numbers (intermediate values stay
    positive integers), so a solution always exists; one is kept in ``extra_info["expression"]``.
    Ground truth is ``{"target": int, "numbers": [int, ...]}``.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        min_numbers: Fewest numbers per puzzle (>= 2).
        max_numbers: Most numbers per puzzle.
        max_number: Numbers are drawn from ``1..max_number``.
        max_target: Targets are at most this (puzzles are redrawn until one fits).
        style: ``"short"`` (``"3 7 12 -> 33="``) or ``"instruct"``.
    """
    _check_common(num, seed, split, style)
    _check_range("min_numbers", min_numbers, "max_numbers", max_numbers, 2)
    _check_range("max_number", max_number, "max_number", max_number, 1)
    _check_range("max_target", max_target, "max_target", max_target, 1)
    rng = _rng("countdown", seed, split)
    rows = []
    for index in range(num):
        count = rng.randint(min_numbers, max_numbers)
        numbers, target, expression = _countdown_puzzle(rng, count, max_number, max_target)
        shown = " ".join(str(n) for n in numbers)
        if style == "short":
            prompt = f"{shown} -> {target}="
        else:
            prompt = (
                f"Using the numbers {shown}, each exactly once, and + - * /, make {target}. "
                f"{ANSWER_INSTRUCTION}"
            )
        rows.append(
            make_row(
                "countdown",
                prompt,
                {"target": target, "numbers": numbers},
                ability="math",
                extra_info={"split": split, "index": index, "expression": expression},
            )
        )
    return rows


def _random_string(rng: random.Random, min_length: int, max_length: int, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))


def _string_task(
    name: str,
    verb: str,
    transform: Callable[[str], str],
    num: int,
    seed: int,
    split: str,
    min_length: int,
    max_length: int,
    alphabet: str,
    style: str,
) -> list[dict]:
    _check_common(num, seed, split, style)
    _check_range("min_length", min_length, "max_length", max_length, 1)
    if not alphabet or not all(c in string.ascii_lowercase for c in alphabet):
        raise ValueError(f"alphabet must be non-empty lowercase ascii letters, got {alphabet!r}")
    rng = _rng(name, seed, split)
    rows = []
    for index in range(num):
        s = _random_string(rng, min_length, max_length, alphabet)
        if style == "short":
            prompt = f"{verb} {s}="
        else:
            prompt = f"{verb.capitalize()} the letters of the string {s}. {ANSWER_INSTRUCTION}"
        rows.append(
            make_row(
                name,
                prompt,
                transform(s),
                ability="string",
                extra_info={"split": split, "index": index, "input": s},
            )
        )
    return rows


@register_task("string_reverse")
def string_reverse(
    num: int,
    seed: int,
    split: str = "train",
    *,
    min_length: int = 3,
    max_length: int = 6,
    alphabet: str = string.ascii_lowercase,
    style: str = "short",
) -> list[dict]:
    """Reverse a short random lowercase string: ``"reverse abc="`` -> ``"cba"``.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        min_length: Shortest string.
        max_length: Longest string.
        alphabet: Letters to draw from.
        style: ``"short"`` or ``"instruct"``.
    """
    return _string_task(
        "string_reverse",
        "reverse",
        lambda s: s[::-1],
        num,
        seed,
        split,
        min_length,
        max_length,
        alphabet,
        style,
    )


@register_task("string_sort")
def string_sort(
    num: int,
    seed: int,
    split: str = "train",
    *,
    min_length: int = 3,
    max_length: int = 6,
    alphabet: str = string.ascii_lowercase,
    style: str = "short",
) -> list[dict]:
    """Sort the letters of a short random lowercase string: ``"sort cab="`` -> ``"abc"``.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        min_length: Shortest string.
        max_length: Longest string.
        alphabet: Letters to draw from.
        style: ``"short"`` or ``"instruct"``.
    """
    return _string_task(
        "string_sort",
        "sort",
        lambda s: "".join(sorted(s)),
        num,
        seed,
        split,
        min_length,
        max_length,
        alphabet,
        style,
    )


# Coding problems of ``code_simple``: (name, statement with {k}, reference program with {k},
# make one input from (rng, k), the output a correct program prints for it).
def _ints_line(rng: random.Random, k: int) -> str:
    return " ".join(str(rng.randint(-50, 99)) for _ in range(rng.randint(2, 5))) + "\n"


def _word(rng: random.Random, k: int) -> str:
    return _random_string(rng, 2, 6, string.ascii_lowercase) + "\n"


def _int_line(rng: random.Random, k: int) -> str:
    return f"{rng.randint(-99, 99)}\n"


def _pair_line(rng: random.Random, k: int) -> str:
    return f"{rng.randint(-99, 99)} {rng.randint(-99, 99)}\n"


_CODE_PROBLEMS: tuple[tuple[str, str, str, Callable[[random.Random, int], str], Callable], ...] = (
    (
        "add_const",
        "read an integer n and print n + {k}",
        "n = int(input())\nprint(n + {k})\n",
        _int_line,
        lambda text, k: f"{int(text) + k}\n",
    ),
    (
        "mul_const",
        "read an integer n and print n * {k}",
        "n = int(input())\nprint(n * {k})\n",
        _int_line,
        lambda text, k: f"{int(text) * k}\n",
    ),
    (
        "add_two",
        "read two integers a and b on one line and print a + b + {k}",
        "a, b = map(int, input().split())\nprint(a + b + {k})\n",
        _pair_line,
        lambda text, k: f"{sum(map(int, text.split())) + k}\n",
    ),
    (
        "reverse",
        "read a word and print it reversed, {k} times on one line separated by spaces",
        "w = input().strip()\nprint(' '.join([w[::-1]] * {k}))\n",
        _word,
        lambda text, k: " ".join([text.strip()[::-1]] * k) + "\n",
    ),
    (
        "max_plus",
        "read integers on one line and print the largest plus {k}",
        "print(max(map(int, input().split())) + {k})\n",
        _ints_line,
        lambda text, k: f"{max(map(int, text.split())) + k}\n",
    ),
)


@register_task("code_simple")
def code_simple(
    num: int,
    seed: int,
    split: str = "train",
    *,
    num_cases: int = 3,
    max_const: int = 9,
    style: str = "short",
) -> list[dict]:
    """Tiny stdin/stdout programming problems scored by running the answer (``code`` scorer).

    Each row asks for a Python program (add a constant, multiply, add two numbers, reverse a
    word, the largest of a list...) with one worked example in the prompt; its ground truth is
    the JSON ``{"inputs": [...], "outputs": [...]}`` of ``num_cases`` test cases (see
    :mod:`polyrl.reward.code_exec`), and ``extra_info["reference"]`` a correct program.

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        num_cases: Test cases per problem.
        max_const: The problems' constant ``k`` is drawn from ``1..max_const``.
        style: ``"short"`` (one line) or ``"instruct"`` (asks for a fenced python block).
    """
    _check_common(num, seed, split, style)
    _check_range("num_cases", num_cases, "num_cases", num_cases, 1)
    _check_range("max_const", max_const, "max_const", max_const, 1)
    rng = _rng("code_simple", seed, split)
    rows = []
    for index in range(num):
        name, statement, reference, make_input, answer = rng.choice(_CODE_PROBLEMS)
        k = rng.randint(1, max_const)
        example = make_input(rng, k)
        inputs = [make_input(rng, k) for _ in range(num_cases)]
        task = statement.format(k=k)
        shown = f"input {example.strip()!r} -> output {answer(example, k).strip()!r}"
        if style == "short":
            prompt = f"Python: {task}. Example: {shown}."
        else:
            prompt = (
                f"Write a Python 3 program that reads standard input: {task}. Example: {shown}. "
                "Answer with the program in a ```python block."
            )
        ground_truth = {"inputs": inputs, "outputs": [answer(x, k) for x in inputs]}
        rows.append(
            make_row(
                "code_simple",
                prompt,
                json.dumps(ground_truth),
                ability="code",
                extra_info={
                    "split": split,
                    "index": index,
                    "problem": name,
                    "reference": reference.format(k=k),
                },
            )
        )
    return rows


#: Colours the visual tasks draw with, by the name the prompt uses.
VISUAL_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
VISUAL_SHAPES: tuple[str, ...] = ("square", "circle")


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@register_task("visual_count")
def visual_count(
    num: int,
    seed: int,
    split: str = "train",
    *,
    image_size: int = 56,
    grid: int = 4,
    min_count: int = 1,
    max_count: int = 4,
    max_distractors: int = 2,
    colors: Sequence[str] = ("red",),
    distractor_colors: Sequence[str] = ("blue",),
    shapes: Sequence[str] = ("square",),
    min_scale: float = 1.0,
    max_scale: float = 1.0,
    style: str = "short",
) -> list[dict]:
    """Count the shapes of one colour in a rendered image; the answer is the count.

    Each row's image is drawn locally with Pillow (no download): a ``grid x grid`` board of
    cells on a white canvas of ``image_size`` pixels, ``count`` cells holding a shape (square or
    circle, of a random size) in the asked colour and up to ``max_distractors`` cells holding
    one in a distractor colour. Cells line up with the vision tower's patches when
    ``image_size / grid`` is the patch size (56 / 4 = 14 for the tiny VLM), which is what makes
    the task learnable by a tiny model in a minute. The defaults (whole-cell squares) are what
    the nano tiny VLM learns reliably (SFT, batch 16, lr 1e-3: about 0.5-0.7 held-out accuracy
    after 75-100 steps, above 0.9 after 200, on every seed tried); shapes of random size
    (``min_scale=0.55, max_scale=0.9``, circles too) make it much harder: some seeds stay at
    chance for 800 steps.

    Rows follow verl's multi-modal layout: ``images`` is ``[{"bytes": <png>}]`` and the user
    message holds an ``<image>`` placeholder, e.g. ``"<image>How many red shapes?"``; the
    ground truth is the count as a string (scored by the ``visual_count`` rule scorer).

    Args:
        num: Number of rows.
        seed: Random seed.
        split: Stored in ``extra_info`` and part of the random stream.
        image_size: Side of the square image in pixels.
        grid: Cells per side.
        min_count: Fewest target shapes.
        max_count: Most target shapes (chance accuracy is ``1 / (max_count - min_count + 1)``).
        max_distractors: Most shapes in distractor colours.
        colors: Colours the question may ask about (one drawn per row).
        distractor_colors: Colours of the distractor shapes (a row's asked colour is never one).
        shapes: Shapes to draw, from ``"square"`` and ``"circle"``.
        min_scale: Smallest shape side as a fraction of the cell side.
        max_scale: Largest shape side as a fraction of the cell side (1: a square fills it).
        style: ``"short"`` or ``"instruct"`` (asks for the answer after ``####``).
    """
    _check_common(num, seed, split, style)
    _check_range("min_count", min_count, "max_count", max_count, 0)
    for name, value, low in (("image_size", image_size, 8), ("grid", grid, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(max_distractors, bool) or not isinstance(max_distractors, int):
        raise ValueError(f"max_distractors must be an integer, got {max_distractors!r}")
    if max_count + max(max_distractors, 0) > grid * grid:
        raise ValueError(
            f"max_count + max_distractors ({max_count + max_distractors}) exceed the "
            f"{grid * grid} cells of a {grid}x{grid} grid"
        )
    for name, names in (("colors", colors), ("distractor_colors", distractor_colors)):
        unknown = [c for c in names if c not in VISUAL_COLORS]
        if isinstance(names, str) or unknown:
            raise ValueError(
                f"{name} must be a list of colour names from {sorted(VISUAL_COLORS)}, got {names!r}"
            )
    if not colors:
        raise ValueError("colors must name at least one colour")
    if isinstance(shapes, str) or not shapes or not set(shapes) <= set(VISUAL_SHAPES):
        raise ValueError(f"shapes must be a list from {VISUAL_SHAPES}, got {shapes!r}")
    if not 0 < min_scale <= max_scale <= 1:
        raise ValueError(
            f"need 0 < min_scale <= max_scale <= 1, got min_scale={min_scale!r}, "
            f"max_scale={max_scale!r}"
        )
    from PIL import Image, ImageDraw  # deferred: the text tasks do not need Pillow

    rng = _rng("visual_count", seed, split)
    cell = image_size / grid
    rows = []
    for index in range(num):
        color = rng.choice(list(colors))
        others = [c for c in distractor_colors if c != color]
        count = rng.randint(min_count, max_count)
        distract = rng.randint(0, max_distractors) if others and max_distractors > 0 else 0
        cells = rng.sample(range(grid * grid), count + distract)
        image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for k, c in enumerate(cells):
            fill = VISUAL_COLORS[color if k < count else rng.choice(others)]
            # A random size and offset inside the cell, so no two images of one count match.
            side = cell * rng.uniform(min_scale, max_scale)
            x0 = (c % grid) * cell + rng.uniform(0, cell - side)
            y0 = (c // grid) * cell + rng.uniform(0, cell - side)
            box = (round(x0), round(y0), round(x0 + side) - 1, round(y0 + side) - 1)
            if rng.choice(list(shapes)) == "square":
                draw.rectangle(box, fill=fill)
            else:
                draw.ellipse(box, fill=fill)
        if style == "short":
            text = f"<image>How many {color} shapes?"
        else:
            text = f"<image>How many {color} shapes are in the image? {ANSWER_INSTRUCTION}"
        row = make_row(
            "visual_count",
            text,
            str(count),
            ability="vision",
            extra_info={"split": split, "index": index, "color": color},
        )
        row["images"] = [{"bytes": _png(image)}]
        rows.append(row)
    return rows


def _prompt_text(row: dict) -> str:
    text = "\n".join(str(m["content"]) for m in row["prompt"])
    images = row.get("images") or ()
    if images:
        # The visual tasks repeat their question text: the image bytes tell prompts apart.
        digest = hashlib.sha256()
        for image in images:
            data = image.get("bytes") if isinstance(image, dict) else None
            digest.update(data if isinstance(data, bytes) else repr(image).encode())
        text += "\n" + digest.hexdigest()
    return text


def write_task_splits(
    name: str,
    out_dir: str | Path,
    num_train: int,
    num_test: int,
    seed: int,
    **task_kwargs: Any,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` for task ``name`` into ``out_dir``.

    Train prompts that also occur in the test split are skipped (and more drawn), so evaluation
    measures generalisation; ``extra_info["index"]`` is renumbered ``0..num_train-1``.

    Returns:
        ``(train_path, test_path)``.

    Raises:
        KeyError: For an unknown task.
        ValueError: For bad counts, or when the task cannot supply enough distinct train
            prompts (widen its kwargs, e.g. more digits).
    """
    task = get_task(name)
    for n, v in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{n} must be a non-negative integer, got {v!r}")
    test_rows = task(num_test, seed, "test", **task_kwargs)
    banned = {_prompt_text(r) for r in test_rows}
    draw = num_train + len(banned)
    train_rows: list[dict] = []
    for _ in range(8):
        candidates = task(draw, seed, "train", **task_kwargs)
        train_rows = [r for r in candidates if _prompt_text(r) not in banned][:num_train]
        if len(train_rows) == num_train:
            break
        draw *= 2
    else:
        raise ValueError(
            f"task {name!r} with {task_kwargs} produced only {len(train_rows)} train prompts "
            f"not seen in the {num_test} test prompts after drawing {draw // 2}; "
            "widen the task (more digits / longer strings) or lower num_test"
        )
    for i, row in enumerate(train_rows):
        row["extra_info"]["index"] = i
    out = Path(out_dir)
    train_path = write_rows(train_rows, out / "train.parquet")
    test_path = write_rows(test_rows, out / "test.parquet")
    return train_path, test_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the two written paths."""
    parser = argparse.ArgumentParser(
        prog="python -m polyrl.data.tasks",
        description="Generate train/test parquet files for a synthetic RL task.",
    )
    parser.add_argument("name", choices=sorted(TASKS), help="task to generate")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kwargs",
        default="{}",
        help="task options as a JSON object, e.g. '{\"max_digits\": 3}'",
    )
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.kwargs)
    except json.JSONDecodeError as err:
        parser.error(f"--kwargs is not valid JSON: {err}")
    if not isinstance(kwargs, dict):
        parser.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    try:
        train, test = write_task_splits(
            args.name, args.out, args.num_train, args.num_test, args.seed, **kwargs
        )
    except (TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(train)
    print(test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
