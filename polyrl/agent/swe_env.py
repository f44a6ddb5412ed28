"""A software-engineering environment: fix the planted bug of a small generated Python repository.

:func:`make_repo` generates, deterministically and with no download, a tiny package with a few
functions, one of them buggy, and the tests that expose the bug (one test file per module, plain
``test_*`` functions with ``assert``). ``split="train"`` and ``split="heldout"`` draw from
disjoint constants and names, so a held-out repository is never a training one.

:class:`SWEEnv` (registered as ``swe``) runs one episode on a per-episode copy of a repository,
held in memory by the environment. Each model turn is one tool call in the Hermes format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``):

* ``read_file {path}``, ``write_file {path, content}``, ``apply_patch {path, old, new}``
  (replace one exact occurrence of ``old``), ``list_files {}``: on the episode's copy; a path
  must stay inside the repository (relative, no ``..``), anything else is an error message;
* ``run_tests {}`` and ``bash {command}``: executed in :func:`~polyrl.core.sandbox.arun_in_sandbox`
  on a fresh copy of the episode's files written into the sandbox's private tmpfs, with the
  environment's time, memory, process and disk limits, no network and no host file visible
  but the interpreter, libraries and ``/bin`` (read-only). What ``bash`` changes in the
  repository is copied back into the episode's copy (and nothing else: the sandbox and every
  process it started are gone when the call returns);
* ``submit {}``: ends the episode.

The same environment through the proxy path: :func:`openai_swe_agent` is an agent on the
stock ``openai`` client (``agent.entrypoint=polyrl.agent.swe_env:openai_swe_agent``).

Reward (at the end only: on ``submit`` or after ``max_steps`` turns): the fraction of the
repository's tests that pass, run from the pristine test files against the episode's code, and
1.0 only when all pass. A test file that the agent deleted or changed makes the reward 0 (its
tests cannot be trusted to be the ones that define the task).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import posixpath
import random
import shutil
from collections.abc import Mapping
from typing import Any

from polyrl.agent.envs import Env, StepResult, register_env
from polyrl.core.sandbox import SandboxConfig, arun_in_sandbox

__all__ = ["OPENAI_TOOLS", "SWEEnv", "SWETask", "make_repo", "openai_swe_agent", "swe_rows"]

SPLITS = ("train", "heldout")

# (template name, signature, correct body, buggy body, tests: (name, assertion) with {fn} and {k})
_TEMPLATES: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "sum_to",
        "n",
        "return sum(range(n + 1))",
        "return sum(range(n))",
        [
            ("zero", "assert {fn}(0) == 0"),
            ("small", "assert {fn}(3) == 6"),
            ("k", "assert {fn}({k}) == {k} * ({k} + 1) // 2"),
        ],
    ),
    (
        "is_even",
        "n",
        "return n % 2 == 0",
        "return n % 2 == 1",
        [
            ("even", "assert {fn}(2 * {k})"),
            ("odd", "assert not {fn}(2 * {k} + 1)"),
            ("type", "assert isinstance({fn}(1), bool)"),
        ],
    ),
    (
        "largest",
        "xs",
        "best = xs[0]\n    for x in xs:\n        if x > best:\n"
        "            best = x\n    return best",
        "best = xs[0]\n    for x in xs:\n        if x < best:\n"
        "            best = x\n    return best",
        [
            ("single", "assert {fn}([{k}]) == {k}"),
            ("many", "assert {fn}([1, {k}, 3]) == {k}"),
            ("first", "assert {fn}([{k}, 1, 2]) == {k}"),
        ],
    ),
    (
        "clamp",
        "x, lo, hi",
        "return max(lo, min(x, hi))",
        "return min(lo, max(x, hi))",
        [
            ("inside", "assert {fn}(5, 0, {k}) == 5"),
            ("above", "assert {fn}({k} + 7, 0, {k}) == {k}"),
            ("below", "assert {fn}(-3, 0, {k}) == 0"),
        ],
    ),
    (
        "count_vowels",
        "s",
        'return sum(c in "aeiou" for c in s.lower())',
        'return sum(c in "aeio" for c in s.lower())',
        [
            ("none", 'assert {fn}("xyz") == 0'),
            ("u", 'assert {fn}("u" * {k}) == {k}'),
            ("mixed", 'assert {fn}("Audio") == 4'),
        ],
    ),
    (
        "scale",
        "xs, k",
        "return [x * k for x in xs]",
        "return [x + k for x in xs]",
        [
            ("empty", "assert {fn}([], {k}) == []"),
            ("one", "assert {fn}([1], {k}) == [{k}]"),
            ("two", "assert {fn}([2, 3], {k}) == [2 * {k}, 3 * {k}]"),
        ],
    ),
]
# Names and constants differ between the splits, so no held-out repository is a training one.
_PACKAGES = {"train": ("mathkit", "utilbox", "numtools"), "heldout": ("calclib", "smalltools")}
_CONSTANTS = {"train": (5, 50), "heldout": (51, 99)}


@dataclasses.dataclass(frozen=True)
class SWETask:
    """One generated repository.

    Attributes:
        files: path -> content of the buggy repository (source and tests).
        fix: path -> content of the files the right fix changes.
        tests: the test ids (``file::function``) that define success, in order.
        buggy: the name of the function with the planted bug.
        split: ``train`` or ``heldout``; index: its index in the split.
    """

    files: dict[str, str]
    fix: dict[str, str]
    tests: tuple[str, ...]
    buggy: str
    split: str
    index: int


def make_repo(split: str = "train", index: int = 0) -> SWETask:
    """Generate repository ``index`` of ``split`` (deterministic: same arguments, same files)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    rng = random.Random(f"polyrl-swe-{split}-{index}")
    pkg = rng.choice(_PACKAGES[split])
    mod = rng.choice(("core", "ops", "helpers"))
    chosen = rng.sample(range(len(_TEMPLATES)), 3)
    bug = chosen[0]  # the first function drawn carries the bug; the others are correct
    lo, hi = _CONSTANTS[split]
    funcs, fixed_funcs, tests, test_src = [], [], [], []
    for t in sorted(chosen):
        name, sig, good, bad, cases = _TEMPLATES[t]
        fn = f"{name}_{rng.randint(1, 9)}"
        k = rng.randint(lo, hi)
        body = bad if t == bug else good
        funcs.append(f"def {fn}({sig}):\n    {body}\n")
        fixed_funcs.append(f"def {fn}({sig}):\n    {good}\n")
        if t == bug:
            buggy = fn
        for case, assertion in cases:
            test = f"test_{fn}_{case}"
            test_src.append(f"def {test}():\n    {assertion.format(fn=fn, k=k)}\n")
            tests.append(f"tests/test_{mod}.py::{test}")
    names = ", ".join(f.split("(")[0][4:] for f in funcs)
    src = f"{pkg}/{mod}.py"
    header = f'"""Small helpers of {pkg}."""\n\n\n'
    files = {
        f"{pkg}/__init__.py": "",
        src: header + "\n\n".join(funcs),
        f"tests/test_{mod}.py": f"from {pkg}.{mod} import {names}\n\n\n" + "\n\n".join(test_src),
        "README.md": f"# {pkg}\n\nRun the tests with the run_tests tool.\n",
    }
    fix = {src: header + "\n\n".join(fixed_funcs)}
    return SWETask(files, fix, tuple(tests), buggy, split, index)


def swe_rows(split: str = "train", n: int = 8, start: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` RL dataset rows of the ``swe`` environment (``env`` loop)."""
    rows = []
    for i in range(start, start + n):
        rows.append(
            {
                "data_source": f"swe_{split}",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}],
                "extra_info": {
                    "agent_name": "env",
                    "env_name": "swe",
                    "env_kwargs": {"split": split, "index": i},
                },
            }
        )
    return rows


SYSTEM_PROMPT = (
    "You fix bugs in Python repositories. Each turn, call exactly one tool as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>. Tools: list_files {}, '
    "read_file {path}, write_file {path, content}, apply_patch {path, old, new}, run_tests {}, "
    "bash {command}, submit {}."
)

# The program run in the sandbox: write the files, run the tests or a command, report as JSON
# after a marker line (the marker keeps the report apart from what the command printed).
_MARKER = "=====POLYRL-SWE-REPORT====="
_RUNNER = r"""
import base64, importlib, json, os, subprocess, sys, traceback
files = json.loads(base64.b64decode(FILES_B64))
root = "/tmp/repo"
for path, text in files.items():
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)
os.chdir(root)
sys.path.insert(0, root)
report = {}
if MODE == "tests":
    results = {}
    for test_id in TESTS:
        path, func = test_id.split("::")
        name = path[:-3].replace("/", ".")
        try:
            fn = getattr(importlib.import_module(name), func)
            fn()
            results[test_id] = "passed"
        except Exception as exc:
            results[test_id] = "failed: " + type(exc).__name__ + ": " + str(exc)[:200]
    report["results"] = results
else:
    # `python`/`python3` in a command are the sandbox's interpreter (links, not copies).
    bindir = "/tmp/.bin"
    os.makedirs(bindir, exist_ok=True)
    for alias in ("python", "python3"):
        if not os.path.exists(os.path.join(bindir, alias)):
            os.symlink(sys.executable, os.path.join(bindir, alias))
    env = dict(os.environ, PATH=bindir + ":" + os.environ.get("PATH", "/usr/bin"))
    try:
        proc = subprocess.run(
            [SHELL, "-c", COMMAND],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            env=env,
        )
        report["output"] = (proc.stdout + proc.stderr)[-4000:]
        report["exit_code"] = proc.returncode
    except subprocess.TimeoutExpired:
        report["output"] = "command timed out"
        report["exit_code"] = None
    tree = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for n in names:
            full = os.path.join(base, n)
            try:
                if os.path.getsize(full) <= MAX_FILE_BYTES:
                    with open(full) as f:
                        tree[os.path.relpath(full, root)] = f.read()
            except (OSError, UnicodeDecodeError):
                pass
    report["files"] = tree
print(MARKER)
print(json.dumps(report))
"""


def _shell() -> str:
    """Return the host's ``sh`` by its real path (``/bin`` may be a link the sandbox lacks)."""
    found = shutil.which("sh") or "/bin/sh"
    return os.path.realpath(found)


def _clean_path(path: Any) -> str:
    """Return ``path`` normalised inside the repository; raise ``ValueError`` otherwise."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("path must be a non-empty string")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"path {path!r} is outside the repository (use a relative path)")
    norm = posixpath.normpath(path)
    if norm == "." or norm == ".." or norm.startswith("../"):
        raise ValueError(f"path {path!r} is outside the repository")
    return norm


@register_env("swe")
class SWEEnv(Env):
    """Fix a generated repository's planted bug with file, test and shell tools (see module).

    Args:
        timeout: wall-clock seconds of each sandboxed ``run_tests`` / ``bash`` call.
        memory_mb: address-space limit of each sandboxed process.
        disk_mb: size of the sandbox's writable tmpfs.
        max_procs: processes and threads a sandboxed call may have.
        max_steps: turns before the episode ends (and is scored) without ``submit``.
        max_file_bytes: largest file a tool writes or ``bash`` copies back.
    """

    def __init__(
        self,
        *,
        timeout: float = 10.0,
        memory_mb: int = 512,
        disk_mb: int = 16,
        max_procs: int = 16,
        max_steps: int = 8,
        max_file_bytes: int = 1 << 16,
    ):
        self.sandbox = SandboxConfig(
            timeout=timeout,
            memory_mb=memory_mb,
            disk_mb=disk_mb,
            max_procs=max_procs,
            cpu_seconds=max(1, int(timeout)),
            max_output_bytes=1 << 20,
            # A shell for the bash tool; the interpreter and libraries are bound already.
            ro_binds=(os.path.dirname(_shell()), "/usr/bin"),
        )
        self.max_steps = max_steps
        self.max_file_bytes = max_file_bytes
        self.task: SWETask | None = None
        self.files: dict[str, str] = {}
        self.steps = 0
        self.finished: dict[str, float] | None = None

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start on a copy of repository ``index`` (default: ``seed``) of ``split``.

        The constructor's limits may be given here too (``extra_info.env_kwargs`` reach only
        ``reset``): ``timeout``, ``memory_mb``, ``disk_mb``, ``max_procs``, ``max_steps``.
        """
        limits = {
            k: kwargs[k] for k in ("timeout", "memory_mb", "disk_mb", "max_procs") if k in kwargs
        }
        if limits:
            if "timeout" in limits:
                limits["cpu_seconds"] = max(1, int(limits["timeout"]))
            self.sandbox = dataclasses.replace(self.sandbox, **limits)
        self.max_steps = int(kwargs.get("max_steps", self.max_steps))
        index = int(kwargs.get("index", seed if seed is not None else 0))
        self.task = make_repo(str(kwargs.get("split", "train")), index)
        self.files = dict(self.task.files)
        self.steps = 0
        self.finished: dict[str, float] | None = None
        listing = "\n".join(sorted(self.files))
        return (
            f"Repository files:\n{listing}\n\nSome tests fail. Find the bug, fix it so that "
            "every test passes, then call submit."
        )

    async def step(self, action: str) -> StepResult:
        """Run the tool call in ``action``; score the repository when the episode ends."""
        from polyrl.agent.tool_loop import HermesToolParser

        self.steps += 1
        calls = HermesToolParser().parse(action)
        done = False
        if not calls:
            obs = 'No tool call found. Call one tool as <tool_call>{"name": ...}</tool_call>.'
        elif calls[0].error is not None:
            obs = f"Error: {calls[0].error}"
        else:
            obs, done = await self.call(calls[0].name, dict(calls[0].arguments or {}))
        if done or self.steps >= self.max_steps:
            score, info, summary = await self._final()
            return f"{obs}\n{summary}", score, True, info
        return obs, 0.0, False, {}

    async def finish(self) -> tuple[float, dict[str, float]]:
        """Score the episode once: ``(reward, info)`` (the env loop calls it at its limits)."""
        if self.finished is not None:
            return 0.0, self.finished  # scored already: nothing more to add
        score, info, _ = await self._final()
        return score, info

    async def _final(self) -> tuple[float, dict[str, float], str]:
        score, results = await self.score()
        passed = sum(r == "passed" for r in results.values())
        self.finished = {"tests_passed": float(passed), "solved": float(score == 1.0)}
        return score, self.finished, f"Final: {passed}/{len(results)} tests pass."

    async def call(self, name: str, args: Mapping[str, Any]) -> tuple[str, bool]:
        """Run one tool; return ``(observation, done)``. Errors are observations."""
        try:
            if name == "submit":
                return "Submitted.", True
            if name == "list_files":
                return "\n".join(sorted(self.files)), False
            if name == "read_file":
                path = _clean_path(args.get("path"))
                if path not in self.files:
                    return f"Error: no file {path!r}", False
                return self.files[path], False
            if name == "write_file":
                path, content = _clean_path(args.get("path")), args.get("content")
                if not isinstance(content, str) or len(content.encode()) > self.max_file_bytes:
                    return (
                        f"Error: content must be a string of <= {self.max_file_bytes} bytes",
                        False,
                    )
                self.files[path] = content
                return f"Wrote {path}.", False
            if name == "apply_patch":
                path = _clean_path(args.get("path"))
                old, new = args.get("old"), args.get("new")
                text = self.files.get(path)
                if text is None or not isinstance(old, str) or not isinstance(new, str):
                    return "Error: apply_patch needs an existing path and strings old, new", False
                if text.count(old) != 1:
                    return f"Error: old text occurs {text.count(old)} times in {path}", False
                self.files[path] = text.replace(old, new)
                return f"Patched {path}.", False
            if name == "run_tests":
                results = await self.run_tests(self.files)
                lines = [f"{t}: {r}" for t, r in results.items()]
                return "\n".join(lines), False
            if name == "bash":
                command = args.get("command")
                if not isinstance(command, str) or not command:
                    return "Error: bash needs a command string", False
                return await self.bash(command), False
            return f"Error: unknown tool {name!r}", False
        except ValueError as exc:
            return f"Error: {exc}", False

    async def _sandboxed(self, files: Mapping[str, str], **settings: Any) -> dict[str, Any]:
        blob = base64.b64encode(json.dumps(dict(files)).encode()).decode()
        consts = {
            "FILES_B64": blob,
            "MARKER": _MARKER,
            "MAX_FILE_BYTES": self.max_file_bytes,
            **settings,
        }
        code = "".join(f"{k} = {v!r}\n" for k, v in consts.items()) + _RUNNER
        result = await arun_in_sandbox(code, self.sandbox)
        out = result.output
        if _MARKER not in out:
            why = "timed out" if result.timed_out else f"exit {result.exit_code} {result.signal}"
            return {"error": f"sandbox run failed ({why}): {out[-500:]}"}
        return json.loads(out.split(_MARKER, 1)[1].strip().splitlines()[0])

    async def run_tests(self, files: Mapping[str, str]) -> dict[str, str]:
        """Run the task's tests on ``files`` in the sandbox: test id -> passed / failed: why."""
        assert self.task is not None, "reset() first"
        report = await self._sandboxed(files, MODE="tests", TESTS=list(self.task.tests))
        if "error" in report:
            return dict.fromkeys(self.task.tests, f"failed: {report['error']}")
        return {t: report["results"].get(t, "failed: not run") for t in self.task.tests}

    async def bash(self, command: str) -> str:
        """Run ``command`` in the sandbox on the episode's files; keep its changes."""
        timeout = max(1.0, float(self.sandbox.timeout) - 2.0)
        report = await self._sandboxed(
            self.files, MODE="bash", COMMAND=command, COMMAND_TIMEOUT=timeout, SHELL=_shell()
        )
        if "error" in report:
            return report["error"]
        self.files = dict(report["files"])
        return f"exit code {report['exit_code']}\n{report['output']}"

    async def score(self) -> tuple[float, dict[str, str]]:
        """Fraction of the pristine tests passing on the episode's code (0 if tests tampered)."""
        assert self.task is not None, "reset() first"
        pristine = {p: t for p, t in self.task.files.items() if p.startswith("tests/")}
        if any(self.files.get(p) != t for p, t in pristine.items()):
            return 0.0, dict.fromkeys(self.task.tests, "failed: the test files were changed")
        results = await self.run_tests({**self.files, **pristine})
        passed = sum(r == "passed" for r in results.values())
        return passed / len(results), results


#: The environment's tools in the OpenAI ``tools`` format (for agents using the openai client).
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        },
    }
    for name, description, params in (
        ("list_files", "List the repository's files.", ()),
        ("read_file", "Read a file.", ("path",)),
        ("write_file", "Replace a file's content.", ("path", "content")),
        ("apply_patch", "Replace one exact occurrence of old by new.", ("path", "old", "new")),
        ("run_tests", "Run the tests.", ()),
        ("bash", "Run a shell command in the repository.", ("command",)),
        ("submit", "End the episode.", ()),
    )
]


async def openai_swe_agent(client: Any, task: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
    """Play the ``swe`` environment as an agent on the openai client (``agent.entrypoint``).

    ``polyrl train grpo agent.entrypoint=polyrl.agent.swe_env:openai_swe_agent`` on rows of
    :func:`swe_rows` (without their ``agent_name``, which picks the ``env`` loop): the tools
    are offered as OpenAI ``tools``, each tool call the model makes (the proxy parses them)
    runs on the episode's copy, its result goes back as a ``tool`` message, and the
    conversation only ever grows, so the episode is one trajectory. It ends on ``submit``, a
    reply without a tool call, or ``max_steps``; the reward is the tests'.
    """
    extra = task.get("extra_info") or {}
    env = SWEEnv()
    kwargs = dict(extra.get("env_kwargs") or {})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": env.reset(seed=extra.get("seed"), **kwargs)},
    ]
    for _ in range(env.max_steps):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=OPENAI_TOOLS
        )
        message = reply.choices[0].message
        calls = list(message.tool_calls or [])
        # Echoed back as received, so the next call extends this one (one trajectory).
        echoed: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            echoed["tool_calls"] = [c.model_dump() for c in calls]
        messages.append(echoed)
        if not calls:
            break
        done = False
        for c in calls:
            try:
                args = json.loads(c.function.arguments or "{}")
            except ValueError:
                args = {}
            obs, done = await env.call(c.function.name, args if isinstance(args, dict) else {})
            messages.append({"role": "tool", "tool_call_id": c.id, "content": obs})
            if done:
                break
        if done:
            break
    reward, info = await env.finish()
    return reward, info
