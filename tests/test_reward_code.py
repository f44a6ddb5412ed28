"""The code-execution scorer: programs run against test cases in the namespace sandbox."""

from __future__ import annotations

import json
import time

import pytest

from polyrl.core.sandbox import SandboxUnavailable, check_sandbox
from polyrl.data.tasks import generate
from polyrl.reward import get_scorer
from polyrl.reward.code_exec import (
    code_score,
    extract_program,
    outputs_match,
    parse_code_ground_truth,
)


@pytest.fixture(scope="module", autouse=True)
def _sandbox():
    try:
        check_sandbox()
    except SandboxUnavailable as exc:  # the scorer needs the namespace sandbox
        pytest.skip(str(exc))


ADD = json.dumps({"inputs": ["1 2\n", "-5 7\n", "10 20\n"], "outputs": ["3\n", "2\n", "30\n"]})


def test_extract_program_and_output_matching():
    text = "Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```\nbye"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("x = 1\nprint(x)") == "x = 1\nprint(x)"
    assert extract_program("```python\nprint(3)\n") == "print(3)\n"  # cut before the fence
    assert extract_program("```\nprint(4)\n```") == "print(4)\n"
    assert outputs_match("3  \n\n", "3\n") and outputs_match("1 2\n3", "1\n2 3")
    assert not outputs_match("4\n", "3\n")


def test_ground_truth_forms_and_errors():
    assert parse_code_ground_truth(ADD).kind == "stdio"
    call = parse_code_ground_truth({"inputs": ["[1, 2]"], "outputs": [3], "fn_name": "f"})
    assert call.kind == "call" and call.inputs == ([1, 2],)
    asserts = parse_code_ground_truth({"asserts": ["assert f(1) == 1"], "time_limit_s": 2})
    assert asserts.kind == "assert" and asserts.time_limit_s == 2.0
    for bad, match in (
        ("not json", "not JSON"),
        ({"inputs": ["1"], "outputs": []}, "same length"),
        ({"inputs": ["1"]}, "needs 'inputs' and 'outputs'"),
        ({"asserts": []}, "non-empty list"),
        ({"asserts": ["x"], "memory_mb": 1}, "memory_mb"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_code_ground_truth(bad)
    assert get_scorer("code") is code_score and get_scorer("code_simple") is code_score


def test_correct_wrong_and_crashing_programs():
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_score(good, ADD) == {
        "score": 1.0,
        "acc": 1.0,
        "passed": 3.0,
        "cases": 3.0,
        "timeouts": 0.0,
    }
    # Right on two of three cases: partial credit, not accepted.
    partial = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 0)"
    result = code_score(partial, ADD)
    assert result["score"] == pytest.approx(2 / 3) and result["acc"] == 0.0
    # The right output followed by a crash fails: the exit status counts.
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise ValueError('late')"
    assert code_score(crash, ADD)["score"] == 0.0
    # Call-based (LeetCode style) and assert cases.
    solution = "class Solution:\n    def add(self, a, b):\n        return [a + b, a]"
    gt = {"inputs": [[1, 2], [3, 4]], "outputs": [[3, 1], [7, 9]], "fn_name": "add"}
    assert code_score(solution, gt)["score"] == 0.5
    asserts = {"asserts": ["assert rev('ab') == 'ba'", "assert rev('') == ''"]}
    assert code_score("def rev(s):\n    return s[::-1]", asserts)["acc"] == 1.0
    # Leaving early with status 0 does not pass the checks it skipped.
    assert code_score("import os\nos._exit(0)", asserts)["score"] == 0.0
    assert code_score("import sys\nsys.exit(0)", asserts)["score"] == 0.0


def test_infinite_loops_and_memory_hogs_are_killed_and_score_zero():
    cases = {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"], "time_limit_s": 1.0}
    start = time.monotonic()
    result = code_score("while True:\n    pass", cases)
    elapsed = time.monotonic() - start
    assert result["score"] == 0.0 and result["timeouts"] == 2.0
    assert elapsed < 60  # each killed at its 1 s limit (the loops never end)
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 20))"
    start = time.monotonic()
    # A clock far beyond what reaching 128 MiB takes, even with the sandbox's start-up on a
    # loaded machine (1 s was once exceeded under CI load): the limit that stops it is memory.
    result = code_score(hog, {**cases, "memory_mb": 128, "time_limit_s": 20.0})
    assert result["score"] == 0.0 and result["timeouts"] == 0.0  # MemoryError, not the clock
    assert time.monotonic() - start < 15.0


def test_code_simple_task_reference_solutions_pass():
    rows = generate("code_simple", 5, seed=3, num_cases=2)
    assert len({r["prompt"][0]["content"] for r in rows}) == 5
    assert generate("code_simple", 3, seed=3, num_cases=2) == rows[:3]  # prefix-stable
    assert generate("code_simple", 5, seed=3, split="test", num_cases=2) != rows
    instruct = generate("code_simple", 2, seed=3, style="instruct")
    assert all("```python" in r["prompt"][0]["content"] for r in instruct)
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert json.loads(truth)["inputs"]  # stored as JSON text, as verl and PRIME do
        assert row["data_source"] == "code_simple"
        assert code_score(row["extra_info"]["reference"], truth)["acc"] == 1.0
        assert code_score("print('no')", truth)["score"] == 0.0
