"""Ulysses sequence parallelism: sequence-sharded layers, head-sharded attention.

Each sequence-parallel rank runs the model on one contiguous slice of a packed micro-batch's
tokens (padded to a multiple of the group size).  Everything but attention is per token, so
only attention needs the other slices: before it an all-to-all turns sequence-sharded
``(b, heads, T/sp, d)`` query/key/value into head-sharded ``(b, heads/sp, T, d)`` (every token,
some heads); after it a second all-to-all turns the output back.  Rotary embeddings were
already applied per token with the slice's own position ids, so attention over the whole
sequence only needs the whole sequence's boundaries: a block-causal mask built from the full
packed ``position_ids`` (SDPA), or those position ids themselves (flash-attention's varlen
path).

The model is switched to the attention implementation :data:`ULYSSES_ATTENTION`, which wraps
the model's own one and reads the group and full position ids from :func:`ulysses_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ULYSSES_ATTENTION",
    "enable_ulysses",
    "gather_sequence",
    "head_to_seq",
    "seq_to_head",
    "ulysses_context",
]

#: Name under which the Ulysses attention wrapper is registered with transformers.
ULYSSES_ATTENTION = "polyrl_ulysses"


class _State:
    """What the running forward's attention calls need (set by :func:`ulysses_context`)."""

    group: dist.ProcessGroup | None = None
    position_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    inner: str = "sdpa"
    windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """Return the SDPA mask, with a sliding window (Mistral) shorter than the row."""
        assert self.position_ids is not None
        length = self.position_ids.shape[-1]
        if not window or window >= length:
            return self.mask
        if window not in self.windowed:
            mask = self.mask if self.mask is not None else _block_causal_mask(self.position_ids)
            idx = torch.arange(length, device=mask.device)
            near = (idx[:, None] - idx[None, :]) < window  # HF: kv > q - window
            self.windowed[window] = mask & near
        return self.windowed[window]


_STATE = _State()


class _AllToAll(torch.autograd.Function):
    """All-to-all over dim 0 (one block per rank); its own adjoint, so backward is the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        # Fresh contiguous buffers: empty_like would copy a permuted input's strides, and the
        # collective reads and writes flat memory.
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(b, h, L, d)`` for this rank's tokens -> ``(b, h/sp, sp*L, d)`` for all tokens."""
    sp = dist.get_world_size(group)
    b, h, length, d = x.shape
    # Block j (heads j*h/sp ...) goes to rank j; block i received is rank i's tokens.
    blocks = x.reshape(b, sp, h // sp, length, d).permute(1, 0, 2, 3, 4)
    out = _AllToAll.apply(blocks, group)
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * length, d)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(b, sp*L, h/sp, d)`` for all tokens -> ``(b, L, h, d)`` for this rank's tokens."""
    sp = dist.get_world_size(group)
    b, total, heads, d = x.shape
    length = total // sp
    blocks = x.reshape(b, sp, length, heads, d).permute(1, 0, 2, 3, 4)
    out = _AllToAll.apply(blocks, group)
    return out.permute(1, 2, 0, 3, 4).reshape(b, length, sp * heads, d)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1; backward keeps this rank's slice.

    Every rank computes the same loss from the gathered tensor, so each already holds the
    whole upstream gradient: summing it over ranks (the all-gather's usual adjoint) would
    count it ``sp`` times.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        sp = dist.get_world_size(group)
        ctx.rank, ctx.length = dist.get_rank(group), x.shape[1]
        x = x.contiguous()
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(sp)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.rank * ctx.length
        return grad[:, start : start + ctx.length].contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every sequence-parallel rank's ``x`` along dim 1 (identity without a group)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)


def _block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``(b, 1, T, T)`` bool mask: causal within each packed sequence (a 0 position starts one)."""
    seq = (position_ids == 0).cumsum(dim=-1)
    same = seq[:, :, None] == seq[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def _inner_attention(name: str) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ("sdpa", "eager"):
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    group = _STATE.group
    if group is None:
        raise RuntimeError(
            "Ulysses attention ran outside ulysses_context(); the engine sets it for each forward"
        )
    q, k, v = (seq_to_head(t, group) for t in (query, key, value))
    inner = _STATE.inner
    if "flash" in inner:
        # flash-attention's varlen path takes sequence boundaries from the full position ids.
        kwargs["position_ids"] = _STATE.position_ids
        mask = None
    else:
        kwargs.pop("position_ids", None)
        # None: causal (HF's SDPA sets is_causal without a mask).
        mask = _STATE.mask_for(kwargs.pop("sliding_window", None))
    kwargs.pop("is_causal", None)
    out, _ = _inner_attention(inner)(module, q, k, v, mask, **kwargs)
    return head_to_seq(out, group), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for :data:`ULYSSES_ATTENTION`: the per-slice mask HF would build is wrong."""
    return None


def _target(model: nn.Module) -> nn.Module:
    return getattr(model, "backbone", model)


def enable_ulysses(model: nn.Module, sp: int, tp: int = 1) -> str:
    """Switch ``model`` to :data:`ULYSSES_ATTENTION`; return its previous implementation name.

    Raises:
        ValueError: the (tensor-parallel local) attention or key/value heads do not divide by
            ``sp``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    target = _target(model)
    config = target.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads // tp
    kv_heads = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) // tp
    if heads % sp or kv_heads % sp:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp} must divide the attention heads ({heads}) "
            f"and key/value heads ({kv_heads}) of each tensor-parallel rank "
            f"(tensor_parallel_size={tp})"
        )
    AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ULYSSES_ATTENTION, _no_mask)
    inner = str(getattr(config, "_attn_implementation", None) or "sdpa")
    target.set_attn_implementation(ULYSSES_ATTENTION)
    return inner


@contextlib.contextmanager
def ulysses_context(
    group: dist.ProcessGroup,
    position_ids: torch.Tensor,
    inner: str,
    real_length: int | None = None,
) -> Iterator[None]:
    """Within it, Ulysses attention uses ``group`` and the full sequence's ``position_ids``.

    The block-causal mask is built once here (not per layer) unless ``inner`` is a
    flash-attention implementation, or the first ``real_length`` positions (the rest being
    padding) hold one sequence: then plain causal attention is exact for every real token (none
    attends to the padding after it) and SDPA needs no ``T x T`` mask.
    """
    _STATE.group, _STATE.position_ids, _STATE.inner = group, position_ids, inner
    real = position_ids[:, :real_length] if real_length is not None else position_ids
    single = position_ids.shape[0] == 1 and int((real[0, 1:] == 0).sum()) == 0
    flash = "flash" in inner
    _STATE.mask = None if flash or single else _block_causal_mask(position_ids)
    _STATE.windowed = {}
    # Left set on exit: activation checkpointing re-runs attention in the backward pass, after
    # the forward returned; the next forward replaces it.
    yield
