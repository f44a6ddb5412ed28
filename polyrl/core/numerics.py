"""Token log-probabilities and entropies from logits, computed in chunks of tokens.

A plain ``log_softmax(logits.float())`` over a ``(tokens, vocab)`` tensor materialises the whole
fp32 softmax, and autograd keeps it alive until backward.  With a 150k vocabulary that is the
largest tensor of an RL step.  :func:`token_log_probs_and_entropy` instead walks over chunks of
tokens: forward keeps only one chunk's fp32 softmax at a time and saves nothing of that size
for backward, which recomputes each chunk's softmax from the (low-precision) logits.

All functions take a ``temperature``: logits are divided by it before the softmax, matching how a
sampler with that temperature drew the tokens.

Masked reductions over ``(B, T)`` tensors live here too: :func:`masked_sum`,
:func:`masked_mean`, :func:`masked_var`, :func:`masked_whiten`, and :func:`agg_loss`, the one
reduction of a per-token loss to a scalar (every loss of polyrl, from the policy losses to the
engine's SFT loss, aggregates with it).
"""

from __future__ import annotations

import torch

__all__ = [
    "AGG_MODES",
    "agg_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "shifted_token_log_probs",
    "token_entropy",
    "token_log_probs",
    "token_log_probs_and_entropy",
]


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, torch.Tensor):
        temperature = float(temperature)
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    return float(temperature)


def _check_chunk(chunk_size: int) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    return chunk_size


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """Autograd function over flat ``(N, V)`` logits; see :func:`token_log_probs_and_entropy`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        # fp32 at least (bf16/fp16 logits are upcast chunk by chunk); fp64 stays fp64.
        cdt = torch.promote_types(logits.dtype, torch.float32)
        logp = torch.empty(n, dtype=cdt, device=logits.device)
        ent = torch.empty(n if with_entropy else 0, dtype=cdt, device=logits.device)
        inv_t = 1.0 / temperature
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z = logits[start:stop].to(cdt)
            if temperature != 1.0:
                z = z * inv_t
            chunk_lse = torch.logsumexp(z, dim=-1)
            logp[start:stop] = z.gather(-1, labels[start:stop, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                p = torch.exp(z - chunk_lse[:, None])
                ent[start:stop] = chunk_lse - (p * z).sum(-1)
        ctx.save_for_backward(logits, labels, ent)
        ctx.compute_dtype = cdt
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp: torch.Tensor | None,
        grad_ent: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, labels, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        inv_t = 1.0 / temperature
        cdt = ctx.compute_dtype
        use_ent = ctx.with_entropy and grad_ent is not None
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            stop = min(start + chunk_size, logits.shape[0])
            z = logits[start:stop].to(cdt)
            if temperature != 1.0:
                z = z * inv_t
            if grad_logp is not None:
                gl = grad_logp[start:stop].to(cdt)[:, None]
            else:
                gl = torch.zeros(stop - start, 1, dtype=cdt, device=z.device)
            # Fused (in-place) forms of
            #   d logp_label / dz_j = 1[j = label] - p_j
            #   d H / dz_j          = -p_j (log p_j + H)
            if use_ent:
                ge = grad_ent[start:stop].to(cdt)[:, None]
                log_p = torch.log_softmax(z, dim=-1)
                p = log_p.exp()
                g = log_p.add_(ent[start:stop, None]).mul_(ge).add_(gl).mul_(p).neg_()
            else:
                g = torch.softmax(z, dim=-1).mul_(gl.neg())
            g.scatter_add_(-1, labels[start:stop, None], gl)
            if temperature != 1.0:
                g.mul_(inv_t)
            grad[start:stop] = g
        return grad, None, None, None, None


def _flatten(logits: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    if not isinstance(logits, torch.Tensor) or logits.ndim < 1:
        raise ValueError("logits must be a tensor of shape (..., vocab)")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if labels is None:
        return (flat,)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    flat_labels = labels.reshape(-1).long()
    if flat_labels.numel() and (flat_labels.min() < 0 or flat_labels.max() >= vocab):
        bad = flat_labels[(flat_labels < 0) | (flat_labels >= vocab)][0].item()
        raise ValueError(
            f"label {bad} is outside the vocabulary [0, {vocab}); padding positions must hold "
            "a valid token id (mask them out instead)"
        )
    return flat, flat_labels


def token_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each label and the entropy of each position's distribution.

    Args:
        logits: ``(..., V)`` logits in any float dtype (bf16 logits stay bf16 in memory).
        labels: ``(...)`` integer token ids in ``[0, V)``.
        temperature: logits are divided by it before the softmax (> 0).
        chunk_size: tokens per chunk; bounds the fp32 working set to ``chunk_size * V``.
        with_entropy: also compute the entropy (else the second result is ``None``).

    Returns:
        ``(log_probs, entropy)``, both fp32 (fp64 for fp64 logits) with the shape of
        ``labels``; differentiable with respect to ``logits``.
    """
    temperature = _check_temperature(temperature)
    chunk_size = _check_chunk(chunk_size)
    flat, flat_labels = _flatten(logits, labels)
    logp, ent = _ChunkedLogProbEntropy.apply(
        flat, flat_labels, temperature, chunk_size, bool(with_entropy)
    )
    shape = labels.shape
    return logp.view(shape), (ent.view(shape) if with_entropy else None)


def token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """``log softmax(logits / temperature)[label]`` per position, in fp32, chunked."""
    return token_log_probs_and_entropy(logits, labels, temperature, chunk_size, False)[0]


def token_entropy(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, in fp32, chunked."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    ent = token_log_probs_and_entropy(logits, labels, temperature, chunk_size, True)[1]
    assert ent is not None
    return ent


def shifted_token_log_probs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal-LM log-probs aligned with the tokens they score.

    ``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` from ``logits[:, t - 1]``;
    column 0 (no prediction) is 0.  The entropy, when asked for, is aligned the same way.

    Args:
        logits: ``(B, T, V)``.
        input_ids: ``(B, T)``.
        temperature: sampling temperature (logits are divided by it).
        chunk_size: tokens per chunk (see :func:`token_log_probs_and_entropy`).
        with_entropy: also return the aligned entropy (else ``None``).
    """
    if logits.ndim != 3 or input_ids.ndim != 2 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"expected logits (B, T, V) and input_ids (B, T), got {tuple(logits.shape)} and "
            f"{tuple(input_ids.shape)}"
        )
    b = input_ids.shape[0]
    # Score every position against the next token (a dummy for the last one) instead of slicing
    # logits[:, :-1]: flattening that slice would copy the whole logits tensor.
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    logp, ent = token_log_probs_and_entropy(logits, labels, temperature, chunk_size, with_entropy)
    zero = logp.new_zeros(b, 1)
    logp = torch.cat([zero, logp[:, :-1]], dim=1)
    if ent is not None:
        ent = torch.cat([zero, ent[:, :-1]], dim=1)
    return logp, ent


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true (masked entries may hold NaN/inf safely)."""
    if values.shape != mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} and mask shape {tuple(mask.shape)} differ"
        )
    kept = torch.where(
        mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)
    )
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over true ``mask`` entries; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over true ``mask`` entries (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(values, mask)
    count = mask.bool().sum().to(values.dtype)
    if unbiased:
        count = count - 1
    return masked_sum((values - mean) ** 2, mask) / count.clamp(min=1.0)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` over true ``mask`` entries (Bessel variance).

    Statistics come from the masked entries only; entries off the mask are 0.
    """
    whitened = (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened.masked_fill(~mask.bool(), 0.0)


#: Loss aggregation modes of :func:`agg_loss` (verl's spelling).
AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "sum",
)


def _count(value: float | None, local: torch.Tensor, what: str) -> torch.Tensor | float:
    """Return a denominator: the caller's (global) count if given, else the local one; >= 1."""
    if value is None:
        return local.clamp(min=1)
    value = float(value)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return max(value, 1.0)


def agg_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    horizon: int | float | None = None,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``values (B, T)`` to a scalar over ``mask`` using ``mode``.

    ``mask`` holds 0/1 or per-token weights ``M``; with ``L*M`` summed only where ``M != 0``
    (so masked-out entries may hold NaN/inf), ``N`` the number of tokens with ``M != 0`` and
    ``S`` the number of rows holding one:

    - ``token-mean``: ``sum(L*M) / N``
    - ``seq-mean-token-sum``: ``sum_rows(sum_t L*M) / S``
    - ``seq-mean-token-mean``: ``sum_rows(sum_t L*M / sum_t M) / S``
    - ``seq-mean-token-sum-norm``: ``sum(L*M) / (B * H)`` with a constant horizon ``H``
      (default ``T``), the Dr. GRPO normalisation without length bias
    - ``sum``: ``sum(L*M)``, no normalisation.

    ``num_tokens`` / ``num_seqs`` replace ``N`` / ``S`` (and ``B`` in ``seq-mean-token-sum-norm``).
    A model engine that splits one mini-batch into micro-batches passes the mini-batch-wide
    counts, so the micro-batch losses add up to the mini-batch loss whatever the split.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(mask.shape)}")
    if values.shape != mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(values.shape)} must equal mask shape {tuple(mask.shape)}"
        )
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}")
    weights = mask.to(values.dtype)
    on = mask != 0
    if mode == "sum":
        return masked_sum(values * weights, on)
    if mode == "token-mean":
        return masked_sum(values * weights, on) / _count(num_tokens, on.sum(), "num_tokens")
    if mode == "seq-mean-token-sum-norm":
        h = values.shape[-1] if horizon is None else horizon
        if h <= 0:
            raise ValueError(f"horizon must be positive, got {h}")
        rows = values.shape[0] if num_seqs is None else max(float(num_seqs), 1.0)
        return masked_sum(values * weights, on) / (rows * h)
    per_row = masked_sum(values * weights, on, dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / weights.sum(-1).clamp(min=1.0)
    return per_row.sum() / _count(num_seqs, on.any(-1).sum(), "num_seqs")
