"""Tools an agent can call: the ``Tool`` interface, a registry and the shipped tools.

* ``calculator``: arithmetic on numbers, evaluated by walking the Python AST (never ``eval``).
* ``python``: runs code in the namespace sandbox of :mod:`polyrl.core.sandbox`.
* ``countdown_check``: checks a candidate countdown expression against the sample's numbers
  and target (reusing the countdown scorer's safe expression evaluator).
* ``gsm8k_check``: checks a GSM8K answer against the sample's ground truth (verl's
  ``Gsm8kTool``); :func:`load_tool_config` reads verl's tool YAML.

A tool's ``call`` receives the parsed JSON arguments plus the sample's per-tool context
(``extra_info["tools_kwargs"][tool_name]``) as keyword arguments; it returns a
:class:`ToolResult` (or a plain string, or a list of chat content parts). A result may show the
model images: give its ``text`` as content parts, e.g. ``[{"type": "text", "text": "plot:"},
{"type": "image", "image": <PIL image or PNG bytes>}]`` (the loop needs a vision processor).
Raising :class:`ToolError` (or any exception) is not a crash: the agent loop turns it into an
error message for the model.
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import math
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any

from polyrl.core.registry import Registry
from polyrl.core.sandbox import SandboxConfig, SandboxError, arun_in_sandbox, check_sandbox

__all__ = [
    "TOOLS",
    "CalculatorTool",
    "CountdownCheckTool",
    "Gsm8kCheckTool",
    "PythonSandboxTool",
    "Tool",
    "ToolError",
    "ToolResult",
    "VERL_TOOL_CLASSES",
    "available_tools",
    "create_tool",
    "get_tool",
    "load_tool_config",
    "register_tool",
    "safe_calculate",
]


class ToolError(Exception):
    """An expected tool failure; its message is shown to the model."""


@dataclasses.dataclass
class ToolResult:
    """What a tool call returns to the loop.

    Attributes:
        text: the tool response shown to the model: a string, or chat content parts
            (``{"type": "text", "text": ...}``, ``{"type": "image", "image": ...}``) for a
            response with images.
        reward: reward credited to this turn (0 for most tools).
        error: whether the call failed (counted in ``tool_errors``).
    """

    text: str | list[Any]
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

# Runs in the sandboxed interpreter before the user's code (``SandboxConfig.preamble``): an
# audit hook (which cannot be removed) that refuses network use, writes outside the working
# directory and new processes, so the model gets a clear message. It is a courtesy layer only:
# ctypes gets past it; the namespaces of polyrl.core.sandbox are what the kernel enforces.
_AUDIT_PREAMBLE = r"""
import os, sys
_root = os.path.realpath(os.getcwd())
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
    if event.startswith("socket.") and event != "socket.__new__":
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
"""


@register_tool("python")
class PythonSandboxTool(Tool):
    """Run Python code in the namespace sandbox of :mod:`polyrl.core.sandbox`; return its output.

    The code runs in fresh user, mount, PID, network, IPC and UTS namespaces as an unprivileged
    uid, sees a read-only minimal filesystem (the interpreter, shared libraries and this
    environment's site-packages), writes only to a private ``disk_mb`` tmpfs (its working
    directory, gone after the call), has no network, at most ``max_procs`` processes and the
    CPU, memory and file-size limits below; every process it starts dies with the call. See
    :mod:`polyrl.core.sandbox` for the guarantees and their limits, ``tests/test_sandbox.py``
    for the escape attempts they stop.

    Args:
        timeout: wall-clock seconds before the whole sandbox is killed.
        cpu_seconds: CPU-time limit (per process).
        memory_mb: address-space limit (per process).
        file_size_mb: largest file the code may write.
        disk_mb: size of the private writable directory.
        max_procs: processes and threads the code may have.
        max_output_chars: the output shown to the model is cut to this length.
        isolation: ``"namespaces"`` (the sandbox; the constructor fails with instructions
            where the machine cannot build it) or ``"none"``: rlimits and a temporary
            directory only, UNSAFE (the code can read and write whatever this process can).
        audit_hook: also install an audit hook that refuses sockets, writes outside the
            working directory and new processes with a clear message (not a security
            boundary: ctypes gets past it).
        site_packages: let the code import this environment's packages (e.g. numpy).
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
        disk_mb: int = 64,
        max_procs: int = 16,
        max_output_chars: int = 4000,
        isolation: str = "namespaces",
        audit_hook: bool = True,
        site_packages: bool = True,
    ):
        if not isinstance(max_output_chars, int) or max_output_chars <= 0:
            raise ValueError(f"max_output_chars must be a positive int, got {max_output_chars!r}")
        self.max_output_chars = max_output_chars
        self.audit_hook = bool(audit_hook)
        self.config = SandboxConfig(
            timeout=timeout,
            cpu_seconds=cpu_seconds,
            memory_mb=memory_mb,
            file_size_mb=file_size_mb,
            disk_mb=disk_mb,
            max_procs=max_procs,
            max_output_bytes=4 * max_output_chars,
            isolation=isolation,
            site_packages=site_packages,
            preamble=_AUDIT_PREAMBLE if audit_hook else "",
        )
        check_sandbox(isolation)  # fails here, with what to enable, not at the first call

    @property
    def isolation(self) -> str:
        """The active layers: ``namespaces+audit``, ``namespaces``, ``none+audit``..."""
        return self.config.isolation + ("+audit" if self.audit_hook else "")

    async def run_code(self, code: str) -> ToolResult:
        """Run ``code`` and return its (truncated) output plus how it ended."""
        try:
            res = await arun_in_sandbox(code, self.config)
        except SandboxError as exc:
            return ToolResult(f"[sandbox error: {exc}]", error=True)
        out = res.output
        if len(out) > self.max_output_chars or res.truncated:
            out = (
                out[: self.max_output_chars]
                + f"\n[output truncated: {res.output_bytes} bytes in all]"
            )
        if res.timed_out:
            return ToolResult(
                out + f"\n[killed: wall-clock timeout of {self.config.timeout:g} s]", error=True
            )
        if res.signal is not None:
            why = " (CPU time limit)" if res.signal in ("SIGXCPU", "SIGKILL") else ""
            return ToolResult(out + f"\n[killed by {res.signal}{why}]", error=True)
        if res.exit_code:
            return ToolResult(out + f"\n[exit code {res.exit_code}]", error=True)
        return ToolResult(out)

    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Run ``arguments["code"]``."""
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("'code' must be a non-empty string of Python source")
        return await self.run_code(code)


# ----------------------------------------------------------------------------- gsm8k check


@register_tool("gsm8k_check")
class Gsm8kCheckTool(Tool):
    """Check a GSM8K answer against the sample's ground truth (verl's ``Gsm8kTool``).

    The context (``tools_kwargs[<tool name>]``) gives ``ground_truth``, directly or under
    ``create_kwargs`` as verl's GSM8K data writes it. The answer is read as verl reads it
    (``#### <answer>``, flexible extraction); the reply says the parsed answer and its reward
    (1.0 when correct). The turn reward stays 0: the run's reward function scores the response.
    """

    description = "Check an answer to the GSM8K math problem: 1.0 if it is correct, 0.0 otherwise."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the answer, digits only"}},
        "required": ["answer"],
    }

    async def call(self, arguments: Mapping[str, Any], **context: Any) -> ToolResult | str:
        """Score ``arguments["answer"]`` against the context's ground truth."""
        from polyrl.core.gsm8k import gsm8k_score

        truth = context.get("ground_truth")
        if truth is None:
            truth = (context.get("create_kwargs") or {}).get("ground_truth")
        if truth is None:
            raise ToolError("gsm8k_check needs the sample's 'ground_truth' in tools_kwargs")
        answer = str(arguments.get("answer", ""))
        response = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = gsm8k_score(response, truth, method="flexible")
        return f"Current parsed answer={answer!r} reward={reward}"


# ----------------------------------------------------------------------------- verl tool YAML

#: verl's tool classes and the polyrl tool that does the same.
VERL_TOOL_CLASSES = {"verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k_check"}


def load_tool_config(path: str | os.PathLike[str]) -> list[Tool]:
    """Build the tools a verl tool YAML lists (``multi_turn.tool_config_path``).

    Each entry of ``tools:`` names a ``class_name``, its ``config`` and an OpenAI
    ``tool_schema``. A verl class in :data:`VERL_TOOL_CLASSES` becomes the polyrl tool that
    does the same; any other class is imported by its dotted path, as verl does, and must be a
    :class:`Tool` (it is built with the ``config`` entries other than ``type`` as keyword
    arguments). Each tool takes the name, description and parameters of its ``tool_schema``,
    so the model sees the schema the YAML gives.

    Raises:
        ValueError: an unreadable file, a malformed entry, or a class that cannot be imported
            or is not a polyrl :class:`Tool` (the message names it).
    """
    import importlib

    import yaml

    where = f"tool config {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{where}: cannot read it: {exc}") from None
    entries = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise ValueError(
            f"{where}: expected a 'tools:' list of {{class_name, config, tool_schema}}"
        )
    tools: list[Tool] = []
    for i, entry in enumerate(entries):
        at = f"{where}, tools[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{at}: each tool needs a class_name")
        class_name = entry["class_name"]
        config = dict(entry.get("config") or {})
        kind = config.pop("type", "native")
        if kind != "native":
            raise ValueError(f"{at}: {class_name}: tool type {kind!r} is not supported (native)")
        if class_name in VERL_TOOL_CLASSES:
            cls: Any = get_tool(VERL_TOOL_CLASSES[class_name])
        elif class_name.startswith("verl."):
            raise ValueError(
                f"{at}: verl's tool class {class_name!r} has no polyrl equivalent (polyrl has "
                f"{sorted(VERL_TOOL_CLASSES)}); write it as a polyrl.agent.tools.Tool subclass "
                "and name that class"
            )
        else:
            module, _, attr = class_name.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"{at}: cannot import tool class {class_name!r}: {exc}") from None
            if not (isinstance(cls, type) and issubclass(cls, Tool)):
                raise ValueError(
                    f"{at}: tool class {class_name!r} is not a polyrl tool: subclass "
                    "polyrl.agent.tools.Tool (async call(arguments, **context)); polyrl ships "
                    f"equivalents of {sorted(VERL_TOOL_CLASSES)}"
                )
        try:
            tool = cls(**config)
        except TypeError as exc:
            raise ValueError(f"{at}: {class_name}: bad config {config}: {exc}") from None
        schema = entry.get("tool_schema")
        if schema is not None:
            function = schema.get("function") if isinstance(schema, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise ValueError(f"{at}: tool_schema needs function.name (OpenAI format)")
            tool.name = function["name"]
            tool.description = str(function.get("description", tool.description))
            tool.parameters = dict(function.get("parameters") or tool.parameters)
        tools.append(tool)
    return tools
