"""The tool loop: generate, parse tool calls, run them concurrently, append the responses, repeat.

Each round: the model generates a turn (kept token-exact); a parser (Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` built in; more with
:func:`register_tool_parser`) extracts the calls; they run concurrently, each with a timeout;
their responses become ``tool`` messages appended as the chat template's token delta (mask 0).
A response given as content parts with images is rendered through the loop's vision
``processor`` and its images join the trajectory's ``multi_modal`` in token order.
The loop ends when a turn has no call (``stop``), at ``max_turns`` (``max_turns``), or when the
length budget runs out or a turn is cut short (``length``).

Nothing the model writes can crash the loop: malformed JSON, an unknown tool, bad arguments,
an exception in the tool, a timeout or too many parallel calls all become an ``Error: ...``
tool message for the model, and are counted in ``tool_errors``.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.agent.base import (
    AgentLoop,
    GenerateClient,
    Trajectory,
    register_agent_loop,
    split_messages_media,
)
from polyrl.agent.tools import Tool, ToolError, ToolResult, create_tool
from polyrl.core.registry import Registry
from polyrl.core.rollout_api import SamplingParams

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "ParsedToolCall",
    "ToolAgentLoop",
    "ToolParser",
    "available_tool_parsers",
    "get_tool_parser",
    "register_tool_parser",
]


# Exception texts shown to the model are cut here (they are not cut by token budget).
_MAX_ERROR_CHARS = 300


@dataclasses.dataclass
class ParsedToolCall:
    """One call found in a model turn; ``error`` is set when it could not be parsed."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


class ToolParser(abc.ABC):
    """Extracts tool calls from the decoded text of one model turn (subclass and register)."""

    @abc.abstractmethod
    def parse(self, text: str) -> list[ParsedToolCall]:
        """Return the calls in ``text`` in order (malformed ones with ``error`` set)."""


#: Tool-call parser classes by name.
TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool parser", base=ToolParser)
register_tool_parser = TOOL_PARSERS.register
available_tool_parsers = TOOL_PARSERS.names


def get_tool_parser(name: str) -> ToolParser:
    """Return a new parser instance for ``name``."""
    return TOOL_PARSERS.get(name)()


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": str, "arguments": object}</tool_call>`` blocks (Qwen/Hermes)."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedToolCall]:
        """Parse every block; an unclosed block or bad JSON gives a call with ``error``."""
        calls = []
        for m in self._BLOCK.finditer(text):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                calls.append(ParsedToolCall(None, {}, "the <tool_call> block is not closed"))
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(ParsedToolCall(None, {}, f"the tool call is not valid JSON: {exc}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(
                    ParsedToolCall(
                        None, {}, 'a tool call must be {"name": str, "arguments": object}'
                    )
                )
                continue
            args = obj.get("arguments", {})
            err = "'arguments' must be an object"
            if isinstance(args, str):  # some models emit the arguments as a JSON string
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    err = f"the arguments string is not valid JSON: {exc}"
            if not isinstance(args, dict):
                calls.append(ParsedToolCall(obj["name"], {}, err))
                continue
            calls.append(ParsedToolCall(obj["name"], args))
        return calls


def _as_tool(spec: str | Tool, kwargs: Mapping[str, Mapping[str, Any]]) -> Tool:
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, str):
        return create_tool(spec, **dict(kwargs.get(spec, {})))
    raise TypeError(f"tools must be tool names or Tool instances, got {type(spec).__name__}")


@register_agent_loop("tool")
class ToolAgentLoop(AgentLoop):
    """Multi-turn tool use (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        tools: tool names (registered) or :class:`Tool` instances offered to the model; a sample
            may restrict them with ``extra_info["tool_names"]``.
        tool_kwargs: constructor kwargs per tool name.
        parser: registered tool-call parser name.
        max_turns: most model turns.
        max_parallel_calls: calls run per turn; further ones get an error message.
        tool_timeout: seconds per call.
        max_tool_response_tokens: a tool response longer than this is cut (and says so).
        max_response_length: budget of response tokens in all.
        sampling_params: per-turn sampling.
        max_prompt_length: ``data.max_prompt_length`` (see :meth:`AgentLoop.start`).
        truncation: ``data.truncation`` (see :meth:`AgentLoop.start`).
        apply_chat_template_kwargs: ``data.apply_chat_template_kwargs`` (see
            :class:`AgentLoop`).
        processor: the policy's vision processor, for tool results with images and image
            prompts (see :class:`AgentLoop`).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[str | Tool] = ("calculator",),
        tool_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        parser: str = "hermes",
        max_turns: int = 8,
        max_parallel_calls: int = 4,
        tool_timeout: float = 10.0,
        max_tool_response_tokens: int = 256,
        max_response_length: int = 1024,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        max_prompt_length: int | None = None,
        truncation: str = "error",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ):
        super().__init__(
            tokenizer,
            sampling_params=sampling_params,
            max_response_length=max_response_length,
            max_turns=max_turns,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            apply_chat_template_kwargs=apply_chat_template_kwargs,
            processor=processor,
        )
        if not isinstance(max_parallel_calls, int) or max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls must be an int >= 1, got {max_parallel_calls}")
        if not tool_timeout > 0:
            raise ValueError(f"tool_timeout must be > 0 seconds, got {tool_timeout}")
        if not isinstance(max_tool_response_tokens, int) or max_tool_response_tokens < 1:
            raise ValueError(
                f"max_tool_response_tokens must be an int >= 1, got {max_tool_response_tokens}"
            )
        built = [_as_tool(t, tool_kwargs or {}) for t in tools]
        self.tools: dict[str, Tool] = {t.name: t for t in built}
        if len(self.tools) != len(built):
            raise ValueError(f"duplicate tool names in {[t.name for t in built]}")
        self.parser = get_tool_parser(parser)
        self.max_parallel_calls = max_parallel_calls
        self.tool_timeout = float(tool_timeout)
        self.max_tool_response_tokens = max_tool_response_tokens

    def tools_for(self, sample: Mapping[str, Any]) -> dict[str, Tool]:
        """Return the tools offered for one sample (``extra_info.tool_names`` filters)."""
        names = (sample.get("extra_info") or {}).get("tool_names")
        if names is None:
            return dict(self.tools)
        missing = [n for n in names if n not in self.tools]
        if missing:
            raise ValueError(
                f"sample asks for tools {missing} that this loop does not have "
                f"(configured: {sorted(self.tools)})"
            )
        return {n: self.tools[n] for n in names}

    def _cut(self, text: str) -> tuple[str, bool]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_tool_response_tokens:
            return text, False
        head = self.tokenizer.decode(ids[: self.max_tool_response_tokens])
        return head + f"\n[truncated: the response had {len(ids)} tokens]", True

    def _cut_content(self, content: str | list[Any]) -> tuple[str | list[Any], bool]:
        """:meth:`_cut` a response, or each text part of a content-parts response."""
        if isinstance(content, str):
            return self._cut(content)
        parts, any_cut = [], False
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text, cut = self._cut(str(part.get("text", "")))
                part, any_cut = {**part, "text": text}, any_cut or cut
            parts.append(part)
        return parts, any_cut

    async def _call_one(
        self, call: ParsedToolCall, tools: Mapping[str, Tool], context: Mapping[str, Any]
    ) -> tuple[ToolResult, str]:
        """Run one call; every failure becomes an error result, with a kind for metrics."""
        if call.error is not None:
            return ToolResult(f"Error: malformed tool call: {call.error}", error=True), "malformed"
        tool = tools.get(call.name or "")
        if tool is None:
            return (
                ToolResult(
                    f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}",
                    error=True,
                ),
                "unknown",
            )
        ctx = context.get(tool.name) or {}
        try:
            out = await asyncio.wait_for(tool.call(call.arguments, **ctx), self.tool_timeout)
        except TimeoutError:
            msg = f"Error: tool {tool.name!r} timed out after {self.tool_timeout:g} s"
            return ToolResult(msg, error=True), "timeout"
        except ToolError as exc:
            return ToolResult(f"Error: {str(exc)[:_MAX_ERROR_CHARS]}", error=True), "tool_error"
        except Exception as exc:  # a crashing tool must not end the rollout
            why = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
            return ToolResult(f"Error: tool {tool.name!r} failed: {why}", error=True), "exception"
        if isinstance(out, str | list):
            out = ToolResult(out)
        if not isinstance(out, ToolResult) or not isinstance(out.text, str | list):
            got = type(out.text if isinstance(out, ToolResult) else out).__name__
            msg = f"Error: tool {tool.name!r} returned {got}, not text or content parts"
            return ToolResult(msg, error=True), "exception"
        return out, "error" if out.error else "ok"

    async def run_calls(
        self,
        calls: Sequence[ParsedToolCall],
        tools: Mapping[str, Tool],
        context: Mapping[str, Any],
        traj: Trajectory,
    ) -> list[str | list[Any]]:
        """Run a turn's calls concurrently; return the (cut) tool message contents in order.

        A content is the response text, or its content parts (text parts cut alike).
        """
        run = list(calls[: self.max_parallel_calls])
        results = list(await asyncio.gather(*(self._call_one(c, tools, context) for c in run)))
        for _ in calls[self.max_parallel_calls :]:
            msg = (
                f"Error: at most {self.max_parallel_calls} tool calls run per turn; "
                "this one was skipped"
            )
            results.append((ToolResult(msg, error=True), "skipped"))
        texts, reward = [], 0.0
        for result, kind in results:
            traj.tool_calls += 1
            if result.error:
                traj.tool_errors += 1
            if kind not in ("ok", "error"):
                traj.metrics[f"tool_{kind}"] = traj.metrics.get(f"tool_{kind}", 0.0) + 1
            reward += float(result.reward)
            # The loop's own error messages are short and must stay whole; tool output is cut.
            text, cut = (
                self._cut_content(result.text) if kind in ("ok", "error") else (result.text, False)
            )
            if cut:
                traj.metrics["tool_truncated"] = traj.metrics.get("tool_truncated", 0.0) + 1
            texts.append(text)
        traj.turn_rewards.append(reward)
        return texts

    async def run(self, sample: Mapping[str, Any], client: GenerateClient) -> Trajectory:
        """Roll out one sample with tool use."""
        tools = self.tools_for(sample)
        schemas = [t.schema() for t in tools.values()]
        extra = sample.get("extra_info") or {}
        context = extra.get("tools_kwargs") or {}
        # Rendered here (not the dataset's input_ids) so the system turn lists these tools.
        prompt_ids, messages, media = self.prompt_of(sample, tools=schemas, render=True)
        if not messages:
            raise ValueError("the tool loop needs the prompt as chat messages ('raw_prompt')")
        # The dataset measured the prompt without these schemas: fit the one sent.
        traj = self.start(
            sample,
            prompt_ids,
            messages,
            f"rendered with {len(schemas)} tool schema(s)",
            multi_modal=media,
        )
        if traj.finish_reason == "filtered":
            return traj
        session = str(sample.get("session_id") or f"tool-{uuid.uuid4().hex}")
        while True:
            ids, text = await self.generate_turn(traj, client, session)
            if traj.finish_reason in ("length", "abort"):
                break  # a turn cut short is not a complete message to act on
            if len(traj.response_ids) >= self.max_response_length:
                traj.finish_reason = "length"
                break
            calls = self.parser.parse(text)
            if not calls:
                traj.finish_reason = "stop"
                break
            if traj.num_turns >= self.max_turns:
                traj.finish_reason = "max_turns"
                break
            texts = await self.run_calls(calls, tools, context, traj)
            items: list[tuple[str, Any]] = []
            showing: list[str] = []  # the tools whose results hold media, for errors
            for call, content in zip(calls, texts, strict=True):
                what = f"tool {call.name!r} result"
                tool_message = {"role": "tool", "content": content}
                (message,), found = split_messages_media([tool_message], what, join_text=True)
                self.check_media(found, what)
                traj.messages.append(message)
                items.extend(found)
                if found:
                    showing.append(repr(call.name))
            delta = self.chat_delta_ids(
                traj.messages,
                len(texts),
                tools=schemas,
                last_ended_with_eos=self.ended_with_eos(ids),
            )
            if len(traj.response_ids) + len(delta) >= self.max_response_length:
                # No room left for another model turn: stop before the tool tokens.
                traj.finish_reason = "length"
                break
            delta, media = self.encode_media(
                delta, items, f"turn {traj.num_turns}: result of tool {', '.join(showing)}"
            )
            if len(traj.response_ids) + len(delta) >= self.max_response_length:
                traj.finish_reason = "length"  # the images did not fit
                break
            traj.append_env(delta, media)
        traj.metrics["response_length"] = float(len(traj.response_ids))
        return traj
