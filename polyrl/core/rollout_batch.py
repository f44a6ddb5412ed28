"""The rollout batch layout: prompt/response pairs packed into one engine batch.

Prompts are left-padded and responses right-padded to a common width, so that every row's
response starts at the same column; the engines, the agent loop and the transfer queue's
workers all build and re-lay rollout batches with these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOSS_MASK,
    POSITION_IDS,
    PROMPT_LENGTH,
    RESPONSE_LENGTH,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
)

__all__ = ["build_rollout_batch", "rollout_widths", "widen_rollout_batch"]


def build_rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    rollout_log_probs: Sequence[Sequence[float] | None] | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
    width_prompt: int = 0,
    width_response: int = 0,
    routed_experts: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
) -> Batch:
    """Pack prompt/response pairs into one engine batch (prompts left-, responses right-padded).

    Tensors ``(B, P + R)``: ``input_ids``, ``attention_mask``, ``position_ids`` and the float
    ``loss_mask`` (1 on response tokens, or each response's ``response_masks`` entry, e.g. 0 on
    tool tokens of a multi-turn trajectory); ``prompt_length`` and ``response_length`` ``(B,)``;
    ``rollout_log_probs`` (the server's per-token log-probs, aligned like the engine's) when given.
    ``width_prompt`` / ``width_response`` widen the two parts beyond the longest prompt and
    response (the transfer queue's consumers rebuild their shard in the whole step's layout).
    ``routed_experts`` (MoE routing replay): per row, the rollout's ``(prompt + response,
    layers, k)`` expert ids (:attr:`~polyrl.core.rollout_api.SampleOutput.routed_experts`),
    laid out as ``routed_experts`` ``(B, P + R, layers, k)`` with -1 elsewhere.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("build_rollout_batch needs at least one prompt/response pair")
    width_p = max(width_prompt, max(len(p) for p in prompts))
    width_r = max(1, width_response, max(len(r) for r in responses))
    rows = len(prompts)
    ids = torch.full((rows, width_p + width_r), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    loss = torch.zeros((rows, width_p + width_r), dtype=torch.float32)
    old = torch.zeros((rows, width_p + width_r), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        ids[i, width_p - len(p) : width_p] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, width_p - len(p) : width_p + len(r)] = 1
        if r:
            ids[i, width_p : width_p + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            if response_masks is None:
                loss[i, width_p : width_p + len(r)] = 1.0
            else:
                mask = torch.as_tensor(list(response_masks[i]), dtype=torch.float32)
                loss[i, width_p : width_p + len(r)] = mask
            lp = rollout_log_probs[i] if rollout_log_probs is not None else None
            if lp is not None:
                old[i, width_p : width_p + len(r)] = torch.as_tensor(list(lp), dtype=torch.float32)
    tensors = {
        INPUT_IDS: ids,
        ATTENTION_MASK: attn,
        POSITION_IDS: (attn.cumsum(1) - 1).clamp(min=0),
        LOSS_MASK: loss,
        PROMPT_LENGTH: torch.as_tensor([len(p) for p in prompts], dtype=torch.long),
        RESPONSE_LENGTH: torch.as_tensor([len(r) for r in responses], dtype=torch.long),
    }
    if rollout_log_probs is not None:
        tensors[ROLLOUT_LOG_PROBS] = old
    if routed_experts is not None:
        tensors[ROUTED_EXPERTS] = _routes_column(prompts, routed_experts, width_p, width_r)
    return Batch(tensors=tensors)


def _routes_column(
    prompts: Sequence[Sequence[int]],
    routes: Sequence[Sequence[Sequence[Sequence[int]]]],
    width_p: int,
    width_r: int,
) -> torch.Tensor:
    rows = [torch.as_tensor(r, dtype=torch.int16) for r in routes]
    shapes = {tuple(r.shape[1:]) for r in rows if r.numel()}
    if len(shapes) > 1 or any(r.dim() != 3 for r in rows if r.numel()):
        raise ValueError(f"routed experts must be (tokens, layers, k) alike, got {shapes}")
    layers, k = shapes.pop() if shapes else (0, 0)
    col = torch.full((len(rows), width_p + width_r, layers, k), -1, dtype=torch.int16)
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        if r.numel():
            start = width_p - len(p)  # the routes start at the row's first prompt token
            col[i, start : start + min(r.shape[0], width_p + width_r - start)] = r[
                : width_p + width_r - start
            ]
    return col


def rollout_widths(batch: Batch) -> tuple[int, int]:
    """``(prompt width, response width)`` of a batch laid out by :func:`build_rollout_batch`.

    Prompts are left-padded and never empty, so a row's prompt ends (and its response starts)
    at its first attended position plus its prompt length.
    """
    attn = batch[ATTENTION_MASK]
    first = int(torch.argmax((attn[0] != 0).to(torch.int8)))
    width_p = first + int(batch[PROMPT_LENGTH][0])
    return width_p, int(attn.shape[1]) - width_p


def widen_rollout_batch(
    batch: Batch, width_prompt: int, width_response: int, pad_token_id: int
) -> Batch:
    """Re-lay a rollout batch to wider prompt/response parts (more left and right padding).

    Every ``(B, T)`` tensor column moves right by the added prompt width and is padded with
    zeros (``input_ids`` with ``pad_token_id``), so rows keep their tokens, masks and per-token
    values; ``position_ids`` are renumbered from the attention mask as
    :func:`build_rollout_batch` numbers them; other columns are unchanged.

    Raises:
        ValueError: a requested width is narrower than the batch's own.
    """
    own_p, own_r = rollout_widths(batch)
    if width_prompt < own_p or width_response < own_r:
        raise ValueError(
            f"cannot narrow a rollout batch of widths ({own_p}, {own_r}) to "
            f"({width_prompt}, {width_response})"
        )
    if (width_prompt, width_response) == (own_p, own_r):
        return batch
    total = own_p + own_r
    shift = width_prompt - own_p
    tensors = {}
    for key, value in batch.tensors.items():
        if value.dim() >= 2 and value.shape[1] == total:
            fill = pad_token_id if key == INPUT_IDS else 0
            wide = torch.full(
                (value.shape[0], width_prompt + width_response, *value.shape[2:]),
                fill,
                dtype=value.dtype,
            )
            wide[:, shift : shift + total] = value
            value = wide
        tensors[key] = value
    if POSITION_IDS in tensors:  # as build_rollout_batch numbers them, padding included
        tensors[POSITION_IDS] = (tensors[ATTENTION_MASK].cumsum(1) - 1).clamp(min=0)
    return Batch(tensors=tensors, non_tensors=dict(batch.non_tensors), meta=dict(batch.meta))
