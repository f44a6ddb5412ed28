"""Code-execution reward: run the response's program against test cases in the sandbox.

The ``code`` scorer (also registered as ``code_simple``, the bundled task of
:mod:`polyrl.data.tasks`) takes the program from the response (the last fenced ```python
block, or the whole text when there is no fence), runs it once per test case in the namespace
sandbox of :mod:`polyrl.core.sandbox` (the one the agent's ``python`` tool uses: no network,
read-only filesystem, a private tmpfs, per-case wall-clock, CPU-time and memory limits, every
process killed at the end), several cases at a time, and scores the fraction of cases passed
(``acc`` = 1 when all pass).

Ground truth (a dict, or a JSON string of one, as verl and PRIME store it):

* ``{"inputs": [str, ...], "outputs": [str, ...]}``: standard input / expected standard output.
  Outputs match when their lines are equal after trailing white space is dropped (or, failing
  that, when their white-space separated tokens are equal). The program must also exit with
  status 0.
* ``{"inputs": [[args], ...], "outputs": [value, ...], "fn_name": "f"}`` (PRIME / APPS
  call-based): ``f(*args)`` must return the value (tuples compare as lists); ``f`` may also be
  a method of a ``Solution`` class (LeetCode style).
* ``{"asserts": ["assert f(1) == 2", ...]}``: each statement runs after the program; the case
  passes when it raises nothing.

Optional keys: ``time_limit_s`` (wall clock per case, default :data:`DEFAULT_TIME_LIMIT_S`) and
``memory_mb`` (address space per process, default :data:`DEFAULT_MEMORY_MB`). A case over its
time limit is killed and fails; a program over its memory limit gets ``MemoryError`` and fails.

The program runs with ``__name__ == "__main__"`` for stdin/stdout cases and as module
``solution`` otherwise (so a ``main()`` guard does not wait for input). For call-based and assert
cases a case passes only if the harness prints a per-run random token after the checks: a
program that just exits early with status 0 does not pass. That is no defence against a program
that reads the harness (it runs in the same interpreter); score such untrusted policies with
stdin/stdout cases, which are checked outside the sandbox.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from polyrl.reward.registry import register_scorer

__all__ = [
    "DEFAULT_MAX_PARALLEL",
    "DEFAULT_MEMORY_MB",
    "DEFAULT_TIME_LIMIT_S",
    "CodeCases",
    "code_score",
    "extract_program",
    "outputs_match",
    "parse_code_ground_truth",
    "run_code_cases",
]

#: Wall-clock seconds per test case unless the ground truth says ``time_limit_s``.
DEFAULT_TIME_LIMIT_S = 4.0
#: Address-space limit per process, in MiB, unless the ground truth says ``memory_mb``.
DEFAULT_MEMORY_MB = 512
#: Test cases of one response run at once (each in its own sandbox process).
DEFAULT_MAX_PARALLEL = 4

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """Return the program in ``response``.

    That is its last ```python block, else its last ``` block, else the whole text (an
    unterminated fence, as in a truncated response, runs to the end of the text).

    Raises:
        TypeError: If ``response`` is not a string.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    blocks = _FENCE.findall(response)
    python = [code for lang, code in blocks if lang]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return response


@dataclass(frozen=True)
class CodeCases:
    """Parsed test cases: ``kind`` is ``"stdio"``, ``"call"`` or ``"assert"``."""

    kind: str
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    fn_name: str = ""
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    memory_mb: int = DEFAULT_MEMORY_MB

    def __len__(self) -> int:
        return len(self.inputs)


def parse_code_ground_truth(ground_truth: Any) -> CodeCases:
    """Parse a code ground truth (see the module docstring) into :class:`CodeCases`.

    Raises:
        ValueError: If it is not one of the documented forms (the message says which).
    """
    gt = ground_truth
    if isinstance(gt, str | bytes):
        try:
            gt = json.loads(gt)
        except ValueError as exc:
            raise ValueError(f"code: ground_truth is a string but not JSON: {exc}") from None
    if not isinstance(gt, Mapping):
        raise ValueError(
            "code: ground_truth must be a dict (or its JSON) with 'inputs' and 'outputs' or "
            f"with 'asserts', got {type(gt).__name__}"
        )
    limit = gt.get("time_limit_s", DEFAULT_TIME_LIMIT_S)
    memory = gt.get("memory_mb", DEFAULT_MEMORY_MB)
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 < limit <= 600:
        raise ValueError(f"code: time_limit_s must be a number in (0, 600], got {limit!r}")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 16:
        raise ValueError(f"code: memory_mb must be an int >= 16, got {memory!r}")
    limits = {"time_limit_s": float(limit), "memory_mb": int(memory)}
    if "asserts" in gt:
        asserts = gt["asserts"]
        if isinstance(asserts, str) or not isinstance(asserts, Sequence) or not asserts:
            raise ValueError("code: 'asserts' must be a non-empty list of statements")
        if not all(isinstance(a, str) and a.strip() for a in asserts):
            raise ValueError("code: every entry of 'asserts' must be a non-empty string")
        return CodeCases("assert", tuple(asserts), (None,) * len(asserts), **limits)
    if "inputs" not in gt or "outputs" not in gt:
        raise ValueError(
            f"code: ground_truth needs 'inputs' and 'outputs' (or 'asserts'); keys: {sorted(gt)}"
        )
    inputs, outputs = list(gt["inputs"]), list(gt["outputs"])
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(
            f"code: 'inputs' ({len(inputs)}) and 'outputs' ({len(outputs)}) must be non-empty "
            "lists of the same length"
        )
    fn_name = gt.get("fn_name") or ""
    if fn_name:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"code: fn_name must be a Python identifier, got {fn_name!r}")
        args = []
        for x in inputs:
            if isinstance(x, str):  # PRIME stores each call's arguments as JSON text
                x = json.loads(x)
            args.append(list(x) if isinstance(x, list | tuple) else [x])
        return CodeCases("call", tuple(args), tuple(outputs), fn_name, **limits)
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("code: stdin/stdout 'inputs' and 'outputs' must be strings")
    return CodeCases("stdio", tuple(inputs), tuple(outputs), **limits)


def outputs_match(got: str, expected: str) -> bool:
    """Whether a program's standard output matches the expected one (see the module doc)."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(expected) or got.split() == expected.split()


# The harness is the sandboxed program; the response's program runs inside it through exec so
# that standard input, the module name and the verdict are under the harness's control.
_STDIO_HARNESS = """\
import io, os, sys
sys.stdin = io.TextIOWrapper(io.BytesIO({stdin!r}), encoding="utf-8")
sys.stderr = open(os.devnull, "w")
_code = 0
try:
    exec(compile({program!r}, "solution.py", "exec"), {{"__name__": "__main__"}})
except SystemExit as _e:
    _code = 0 if _e.code in (None, 0) else 1
except BaseException:
    _code = 1
sys.stdout.flush()
os._exit(_code)
"""

_CHECK_HARNESS = """\
import io, os, sys
sys.stdin = io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8")
sys.stderr = open(os.devnull, "w")
def _norm(x):
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, dict):
        return {{k: _norm(v) for k, v in x.items()}}
    return x
_ok = False
try:
    _g = {{"__name__": "solution"}}
    exec(compile({program!r}, "solution.py", "exec"), _g)
{check}
    _ok = True
except BaseException:
    pass
sys.stdout.flush()
if _ok:
    sys.stdout.write("\\n{token}\\n")
    sys.stdout.flush()
os._exit(0 if _ok else 1)
"""

_CALL_CHECK = """\
    _f = _g.get({fn!r})
    if _f is None and "Solution" in _g:
        _f = getattr(_g["Solution"](), {fn!r})
    assert _norm(_f(*{args!r})) == _norm({expected!r})"""

_ASSERT_CHECK = """\
    exec(compile({statement!r}, "test.py", "exec"), _g)"""


def _harness(cases: CodeCases, index: int, program: str, token: str) -> str:
    if cases.kind == "stdio":
        stdin = cases.inputs[index].encode("utf-8")
        return _STDIO_HARNESS.format(stdin=stdin, program=program)
    if cases.kind == "call":
        check = _CALL_CHECK.format(
            fn=cases.fn_name, args=cases.inputs[index], expected=cases.outputs[index]
        )
    else:
        check = _ASSERT_CHECK.format(statement=cases.inputs[index])
    return _CHECK_HARNESS.format(program=program, check=check, token=token)


def run_code_cases(
    program: str,
    cases: CodeCases,
    *,
    max_parallel: int = DEFAULT_MAX_PARALLEL,
    isolation: str = "namespaces",
) -> list[dict[str, Any]]:
    """Run ``program`` on every case in its own sandbox; return one verdict dict per case.

    Each verdict has ``passed`` (bool), ``timed_out``, ``exit_code``, ``signal`` and
    ``duration_s``. Cases run ``max_parallel`` at a time (each sandbox is a process tree of its
    own, so threads suffice to drive them), so a response costs at most about
    ``ceil(len(cases) / max_parallel) * time_limit_s`` seconds.

    Raises:
        polyrl.core.sandbox.SandboxUnavailable: The machine cannot build the sandbox (the
            message says what to enable).
    """
    from polyrl.core.sandbox import SandboxConfig, run_in_sandbox

    token = secrets.token_hex(16)
    expected_bytes = max((len(str(o)) for o in cases.outputs), default=0)
    config = SandboxConfig(
        timeout=cases.time_limit_s,
        cpu_seconds=max(1, math.ceil(cases.time_limit_s)),
        memory_mb=cases.memory_mb,
        disk_mb=16,
        max_procs=8,
        # Room for the expected output and then some: a flood of output only has to be counted.
        max_output_bytes=max(1 << 16, 4 * expected_bytes + 1024),
        isolation=isolation,
    )

    def run(index: int) -> dict[str, Any]:
        result = run_in_sandbox(_harness(cases, index, program, token), config)
        if result.timed_out or result.exit_code != 0 or result.truncated:
            passed = False
        elif cases.kind == "stdio":
            passed = outputs_match(result.output, cases.outputs[index])
        else:
            lines = result.output.rstrip().splitlines()
            passed = bool(lines) and lines[-1] == token
        return {
            "passed": passed,
            "timed_out": result.timed_out,
            "exit_code": result.exit_code,
            "signal": result.signal,
            "duration_s": result.duration_s,
        }

    workers = max(1, min(int(max_parallel), len(cases)))
    if workers == 1:
        return [run(i) for i in range(len(cases))]
    with ThreadPoolExecutor(workers, thread_name_prefix="polyrl-code") as pool:
        return list(pool.map(run, range(len(cases))))


@register_scorer("code", "code_simple")
def code_score(
    response: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    prompt: str | None = None,
) -> dict[str, float]:
    """Fraction of the ground truth's test cases the response's program passes.

    ``extra_info["max_parallel"]``, when present, overrides :data:`DEFAULT_MAX_PARALLEL`.

    Returns:
        ``{"score": passed / cases, "acc": 1.0 if all passed else 0.0, "passed": ...,
        "cases": ..., "timeouts": ...}``.

    Raises:
        ValueError: If ``ground_truth`` is malformed (see :func:`parse_code_ground_truth`).
        polyrl.core.sandbox.SandboxUnavailable: Where the sandbox cannot be built.
    """
    cases = parse_code_ground_truth(ground_truth)
    parallel = DEFAULT_MAX_PARALLEL
    if extra_info and extra_info.get("max_parallel") is not None:
        parallel = int(extra_info["max_parallel"])
    program = extract_program(response)
    if not program.strip():
        return {
            "score": 0.0,
            "acc": 0.0,
            "passed": 0.0,
            "cases": float(len(cases)),
            "timeouts": 0.0,
        }
    verdicts = run_code_cases(program, cases, max_parallel=parallel)
    passed = sum(v["passed"] for v in verdicts)
    return {
        "score": passed / len(cases),
        "acc": float(passed == len(cases)),
        "passed": float(passed),
        "cases": float(len(cases)),
        "timeouts": float(sum(v["timed_out"] for v in verdicts)),
    }
