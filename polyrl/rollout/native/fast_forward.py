"""The engine's own packed forward for Llama-family decoders, on the HF module's weights.

A HF model forward costs a few hundred Python-level module calls, decorators and output
objects per step; on small models and short decode steps that overhead, not the arithmetic,
sets the step time. :class:`FastForward` walks the same modules but calls the tensor ops
directly (``F.linear`` on each projection's ``weight``/``bias``, fused RMSNorm, one rotary
embedding per step, the paged attention of :mod:`.attention`), keeps the packed tokens as a
2-D ``(T, hidden)`` batch, and normalises and projects only the rows whose logits are sampled.
When the step uses the C kernels (CPU, float32; see :mod:`.cpu_kernels`), RoPE and the KV-cache
store are one call per layer, each residual add is fused into the following RMSNorm, and the
gated MLP's ``silu(gate) * up`` is one pass.

It keeps the modules' ``nn.Parameter`` objects and reads their current tensors at call time,
so in-place weight updates, pointer swaps and sleep/wake (which all replace ``.data``) need no
bookkeeping here. The exception is a *matmul dtype* below the weights' dtype (e.g. bf16 matmuls
over fp32 weights on a CPU with AVX512-BF16, where a bf16 GEMM at decode shapes is ~1.6x faster):
each decoder layer's projections then run on packed low-precision copies (q/k/v as one matrix,
gate/up as one) built on first use, which the owner must drop with :meth:`FastForward.invalidate`
whenever the weights change. Norms, RoPE, attention, the KV cache and the LM head stay in the
weights' dtype. :func:`build_fast_forward` returns ``None`` for any
model whose structure it does not recognise exactly (the runner then keeps the HF forward);
mixture-of-experts and other non-standard MLP blocks are called as modules.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyrl.rollout.native import cpu_kernels
from polyrl.rollout.native.attention import StepMetadata, paged_attention

__all__ = ["SUPPORTED_MODEL_TYPES", "FastForward", "build_fast_forward"]

logger = logging.getLogger(__name__)

#: ``config.model_type`` values whose decoder layers this forward reproduces.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"})

#: HF ``rope_type`` values whose cos/sin are a fixed function of the position.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def _is_rms_norm(module: Any) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _is_linear(module: Any) -> bool:
    return type(module) is nn.Linear


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    # Low precision: normalise in fp32 exactly as the HF modules do.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` of shape ``(T, heads, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer:
    """The modules of one decoder layer, and their parameters, looked up once.

    The parameters are kept as the ``nn.Parameter`` objects themselves (``nn.Module``
    attribute lookups cost about a microsecond each, ~140 per step): weight updates, pointer
    swaps and sleep/wake all replace a parameter's ``.data``, never the parameter, so each call
    still computes with the current tensors.
    """

    def __init__(self, layer: nn.Module):
        attn = layer.self_attn
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_proj, self.k_proj = attn.q_proj, attn.k_proj
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self.q_w, self.q_b = attn.q_proj.weight, attn.q_proj.bias
        self.k_w, self.k_b = attn.k_proj.weight, attn.k_proj.bias
        self.v_w, self.v_b = attn.v_proj.weight, attn.v_proj.bias
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.input_w = self.input_norm.weight
        self.input_eps = float(self.input_norm.variance_epsilon)
        self.post_w = self.post_norm.weight
        self.post_eps = float(self.post_norm.variance_epsilon)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.layer_idx = int(attn.layer_idx)
        self.scaling = float(attn.scaling)
        self.sliding_window = getattr(attn, "sliding_window", None)
        self.head_dim = int(attn.head_dim)
        mlp = layer.mlp
        self.dense = all(
            _is_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")
        ) and _is_silu(getattr(mlp, "act_fn", None))
        self.mlp = mlp
        if self.dense:
            self.gate_w, self.gate_b = mlp.gate_proj.weight, mlp.gate_proj.bias
            self.up_w, self.up_b = mlp.up_proj.weight, mlp.up_proj.bias
            self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias


def _check_layer(layer: nn.Module) -> str | None:
    """Why ``layer`` is not a decoder layer this forward reproduces (``None``: it is)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return "no self_attn"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not _is_linear(getattr(attn, name, None)):
            return f"self_attn.{name} is not an nn.Linear"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not _is_rms_norm(getattr(layer, name, None)):
            return f"{name} is not an RMSNorm"
    for name in ("q_norm", "k_norm"):
        if getattr(attn, name, None) is not None and not _is_rms_norm(getattr(attn, name)):
            return f"self_attn.{name} is not an RMSNorm"
    for name in ("layer_idx", "scaling", "head_dim"):
        if getattr(attn, name, None) is None:
            return f"self_attn has no {name}"
    if getattr(layer, "mlp", None) is None:
        return "no mlp"
    return None


def _pack(
    dtype: torch.dtype, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack projections' weights (and biases) row-wise into one projection cast to ``dtype``.

    A projection without a bias next to one with a bias gets zeros in the packed bias.
    """
    weight = torch.cat([w.detach() for w in weights]).to(dtype)
    if all(b is None for b in biases):
        return weight, None
    parts = [
        torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b.detach()
        for w, b in zip(weights, biases, strict=True)
    ]
    return weight, torch.cat(parts).to(dtype)


class _LowPrecisionLayer:
    """One decoder layer's projections cast to the matmul dtype, q/k/v and gate/up packed."""

    def __init__(self, layer: _Layer, dtype: torch.dtype):
        self.split = (layer.q_w.shape[0], layer.k_w.shape[0], layer.v_w.shape[0])
        self.qkv_w, self.qkv_b = _pack(
            dtype, [layer.q_w, layer.k_w, layer.v_w], [layer.q_b, layer.k_b, layer.v_b]
        )
        self.o_w, self.o_b = _pack(dtype, [layer.o_w], [layer.o_b])
        if layer.dense:
            self.inter = layer.gate_w.shape[0]
            self.gate_up_w, self.gate_up_b = _pack(
                dtype, [layer.gate_w, layer.up_w], [layer.gate_b, layer.up_b]
            )
            self.down_w, self.down_b = _pack(dtype, [layer.down_w], [layer.down_b])


class FastForward:
    """Packed forward of a Llama/Qwen-family causal LM over the paged KV cache.

    Args:
        model: the HF causal LM (its modules and weights are used as they are).
        matmul_dtype: dtype of the decoder layers' projection matmuls; ``None`` (or the
            weights' dtype) uses the weights themselves. A lower one runs on cached cast copies
            (see the module docstring and :meth:`invalidate`).
    """

    def __init__(self, model: nn.Module, matmul_dtype: torch.dtype | None = None):
        base = model.model
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer) for layer in base.layers]
        # Rotary types whose cos/sin depend on the position alone (the others rescale with the
        # sequence length): those come from a table of every position up to the longest seen.
        rope_type = getattr(self.rotary, "rope_type", None)  # a dict on per-layer-type models
        self._rope_static = isinstance(rope_type, str) and rope_type in _STATIC_ROPE_TYPES
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dtype = self.embed.weight.dtype
        self.matmul_dtype = None if matmul_dtype in (None, self.dtype) else matmul_dtype
        self._low: list[_LowPrecisionLayer] | None = None
        self._no_low: list[_LowPrecisionLayer | None] = [None] * len(self.layers)

    def invalidate(self) -> None:
        """Drop the low-precision weight copies; call whenever the weights change or move."""
        self._low = None

    def _low_layers(self) -> list[_LowPrecisionLayer] | None:
        if self.matmul_dtype is None:
            return None
        if self._low is None:
            self._low = [_LowPrecisionLayer(layer, self.matmul_dtype) for layer in self.layers]
        return self._low

    def _cos_sin(
        self, h: torch.Tensor, position_ids: torch.Tensor, highest: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``(T, head_dim)`` contiguous cosines and sines of the packed tokens' positions.

        The HF rotary module recomputes them every step (a handful of small ops, ~0.1 ms at
        decode sizes). For static rotary types they are rows of a table built by the same
        module over positions ``0..n-1``: each row depends on its position only, so the rows
        are bit for bit what the module returns for that position in any batch.
        """
        if not self._rope_static:
            cos, sin = self.rotary(h.unsqueeze(0), position_ids.unsqueeze(0))
            return cos[0].contiguous(), sin[0].contiguous()
        table = self._rope_table
        if highest is None:  # a device sync on GPU: callers pass it when they know it
            highest = int(position_ids.max()) if position_ids.numel() else 0
        if table is None or highest >= table[0].shape[0]:
            size = max(1024, 1 << highest.bit_length())  # grows by doubling
            positions = torch.arange(size, device=position_ids.device)
            cos, sin = self.rotary(h[:1].unsqueeze(0), positions.unsqueeze(0))
            table = self._rope_table = (cos[0].contiguous(), sin[0].contiguous())
        return table[0].index_select(0, position_ids), table[1].index_select(0, position_ids)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        meta: StepMetadata,
        low: _LowPrecisionLayer | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        hd = layer.head_dim
        if low is None:
            q = F.linear(x, layer.q_w, layer.q_b).view(t, -1, hd)
            k = F.linear(x, layer.k_w, layer.k_b).view(t, -1, hd)
            v = F.linear(x, layer.v_w, layer.v_b).view(t, -1, hd)
        else:
            qkv = F.linear(x.to(low.qkv_w.dtype), low.qkv_w, low.qkv_b).to(x.dtype)
            q, k, v = (part.contiguous().view(t, -1, hd) for part in qkv.split(low.split, 1))
        if layer.q_norm is not None:
            q = _rms_norm(q, layer.q_norm)
        if layer.k_norm is not None:
            k = _rms_norm(k, layer.k_norm)
        if meta.use_kernel:
            # One C call rotates q and k in place and stores k and v in the cache.
            cache = meta.cache
            k_cache, v_cache = cache.k(layer.layer_idx), cache.v(layer.layer_idx)
            q, k = q.contiguous(), k.contiguous()
            cpu_kernels.rope_and_store(
                q, k, v, self._cos2d, self._sin2d, meta.slot_mapping, k_cache, v_cache
            )
            store = False
        else:
            q = _rope(q, self._cos, self._sin)
            k = _rope(k, self._cos, self._sin)
            store = True
        out = paged_attention(
            layer.layer_idx, q, k, v, meta, layer.scaling, layer.sliding_window, store
        ).reshape(t, -1)
        if low is not None:
            return F.linear(out.to(low.o_w.dtype), low.o_w, low.o_b).to(x.dtype)
        return F.linear(out, layer.o_w, layer.o_b)

    def _mlp(
        self,
        layer: _Layer,
        x: torch.Tensor,
        fused: bool = False,
        low: _LowPrecisionLayer | None = None,
    ) -> torch.Tensor:
        if not layer.dense:
            return layer.mlp(x.unsqueeze(0))[0]
        if low is not None:
            # silu(gate) * up in the matmul dtype too: it feeds the down projection directly.
            gate_up = F.linear(x.to(low.gate_up_w.dtype), low.gate_up_w, low.gate_up_b)
            gate, up = gate_up.split(low.inter, 1)
            return F.linear(F.silu(gate) * up, low.down_w, low.down_b).to(x.dtype)
        gate = F.linear(x, layer.gate_w, layer.gate_b)
        up = F.linear(x, layer.up_w, layer.up_b)
        # The C kernel does silu and the product in one pass (two torch ops otherwise).
        mid = cpu_kernels.silu_mul(gate, up) if fused else F.silu(gate) * up
        return F.linear(mid, layer.down_w, layer.down_b)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_index: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Run one packed step.

        Args:
            input_ids: ``(T,)`` packed token ids.
            position_ids: ``(T,)`` their positions.
            logits_index: ``(S,)`` packed rows whose next-token logits are wanted.
            meta: the step's paged-attention metadata.

        Returns:
            ``(S, vocab)`` logits.
        """
        h = F.embedding(input_ids, self.embed.weight)
        self._cos2d, self._sin2d = self._cos_sin(h, position_ids, meta.max_position)
        # (T, 1, head_dim): broadcast over heads.
        self._cos, self._sin = self._cos2d.unsqueeze(1), self._sin2d.unsqueeze(1)
        lows = self._low_layers() or self._no_low
        try:
            if meta.use_kernel:
                return self._layers_fused(h, logits_index, meta, lows)
            for layer, low in zip(self.layers, lows, strict=True):
                h = h + self._attention(layer, _rms_norm(h, layer.input_norm), meta, low)
                h = h + self._mlp(layer, _rms_norm(h, layer.post_norm), low=low)
        finally:
            self._cos = self._sin = self._cos2d = self._sin2d = None
        # Norm and head only for the rows that are sampled (the norm is row-wise).
        h = _rms_norm(h.index_select(0, logits_index), self.norm)
        return F.linear(h, self.lm_head.weight, self.lm_head.bias)

    def _layers_fused(
        self,
        h: torch.Tensor,
        logits_index: torch.Tensor,
        meta: StepMetadata,
        lows: list[_LowPrecisionLayer | None],
    ) -> torch.Tensor:
        """Run the layers, each residual add fused into the next RMSNorm (one C call each)."""
        delta: torch.Tensor | None = None
        for layer, low in zip(self.layers, lows, strict=True):
            x = cpu_kernels.add_rms_norm(h, delta, layer.input_w, layer.input_eps)
            attn = self._attention(layer, x, meta, low).contiguous()
            x = cpu_kernels.add_rms_norm(h, attn, layer.post_w, layer.post_eps)
            delta = self._mlp(layer, x, fused=True, low=low).contiguous()
        rows = h.index_select(0, logits_index)
        last = None if delta is None else delta.index_select(0, logits_index)
        x = cpu_kernels.add_rms_norm(rows, last, self.norm.weight, self.norm.variance_epsilon)
        return F.linear(x, self.lm_head.weight, self.lm_head.bias)

    _cos: torch.Tensor | None = None
    _sin: torch.Tensor | None = None
    _cos2d: torch.Tensor | None = None
    _sin2d: torch.Tensor | None = None


def build_fast_forward(
    model: nn.Module, matmul_dtype: torch.dtype | None = None
) -> FastForward | None:
    """Return a :class:`FastForward` for ``model``, or ``None`` where it does not apply.

    ``matmul_dtype`` is passed to :class:`FastForward`.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return None
    base = getattr(model, "model", None)
    problem = None
    if base is None:
        problem = "no .model"
    elif type(getattr(base, "embed_tokens", None)) is not nn.Embedding:
        problem = "embed_tokens is not an nn.Embedding"
    elif not _is_rms_norm(getattr(base, "norm", None)):
        problem = "final norm is not an RMSNorm"
    elif getattr(base, "rotary_emb", None) is None:
        problem = "no rotary_emb"
    elif not _is_linear(getattr(model, "lm_head", None)):
        problem = "lm_head is not an nn.Linear"
    elif getattr(config, "final_logit_softcapping", None) or getattr(
        config, "attn_logit_softcapping", None
    ):
        problem = "logit soft-capping"
    else:
        for i, layer in enumerate(base.layers):
            why = _check_layer(layer)
            if why is not None:
                problem = f"layer {i}: {why}"
                break
    if problem is not None:
        logger.info("fast forward not used for %s (%s); using the HF forward", model_type, problem)
        return None
    return FastForward(model, matmul_dtype)
