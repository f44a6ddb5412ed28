"""Paged attention for Hugging Face models: one packed forward over many sequences.

The engine calls an unmodified HF causal LM on a *packed* batch: ``input_ids`` of shape
``(1, T)`` holding the new tokens of every scheduled sequence one after the other, with their
true ``position_ids``. The model's attention modules project and rotate queries and keys as
usual and then call the attention function registered here (through transformers'
``AttentionInterface``), which

1. writes the new keys and values into the :class:`~polyrl.rollout.native.kv_cache.PagedKVCache`
   at each token's slot, and
2. attends every query to its own sequence's cached keys, gathered through the block tables.

Per-step metadata (slots, block tables, masks) travels as the ``polyrl_step`` keyword argument:
HF models forward unknown keyword arguments from their ``forward`` down to the attention
function. They build no mask of their own for an attention implementation that has no
registered mask function, so ``attention_mask`` arrives as ``None``.

Sequences are attended in separate groups so that no one pays for another's padding:
*decode* sequences (one new token each, packed first, sorted by context length; on CPU in
float32 one call of the C kernel in :mod:`.cpu_kernels` reads their keys in place, otherwise
they are split into a few length buckets and gathered), *fresh* prefill chunks that start a
sequence (plain causal attention over their own new keys, no cache read) and *continued*
prefill chunks of partly computed sequences (queries padded to the longest chunk, keys gathered
from the cache).

:func:`paged_attention` is the packed core, also called directly by the engine's own forward
(:mod:`.fast_forward`); :func:`paged_attention_forward` adapts it to HF's attention interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from polyrl.rollout.native import cpu_kernels
from polyrl.rollout.native.kv_cache import PagedKVCache

__all__ = [
    "ATTENTION_NAME",
    "AttentionGroup",
    "StepMetadata",
    "paged_attention",
    "paged_attention_forward",
]

ATTENTION_NAME = "polyrl_paged"


@dataclasses.dataclass
class AttentionGroup:
    """Sequences attended together: queries padded to ``q_len``, keys to ``kv_len``.

    Attributes:
        block_table: ``(B, num_blocks)`` block ids of each sequence (padded with block 0).
        kv_lens: ``(B,)`` tokens in cache after this step's write.
        q_lens: ``(B,)`` new tokens of each sequence in this step.
        q_index: ``(B, q_len)`` packed position of each query (prefill group only).
        valid_index: ``(sum(q_lens),)`` flat index of the real queries in ``(B * q_len)``.
        kv_len: padded key length (``num_blocks * block_size``, trimmed to the longest).
        offset: packed position of the group's first token.
    """

    block_table: torch.Tensor
    kv_lens: torch.Tensor
    q_lens: torch.Tensor
    q_len: int
    kv_len: int
    q_index: torch.Tensor | None = None
    valid_index: torch.Tensor | None = None
    offset: int = 0
    _masks: dict[int | None, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of sequences."""
        return int(self.block_table.shape[0])

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(B, 1, q_len, kv_len)`` boolean mask (True = attend), built once per step."""
        cached = self._masks.get(sliding_window)
        if cached is not None:
            return cached
        device = self.block_table.device
        keys = torch.arange(self.kv_len, device=device)
        q_offsets = torch.arange(self.q_len, device=device)
        # Absolute position of each query: the cache held kv_len - q_len tokens before it.
        q_pos = (self.kv_lens - self.q_lens)[:, None] + q_offsets[None, :]
        mask = keys[None, None, :] <= q_pos[:, :, None]
        if sliding_window is not None:
            mask &= keys[None, None, :] > (q_pos[:, :, None] - sliding_window)
        # Padded query rows attend to key 0 only so the softmax stays finite; they are dropped.
        pad = q_offsets[None, :] >= self.q_lens[:, None]
        if bool(pad.any()):
            first = keys[None, None, :] == 0
            mask = torch.where(pad[:, :, None], first, mask)
        mask = mask[:, None]
        self._masks[sliding_window] = mask
        return mask


class StepMetadata:
    """What the paged attention function needs for one engine step.

    Decode sequences (one new token each) come first in packed order, sorted by context
    length. With the C kernel (:mod:`.cpu_kernels`) they are attended in one call that reads
    the cache in place; otherwise they are split into a few length buckets (:attr:`decode`)
    so that short sequences do not pay for the padding of long ones.

    Attributes:
        cache: the KV cache.
        slot_mapping: ``(T,)`` cache slot of each packed token.
        decode_table: ``(B, n)`` block table of the decode sequences (padded with block 0).
        decode_kv_lens: ``(B,)`` their cached lengths after this step's write.
        decode_lens: the same lengths as Python ints, ascending.
        fresh: ``(packed start, length)`` of each prefill chunk starting a sequence.
        prefill: continued prefill chunks, or ``None``.
        use_kernel: attend decode tokens with the C kernel.
        max_position: the highest position of the step's tokens (known to the scheduler, so
            readers need no device sync to find it); None: unknown.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        decode_table: torch.Tensor | None,
        decode_kv_lens: torch.Tensor | None,
        decode_lens: list[int],
        fresh: list[tuple[int, int]],
        prefill: AttentionGroup | None,
        use_kernel: bool = False,
        max_position: int | None = None,
    ):
        self.cache = cache
        self.max_position = max_position
        self.slot_mapping = slot_mapping
        self.decode_table = decode_table
        self.decode_kv_lens = decode_kv_lens
        self.decode_lens = decode_lens
        self.fresh = fresh
        self.prefill = prefill
        self.use_kernel = use_kernel
        self._buckets: list[AttentionGroup] | None = None

    @property
    def num_decode(self) -> int:
        """Number of decode tokens (packed first)."""
        return len(self.decode_lens)

    @property
    def decode(self) -> list[AttentionGroup]:
        """Decode length buckets in packed order (built on first use, for the torch path)."""
        if self._buckets is None:
            self._buckets = []
            n = len(self.decode_lens)
            if n:
                assert self.decode_table is not None and self.decode_kv_lens is not None
                buckets = 1 if n < 8 else 2 if n < 32 else 4
                bs = self.cache.shape[3]
                ones = torch.ones(n, dtype=torch.long, device=self.decode_table.device)
                for i in range(buckets):
                    lo, hi = n * i // buckets, n * (i + 1) // buckets
                    if hi > lo:
                        kv_len = self.decode_lens[hi - 1]
                        self._buckets.append(
                            AttentionGroup(
                                block_table=self.decode_table[lo:hi, : -(-kv_len // bs)],
                                kv_lens=self.decode_kv_lens[lo:hi],
                                q_lens=ones[lo:hi],
                                q_len=1,
                                kv_len=kv_len,
                                offset=lo,
                            )
                        )
        return self._buckets


def _gather_kv(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``(B, kv_heads, kv_len, head_dim)`` keys (or values) of a group, via its block table."""
    num_blocks, block_size, heads, dim = cache.shape
    b, nb = group.block_table.shape
    flat = cache.view(num_blocks, block_size * heads * dim)
    gathered = flat.index_select(0, group.block_table.reshape(-1))
    out = gathered.view(b, nb * block_size, heads, dim)[:, : group.kv_len]
    return out.transpose(1, 2)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    k = _gather_kv(k_cache, group)
    v = _gather_kv(v_cache, group)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=group.mask(sliding_window),
        scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: StepMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    store: bool = True,
) -> torch.Tensor:
    """Write a packed step's keys and values to the cache and attend every query.

    Args:
        layer: cache layer.
        q: ``(T, heads, head_dim)`` rotated queries in packed order.
        k: ``(T, kv_heads, head_dim)`` rotated keys.
        v: ``(T, kv_heads, head_dim)`` values.
        meta: the step's metadata.
        scaling: softmax scale (``None``: ``1/sqrt(head_dim)``).
        sliding_window: window of a sliding-attention layer, else ``None``.
        store: write ``k`` and ``v`` to their slots first (``False``: already written, e.g.
            by :func:`.cpu_kernels.rope_and_store`).

    Returns:
        ``(T, heads, head_dim)`` attention output in ``q``'s dtype.
    """
    k_cache = meta.cache.k(layer)
    v_cache = meta.cache.v(layer)
    if k.shape[1] != k_cache.shape[2] or k.shape[2] != k_cache.shape[3]:
        raise RuntimeError(
            f"layer {layer} produced keys with {k.shape[1]} heads of size {k.shape[2]} but "
            f"the KV cache was sized for {k_cache.shape[2]} heads of size {k_cache.shape[3]}"
        )
    if store:
        flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        # (T, kv_heads, head_dim) in packed order, written to each token's slot.
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))

    gqa = q.shape[1] != k.shape[1]
    parts: list[torch.Tensor] = []
    n_dec = meta.num_decode
    if n_dec and meta.use_kernel:
        assert meta.decode_table is not None and meta.decode_kv_lens is not None
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        parts.append(
            cpu_kernels.paged_decode_attention(
                q[:n_dec].contiguous(),
                k_cache,
                v_cache,
                meta.decode_table,
                meta.decode_kv_lens,
                scale,
                sliding_window,
            )
        )
    elif n_dec:
        for group in meta.decode:
            qg = q[group.offset : group.offset + group.size].unsqueeze(2)  # (B, heads, 1, dim)
            out = _attend(qg, k_cache, v_cache, group, scaling, sliding_window)
            parts.append(out.squeeze(2))
    for start, length in meta.fresh:
        # A sequence's first chunk only sees its own new keys: plain causal attention.
        qf = q[start : start + length].transpose(0, 1).unsqueeze(0)
        kf = k[start : start + length].transpose(0, 1).unsqueeze(0)
        vf = v[start : start + length].transpose(0, 1).unsqueeze(0)
        mask = None
        if sliding_window is not None and length > sliding_window:
            ar = torch.arange(length, device=q.device)
            diff = ar[:, None] - ar[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
        out = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        parts.append(out[0].transpose(0, 1))
    if meta.prefill is not None:
        group = meta.prefill
        assert group.q_index is not None and group.valid_index is not None
        qp = q[group.q_index].transpose(1, 2)  # (B, heads, q_len, head_dim)
        out = _attend(qp, k_cache, v_cache, group, scaling, sliding_window)
        heads, dim = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(group.size * group.q_len, heads, dim)
        parts.append(out[group.valid_index])
    attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return attn.to(q.dtype)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    polyrl_step: StepMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged KV cache for a packed batch (see the module docstring).

    Args:
        module: the attention module (its ``layer_idx`` picks the cache layer).
        query: ``(1, heads, T, head_dim)`` rotated queries of the packed new tokens.
        key: ``(1, kv_heads, T, head_dim)`` rotated keys of the new tokens.
        value: ``(1, kv_heads, T, head_dim)``.
        attention_mask: ignored (masks come from the step metadata).
        scaling: softmax scale (``None``: ``1/sqrt(head_dim)``).
        dropout: must be 0 (inference only).
        sliding_window: window of a sliding-attention layer, else ``None``.
        polyrl_step: the step's :class:`StepMetadata`.
        **kwargs: ignored extra arguments from the model.

    Returns:
        ``(1, T, heads, head_dim)`` attention output and ``None`` (no weights).
    """
    meta = polyrl_step
    if not isinstance(meta, StepMetadata):
        raise RuntimeError(
            f"{ATTENTION_NAME} attention only runs inside the polyrl rollout engine "
            "(the forward pass needs its polyrl_step metadata)"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot address KV cache")
    attn = paged_attention(
        layer,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        meta,
        scaling,
        sliding_window,
    )
    return attn.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
