"""Batched next-token sampling with per-row parameters and per-row random streams.

Every row (one sequence) brings its own temperature, top-k, top-p, min-p, repetition penalty
and random generator; the math is vectorised over rows and every step of it is row-local, so a
row's token depends only on its own logits and its own generator. A seeded request owns a
``torch.Generator`` that advances once per sampled token, which is why the same seed gives the
same tokens whatever else shares the batch (and after a preemption).

Sampling uses the exponential race (Gumbel-max): ``argmax(z - log(E))`` with ``E ~ Exp(1)``
drawn per vocabulary entry is an exact draw from ``softmax(z)`` restricted to the unmasked
entries.

Log-probs are those of the *model* distribution at the request's temperature,
``log_softmax(logits / T)`` in fp32 (``T = 1`` for greedy), computed by
:func:`polyrl.model.numerics.token_log_probs` exactly as the training engine computes them;
top-k/top-p/min-p filtering and repetition penalty shape the draw but not the reported values.
"""

from __future__ import annotations

import dataclasses

import torch

from polyrl.model.numerics import token_log_probs

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]


@dataclasses.dataclass
class SamplingRow:
    """Sampling settings of one row."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generator: torch.Generator | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # Token ids the repetition penalty applies to (prompt and output so far).
    seen_tokens: list[int] | None = None


@dataclasses.dataclass
class SamplerOutput:
    """Results per row: token, its log-prob (or ``None``), its top alternatives (or ``None``)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row from ``(rows, vocab)`` logits.

    Args:
        device: device of the logits.
        seed: seed of the shared generator used by rows without their own.
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """Create the generator of one seeded sequence."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def _penalise(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        penalties = [r.repetition_penalty for r in rows]
        if all(p == 1.0 for p in penalties):
            return logits
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for i, row in enumerate(rows):
            if row.repetition_penalty != 1.0 and row.seen_tokens:
                seen[i, torch.tensor(row.seen_tokens, device=logits.device)] = True
        pen = torch.tensor(penalties, device=logits.device, dtype=logits.dtype)[:, None]
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        return torch.where(seen, penalised, logits)

    def _filter(self, z: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Mask (to -inf) what top-k, top-p and min-p exclude, row by row."""
        if all(r.top_k <= 0 and r.top_p >= 1.0 and r.min_p <= 0.0 for r in rows):
            return z
        dev = z.device
        vocab = z.shape[-1]
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        ranks = torch.arange(vocab, device=dev)[None, :]
        k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=dev)
        remove = ranks >= k[:, None]
        # inf for disabled rows: cumulative sums that round to >= 1 must not drop the tail.
        p = torch.tensor(
            [r.top_p if r.top_p < 1.0 else float("inf") for r in rows], device=dev, dtype=z.dtype
        )
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= p[:, None]
        min_p = torch.tensor([r.min_p for r in rows], device=dev, dtype=z.dtype)
        remove |= probs < (min_p[:, None] * probs[:, :1])
        sorted_z = sorted_z.masked_fill(remove, float("-inf"))
        return torch.empty_like(z).scatter_(-1, order, sorted_z)

    def _noise(self, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
        """``-log(E)``, ``E ~ Exp(1)`` i.i.d., one row per sampled row, from each row's stream."""
        e = torch.empty((len(rows), vocab), device=self.device)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            e.exponential_(generator=self.generator)
        else:
            if shared:
                e[shared] = torch.empty((len(shared), vocab), device=self.device).exponential_(
                    generator=self.generator
                )
            for i, row in enumerate(rows):
                if row.generator is not None:
                    e[i].exponential_(generator=row.generator)
        # E == 0 (a rounded draw) would give inf, and nan against a masked -inf logit.
        return e.clamp_min_(torch.finfo(e.dtype).tiny).log_().neg_()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``(R, V)`` next-token logits (any float dtype).
            rows: ``R`` sampling settings, in row order.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        dev = logits.device
        logits = logits.float()
        temps = [r.temperature for r in rows]
        scale = [1.0 / t if t > 0 else 1.0 for t in temps]
        inv_t = torch.tensor(scale, device=dev)[:, None] if any(s != 1.0 for s in scale) else None
        scaled = logits * inv_t if inv_t is not None else logits
        penalised = self._penalise(logits, rows)
        z = (
            scaled
            if penalised is logits
            else (penalised * inv_t if inv_t is not None else penalised)
        )

        sampled = [i for i, t in enumerate(temps) if t > 0]
        # Greedy rows take the argmax; with none, skip it (the usual all-sampled batch).
        tokens = z.argmax(dim=-1) if len(sampled) < len(rows) else None
        if sampled:
            if len(sampled) == len(rows):
                sel_rows, zs = rows, z
            else:
                sel_rows = [rows[i] for i in sampled]
                zs = z[torch.tensor(sampled, device=dev)]
            zs = self._filter(zs, sel_rows)
            drawn = (zs + self._noise(sel_rows, zs.shape[-1])).argmax(dim=-1)
            if tokens is None:
                tokens = drawn
            else:
                tokens[torch.tensor(sampled, device=dev)] = drawn
        assert tokens is not None

        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * len(rows)
        if any(r.logprobs for r in rows):
            # scaled already holds logits / T, so numerics runs at temperature 1.
            values = token_log_probs(scaled, tokens, temperature=1.0).tolist()
            logprobs = [v if r.logprobs else None for v, r in zip(values, rows, strict=True)]
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        k_max = max(r.top_logprobs for r in rows)
        if k_max > 0:
            want = [i for i, r in enumerate(rows) if r.top_logprobs > 0]
            lsm = torch.log_softmax(scaled[torch.tensor(want, device=dev)], dim=-1)
            vals, ids = lsm.topk(min(k_max, lsm.shape[-1]), dim=-1)
            for j, i in enumerate(want):
                k = rows[i].top_logprobs
                top[i] = list(zip(ids[j, :k].tolist(), vals[j, :k].tolist(), strict=True))
        return SamplerOutput(token_list, logprobs, top)
