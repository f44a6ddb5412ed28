"""Attention for low-precision compute on CPU: SDPA with fp32 inputs.

PyTorch's CPU flash-attention kernel is 2-3x slower in bfloat16 than in float32 (forward plus
backward at RL-sized shapes), while the matmuls around it gain ~2.3x from bf16.  Under bf16 mixed
precision on CPU the engine therefore switches Hugging Face's ``sdpa`` attention to
``polyrl_sdpa_fp32``: the same function with query, key and value upcast to fp32 and the output
cast back.  The values differ from bf16 SDPA only by rounding (better), and memory stays that of
a flash kernel (no ``(heads, q, k)`` probability tensor as in the math path).  On any other
device or dtype the function is plain ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FP32_SDPA", "register_fp32_sdpa", "use_fp32_sdpa_on_cpu"]

#: Name under which the fp32-upcast SDPA is registered with transformers.
FP32_SDPA = "polyrl_sdpa_fp32"

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _fp32_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if query.device.type != "cpu" or dtype not in _LOW_PRECISION:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask must match the query dtype
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs
    )
    return out.to(dtype), weights


def register_fp32_sdpa() -> str:
    """Register :data:`FP32_SDPA` with transformers (attention and mask); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(FP32_SDPA, _fp32_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_SDPA, sdpa_mask)
    return FP32_SDPA


def use_fp32_sdpa_on_cpu(
    model: nn.Module, compute_dtype: torch.dtype, device: torch.device
) -> None:
    """Switch ``model`` from ``sdpa`` to :data:`FP32_SDPA` for low-precision compute on CPU.

    Only a Hugging Face model (or a wrapper with a ``backbone``) whose attention is ``sdpa``
    switches, and only for a bf16/fp16 ``compute_dtype`` on a CPU ``device``.
    """
    if device.type != "cpu" or compute_dtype not in _LOW_PRECISION:
        return
    target = getattr(model, "backbone", model)
    if getattr(getattr(target, "config", None), "_attn_implementation", None) == "sdpa":
        target.set_attn_implementation(register_fp32_sdpa())
