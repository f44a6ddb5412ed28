"""Tools an agent can call: the ``Tool`` interface, a registry and the shipped tools.

* ``calculator``: arithmetic on numbers, evaluated by walking the Python AST (never ``eval``).
* ``python``: runs code in a sandboxed subprocess (see :class:`PythonSandboxTool`).
* ``countdown_check``: checks a candidate countdown expression against the sample's numbers
  and target (reusing the countdown scorer's safe expression evaluator).

A tool's ``call`` receives the parsed JSON arguments plus the sample's per-tool context
(``extra_info["tools_kwargs"][tool_name]``) as keyword arguments; it returns a
:class:`ToolResult` (or a plain string). Raising :class:`ToolError` (or any exception) is not a
crash: the agent loop turns it into an error message for the model.
"""

from __future__ import annotations

import abc
import ast
import asyncio
import contextlib
import dataclasses
import functools
import math
import operator
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from polyrl.core.registry import Registry

__all__ = [
    "TOOLS",
    "CalculatorTool",
    "CountdownCheckTool",
    "PythonSandboxTool",
    "Tool",
    "ToolError",
    "ToolResult",
    "available_tools",
    "create_tool",
    "get_tool",
    "network_namespace_command",
    "register_tool",
    "safe_calculate",
]


class ToolError(Exception):
    """An expected tool failure; its message is shown to the model."""


@dataclasses.dataclass
class ToolResult:
    """What a tool call returns to the loop.

    Attributes:
        text: the tool response shown to the model.
        reward: reward credited to this turn (0 for most tools).
        error: whether the call failed (counted in ``tool_errors``).
    """

    text: str
    reward: float = 0.0
    error: bool = False


class Tool(abc.ABC):
    """A function the model can call; subclass, set the class attributes and register it.

    Attributes:
        name: the function name the model uses.
        description: one line for the tools list in the system prompt.
        parameters: JSON schema of the arguments object.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def schema(self) -> dict[str, Any]:
        """Return the OpenAI function schema (the chat template lists it in the system turn)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    @abc.abstractmethod
    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Run the tool on parsed arguments (``context``: the sample's ``tools_kwargs``)."""


#: Tool classes by name (a tool's :attr:`Tool.name` is the name it is registered under).
TOOLS: Registry[type[Tool]] = Registry("tool", base=Tool, name_attr="name")
register_tool = TOOLS.register
available_tools = TOOLS.names
get_tool = TOOLS.get


def create_tool(name: str, **kwargs: Any) -> Tool:
    """Instantiate the tool registered under ``name``."""
    return get_tool(name)(**kwargs)


# ----------------------------------------------------------------------------- calculator

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_MAX_EXPR_CHARS = 200
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10**30


def safe_calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression by walking its AST.

    Allowed: int/float literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Exponents
    are capped at 64 and intermediate magnitudes at 1e30 so no input can exhaust CPU or memory.

    Raises:
        ToolError: anything else (names, calls, attributes, too long, division by zero...).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression must be a non-empty string")
    if len(expression) > _MAX_EXPR_CHARS:
        raise ToolError(f"expression is longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not a valid arithmetic expression: {exc.msg}") from None

    def check(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        if abs(value) > _MAX_MAGNITUDE:
            raise ToolError("a value exceeds the calculator's range (1e30)")
        return value

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ToolError(f"exponents above {_MAX_EXPONENT} are not allowed")
            try:
                return check(_BINOPS[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except (OverflowError, TypeError) as exc:
                raise ToolError(f"cannot compute: {exc}") from None
        raise ToolError(
            f"unsupported syntax {type(node).__name__}; only numbers, + - * / // % ** and "
            "parentheses are allowed"
        )

    return walk(tree)


@register_tool("calculator")
class CalculatorTool(Tool):
    """Evaluate an arithmetic expression safely."""

    description = "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
        "required": ["expression"],
    }

    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Return the value of ``arguments["expression"]`` as text."""
        value = safe_calculate(arguments.get("expression"))  # type: ignore[arg-type]
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return str(value)


# ----------------------------------------------------------------------------- countdown


@register_tool("countdown_check")
class CountdownCheckTool(Tool):
    """Check a candidate countdown expression against the sample's numbers and target.

    The context (``tools_kwargs["countdown_check"]``) must give ``target`` and ``numbers``.
    """

    description = (
        "Check a candidate expression for the countdown puzzle: reports its value and "
        "whether it uses each given number exactly once and hits the target."
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (25 - 5) * 4"}},
        "required": ["expression"],
    }

    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Evaluate the expression with exact fractions and compare with the puzzle."""
        from polyrl.core.expressions import ExpressionError, evaluate_expression

        if "target" not in context or "numbers" not in context:
            raise ToolError("countdown_check needs the puzzle's 'target' and 'numbers' in context")
        target, numbers = int(context["target"]), [int(n) for n in context["numbers"]]
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError("'expression' must be a string")
        try:
            value, used = evaluate_expression(expression)
        except ExpressionError as exc:
            raise ToolError(f"invalid expression: {exc}") from None
        shown = str(value.numerator) if value.denominator == 1 else str(value)
        if sorted(used) != sorted(numbers):
            return f"{expression} = {shown}, but it must use each of {numbers} exactly once"
        if value != target:
            return f"{expression} = {shown}, not {target}"
        return ToolResult(text=f"{expression} = {shown}: correct", reward=0.0)


# ----------------------------------------------------------------------------- python sandbox

_NOBODY = 65534

# Runs in the child before the user's code: installs an audit hook (which cannot be removed)
# that refuses network use, writes outside the sandbox directory and new processes. ctypes is
# allowed (numpy needs it) and could bypass the hook: the network namespace and the dropped
# privileges are the OS-level layers that still hold then.
_BOOTSTRAP = r"""
import os, sys
_root = os.path.realpath(os.getcwd())
_code = compile(open("main.py", encoding="utf-8").read(), "main.py", "exec")
_net = {NET!r}
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.replace": 2,
    "os.chmod": 1, "os.chown": 1, "os.link": 2, "os.symlink": 2, "os.truncate": 1,
    "os.utime": 1, "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.move": 2}
_PROC = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen")
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        rp = os.path.realpath(os.fsdecode(p))
    except Exception:
        return False
    return rp == _root or rp.startswith(_root + os.sep)
def _hook(event, args):
    if _net and event.startswith("socket.") and event not in ("socket.__new__",):
        raise PermissionError("sandbox: network access is disabled (" + event + ")")
    if event == "open":
        path, mode, flags = args
        if path is not None and (flags or 0) & _W and not _inside(path):
            raise PermissionError("sandbox: writing outside the sandbox directory is not allowed")
    elif event in _PATH_EVENTS:
        for p in args[:_PATH_EVENTS[event]]:
            if p is not None and not _inside(p):
                raise PermissionError("sandbox: changing files outside the sandbox directory "
                                      "is not allowed (" + event + ")")
    elif event in _PROC:
        raise PermissionError("sandbox: " + event + " is not allowed")
sys.addaudithook(_hook)
del _hook
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@functools.cache
def network_namespace_command() -> tuple[str, ...] | None:
    """Return the command prefix running a child in a new, empty network namespace, if any.

    ``unshare -n`` (needs CAP_SYS_ADMIN, e.g. root) or ``unshare -rn`` (an unprivileged user
    namespace); ``None`` when neither is available here.
    """
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for flags in (("-n",), ("-r", "-n")):
        try:
            ok = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return (exe, *flags)
    return None


@register_tool("python")
class PythonSandboxTool(Tool):
    """Run Python code in a contained subprocess and return its output.

    Containment (each layer is tested in ``tests/test_agent_tools.py``):

    * resource limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size
      (``RLIMIT_FSIZE``), no core dumps; a wall-clock timeout kills the whole process group;
    * a fresh temporary directory as the working directory, deleted afterwards;
    * network: a new, empty network namespace (``unshare -n``) when available, plus an audit
      hook installed before the code runs that refuses socket use;
    * files: the audit hook refuses writes, renames and deletions outside the directory; when
      running as root the child also drops to user ``nobody`` (``setpriv``), so the OS refuses
      writes to anything the sandbox does not own;
    * processes: the audit hook refuses fork/exec/subprocess (ctypes stays allowed for numpy,
      so the hook is a second layer; the namespace and ``nobody`` are the OS-enforced ones).

    Args:
        timeout: wall-clock seconds before the process group is killed.
        cpu_seconds: CPU-time limit.
        memory_mb: address-space limit.
        file_size_mb: largest file the code may write.
        max_output_chars: the output shown to the model is cut to this length.
        network: ``"auto"`` (namespace when available; audit hook always), ``"namespace"``
            (require the namespace), ``"audit"`` (audit hook only).
        audit_hook: install the audit hook (disable only to test the OS layers alone).
        drop_privileges: when root, run the code as ``nobody``.
    """

    description = "Run a Python 3 program and return what it prints (stdout and stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program's source"}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        timeout: float = 10.0,
        cpu_seconds: int = 5,
        memory_mb: int = 512,
        file_size_mb: int = 16,
        max_output_chars: int = 4000,
        network: str = "auto",
        audit_hook: bool = True,
        drop_privileges: bool = True,
    ):
        if network not in ("auto", "namespace", "audit"):
            raise ValueError(f"network must be 'auto', 'namespace' or 'audit', got {network!r}")
        for name, value in (
            ("timeout", timeout),
            ("cpu_seconds", cpu_seconds),
            ("memory_mb", memory_mb),
            ("file_size_mb", file_size_mb),
            ("max_output_chars", max_output_chars),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.timeout = float(timeout)
        self.cpu_seconds = int(cpu_seconds)
        self.memory_bytes = int(memory_mb) << 20
        self.file_size_bytes = int(file_size_mb) << 20
        self.max_output_chars = int(max_output_chars)
        self.audit_hook = audit_hook
        self.netns: tuple[str, ...] | None = None
        if network in ("auto", "namespace"):
            self.netns = network_namespace_command()
            if self.netns is None and network == "namespace":
                raise RuntimeError(
                    "network='namespace' needs a working 'unshare -n' or 'unshare -rn'; use "
                    "network='auto' or 'audit' on this machine"
                )
        if network == "audit" and not audit_hook:
            raise ValueError("network='audit' needs audit_hook=True (nothing would block it)")
        setpriv = shutil.which("setpriv")
        # `unshare -r` maps us to root inside a user namespace; setpriv cannot drop to nobody
        # there, and the mapped "root" has no real privileges anyway.
        self.drop_to: int | None = (
            _NOBODY
            if drop_privileges and os.geteuid() == 0 and setpriv and "-r" not in (self.netns or ())
            else None
        )
        self._setpriv = setpriv
        # prlimit sets the limits in the exec chain; without it they are set in a preexec_fn
        # (between fork and exec), which is less safe in a multi-threaded parent.
        self._prlimit = shutil.which("prlimit")

    @property
    def isolation(self) -> str:
        """Which network layers are active: ``netns+audit``, ``netns`` or ``audit``."""
        layers = (["netns"] if self.netns else []) + (["audit"] if self.audit_hook else [])
        return "+".join(layers)

    def _limits(self) -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_bytes, self.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def command(self) -> list[str]:
        """Return the child's argv (namespace prefix, privilege drop, isolated Python)."""
        cmd: list[str] = []
        if self._prlimit:
            cmd += [
                self._prlimit,
                f"--cpu={self.cpu_seconds}:{self.cpu_seconds + 1}",
                f"--as={self.memory_bytes}",
                f"--fsize={self.file_size_bytes}",
                "--core=0",
                "--",
            ]
        cmd += list(self.netns or ())
        if self.drop_to is not None:
            cmd += [
                str(self._setpriv),
                f"--reuid={self.drop_to}",
                f"--regid={self.drop_to}",
                "--clear-groups",
            ]
        boot = _BOOTSTRAP.replace("{NET!r}", repr(self.audit_hook))
        if not self.audit_hook:
            boot = boot.replace("sys.addaudithook(_hook)", "")
        return [*cmd, sys.executable, "-I", "-u", "-c", boot]  # -u: output in order

    async def run_code(self, code: str) -> ToolResult:
        """Run ``code`` and return its (truncated) output plus how it ended."""
        workdir = tempfile.mkdtemp(prefix="polyrl-sandbox-")
        proc: asyncio.subprocess.Process | None = None
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if self.drop_to is not None:
                os.chown(workdir, self.drop_to, self.drop_to)
                os.chown(os.path.join(workdir, "main.py"), self.drop_to, self.drop_to)
            proc = await asyncio.create_subprocess_exec(
                *self.command(),
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=None if self._prlimit else self._limits,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"},
            )
            keep = bytearray()
            total = 0

            async def drain() -> None:
                # Read everything (so the child never blocks on a full pipe) but keep a bounded
                # prefix: a print loop cannot exhaust our memory.
                nonlocal total
                assert proc.stdout is not None
                while chunk := await proc.stdout.read(65536):
                    total += len(chunk)
                    room = 4 * self.max_output_chars - len(keep)
                    if room > 0:
                        keep.extend(chunk[:room])

            timed_out = False
            try:
                await asyncio.wait_for(asyncio.gather(drain(), proc.wait()), self.timeout)
            except TimeoutError:
                timed_out = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            out = keep.decode("utf-8", errors="replace")
            if len(out) > self.max_output_chars or total > len(keep):
                out = out[: self.max_output_chars] + f"\n[output truncated: {total} bytes in all]"
            rc = proc.returncode
            if timed_out:
                return ToolResult(
                    out + f"\n[killed: wall-clock timeout of {self.timeout:g} s]", error=True
                )
            if rc is not None and rc < 0:
                sig = signal.Signals(-rc).name
                why = " (CPU time limit)" if sig in ("SIGXCPU", "SIGKILL") else ""
                return ToolResult(out + f"\n[killed by {sig}{why}]", error=True)
            if rc:
                return ToolResult(out + f"\n[exit code {rc}]", error=True)
            return ToolResult(out)
        finally:
            # Also on cancellation (the loop's own timeout): never leave the child running.
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            shutil.rmtree(workdir, ignore_errors=True)

    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Run ``arguments["code"]``."""
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("'code' must be a non-empty string of Python source")
        return await self.run_code(code)
