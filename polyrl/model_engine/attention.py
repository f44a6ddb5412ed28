"""Attention for low-precision training compute on CPU.

PyTorch's CPU flash-attention kernel is 2-3x slower in bfloat16 than in float32 at RL-sized
shapes, while the matmuls around it gain ~2.3x from bf16; and at short sequences even its fp32
form spends most of its time outside arithmetic.  Under bf16/fp16 mixed precision on CPU the
engine therefore switches Hugging Face's ``sdpa`` attention to :data:`CPU_SDPA`, which picks per
call:

* **grouped math attention** when the score tensor is small (at most
  :data:`MATH_MAX_SCORES` entries): ``softmax(q k^T * scale + mask) v`` as two batched matmuls
  per key/value head, the query heads that share that head stacked into one matmul (no
  ``repeat_kv`` copy), and the softmax on the low-precision scores (its kernel accumulates in
  fp32).  It keeps the ``(heads, q, k)`` probabilities for the backward, hence the size limit;
  forward plus backward is ~2.5x faster than the fp32 flash kernel at 128 x 64-token rows.
* otherwise **SDPA on fp32 inputs**: query, key and value upcast, the output cast back.

Masked-out positions get the dtype's most negative finite value rather than ``-inf``, so a
query row with no visible key (left padding) attends uniformly instead of producing NaN; such
rows are padding, which no loss reads and no real token attends to.  On any other device or
dtype the function is plain ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["CPU_SDPA", "MATH_MAX_SCORES", "register_cpu_sdpa", "use_cpu_sdpa"]

#: Name under which the CPU low-precision attention is registered with transformers.
CPU_SDPA = "polyrl_cpu_sdpa"

#: Most ``batch * heads * q_len * k_len`` entries for which the math path is used (its saved
#: probabilities then take at most 32 MiB per layer in bf16).
MATH_MAX_SCORES = 1 << 24

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _grouped_math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    is_causal: bool,
) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask) v`` with grouped query heads; ``(b, q, heads, d)`` out.

    ``query`` is ``(b, heads, q, d)``, ``key``/``value`` ``(b, kv_heads, k, d)``, and a mask
    ``(b or 1, 1, q, k)`` (bool: True attends; float: additive).
    """
    b, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    lowest = torch.finfo(query.dtype).min
    bias: torch.Tensor | None = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~attention_mask, lowest)
        else:  # additive; -inf (or fp32's min, which overflows) clamps to a finite value
            bias = attention_mask.to(query.dtype).clamp_min(lowest)
        bias = bias.view(bias.shape[0], 1, 1, q_len, k_len)
    elif is_causal and q_len > 1:
        # Top-left aligned, as SDPA's is_causal (HF passes no mask only when that is right).
        bias = torch.full((q_len, k_len), lowest, dtype=query.dtype, device=query.device).triu(1)
    # Scaling the (smaller) query rather than the scores saves a pass over the scores.
    stacked = (query * scaling).reshape(b, kv_heads, groups * q_len, dim)
    scores = torch.matmul(stacked, key.transpose(-1, -2)).view(b, kv_heads, groups, q_len, k_len)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, groups * q_len, k_len)
    out = torch.matmul(probs, value).view(b, heads, q_len, dim)
    return out.transpose(1, 2).contiguous()


def _math_applies(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    b, heads, q_len, _ = query.shape
    if dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    if heads % key.shape[1] or b * heads * q_len * key.shape[2] > MATH_MAX_SCORES:
        return False
    # A per-head mask would need its own layout; HF's causal-LM masks are shared by all heads.
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)


def _cpu_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in _LOW_PRECISION:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if _math_applies(query, key, attention_mask, dropout, kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return _grouped_math_attention(query, key, value, attention_mask, scale, causal), None
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query dtype
    out, weights = sdpa_attention_forward(
        module,
        query.float(),
        key.float(),
        value.float(),
        attention_mask,
        dropout,
        scaling,
        is_causal,
        **kwargs,
    )
    return out.to(dtype), weights


def register_cpu_sdpa() -> str:
    """Register :data:`CPU_SDPA` with transformers (attention and mask); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CPU_SDPA, _cpu_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_SDPA, sdpa_mask)
    return CPU_SDPA


def use_cpu_sdpa(model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
    """Switch ``model`` from ``sdpa`` to :data:`CPU_SDPA` for low-precision compute on CPU.

    Only a Hugging Face model (or a wrapper with a ``backbone``) whose attention is ``sdpa``
    switches, and only for a bf16/fp16 ``compute_dtype`` on a CPU ``device``.
    """
    if device.type != "cpu" or compute_dtype not in _LOW_PRECISION:
        return
    target = getattr(model, "backbone", model)
    if getattr(getattr(target, "config", None), "_attn_implementation", None) == "sdpa":
        target.set_attn_implementation(register_cpu_sdpa())
