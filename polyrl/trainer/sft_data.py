"""SFT data: multi-turn chats rendered with the chat template, loss on assistant tokens only.

A conversation is rendered turn by turn.  Chat templates used for training must be
*prefix-stable*: rendering ``messages[:k]`` is a string prefix of rendering ``messages[:k+1]``
(the polyrl tiny-model template is, like Qwen's ChatML).  For an assistant message ``k`` the
text up to the generation prompt, ``render(messages[:k], add_generation_prompt=True)``, is
context; what ``render(messages[:k+1])`` adds after it is the assistant's turn and is learned,
up to and including its last end-of-turn (eos) token -- the newline after it is never sampled.
Each segment is tokenised on its own, which is exactly how a rollout sees a prompt followed by
generated tokens.

Rows come either as chats (a ``messages`` column) or as RL rows (``prompt`` + ground truth),
which become chats by appending the ground truth as the assistant turn
(:func:`chat_from_rl_row`).

Rows may carry images and videos in the layouts :mod:`polyrl.data.media` reads (verl's
``images`` column with ``<image>`` in the text, TRL's ``image`` column and content parts). With
a vision model's processor, :class:`SFTDataset` processes them at load time like the RL dataset:
the placeholders are expanded to each item's run of tokens (never learned, never cut by
truncation) and each item carries its :class:`~polyrl.core.multimodal.MultiModalInputs`, which
:func:`collate_chats` puts in the batch's ``multi_modal`` column.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from polyrl.core.batch import Batch
from polyrl.core.columns import MULTI_MODAL
from polyrl.core.multimodal import MultiModalInputError
from polyrl.core.prompts import check_template_kwargs, render_chat
from polyrl.data.media import expand_mask, media_messages, resolve_media_paths, row_media
from polyrl.data.schema import RowValidationError, ground_truth_of, validate_messages

__all__ = [
    "SFTDataError",
    "SFTDataset",
    "TokenizedChat",
    "chat_from_rl_row",
    "chats_from_rows",
    "collate_chats",
    "tokenize_chat",
]


class SFTDataError(ValueError):
    """SFT rows or their rendering are unusable; the message names the row and the problem."""


@dataclasses.dataclass(frozen=True)
class TokenizedChat:
    """One tokenised conversation.

    Attributes:
        input_ids: token ids of the whole rendered conversation (image and video placeholders
            expanded when it has media).
        loss_mask: 1 on tokens the model learns (assistant turns), else 0.
        multi_modal: its processed images and videos
            (:class:`~polyrl.core.multimodal.MultiModalInputs`), or ``None``.
    """

    input_ids: list[int]
    loss_mask: list[int]
    multi_modal: Any = None

    def __len__(self) -> int:
        return len(self.input_ids)


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    try:
        return render_chat(
            tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
    except TypeError as exc:  # a data error: the callers name the row
        raise SFTDataError(str(exc)) from None


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _not_prefix(what: str, k: int, before: str, after: str) -> SFTDataError:
    return SFTDataError(
        f"the chat template is not prefix-stable: rendering {what} (message {k}) does not start "
        f"with the rendering of the earlier messages ({before[-60:]!r} vs {after[:80]!r}...); "
        "SFT needs a template where rendering messages[:k] is a prefix of messages[:k+1]"
    )


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedChat:
    """Tokenise a conversation and mark its assistant tokens (see the module docstring).

    ``apply_chat_template_kwargs``: extra template arguments (``data.apply_chat_template_kwargs``),
    used for every rendering, so the trained turns are rendered as the RL prompts are.

    Raises:
        SFTDataError: the template is not prefix-stable, or there is no assistant message.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise SFTDataError("the conversation has no assistant message, so nothing to learn")
    if messages[0].get("role") == "assistant":
        # Its context would be the empty conversation, which chat templates cannot render.
        raise SFTDataError(
            "the conversation starts with an assistant message; put a system or user message "
            "before it"
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # rendered text already tokenised
    for k, message in enumerate(messages):
        if message.get("role") == "assistant":
            head = _render(tokenizer, messages[:k], tools, True, apply_chat_template_kwargs)
            if not head.startswith(done):
                raise _not_prefix("the generation prompt", k, done, head)
            context = _encode(tokenizer, head[len(done) :])
            ids += context
            mask += [0] * len(context)
            full = _render(tokenizer, messages[: k + 1], tools, False, apply_chat_template_kwargs)
            if not full.startswith(head):
                raise _not_prefix("an assistant turn", k, head, full)
            turn = _encode(tokenizer, full[len(head) :])
            learn = len(turn)
            if eos is not None and eos in turn:
                learn = len(turn) - turn[::-1].index(eos)
            ids += turn
            mask += [1] * learn + [0] * (len(turn) - learn)
            done = full
        else:
            full = _render(tokenizer, messages[: k + 1], tools, False, apply_chat_template_kwargs)
            if not full.startswith(done):
                raise _not_prefix(f"a {message.get('role')} message", k, done, full)
            piece = _encode(tokenizer, full[len(done) :])
            ids += piece
            mask += [0] * len(piece)
            done = full
    return TokenizedChat(ids, mask)


_ROW_PREFIX = re.compile(r"^row( \d+)?: ")


def chat_from_rl_row(row: Mapping[str, Any], prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """``row[prompt_key]`` messages plus the ground truth as the assistant's answer."""
    if prompt_key not in row:
        raise SFTDataError(f"row has no {prompt_key!r} column (columns: {sorted(row)})")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    validate_messages(prompt, field=prompt_key)  # an int or a list of non-dicts is named here
    answer = ground_truth_of(row)
    if not isinstance(answer, str | int | float) or isinstance(answer, bool):
        raise SFTDataError(
            f"ground truth {answer!r} ({type(answer).__name__}) cannot be an assistant answer; "
            "expected a string or a number"
        )
    return [dict(m) for m in prompt] + [{"role": "assistant", "content": str(answer)}]


def chats_from_rows(
    rows: Sequence[Mapping[str, Any]],
    messages_key: str = "messages",
    prompt_key: str = "prompt",
    source: str = "rows",
    image_key: str = "images",
    video_key: str = "videos",
    base_dir: Any = None,
) -> list[dict[str, Any]]:
    """Normalise rows to ``{"messages": [...], "tools": [...] | None}``.

    A row with ``messages_key`` is a chat; otherwise a row with ``prompt_key`` and
    ``reward_model.ground_truth`` becomes one (:func:`chat_from_rl_row`).  Tools come from a
    ``tools`` column or ``extra_info.tools``. A row with images or videos (``image_key``, TRL's
    ``image``, ``video_key``) also gets ``"images"`` / ``"videos"`` lists, relative image paths
    made absolute from ``base_dir`` when given (the data file's folder).
    """
    chats = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        try:
            if messages_key in row and row[messages_key] is not None:
                validate_messages(row[messages_key], index=i, field=messages_key)
                messages = [dict(m) for m in row[messages_key]]
            elif prompt_key in row:
                messages = chat_from_rl_row(row, prompt_key)
            else:
                raise SFTDataError(
                    f"has neither a {messages_key!r} column (chat messages) nor a {prompt_key!r} "
                    f"column with reward_model.ground_truth; columns: {sorted(row)}"
                )
            validate_messages(messages, index=i, field=messages_key)
        except (SFTDataError, RowValidationError, TypeError) as exc:
            # Validation messages start with "row [i]: " themselves; ``where`` says it once.
            raise SFTDataError(f"{where}: {_ROW_PREFIX.sub('', str(exc))}") from None
        if not any(m["role"] == "assistant" for m in messages):
            raise SFTDataError(f"{where}: the conversation has no assistant message to learn")
        tools = row.get("tools")
        if tools is None:
            extra = row.get("extra_info") or {}
            tools = extra.get("tools") if isinstance(extra, Mapping) else None
        chat: dict[str, Any] = {"messages": messages, "tools": tools or None}
        images, videos = row_media(row, image_key, video_key)
        if images or videos:
            if base_dir is not None:
                images = resolve_media_paths(images, base_dir)
                videos = resolve_media_paths(videos, base_dir)
            chat["images"], chat["videos"] = images, videos
        chats.append(chat)
    return chats


class SFTDataset:
    """Tokenised conversations, truncated or filtered to ``max_length`` tokens.

    Args:
        chats: from :func:`chats_from_rows`.
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_length: longest allowed conversation in tokens.
        truncation: ``"error"`` (raise naming the row), ``"filter"`` (drop it) or ``"right"``
            (cut the end off).
        source: name used in error messages.
        apply_chat_template_kwargs: extra chat-template arguments (see :func:`tokenize_chat`).
        processor: the vision model's :class:`~polyrl.models.processor.VisionProcessor`
            (needed when chats have images or videos; they are processed here, at load time).
            An unusable image is an error naming the row, or, under ``"filter"``, the chat is
            dropped and counted in :attr:`num_bad_media`.
    """

    def __init__(
        self,
        chats: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        max_length: int,
        truncation: str = "error",
        source: str = "data",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ) -> None:
        template_kwargs = check_template_kwargs(apply_chat_template_kwargs)
        if truncation not in ("error", "filter", "right"):
            raise ValueError(f"truncation must be 'error', 'filter' or 'right', got {truncation!r}")
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        self.max_length = max_length
        self.items: list[TokenizedChat] = []
        self.num_filtered = 0
        self.num_truncated = 0
        self.num_bad_media = 0
        self.processor = processor
        for i, chat in enumerate(chats):
            images, videos = list(chat.get("images") or ()), list(chat.get("videos") or ())
            messages = chat["messages"]
            if images or videos:
                messages = media_messages(messages, len(images), len(videos))
            try:
                item = tokenize_chat(tokenizer, messages, chat.get("tools"), template_kwargs)
            except SFTDataError as exc:
                raise SFTDataError(f"{source}: row {i}: {exc}") from None
            if images or videos:
                try:
                    item = self._with_media(item, images, videos, f"{source}: row {i}")
                except MultiModalInputError as exc:
                    if truncation != "filter":
                        raise SFTDataError(str(exc)) from None
                    self.num_bad_media += 1
                    continue
            if len(item) > max_length:
                if truncation == "error":
                    raise SFTDataError(
                        f"{source}: row {i} has {len(item)} tokens, more than max_length="
                        f"{max_length}; raise sft.max_length or set sft.truncation to 'filter' or "
                        "'right'"
                    )
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                if item.multi_modal is not None and self._cuts_media(item, max_length):
                    # A cut image run no longer matches its pixels.
                    raise SFTDataError(
                        f"{source}: row {i} has {len(item)} tokens, more than max_length="
                        f"{max_length}, and cutting it would cut its image/video tokens; raise "
                        "sft.max_length or set sft.truncation to 'filter'"
                    )
                item = dataclasses.replace(
                    item,
                    input_ids=item.input_ids[:max_length],
                    loss_mask=item.loss_mask[:max_length],
                )
                self.num_truncated += 1
            self.items.append(item)
        if not self.items:
            raise SFTDataError(
                f"{source}: no conversation left ({self.num_filtered} filtered as longer than "
                f"max_length={max_length})"
            )

    def _with_media(
        self, item: TokenizedChat, images: list[Any], videos: list[Any], where: str
    ) -> TokenizedChat:
        if self.processor is None:
            raise SFTDataError(
                f"{where} has images or videos but the model is not a vision-language model "
                "(its config has no vision_config)"
            )
        field = "images" if images else "videos"
        # Training data is the user's own: image paths may point anywhere on this machine.
        ids, mm = self.processor.encode(
            item.input_ids, images, videos, what=f"{where}: field {field!r}", allowed_dir="/"
        )
        mask = expand_mask(
            item.input_ids, item.loss_mask, self.processor.token_ids, mm.expanded_lengths
        )
        return TokenizedChat(ids, mask, mm)

    def _cuts_media(self, item: TokenizedChat, max_length: int) -> bool:
        media = set(self.processor.token_ids.values())
        return any(t in media for t in item.input_ids[max_length:])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedChat:
        return self.items[index]

    def loss_tokens(self) -> int:
        """Tokens the loss covers over the whole dataset."""
        return sum(sum(item.loss_mask) for item in self.items)


def collate_chats(items: Sequence[TokenizedChat], pad_token_id: int) -> Batch:
    """Right-padded engine batch: ``input_ids``, ``attention_mask`` and float ``loss_mask``.

    When any conversation has images or videos, the object column ``multi_modal``
    (:data:`~polyrl.core.columns.MULTI_MODAL`) holds each row's inputs (``None`` for text rows).
    """
    if not items:
        raise ValueError("collate_chats needs at least one conversation")
    width = max(len(item) for item in items)
    ids = torch.full((len(items), width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    loss = torch.zeros((len(items), width), dtype=torch.float32)
    for row, item in enumerate(items):
        n = len(item)
        ids[row, :n] = torch.tensor(item.input_ids, dtype=torch.long)
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(item.loss_mask, dtype=torch.float32)
    tensors = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    if any(item.multi_modal is not None for item in items):
        column = np.empty(len(items), dtype=object)
        for row, item in enumerate(items):
            column[row] = item.multi_modal
        return Batch(tensors=tensors, non_tensors={MULTI_MODAL: column})
    return Batch(tensors=tensors)
