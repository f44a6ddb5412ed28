"""Shared-prefix forward: run a prompt once for all the rows that continue it.

GRPO-style batches hold ``n`` responses per prompt, and DPO batches a chosen and a rejected
response per prompt.  A plain forward runs every prompt ``n`` times and then computes logits (a
vocabulary-wide matmul and softmax) on prompt positions that no loss reads.  This module splits a
micro-batch at the first column any row trains on (the *split*):

1. **prefix pass** -- each distinct prefix (columns before the split: same tokens, mask and
   positions) runs once, with a KV cache, keeping only its last position's logits (they predict
   the first column after the split);
2. the cache is gathered to one entry per row (``reorder_cache``; autograd carries the rows'
   gradients back to the shared prefix);
3. **suffix pass** -- every row's columns from the split on run against that cache, as decoding
   a long chunk would.

Both passes use the model's own cached-attention path, so any Hugging Face causal LM that
generates with a ``DynamicCache`` works.  The result is the same function of the weights as a full
forward (up to floating-point summation order), with fewer FLOPs: prompt tokens run once per group
instead of once per row, and the LM head runs only where a loss can read it.  Log-probs and
entropies before the split are reported as 0 (nothing there is trained).

:func:`plan_prefix_split` decides whether a micro-batch can be split; :func:`shared_prefix_forward`
runs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyrl.model_engine.batching import MicroBatchLayout, row_spans
from polyrl.model_engine.engine import ModelOutput

__all__ = [
    "PrefixSplit",
    "agree_prefix_splits",
    "plan_prefix_split",
    "shared_prefix_forward",
    "supports_shared_prefix",
]


@dataclass
class PrefixSplit:
    """How a micro-batch splits into shared prefixes and per-row suffixes.

    Attributes:
        split: first column on which any row has a nonzero ``loss_mask``; every row's token at
            ``split - 1`` is real, so every row has a nonempty prefix ending there.
        first: leftmost column holding a real prefix token in any row (the prefix pass's columns
            are ``first .. split - 1``).
        prefix_rows: ``(u,)`` one row index per distinct prefix.
        group: ``(b,)`` index into ``prefix_rows`` of each row's prefix.
    """

    split: int
    first: int
    prefix_rows: torch.Tensor
    group: torch.Tensor

    @property
    def num_prefixes(self) -> int:
        """Number of distinct prefixes (rows of the prefix pass)."""
        return int(self.prefix_rows.numel())


def plan_prefix_split(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    loss_mask: torch.Tensor,
) -> PrefixSplit | None:
    """Find where a micro-batch splits into prefixes and suffixes; ``None`` if it cannot.

    ``None`` when no row trains on any token, or when some row's token just before the split is
    padding (its real tokens start after the split or end before it: rows that do not line up on
    a common split column, e.g. right-padded prompts of different lengths with left-aligned
    responses).  Rows share a prefix when their ids, attention mask and position ids agree on
    every prefix column.
    """
    trained = loss_mask != 0
    cols = trained.any(dim=0).nonzero()
    if cols.numel() == 0:
        return None
    split = int(cols[0, 0])
    if split < 1:
        return None
    starts, lengths = row_spans(attention_mask)
    ends = starts + lengths - 1
    if bool(((starts > split - 1) | (ends < split - 1)).any()):
        return None
    first = int(starts.min())
    ids = input_ids[:, first:split]
    mask = attention_mask[:, first:split].to(ids.dtype)
    pos = position_ids[:, first:split].to(ids.dtype)
    # Padding may hold any id/position: mark it so that only real tokens tell prefixes apart.
    key = torch.cat([torch.where(mask != 0, ids, -1), torch.where(mask != 0, pos, -1), mask], 1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    u = int(group.max()) + 1
    # The first row of each group represents it.
    b = group.numel()
    prefix_rows = torch.full((u,), b, dtype=torch.long, device=group.device)
    prefix_rows = prefix_rows.scatter_reduce(
        0, group, torch.arange(b, device=group.device), reduce="amin"
    )
    return PrefixSplit(split=split, first=first, prefix_rows=prefix_rows, group=group)


def agree_prefix_splits(
    columns: Sequence[torch.Tensor],
    plan: list[list[int]],
    world_size: int,
) -> tuple[list[PrefixSplit | None], list[bool]]:
    """Per micro-batch of ``plan``: this rank's prefix split (or None), and all ranks' say.

    ``columns``: the batch's ``input_ids``, ``attention_mask``, ``position_ids`` and
    ``loss_mask``.  Under FSDP every model call is a collective, so a micro-batch takes the
    two-call shared-prefix forward only if every rank with rows in it can (collective when
    ``world_size > 1``); ranks without rows then run two dummy calls.
    """
    splits: list[PrefixSplit | None] = [
        plan_prefix_split(*(c[rows] for c in columns)) if rows else None for rows in plan
    ]
    if world_size == 1:
        return splits, [split is not None for split in splits]
    # A rank without rows in a micro-batch does not stand in the others' way.
    ready = [s is not None or not rows for rows, s in zip(plan, splits, strict=True)]
    flags = torch.tensor(ready, dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    agreed = [bool(f) for f in flags.tolist()]
    return [split if ok else None for split, ok in zip(splits, agreed, strict=True)], agreed


def _forward_params(model: torch.nn.Module) -> set[str]:
    """Parameter names of ``model.forward``, cached on the model (read every micro-batch)."""
    cached = getattr(model, "_polyrl_forward_params", None)
    if cached is None:
        try:
            cached = set(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            cached = set()
        model._polyrl_forward_params = cached
    return cached


def supports_shared_prefix(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes a KV cache and ``logits_to_keep`` (HF causal LMs do)."""
    params = _forward_params(model)
    has_cache = "cache" in params or "past_key_values" in params
    return has_cache and "logits_to_keep" in params and "use_cache" in params


def _new_cache(model: torch.nn.Module) -> object:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def shared_prefix_forward(
    model: torch.nn.Module,
    plan: PrefixSplit,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> ModelOutput:
    """Run a causal-LM micro-batch as one prefix pass and one suffix pass.

    The output's layout is the trim layout of the attention mask with the columns before
    ``split - 1`` cleared: compute column 0 of a row is its token at ``split - 1``, whose logits
    come from the prefix pass, so log-probs and entropies start at column ``split``.  Its
    ``compute_tokens`` counts the positions both passes ran (padding included).
    """
    split, first = plan.split, plan.first
    cache_kw = "cache" if "cache" in _forward_params(model) else "past_key_values"
    rows = plan.prefix_rows
    prefix_mask = attention_mask[rows, first:split]
    cache = _new_cache(model)
    prefix = model(
        input_ids=input_ids[rows, first:split],
        attention_mask=prefix_mask,
        position_ids=position_ids[rows, first:split],
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: cache},
    )
    # index_select, not ``[plan.group]``: the backward of advanced indexing accumulates with
    # atomic adds on CPU, whose order (and so the rounding of the summed gradient) changes from
    # run to run; index_select's backward (index_add) sums in a fixed order.
    last = prefix.logits[:, -1].index_select(0, plan.group)

    window_mask = attention_mask.clone()
    window_mask[:, : split - 1] = 0
    layout = MicroBatchLayout.build(window_mask, "trim")
    width = layout.compute_shape[1]
    compute_ids = layout.to_compute(input_ids)
    compute_tokens = plan.num_prefixes * (split - first)
    logits = last[:, None]
    if width > 1:
        pos = layout.to_compute(position_ids)[:, 1:]
        suffix_mask = layout.compute_attention_mask(window_mask)[:, 1:].to(prefix_mask.dtype)
        cache.reorder_cache(plan.group)
        suffix = model(
            input_ids=compute_ids[:, 1:],
            attention_mask=torch.cat([prefix_mask[plan.group], suffix_mask], 1),
            position_ids=pos,
            use_cache=True,
            **{cache_kw: cache},
        )
        logits = torch.cat([logits.to(suffix.logits.dtype), suffix.logits], dim=1)
        compute_tokens += pos.numel()
    return ModelOutput(
        kind="causal_lm",
        raw=logits,
        layout=layout,
        compute_input_ids=compute_ids,
        attention_mask=window_mask,
        temperature=temperature,
        chunk_size=chunk_size,
        compute_tokens=compute_tokens,
    )
