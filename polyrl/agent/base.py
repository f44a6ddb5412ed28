"""The agent-loop interface: trajectories, the ``AgentLoop`` ABC, its registry and the collator.

An agent loop turns one dataset sample into one :class:`Trajectory` by talking to the rollout
servers token-in/token-out (through a :class:`~polyrl.rollout.client.RolloutClient` or any object
with the same ``async generate(input_ids, sampling_params, session_id=...)``). A trajectory is
``prompt_ids`` followed by ``response_ids``; the response interleaves model tokens (mask 1,
with the server's log-probs) and tool/environment tokens (mask 0, log-prob 0).

Token-in/token-out means the conversation is never re-tokenised: model tokens are kept exactly as
the server returned them, and each tool or environment message is appended as the token delta of
the chat template for the new messages (:func:`chat_delta_ids`).

Loops are registered by name with :func:`register_agent_loop`; a sample picks its loop through
``sample["extra_info"]["agent_name"]`` (:func:`agent_name_of`), falling back to a configured
default. :func:`collate_trajectories` packs trajectories into the RL batch layout of
``polyrl.trainer.rl.build_rollout_batch`` with the response mask as ``loss_mask``.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from polyrl.core.batch import Batch
from polyrl.core.multimodal import MultiModalInputs
from polyrl.core.prompts import (
    TEXT_PROMPT_KEY,
    check_template_kwargs,
    check_truncation,
    fit_prompt,
    render_chat,
)
from polyrl.core.registry import Registry
from polyrl.core.rollout_api import SamplingParams

__all__ = [
    "AGENT_LOOPS",
    "AgentLoop",
    "ChatTemplateError",
    "GenerateClient",
    "Trajectory",
    "agent_name_of",
    "available_agent_loops",
    "chat_delta_ids",
    "collate_trajectories",
    "create_agent_loop",
    "get_agent_loop",
    "prompt_ids_of",
    "register_agent_loop",
    "render_prompt_ids",
    "require_chat_prompt",
    "run_agent_loops",
]


class GenerateClient(Protocol):
    """What an agent loop needs from the rollout side (``RolloutClient`` satisfies it)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        session_id: str | None = None,
        request_id: str | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> Any:
        """Generate from token ids; return an object with ``.outputs[i].output_ids`` etc.

        ``multi_modal``: the prompt's images and videos (vision models); ``input_ids`` then
        hold their placeholders.
        """
        ...


class ChatTemplateError(ValueError):
    """The chat template cannot be extended token-wise (it rewrites earlier turns)."""


@dataclasses.dataclass
class Trajectory:
    """One multi-turn rollout as token ids plus everything training needs.

    Attributes:
        prompt_ids: the initial prompt tokens (never trained on).
        response_ids: everything after the prompt: model turns and tool/env deltas.
        response_mask: 1 on model-generated tokens, 0 on tool/env/user tokens.
        rollout_log_probs: the server's log-prob of each model token; 0.0 on other tokens.
        turn_rewards: per-turn rewards (environment steps, tool rewards), in order.
        reward: the final reward, or ``None`` when the trainer's scorer decides it.
        num_turns: number of model (assistant) turns.
        tool_calls: tool calls attempted (parsed or malformed).
        tool_errors: calls that failed (malformed, unknown tool, exception, timeout).
        finish_reason: why the loop stopped (``stop``, ``max_turns``, ``length``, ``done``...).
        weight_versions: policy weight version of each model turn.
        messages: the conversation as chat messages (for logging and text scoring).
        metrics: free-form per-trajectory numbers (averaged by :func:`collate_trajectories`).
        agent_name: the registered loop that produced it.
        seed: the trajectory's sampling seed (from ``sample["seed"]``); turn ``k`` samples
            with ``seed + k``. ``None``: the loop's configured seed (if any) is used.
    """

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    response_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    reward: float | None = None
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""
    weight_versions: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    agent_name: str = ""
    seed: int | None = None

    def append_model(self, ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        """Append one model turn exactly as the server returned it (mask 1)."""
        ids = [int(t) for t in ids]
        if log_probs is None:
            lps = [0.0] * len(ids)
        else:
            lps = [float(x) for x in log_probs]
            if len(lps) != len(ids):
                raise ValueError(
                    f"model turn has {len(ids)} tokens but {len(lps)} log-probs; the server "
                    "must return one log-prob per generated token"
                )
        self.response_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        self.rollout_log_probs.extend(lps)

    def append_env(self, ids: Sequence[int]) -> None:
        """Append tool/environment tokens (mask 0, log-prob 0)."""
        ids = [int(t) for t in ids]
        self.response_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.rollout_log_probs.extend([0.0] * len(ids))

    def truncate(self, max_response_length: int) -> bool:
        """Cut the response to ``max_response_length`` tokens; return whether anything was cut."""
        if len(self.response_ids) <= max_response_length:
            return False
        del self.response_ids[max_response_length:]
        del self.response_mask[max_response_length:]
        del self.rollout_log_probs[max_response_length:]
        return True

    def validate(self) -> None:
        """Check the parallel lists agree.

        Raises:
            ValueError: lengths differ or the mask holds something other than 0/1.
        """
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.rollout_log_probs) != n:
            raise ValueError(
                f"trajectory lists disagree: {n} response ids, {len(self.response_mask)} mask "
                f"entries, {len(self.rollout_log_probs)} log-probs"
            )
        if any(m not in (0, 1) for m in self.response_mask):
            raise ValueError("response_mask must hold only 0 and 1")
        if not self.prompt_ids:
            raise ValueError("trajectory has an empty prompt")

    def response_text(self, tokenizer: Any, model_only: bool = False) -> str:
        """Decode the response (special tokens dropped); ``model_only`` keeps mask-1 tokens."""
        ids = self.response_ids
        if model_only:
            ids = [t for t, m in zip(ids, self.response_mask, strict=True) if m == 1]
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    @property
    def total_reward(self) -> float:
        """``reward`` when set, else the sum of ``turn_rewards``."""
        return float(self.reward) if self.reward is not None else float(sum(self.turn_rewards))


# ----------------------------------------------------------------------------- chat deltas


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render ``messages`` with the chat template (generation prompt on) and encode the text.

    What :class:`~polyrl.data.dataset.RLDataset` does to a row, so a loop that builds its own
    prompt (tool schemas, a first observation) renders it the same way: same extra template
    arguments (``data.apply_chat_template_kwargs``), no special tokens added by the encoder
    (the template places its own).
    """
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt=True,
        tools=tools,
        template_kwargs=apply_chat_template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _eos_text(tokenizer: Any) -> str:
    eos = tokenizer.eos_token
    if not eos:
        raise ValueError("the tokenizer has no eos token; agent loops need one to end turns")
    return str(eos)


def chat_delta_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    num_new: int,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    last_ended_with_eos: bool = True,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    r"""Token ids the chat template adds for the last ``num_new`` messages (+ generation prompt).

    ``messages[:-num_new]`` must end with the assistant turn the model just generated; its tokens
    are already in the trajectory, exactly as generated, ending with eos when
    ``last_ended_with_eos``. The template text after that eos (e.g. the ``\\n`` after
    ``<|im_end|>``) is not generated by the model, so it is part of the delta (and eos itself too
    when the turn was cut short). Only this delta text is tokenised. Both conversations are
    rendered with ``tools`` and ``apply_chat_template_kwargs``, as the prompt was.

    Raises:
        ChatTemplateError: the template does not render the longer conversation as an
            extension of the shorter one, or the shorter one does not end with eos.
        ValueError: ``num_new`` is out of range.
    """
    if not 1 <= num_new < len(messages):
        raise ValueError(f"num_new must be in [1, {len(messages) - 1}], got {num_new}")
    kw = {"tools": tools, "template_kwargs": apply_chat_template_kwargs}
    before = render_chat(tokenizer, messages[:-num_new], add_generation_prompt=False, **kw)
    after = render_chat(tokenizer, messages, add_generation_prompt=True, **kw)
    if not after.startswith(before):
        at = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
            min(len(before), len(after)),
        )
        raise ChatTemplateError(
            "the chat template is not prefix-preserving: rendering the conversation with "
            f"{num_new} new message(s) changes earlier text at character {at} "
            f"(before: {before[at : at + 40]!r}, after: {after[at : at + 40]!r}); token-in/"
            "token-out agent loops need a template that only appends (e.g. one that does not "
            "strip reasoning from earlier assistant turns)"
        )
    eos = _eos_text(tokenizer)
    cut = before.rfind(eos)
    if cut < 0:
        raise ChatTemplateError(
            f"the rendered conversation does not contain the eos token {eos!r}; cannot find "
            "where the last assistant turn ends"
        )
    trailer = before[cut if not last_ended_with_eos else cut + len(eos) :]
    return list(tokenizer.encode(trailer + after[len(before) :], add_special_tokens=False))


def prompt_ids_of(
    sample: Mapping[str, Any],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prompt_key: str = "prompt",
    render: bool = False,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Return the prompt token ids and chat messages of a sample.

    Uses ``sample["input_ids"]`` when present (what ``RLDataset`` built) and the messages from
    ``raw_prompt`` / ``prompt_key``; otherwise, or with ``render`` (a loop offering its own
    ``tools``), renders the messages with the chat template (:func:`render_prompt_ids`, with
    ``apply_chat_template_kwargs``). The ids may be longer than what the dataset measured:
    loops fit them with :meth:`AgentLoop.start`.

    Raises:
        ValueError: the sample has neither messages nor input ids, or ``render`` is asked of a
            plain-text prompt the dataset tokenized without the template
            (:func:`require_chat_prompt`).
    """
    if render:
        require_chat_prompt(sample, "rendering it with the loop's tool schemas")
    messages = sample.get("raw_prompt", sample.get(prompt_key))
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    msgs = [dict(m) for m in messages] if messages is not None else []
    ids = sample.get("input_ids")
    if ids is not None and not (render and msgs):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [int(t) for t in ids], msgs
    if not msgs:
        raise ValueError(
            f"sample has neither 'input_ids' nor chat messages under 'raw_prompt'/{prompt_key!r}"
        )
    ids = render_prompt_ids(
        tokenizer, msgs, tools=tools, apply_chat_template_kwargs=apply_chat_template_kwargs
    )
    return ids, msgs


def require_chat_prompt(sample: Mapping[str, Any], what: str) -> None:
    """Refuse a plain-text prompt that the dataset tokenized as it is, without the template.

    Such a prompt (``data.template_string_prompts=false``, TRL's "standard" format) has no chat
    turns to add tool schemas, observations or tool responses to; templating it here would
    train on a prompt the dataset never built.

    Raises:
        ValueError: naming the sample and ``what`` the loop needs the template for.
    """
    if sample.get(TEXT_PROMPT_KEY) is not None:
        raise ValueError(
            f"{_describe(sample)}: the prompt is plain text, tokenized without the chat "
            f"template (data.template_string_prompts=false, TRL's standard format), but the "
            f"loop needs the template for {what}; give this prompt as chat messages "
            '([{"role": "user", "content": ...}])'
        )


def _describe(sample: Mapping[str, Any]) -> str:
    """Name a sample in errors: its uid and data source, when it has them."""
    parts = [f"sample {sample['uid']!r}" if sample.get("uid") is not None else "sample"]
    if sample.get("data_source") is not None:
        parts.append(f"(data_source={sample['data_source']!r})")
    return " ".join(parts)


# ----------------------------------------------------------------------------- the loop ABC


class AgentLoop(abc.ABC):
    """Turns one sample into one :class:`Trajectory` (subclass and register it).

    Args:
        tokenizer: the policy's tokenizer (chat template and eos).
        sampling_params: per-turn sampling (``logprobs`` is forced on; ``n`` must be 1).
        max_response_length: budget of response tokens (model + tool/env) per trajectory.
        max_turns: most model turns.
        max_prompt_length: ``data.max_prompt_length``; ``None``: prompts are not checked.
        truncation: ``data.truncation``, applied to the prompt the loop sends
            (:meth:`start`).
        apply_chat_template_kwargs: ``data.apply_chat_template_kwargs``: extra template
            arguments (e.g. ``{"enable_thinking": False}``) for every prompt and delta the loop
            renders (:meth:`prompt_ids_of`, :meth:`chat_delta_ids`), as the dataset used.
    """

    name: str = ""

    def __init__(
        self,
        tokenizer: Any,
        *,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        max_response_length: int = 1024,
        max_turns: int = 8,
        max_prompt_length: int | None = None,
        truncation: str = "error",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if max_prompt_length is not None:
            check_truncation(max_prompt_length, truncation)
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params.to_dict()
        else:
            params = dict(sampling_params or {})
        params["logprobs"] = True
        if params.get("n", 1) != 1:
            raise ValueError(f"agent loops sample one response per run; got n={params['n']}")
        # Validate early, with the server's messages; keep the JSON-ready form.
        params = SamplingParams.from_dict(params).to_dict()
        if not isinstance(max_response_length, int) or max_response_length < 1:
            raise ValueError(f"max_response_length must be an int >= 1, got {max_response_length}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns}")
        self.tokenizer = tokenizer
        self.sampling_params = params
        self.max_response_length = max_response_length
        self.max_turns = max_turns
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.apply_chat_template_kwargs = check_template_kwargs(apply_chat_template_kwargs)
        self.eos_ids = set(_eos_ids(tokenizer))

    @abc.abstractmethod
    async def run(self, sample: Mapping[str, Any], client: GenerateClient) -> Trajectory:
        """Roll out one sample."""

    def prompt_ids_of(
        self,
        sample: Mapping[str, Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        render: bool = False,
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """:func:`prompt_ids_of` with this loop's tokenizer and template arguments."""
        return prompt_ids_of(
            sample,
            self.tokenizer,
            tools=tools,
            render=render,
            apply_chat_template_kwargs=self.apply_chat_template_kwargs,
        )

    def render_prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """:func:`render_prompt_ids` with this loop's tokenizer and template arguments."""
        return render_prompt_ids(
            self.tokenizer,
            messages,
            tools=tools,
            apply_chat_template_kwargs=self.apply_chat_template_kwargs,
        )

    def chat_delta_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        num_new: int,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        last_ended_with_eos: bool = True,
    ) -> list[int]:
        """:func:`chat_delta_ids` with this loop's tokenizer and template arguments."""
        return chat_delta_ids(
            self.tokenizer,
            messages,
            num_new,
            tools=tools,
            last_ended_with_eos=last_ended_with_eos,
            apply_chat_template_kwargs=self.apply_chat_template_kwargs,
        )

    def start(
        self,
        sample: Mapping[str, Any],
        prompt_ids: Sequence[int],
        messages: list[dict[str, Any]],
        built: str,
    ) -> Trajectory:
        """Begin a trajectory from the prompt this loop sends, fitted to ``max_prompt_length``.

        The dataset applied ``data.truncation`` to the prompt it built; a loop that builds its
        own (tool schemas in the system turn, a first observation) can exceed the limit, so
        the same rule (:func:`polyrl.core.prompts.fit_prompt`) is applied again here:

        * ``error``: raises :class:`~polyrl.core.prompts.PromptTooLongError` naming the sample,
          how the loop ``built`` its prompt, its length and the limit;
        * ``left`` / ``right``: the prompt is cut as the dataset cuts; metric
          ``prompt_truncated`` (fraction of trajectories);
        * ``filter``: the trajectory is returned empty with ``finish_reason="filtered"`` (no
          generation; an empty response adds nothing to the loss, and the batch keeps its
          rows, one group per prompt); metric ``prompt_filtered``. Callers return it as is.

        ``built`` says how the loop built the prompt (for the error), e.g. ``"with the tool
        loop's 2 tool schemas"``.
        """
        ids = [int(t) for t in prompt_ids]
        traj = Trajectory(prompt_ids=ids, messages=messages, seed=sample.get("seed"))
        limit = self.max_prompt_length
        if limit is None:
            return traj
        fitted = fit_prompt(ids, limit, self.truncation, f"{_describe(sample)}, prompt {built}")
        if self.truncation in ("left", "right"):
            traj.metrics["prompt_truncated"] = float(fitted is not None and len(fitted) < len(ids))
        if self.truncation == "filter":
            traj.metrics["prompt_filtered"] = float(fitted is None)
        if fitted is None:
            # Nothing is generated; the last `limit` tokens keep the row within the batch's
            # planned width (it is never trained on: its response is empty).
            traj.prompt_ids = ids[-limit:]
            traj.finish_reason = "filtered"
        else:
            traj.prompt_ids = fitted
        return traj

    def turn_params(self, traj: Trajectory) -> dict[str, Any]:
        """Return the next turn's sampling params, capped by the remaining length budget."""
        params = dict(self.sampling_params)
        room = self.max_response_length - len(traj.response_ids)
        cap = params.get("max_new_tokens")
        params["max_new_tokens"] = max(1, room if cap is None else min(cap, room))
        # Each turn (and, with sample seeds, each of a prompt's n copies) samples differently.
        base = traj.seed if traj.seed is not None else params.get("seed")
        if base is not None:
            params["seed"] = int(base) + traj.num_turns
        return params

    async def generate_turn(
        self, traj: Trajectory, client: GenerateClient, session_id: str | None
    ) -> tuple[list[int], str]:
        """Generate one model turn from the trajectory so far; append it; return (ids, text)."""
        result = await client.generate(
            traj.prompt_ids + traj.response_ids,
            self.turn_params(traj),
            session_id=session_id,
        )
        out = result.outputs[0]
        ids = list(out.output_ids)
        traj.append_model(ids, out.logprobs)
        traj.num_turns += 1
        traj.weight_versions.append(int(getattr(out, "weight_version", 0) or 0))
        traj.finish_reason = str(out.finish_reason or "")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": text})
        return ids, text

    def ended_with_eos(self, ids: Sequence[int]) -> bool:
        """Whether a model turn ended on an eos token (rather than being cut short)."""
        return bool(ids) and int(ids[-1]) in self.eos_ids


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = tokenizer.eos_token_id
    if ids is None:
        raise ValueError("the tokenizer has no eos_token_id; agent loops need one to end turns")
    return list(ids) if isinstance(ids, list | tuple) else [int(ids)]


# ----------------------------------------------------------------------------- registry

#: Agent-loop classes by name; the built-in loops' modules are imported on first use, so that
#: ``polyrl.agent.base`` stays importable on its own.
AGENT_LOOPS: Registry[type[AgentLoop]] = Registry(
    "agent loop",
    lazy={
        "env": "polyrl.agent.env_loop",
        "single_turn": "polyrl.agent.single_turn",
        "tool": "polyrl.agent.tool_loop",
    },
    base=AgentLoop,
    name_attr="name",
)
register_agent_loop = AGENT_LOOPS.register
available_agent_loops = AGENT_LOOPS.names
get_agent_loop = AGENT_LOOPS.get


def create_agent_loop(name: str, tokenizer: Any, **kwargs: Any) -> AgentLoop:
    """Instantiate the loop registered under ``name``."""
    return get_agent_loop(name)(tokenizer, **kwargs)


def agent_name_of(sample: Mapping[str, Any], default: str = "single_turn") -> str:
    """Return the loop a sample asks for: ``extra_info.agent_name``, else ``default``."""
    extra = sample.get("extra_info") or {}
    name = extra.get("agent_name") if isinstance(extra, Mapping) else None
    if name is None:
        return default
    if not isinstance(name, str) or not name:
        raise ValueError(f"extra_info.agent_name must be a non-empty string, got {name!r}")
    return name


async def run_agent_loops(
    samples: Sequence[Mapping[str, Any]],
    client: GenerateClient,
    tokenizer: Any,
    *,
    default_agent: str = "single_turn",
    loop_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    max_concurrency: int = 64,
) -> list[Trajectory]:
    """Run each sample through its loop (``extra_info.agent_name`` or ``default_agent``).

    One loop instance per name is built with ``loop_kwargs[name]``; at most ``max_concurrency``
    trajectories run at once. Results come back in sample order.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    kwargs = dict(loop_kwargs or {})
    loops: dict[str, AgentLoop] = {}
    for sample in samples:
        name = agent_name_of(sample, default_agent)
        if name not in loops:
            loops[name] = create_agent_loop(name, tokenizer, **dict(kwargs.get(name, {})))
    gate = asyncio.Semaphore(max_concurrency)

    async def one(sample: Mapping[str, Any]) -> Trajectory:
        name = agent_name_of(sample, default_agent)
        async with gate:
            traj = await loops[name].run(sample, client)
        traj.agent_name = name
        traj.validate()
        return traj

    return list(await asyncio.gather(*(one(s) for s in samples)))


# ----------------------------------------------------------------------------- collator


def collate_trajectories(trajectories: Sequence[Trajectory], pad_token_id: int) -> Batch:
    """Pack trajectories into one RL batch (prompts left-padded, responses right-padded).

    The layout is ``polyrl.trainer.rl.build_rollout_batch``'s: tensors ``(B, P + R)``
    ``input_ids``, ``attention_mask``, ``position_ids``, float ``loss_mask`` (here the response
    mask: 0 on tool/env tokens), ``rollout_log_probs``; ``prompt_length`` and
    ``response_length`` ``(B,)``. Non-tensor columns: ``num_turns``, ``tool_calls``,
    ``tool_errors``, ``reward`` (NaN when the scorer decides), ``turn_rewards``,
    ``finish_reason``, ``agent_name``, ``messages``. ``meta["agent_metrics"]`` holds the batch
    means (``num_turns/mean``, ``tool_calls/mean``, ``tool_errors/mean``, ...).

    Raises:
        ValueError: no trajectories, or an invalid one.
    """
    if not trajectories:
        raise ValueError("collate_trajectories needs at least one trajectory")
    for i, t in enumerate(trajectories):
        try:
            t.validate()
        except ValueError as exc:
            raise ValueError(f"trajectory {i}: {exc}") from exc
    # The trainer's packer, so both paths share one layout; the response mask marks model tokens.
    from polyrl.core.rollout_batch import build_rollout_batch

    packed = build_rollout_batch(
        [t.prompt_ids for t in trajectories],
        [t.response_ids for t in trajectories],
        pad_token_id,
        rollout_log_probs=[t.rollout_log_probs for t in trajectories],
        response_masks=[t.response_mask for t in trajectories],
    )
    tensors = dict(packed.tensors.items())

    def col(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        for k, v in enumerate(values):
            out[k] = v
        return out

    non_tensors = {
        "num_turns": np.array([t.num_turns for t in trajectories], dtype=np.int64),
        "tool_calls": np.array([t.tool_calls for t in trajectories], dtype=np.int64),
        "tool_errors": np.array([t.tool_errors for t in trajectories], dtype=np.int64),
        "reward": np.array(
            [math.nan if t.reward is None else float(t.reward) for t in trajectories],
            dtype=np.float64,
        ),
        "turn_rewards": col([list(t.turn_rewards) for t in trajectories]),
        "finish_reason": col([t.finish_reason for t in trajectories]),
        "agent_name": col([t.agent_name for t in trajectories]),
        "messages": col([list(t.messages) for t in trajectories]),
    }
    metrics: dict[str, float] = {
        "num_turns/mean": float(np.mean(non_tensors["num_turns"])),
        "num_turns/max": float(np.max(non_tensors["num_turns"])),
        "num_turns/min": float(np.min(non_tensors["num_turns"])),
        "tool_calls/mean": float(np.mean(non_tensors["tool_calls"])),
        "tool_errors/mean": float(np.mean(non_tensors["tool_errors"])),
    }
    keys = sorted({k for t in trajectories for k in t.metrics})
    for k in keys:
        vals = [t.metrics[k] for t in trajectories if k in t.metrics]
        metrics[f"{k}/mean"] = float(np.mean(vals))
    return Batch(tensors=tensors, non_tensors=non_tensors, meta={"agent_metrics": metrics})
