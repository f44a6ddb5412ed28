"""Preference pairs: rows, tokenisation and pair batches for the DPO and reward-model trainers.

A row holds a prompt and two completions, one preferred. The columns follow TRL's preference
format, which verl's reward-model data also uses: ``prompt``, ``chosen``, ``rejected``
(names set by ``data.prompt_key``, ``<group>.chosen_key``, ``<group>.rejected_key``). Values are

* **strings** (TRL's "standard" format; verl's ``RMDataset``): the sequence is the prompt text
  followed by the completion text and an end-of-sequence token, with no chat template;
* **chat message lists** (TRL's "conversational" format; a verl RL row's ``prompt``): rendered
  with the chat template: the prompt up to the generation prompt is context, and what the
  completion's messages add after it is learned, up to and including its last end-of-turn token.
  A string next to a message list is one message (the prompt a user turn, a completion an
  assistant turn). Without a prompt column the prompt is the messages that ``chosen`` and
  ``rejected`` share at their start (TRL's "implicit prompt").

Optional numeric columns: ``ref_chosen_logps`` / ``ref_rejected_logps`` (the reference model's
summed log-probs of each completion, as TRL precomputes them: DPO then builds no reference model)
and ``margin`` (the reward model's per-pair margin; name set by ``rm.margin_key``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from polyrl.core.batch import Batch
from polyrl.core.prompts import check_template_kwargs
from polyrl.model_engine.engine import ROW_GROUP_KEY
from polyrl.trainer.sft_data import TokenizedChat, _encode, _render

__all__ = [
    "REF_COLUMNS",
    "PreferenceDataError",
    "PreferenceDataset",
    "TokenizedPair",
    "collate_pairs",
    "pairs_from_rows",
    "tokenize_completion",
]

#: Columns of precomputed reference log-probs (TRL's names).
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class PreferenceDataError(ValueError):
    """Preference rows are unusable; the message names the row and the problem."""


@dataclasses.dataclass(frozen=True)
class TokenizedPair:
    """One tokenised pair: two sequences with a shared prompt, and optional per-pair numbers."""

    chosen: TokenizedChat
    rejected: TokenizedChat
    ref_chosen: float | None = None
    ref_rejected: float | None = None
    margin: float | None = None

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))


def _is_messages(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(m, Mapping) for m in value)


def _messages(value: Any, role: str, field: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not _is_messages(value) or not value:
        raise PreferenceDataError(
            f"{field} must be a string or a non-empty list of chat messages, got "
            f"{type(value).__name__}"
        )
    for m in value:
        if "role" not in m or "content" not in m:
            raise PreferenceDataError(f"{field}: each message needs a role and a content: {m!r}")
    return [dict(m) for m in value]


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PreferenceDataError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def pairs_from_rows(
    rows: Sequence[Mapping[str, Any]],
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    margin_key: str = "",
    source: str = "rows",
) -> list[dict[str, Any]]:
    """Normalise rows to dicts of prompt, chosen, rejected, ref_chosen, ref_rejected, margin.

    ``prompt`` / ``chosen`` / ``rejected`` become either three strings or three message lists
    (see the module docstring); the numbers are ``None`` where the row has no such column.
    """
    pairs = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        missing = [k for k in (chosen_key, rejected_key) if row.get(k) is None]
        if missing:
            raise PreferenceDataError(
                f"{where} has no {' or '.join(repr(k) for k in missing)} column; preference "
                f"rows need {prompt_key!r} (optional), {chosen_key!r} and {rejected_key!r} "
                f"(columns: {sorted(row)})"
            )
        prompt, chosen, rejected = row.get(prompt_key), row[chosen_key], row[rejected_key]
        try:
            if all(isinstance(v, str) for v in (chosen, rejected)) and (
                prompt is None or isinstance(prompt, str)
            ):
                prompt = prompt or ""
            elif prompt is None:
                chosen = _messages(chosen, "assistant", chosen_key)
                rejected = _messages(rejected, "assistant", rejected_key)
                shared = 0
                while (
                    shared < min(len(chosen), len(rejected)) - 1
                    and chosen[shared] == rejected[shared]
                ):
                    shared += 1
                if shared == 0:
                    raise PreferenceDataError(
                        f"there is no {prompt_key!r} column and {chosen_key!r} and "
                        f"{rejected_key!r} share no leading message to use as the prompt"
                    )
                prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            else:
                prompt = _messages(prompt, "user", prompt_key)
                chosen = _messages(chosen, "assistant", chosen_key)
                rejected = _messages(rejected, "assistant", rejected_key)
            refs = [_number(row, k) for k in REF_COLUMNS]
            margin = _number(row, margin_key) if margin_key else None
        except PreferenceDataError as exc:
            raise PreferenceDataError(f"{where}: {exc}") from None
        if (refs[0] is None) != (refs[1] is None):
            raise PreferenceDataError(f"{where}: give both {REF_COLUMNS} or neither")
        pairs.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "ref_chosen": refs[0],
                "ref_rejected": refs[1],
                "margin": margin,
            }
        )
    return pairs


def tokenize_completion(
    tokenizer: Any,
    prompt: Any,
    completion: Any,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedChat:
    """Tokenise a prompt and one completion; ``loss_mask`` marks the completion's tokens.

    Strings: prompt text, completion text and the eos token (unless the completion ends with
    it). Message lists: rendered with the chat template (and ``apply_chat_template_kwargs``)
    as described in the module docstring; tokens after the completion's last end-of-turn token
    are dropped.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(prompt, str):
        context = _encode(tokenizer, prompt)
        learned = _encode(tokenizer, completion)
        if eos is not None and (not learned or learned[-1] != eos):
            learned.append(int(eos))
    else:
        head = _render(tokenizer, prompt, None, True, apply_chat_template_kwargs)
        messages = list(prompt) + list(completion)
        full = _render(tokenizer, messages, None, False, apply_chat_template_kwargs)
        if not full.startswith(head):
            raise PreferenceDataError(
                "the chat template is not prefix-stable: the rendered conversation does not "
                f"start with the rendered prompt ({head[-60:]!r} vs {full[:80]!r}...)"
            )
        context = _encode(tokenizer, head)
        learned = _encode(tokenizer, full[len(head) :])
        if eos is not None and eos in learned:
            learned = learned[: len(learned) - learned[::-1].index(eos)]
    if not context:
        raise PreferenceDataError("the prompt renders to no token; nothing predicts the completion")
    if not learned:
        raise PreferenceDataError("the completion renders to no token")
    return TokenizedChat(context + learned, [0] * len(context) + [1] * len(learned))


class PreferenceDataset:
    """Tokenised pairs, filtered to ``max_length`` tokens per sequence or refused.

    Args:
        pairs: from :func:`pairs_from_rows`.
        tokenizer: a Hugging Face tokenizer (with a chat template for message lists).
        max_length: longest allowed sequence (prompt + completion) in tokens.
        truncation: ``"error"`` (raise naming the row) or ``"filter"`` (drop the pair).
        source: name used in error messages.
        apply_chat_template_kwargs: extra chat-template arguments for message lists.
    """

    def __init__(
        self,
        pairs: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        max_length: int,
        truncation: str = "error",
        source: str = "data",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        template_kwargs = check_template_kwargs(apply_chat_template_kwargs)
        if truncation not in ("error", "filter"):
            raise ValueError(f"truncation must be 'error' or 'filter', got {truncation!r}")
        self.items: list[TokenizedPair] = []
        self.num_filtered = 0
        for i, pair in enumerate(pairs):
            try:
                prompt = pair["prompt"]
                chosen = tokenize_completion(tokenizer, prompt, pair["chosen"], template_kwargs)
                rejected = tokenize_completion(tokenizer, prompt, pair["rejected"], template_kwargs)
            except PreferenceDataError as exc:
                raise PreferenceDataError(f"{source}: row {i}: {exc}") from None
            longest = max(len(chosen), len(rejected))
            if longest > max_length:
                if truncation == "error":
                    raise PreferenceDataError(
                        f"{source}: row {i} has a sequence of {longest} tokens, more than "
                        f"max_length={max_length}; raise max_length or set truncation=filter"
                    )
                self.num_filtered += 1
                continue
            self.items.append(
                TokenizedPair(
                    chosen,
                    rejected,
                    pair.get("ref_chosen"),
                    pair.get("ref_rejected"),
                    pair.get("margin"),
                )
            )
        if not self.items:
            raise PreferenceDataError(
                f"{source}: no pair left ({self.num_filtered} filtered as longer than "
                f"max_length={max_length})"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedPair:
        return self.items[index]

    @property
    def has_ref_logps(self) -> bool:
        """Every pair carries precomputed reference log-probs."""
        return all(p.ref_chosen is not None for p in self.items)


def collate_pairs(
    items: Sequence[TokenizedPair],
    pad_token_id: int,
    ref_logps: Sequence[tuple[float, float]] | None = None,
    margin: bool = False,
) -> Batch:
    """Right-padded engine batch of interleaved rows (chosen, rejected, chosen, ...).

    Columns ``input_ids``, ``attention_mask``, ``loss_mask`` (the completions), and with
    ``ref_logps`` (one ``(chosen, rejected)`` per pair) a ``ref_logps`` column, with ``margin`` a
    ``margin`` column (0 where a pair has none); ``meta[ROW_GROUP_KEY] = 2`` keeps pairs whole.
    """
    if not items:
        raise ValueError("collate_pairs needs at least one pair")
    rows = [seq for pair in items for seq in (pair.chosen, pair.rejected)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        n = len(row)
        ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(row.loss_mask, dtype=torch.float32)
    tensors = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    if ref_logps is not None:
        if len(ref_logps) != len(items):
            raise ValueError(f"{len(ref_logps)} reference log-prob pairs for {len(items)} pairs")
        tensors["ref_logps"] = torch.tensor([v for pair in ref_logps for v in pair])
    if margin:
        values = [p.margin or 0.0 for p in items]
        tensors["margin"] = torch.tensor([v for v in values for _ in range(2)])
    return Batch(tensors=tensors, meta={ROW_GROUP_KEY: 2})
