"""Batched next-token sampling with per-row parameters and per-row random streams.

Every row (one sequence) brings its own temperature, top-k, top-p, min-p, repetition penalty
and random stream; the math is vectorised over rows and every step of it is row-local, so a
row's token depends only on its own logits and its own stream.

Sampling is by inversion: one uniform ``u`` per row, and the token is the first vocabulary
entry whose cumulative probability (of ``softmax(z)`` over the unmasked entries) exceeds
``u * total``. That needs one uniform per row and step instead of one random number per
vocabulary entry.

A seeded row draws its uniforms from a counter-based stream: the uniform of its ``c``-th draw
is a pure function of ``(seed, c)`` (the ``c``-th output of SplitMix64 started from the seed),
computed exactly with Python integers, so no generator object is needed and all rows are
drawn at once. The row's draw counter (:attr:`SamplingRow.draws`) lives in the request state
and advances once per sampled token, which is why the same seed gives the same tokens whatever
else shares the batch, and after a preemption (the recomputed sequence keeps its tokens and
its counter). Rows without a seed take their uniforms from the sampler's shared generator.

Log-probs are those of the *model* distribution at the request's temperature,
``log_softmax(logits / T)`` in fp32 (``T = 1`` for greedy), computed by
:func:`polyrl.core.numerics.token_log_probs` exactly as the training engine computes them;
top-k/top-p/min-p filtering and repetition penalty shape the draw but not the reported values.
"""

from __future__ import annotations

import dataclasses

import torch

from polyrl.core.numerics import token_log_probs
from polyrl.rollout.native import cpu_kernels

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "seeded_uniform"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd; 2**64 / golden ratio)
# Uniforms carry 23 random bits so that every value, ``(k + 0.5) / 2**23``, and its products
# below 1 are exact or correctly rounded in float32 and lie strictly inside (0, 1).
_UNIFORM_BITS = 23
_UNIFORM_SCALE = 2.0**-_UNIFORM_BITS


def _mix64(x: int) -> int:
    """SplitMix64's output function (a bijection of 64-bit integers with full avalanche)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, counter: int) -> float:
    """Return the uniform in ``(0, 1)`` of draw ``counter`` of the stream seeded with ``seed``.

    Draw ``c`` is output ``c`` of SplitMix64 whose state starts at a hash of the seed, so it
    depends on ``(seed, c)`` only; the top :data:`_UNIFORM_BITS` bits give the value.
    """
    return _uniform_at(_mix64(seed & _MASK64), counter)


def _uniform_at(start: int, counter: int) -> float:
    """:func:`seeded_uniform` from the stream's start state (``_mix64`` of the seed)."""
    state = (start + (counter + 1) * _GAMMA) & _MASK64
    return ((_mix64(state) >> (64 - _UNIFORM_BITS)) + 0.5) * _UNIFORM_SCALE


@dataclasses.dataclass
class SamplingRow:
    """Sampling settings of one row."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Seed of the row's own stream (None: the sampler's shared generator) and how many
    # uniforms the row has drawn from it (advanced by the sampler, kept across preemption).
    seed: int | None = None
    draws: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # Token ids the repetition penalty applies to (prompt and output so far).
    seen_tokens: list[int] | None = None
    # (seed, its stream's start state): the hash of the seed, computed once, not every step.
    _start: tuple[int, int] | None = dataclasses.field(default=None, repr=False, compare=False)

    def stream_start(self) -> int:
        """Start state of this row's seeded stream (``seed`` must be set)."""
        assert self.seed is not None
        cached = self._start
        if cached is None or cached[0] != self.seed:
            cached = self._start = (self.seed, _mix64(self.seed & _MASK64))
        return cached[1]


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
        use_kernels: on CPU with float32, draw with the C kernel of :mod:`.cpu_kernels`
            (the same tokens as the torch path, one pass instead of five ops) when it is
            available.
    """

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        use_kernels: bool = True,
        suppressed_ids: tuple[int, ...] = (),
    ):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.use_kernels = use_kernels
        # Never drawn (a vision model's media placeholders: a sampled one would claim an image
        # the sequence does not have). Only the draw is masked: reported log-probs stay the
        # model's own, as the engines compute them.
        self.suppressed = (
            torch.tensor(suppressed_ids, dtype=torch.long, device=device)
            if suppressed_ids
            else None
        )

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

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One float32 uniform per row: seeded rows from their own stream, others shared.

        Advances each seeded row's draw counter.
        """
        values: list[float] = []
        shared: list[int] = []
        for i, row in enumerate(rows):
            if row.seed is None:
                shared.append(i)
                values.append(0.5)
            else:
                values.append(_uniform_at(row.stream_start(), row.draws))
                row.draws += 1
        u = torch.tensor(values, dtype=torch.float32)
        if shared:
            drawn = torch.rand(len(shared), generator=self.generator, device=self.device)
            if len(shared) == len(rows):
                return drawn
            u[shared] = drawn.cpu()
        return u.to(self.device, non_blocking=True)

    def _draw(self, z: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one entry per row of ``softmax(z)`` by inversion (``-inf`` entries never)."""
        if (
            self.use_kernels
            and z.dtype is torch.float32
            and z.device.type == "cpu"
            and cpu_kernels.available()
        ):
            z = z.contiguous()
            return cpu_kernels.inverse_sample(torch.softmax(z, dim=-1), z, self._uniforms(rows))
        cdf = torch.softmax(z, dim=-1).cumsum_(dim=-1)
        target = self._uniforms(rows)[:, None] * cdf[:, -1:]
        # The first entry whose cumulative probability exceeds the target; zero-probability
        # entries repeat their predecessor's value, so they are never the first to exceed it.
        drawn = torch.searchsorted(cdf, target, right=True).squeeze_(1)
        vocab = z.shape[-1]
        drawn.clamp_max_(vocab - 1)
        # Only a target rounded up to the row's total can pass its last positive entry (and
        # land on a masked tail): move those rare rows back to their last positive entry.
        picked = z.gather(1, drawn[:, None]).squeeze_(1)
        bad = picked == float("-inf")
        if bool(bad.any()):
            last = (cdf[bad] < cdf[bad, -1:]).sum(dim=-1)
            drawn[bad] = last.clamp_max_(vocab - 1)
        return drawn

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

        if self.suppressed is not None:
            z = z.clone() if z is scaled else z
            z[:, self.suppressed] = float("-inf")

        sampled = [i for i, t in enumerate(temps) if t > 0]
        # Greedy rows take the argmax; with none, skip it (the usual all-sampled batch).
        tokens = z.argmax(dim=-1) if len(sampled) < len(rows) else None
        if sampled:
            if len(sampled) == len(rows):
                sel_rows, zs = rows, z
            else:
                sel_rows = [rows[i] for i in sampled]
                zs = z[torch.tensor(sampled, device=dev)]
            drawn = self._draw(self._filter(zs, sel_rows), sel_rows)
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
