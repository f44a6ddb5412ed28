"""The agent-loop interface: trajectories, the ``AgentLoop`` ABC, its registry and the collator.

An agent loop turns one dataset sample into one :class:`Trajectory` (or, for an episode whose
model calls do not extend one another, a list of *linked samples*, one per extending chain of
calls, sharing the episode) by talking to the rollout
servers token-in/token-out (through a :class:`~polyrl.rollout.client.RolloutClient` or any object
with the same ``async generate(input_ids, sampling_params, session_id=...)``). A trajectory is
``prompt_ids`` followed by ``response_ids``; the response interleaves model tokens (mask 1,
with the server's log-probs) and tool/environment tokens (mask 0, log-prob 0).

Token-in/token-out means the conversation is never re-tokenised: model tokens are kept exactly as
the server returned them, and each tool or environment message is appended as the token delta of
the chat template for the new messages (:func:`chat_delta_ids`).

Images and videos: a sample may carry ``multi_modal`` (the
:class:`~polyrl.core.multimodal.MultiModalInputs` of its prompt, ``input_ids`` already expanded);
the trajectory keeps it and every turn sends the media of the whole context with
``generate(..., multi_modal=...)``. Observations and tool results may be chat content parts
with images (``{"type": "image", "image": ...}``); a loop built with a ``processor`` (the
policy's :class:`~polyrl.models.processor.VisionProcessor`) renders them through the chat
template delta, expands their placeholders and appends their media in token order
(:meth:`AgentLoop.encode_media`).

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
from polyrl.core.columns import EPISODE, MULTI_MODAL
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
    "split_media",
    "split_messages_media",
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

        ``multi_modal`` is the media of every image/video placeholder run in ``input_ids``, in
        order (the client sends its ``media_payload()``). Loops pass it only when the context
        has media, so a text-only client need not accept it.
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
        multi_modal: the images/videos of ``prompt_ids + response_ids``, one item per
            placeholder run, in token order (``None``: text only). Starts as the sample's own
            (the same object, shared by a prompt's ``n`` trajectories) and grows, as a new
            object, when observations or tool results add media (:meth:`append_env`).
        episode: the index of the sample it was rolled out from in :func:`run_agent_loops`
            (set there); the linked samples of one episode share it.
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
    multi_modal: MultiModalInputs | None = None
    episode: int | None = None

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

    def append_env(self, ids: Sequence[int], multi_modal: MultiModalInputs | None = None) -> None:
        """Append tool/environment tokens (mask 0, log-prob 0), with the media they hold.

        ``ids`` must already be expanded (one full placeholder run per item of
        ``multi_modal``); the items are appended after the trajectory's own, since the new
        tokens come after every earlier one.
        """
        ids = [int(t) for t in ids]
        self.response_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.rollout_log_probs.extend([0.0] * len(ids))
        if multi_modal is not None and len(multi_modal):
            self.add_media(multi_modal)

    def add_media(self, multi_modal: MultiModalInputs) -> None:
        """Append media items after the trajectory's own (a new object: the old may be shared)."""
        if self.multi_modal is None or not len(self.multi_modal):
            self.multi_modal = multi_modal
        else:
            self.multi_modal = MultiModalInputs.concat([self.multi_modal, multi_modal])

    def truncate(self, max_response_length: int) -> bool:
        """Cut the response to ``max_response_length`` tokens; return whether anything was cut.

        Raises:
            ValueError: the trajectory carries media: a cut could split a placeholder run
                and leave items without tokens (the loops never exceed the budget instead).
        """
        if len(self.response_ids) <= max_response_length:
            return False
        if self.multi_modal is not None and len(self.multi_modal):
            raise ValueError(
                "cannot truncate a trajectory with images or videos: the cut could split "
                "a placeholder run; keep the response within the budget instead"
            )
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


# ----------------------------------------------------------------------------- media in messages

#: Content-part types that carry an image (``image_url``: the OpenAI form, a ``data:`` URL).
_IMAGE_PARTS = ("image", "image_url")


def split_media(
    content: Any, what: str = "message", *, require_data: bool = True, join_text: bool = False
) -> tuple[Any, list[tuple[str, Any]]]:
    """Separate a message's media from what the chat template renders.

    Args:
        content: a string, or chat content parts: ``{"type": "text", "text": ...}``,
            ``{"type": "image", "image": <any form decode_image takes>}``,
            ``{"type": "image_url", "image_url": {"url": "data:..."}}`` or
            ``{"type": "video", "video": [frames]}`` (a bare string part is text).
        what: how errors name the content.
        require_data: refuse a media part without its data; ``False`` accepts the bare
            ``{"type": "image"}`` of a prompt whose media were processed already (its item is
            ``None``).
        join_text: return parts that are all text as one string (what a text-only chat
            template expects of an observation or a tool response).

    Returns:
        ``(template_content, items)``: the content with each media part reduced to its bare
        ``{"type": "image"}`` / ``{"type": "video"}`` (the template renders one placeholder
        per part; the pixels stay out of ``Trajectory.messages``), and ``(kind, item)`` per
        media part in order. A string comes back unchanged, with no items.

    Raises:
        ValueError: content that is neither a string nor a list of parts, or a media part
            without its data.
    """
    if content is None or isinstance(content, str):
        return content, []
    if not isinstance(content, list | tuple):
        raise ValueError(
            f"{what}: content must be a string or a list of content parts, got "
            f"{type(content).__name__}"
        )
    parts: list[Any] = []
    items: list[tuple[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in _IMAGE_PARTS:
            data = part.get(kind)
            if data is None and require_data:
                raise ValueError(f"{what}: content part {i} ({kind}) has no {kind!r} data")
            items.append(("image", None if data is None else part))
            parts.append({"type": "image"})
        elif kind == "video":
            if part.get("video") is None and require_data:
                raise ValueError(f"{what}: content part {i} (video) has no 'video' frames")
            items.append(("video", part.get("video")))
            parts.append({"type": "video"})
        else:
            raise ValueError(
                f"{what}: content part {i} has type {kind!r}; expected text, image, image_url "
                "or video"
            )
    if join_text and not items:
        return "".join(p["text"] for p in parts), items
    return parts, items


def split_messages_media(
    messages: Sequence[Mapping[str, Any]],
    what: str = "message",
    *,
    require_data: bool = True,
    join_text: bool = False,
) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """:func:`split_media` over messages: template-ready copies and all items in token order.

    The chat template renders messages in order and each message's parts in order, so the
    items come back in the order their placeholders appear in the rendered text.
    """
    out: list[dict[str, Any]] = []
    items: list[tuple[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if "content" in msg:
            msg["content"], found = split_media(
                msg["content"], what, require_data=require_data, join_text=join_text
            )
            items.extend(found)
        out.append(msg)
    return out, items


def _no_processor_error(what: str, n: int) -> ValueError:
    """Return the error for media met by a loop that has no vision processor."""
    return ValueError(
        f"{what} holds {n} image(s)/video(s) but the agent loop has no vision processor; "
        "build the loop with processor=<the policy's VisionProcessor> "
        "(polyrl.models.processor.load_vision_processor) to render images"
    )


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
    msgs = _messages_of(sample, prompt_key)
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


def _messages_of(sample: Mapping[str, Any], prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Return copies of a sample's chat messages (``raw_prompt``, else ``prompt_key``)."""
    messages = sample.get("raw_prompt", sample.get(prompt_key))
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return [dict(m) for m in messages] if messages is not None else []


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
        processor: the policy's vision processor (a
            :class:`~polyrl.models.processor.VisionProcessor` or any object with its
            ``process_media(images, videos, order=, what=)`` and ``expand(ids, inputs)``);
            needed only to render images/videos the loop meets in prompts it builds,
            observations or tool results (:meth:`encode_media`). ``None``: text only (a
            sample's own ``multi_modal`` is still passed through).
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
        processor: Any = None,
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
        self.processor = processor

    @abc.abstractmethod
    async def run(
        self, sample: Mapping[str, Any], client: GenerateClient
    ) -> Trajectory | list[Trajectory]:
        """Roll out one sample: one trajectory, or the linked samples of one episode."""

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

    def prompt_of(
        self,
        sample: Mapping[str, Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        render: bool = False,
        added: Sequence[Mapping[str, Any]] = (),
        what: str = "the prompt",
    ) -> tuple[list[int], list[dict[str, Any]], MultiModalInputs | None]:
        """Return the prompt this loop sends: ``(ids, messages, media)``, media included.

        Like :meth:`prompt_ids_of` (the dataset's ``input_ids`` when they can be used as they
        are, else the messages rendered, with ``tools``), plus ``added`` messages the loop
        appends (a first observation; they force rendering). The sample's ``multi_modal``
        covers the media parts of its own messages (which may be bare ``{"type": "image"}``);
        media parts of ``added`` messages, or of a sample without ``multi_modal``, are
        processed here (:meth:`encode_media`, errors naming ``what``). ``messages`` come back
        in template form (media parts reduced to their type, :func:`split_media`).
        """
        base = sample.get(MULTI_MODAL)
        if render:
            require_chat_prompt(sample, "rendering it with the loop's tool schemas")
        msgs = _messages_of(sample)
        own, own_items = split_messages_media(
            msgs, f"{_describe(sample)}: prompt", require_data=False
        )
        new, new_items = split_messages_media(added, what, join_text=True)
        if (
            not added
            and sample.get("input_ids") is not None
            and not (render and msgs)
            and (base is not None or not own_items)
        ):
            # The dataset's ids, as prompt_ids_of takes them: already expanded. (Images in
            # the messages without the sample's media are rendered and processed below.)
            ids, _ = self.prompt_ids_of(sample)
            return ids, own, base
        if not own and not new:
            raise ValueError(
                f"{_describe(sample)} has neither 'input_ids' nor chat messages under "
                "'raw_prompt'/'prompt'"
            )
        if base is None and any(item is None for _, item in own_items):
            raise ValueError(
                f"{_describe(sample)}: the prompt has an image/video part without its data "
                "and the sample has no 'multi_modal' (the processed media of its prompt)"
            )
        items = ([] if base is not None else own_items) + new_items
        ids = self.render_prompt_ids(own + new, tools=tools)
        ids, media = self.encode_media(ids, items, what, base=base)
        return ids, own + new, media

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

    def check_media(self, items: Sequence[tuple[str, Any]], what: str) -> None:
        """Refuse media items when the loop has no processor (the error names ``what``)."""
        if items and self.processor is None:
            raise _no_processor_error(what, len(items))

    def encode_media(
        self,
        ids: Sequence[int],
        items: Sequence[tuple[str, Any]],
        what: str,
        base: MultiModalInputs | None = None,
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Process ``items`` and expand the placeholders of freshly rendered ``ids``.

        Args:
            ids: template-rendered ids with one placeholder token per media item (a prompt,
                or a chat delta).
            items: ``(kind, item)`` in token order (:func:`split_messages_media`).
            what: names the source in errors (``"environment 'x' observation"``).
            base: media already processed for the first placeholders of ``ids`` (a sample's
                ``multi_modal`` when its prompt is re-rendered); ``items`` follow them.

        Returns:
            ``(expanded ids, media)``: ``media`` is ``base`` followed by the processed
            ``items`` (``None`` when there is neither).

        Raises:
            ValueError: ``items`` but no processor (naming ``what``).
            polyrl.core.multimodal.MultiModalInputError: placeholders and items disagree, or
                an item cannot be decoded.
        """
        ids = [int(t) for t in ids]
        if self.processor is None:
            self.check_media(items, what)
            if base is not None and len(base):
                raise _no_processor_error(what, len(base))
            return ids, None
        new = None
        if items:
            new = self.processor.process_media(
                images=[item for kind, item in items if kind == "image"],
                videos=[item for kind, item in items if kind == "video"],
                order=[kind for kind, _ in items],
                what=what,
            )
        parts = [m for m in (base, new) if m is not None and len(m)]
        media = parts[0] if len(parts) == 1 else MultiModalInputs.concat(parts) if parts else None
        # expand() also refuses placeholders without items (e.g. a literal <|image_pad|>).
        return list(self.processor.expand(ids, media)), media

    def start(
        self,
        sample: Mapping[str, Any],
        prompt_ids: Sequence[int],
        messages: list[dict[str, Any]],
        built: str,
        multi_modal: MultiModalInputs | None = None,
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
        loop's 2 tool schemas"``. ``multi_modal`` is the prompt's media (default: the
        sample's ``multi_modal``); a prompt with media is never cut (``left`` / ``right``
        act as ``error``): a cut could split an image's placeholder run.
        """
        ids = [int(t) for t in prompt_ids]
        if multi_modal is None:
            multi_modal = sample.get(MULTI_MODAL)
        traj = Trajectory(
            prompt_ids=ids, messages=messages, seed=sample.get("seed"), multi_modal=multi_modal
        )
        limit = self.max_prompt_length
        if limit is None:
            return traj
        what = f"{_describe(sample)}, prompt {built}"
        truncation = self.truncation
        if multi_modal is not None and len(multi_modal) and truncation in ("left", "right"):
            truncation = "error"
            what += " (it has images, so it is not cut)"
        fitted = fit_prompt(ids, limit, truncation, what)
        if self.truncation in ("left", "right"):
            traj.metrics["prompt_truncated"] = float(fitted is not None and len(fitted) < len(ids))
        if self.truncation == "filter":
            traj.metrics["prompt_filtered"] = float(fitted is None)
        if fitted is None:
            # Nothing is generated; the last `limit` tokens keep the row within the batch's
            # planned width (it is never trained on: its response is empty).
            traj.prompt_ids = ids[-limit:]
            traj.finish_reason = "filtered"
            if traj.multi_modal is not None:
                # The cut may split a placeholder run: drop the media and blank the
                # placeholders so the row stays consistent (nothing of it is trained on).
                traj.multi_modal = None
                traj.prompt_ids = self._blank_placeholders(traj.prompt_ids)
        else:
            traj.prompt_ids = fitted
        return traj

    def _blank_placeholders(self, ids: list[int]) -> list[int]:
        token_ids = getattr(self.processor, "token_ids", None) or {}
        placeholders = {int(t) for t in token_ids.values()}
        pad = self.tokenizer.pad_token_id
        pad = int(pad) if pad is not None else min(self.eos_ids)
        return [pad if t in placeholders else t for t in ids]

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
        # Only a context with media sends it: text-only clients keep their old signature.
        media = traj.multi_modal
        extra = {"multi_modal": media} if media is not None and len(media) else {}
        result = await client.generate(
            traj.prompt_ids + traj.response_ids,
            self.turn_params(traj),
            session_id=session_id,
            **extra,
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
        "openai_agent": "polyrl.agent.openai_agent",
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
    processor: Any = None,
) -> list[Trajectory]:
    """Run each sample through its loop (``extra_info.agent_name`` or ``default_agent``).

    One loop instance per name is built with ``loop_kwargs[name]``; at most ``max_concurrency``
    trajectories run at once. Results come back in sample order, one per sample, except that a
    loop returning an episode's linked samples (a list) gives them all, in their order; each
    trajectory's ``episode`` is the index of its sample. ``processor`` (the policy's
    vision processor, for image observations and tool results) is given to every loop whose
    ``loop_kwargs`` do not name one; ``None`` passes nothing, so loops written before it
    keep working.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    kwargs = dict(loop_kwargs or {})
    loops: dict[str, AgentLoop] = {}
    for sample in samples:
        name = agent_name_of(sample, default_agent)
        if name not in loops:
            args = dict(kwargs.get(name, {}))
            if processor is not None:
                args.setdefault("processor", processor)
            loops[name] = create_agent_loop(name, tokenizer, **args)
    gate = asyncio.Semaphore(max_concurrency)

    async def one(index: int, sample: Mapping[str, Any]) -> list[Trajectory]:
        name = agent_name_of(sample, default_agent)
        async with gate:
            out = await loops[name].run(sample, client)
        linked = out if isinstance(out, list) else [out]
        if not linked:
            raise ValueError(f"agent loop {name!r} returned no trajectory for sample {index}")
        for traj in linked:
            traj.agent_name = name
            traj.episode = index
            traj.validate()
        return linked

    episodes = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    return [traj for linked in episodes for traj in linked]


# ----------------------------------------------------------------------------- collator


def collate_trajectories(trajectories: Sequence[Trajectory], pad_token_id: int) -> Batch:
    """Pack trajectories into one RL batch (prompts left-padded, responses right-padded).

    The layout is ``polyrl.trainer.rl.build_rollout_batch``'s: tensors ``(B, P + R)``
    ``input_ids``, ``attention_mask``, ``position_ids``, float ``loss_mask`` (here the response
    mask: 0 on tool/env tokens), ``rollout_log_probs``; ``prompt_length`` and
    ``response_length`` ``(B,)``. Non-tensor columns: ``num_turns``, ``tool_calls``,
    ``tool_errors``, ``reward`` (NaN when the scorer decides), ``turn_rewards``,
    ``finish_reason``, ``agent_name``, ``messages``, ``episode`` (:data:`~polyrl.core.columns.
    EPISODE`: each trajectory's ``episode``, else its position); when any trajectory has media, also
    ``multi_modal`` (:data:`~polyrl.core.columns.MULTI_MODAL`: each row's
    ``Trajectory.multi_modal`` object as it is, ``None`` for text rows, so a prompt's ``n``
    rows share one object unless their turns added media). ``meta["agent_metrics"]`` holds the batch
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
        EPISODE: np.array(
            [i if t.episode is None else t.episode for i, t in enumerate(trajectories)],
            dtype=np.int64,
        ),
    }
    if any(t.multi_modal is not None for t in trajectories):
        # Only then: text batches keep their columns (and their concat with older batches).
        non_tensors[MULTI_MODAL] = col([t.multi_modal for t in trajectories])
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
