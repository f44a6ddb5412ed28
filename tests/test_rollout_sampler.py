"""The native engine's sampler: its counter-based seeded streams and the law of its draws."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from polyrl.rollout.native.sampler import Sampler, SamplingRow, _mix64, seeded_uniform

# Chi-square critical values at p = 0.001 (the tests fail one correct generator in 1000 seeds).
CHI2_CRIT = {7: 24.32, 2: 13.82, 63: 103.44}


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_stream_is_splitmix64():
    # Known-answer values of SplitMix64 started at state 1234567 (Vigna's reference code).
    state, outputs = 1234567, []
    for _ in range(3):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        outputs.append(_mix64(state))
    assert outputs == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    u = [seeded_uniform(7, c) for c in range(4)]
    assert u == [seeded_uniform(7, c) for c in range(4)]  # a pure function of (seed, counter)
    assert len(set(u)) == 4 and all(0.0 < x < 1.0 for x in u)


def test_seeded_uniforms_look_uniform_and_independent():
    seeds, draws = 64, 512
    u = torch.tensor(
        [[seeded_uniform(s, c) for c in range(draws)] for s in range(seeds)], dtype=torch.float64
    )
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 4 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    assert chi_square(counts, torch.full((64,), n / 64, dtype=torch.float64)) < CHI2_CRIT[63]
    # Neighbouring counters of one seed, and neighbouring seeds at one counter, are
    # uncorrelated (a plain counter or seed without mixing would fail both).
    c = u - 0.5
    bound = 4 / math.sqrt(n)
    assert abs((c[:, 1:] * c[:, :-1]).mean().item() * 12) < bound
    assert abs((c[1:] * c[:-1]).mean().item() * 12) < bound
    # Pairs of consecutive draws fill the unit square evenly (8 x 8 cells).
    pairs = (u[:, 0::2] * 8).long() * 8 + (u[:, 1::2] * 8).long()
    cells = torch.bincount(pairs.reshape(-1), minlength=64)
    expected = torch.full((64,), pairs.numel() / 64, dtype=torch.float64)
    assert chi_square(cells, expected) < CHI2_CRIT[63]


def _frequencies(rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=11)
    out = sampler(logits.expand(len(rows), -1), rows)
    return torch.bincount(torch.tensor(out.tokens), minlength=logits.shape[-1])


def test_token_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]])
    n = 20000
    for temperature, seeded in ((1.0, True), (0.7, True), (1.0, False)):
        rows = [SamplingRow(temperature=temperature, seed=s if seeded else None) for s in range(n)]
        counts = _frequencies(rows, logits)
        probs = torch.softmax(logits[0].double() / temperature, -1)
        assert chi_square(counts, n * probs) < CHI2_CRIT[7], (temperature, seeded, counts)
        if seeded:
            assert all(r.draws == 1 for r in rows)
    # top-k = 3: the other entries never come up, the kept three keep their proportions.
    rows = [SamplingRow(top_k=3, seed=s) for s in range(n)]
    counts = _frequencies(rows, logits)
    keep = torch.tensor([0, 1, 7])
    assert counts.sum() == counts[keep].sum() == n
    probs = torch.softmax(logits[0, keep].double(), -1)
    assert chi_square(counts[keep], n * probs) < CHI2_CRIT[2]


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    solo_row = SamplingRow(seed=42)
    sampler = Sampler(torch.device("cpu"), seed=0)
    alone = [sampler(logits[2:3], [solo_row]).tokens[0] for _ in range(5)]
    assert solo_row.draws == 5
    row = SamplingRow(seed=42)
    together = []
    for step in range(5):
        others = [SamplingRow(seed=None if i % 2 else 100 + i + step) for i in range(5)]
        batch = [*others[:2], row, *others[2:]]
        together.append(Sampler(torch.device("cpu"), seed=step)(logits, batch).tokens[2])
    assert together == alone
    # The counter is the stream position: a copy resumed at draw 3 continues identically.
    resumed = dataclasses.replace(SamplingRow(seed=42), draws=3)
    assert [sampler(logits[2:3], [resumed]).tokens[0] for _ in range(2)] == alone[3:]


@pytest.mark.parametrize("use_kernels", [True, False])
def test_masked_entries_are_never_drawn_even_at_the_extremes(use_kernels, request):
    if use_kernels:
        request.getfixturevalue("native_kernels")  # else the torch path would run twice
    # Uniforms as close to 0 and 1 as the stream makes them, and a target rounded up to the
    # total (1.0): the first and the last allowed entry, never the masked tail.
    logits = torch.tensor([[-1.0, 0.0, 3.0, 1.0, -2.0]])
    sampler = Sampler(torch.device("cpu"), use_kernels=use_kernels)
    z = logits.masked_fill(torch.tensor([[True, False, False, True, True]]), float("-inf"))
    for u, want in ((2.0**-24, 1), (1 - 2.0**-24, 2), (1.0, 2)):
        sampler._uniforms = lambda rows, u=u: torch.tensor([u])  # type: ignore[method-assign]
        assert sampler._draw(z, [SamplingRow()]).tolist() == [want]


@pytest.mark.usefixtures("native_kernels")
def test_kernel_draws_the_tokens_of_the_torch_path():
    # The C inversion must pick exactly the torch path's token (same cumulative sums, same
    # search, same masked-tail fix), so seeded outputs do not depend on the kernels.
    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        vocab = (1024, 1000, 7, 32000)[trial % 4]
        # Row counts around the kernel's groups of four rows.
        num_rows = (32, 7, 33, 6, 5)[trial % 5]
        z = torch.randn(num_rows, vocab, generator=gen) * (0.5, 3.0, 10.0)[trial % 3]
        if trial % 7 in (0, 3):  # a top-k style masked tail
            kth = z.topk(max(1, vocab // 10), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        u = torch.rand(num_rows, generator=gen)
        u[:4] = 1 - 2.0**-24  # targets at the very top exercise the masked-tail fix
        u[4] = 1.0
        rows = [SamplingRow() for _ in range(num_rows)]
        draws = []
        for use_kernels in (True, False):
            sampler = Sampler(torch.device("cpu"), use_kernels=use_kernels)
            sampler._uniforms = lambda rows, u=u: u.clone()  # type: ignore[method-assign]
            draws.append(sampler._draw(z, rows))
        assert torch.equal(draws[0], draws[1])
        assert not bool((z.gather(1, draws[0][:, None]) == float("-inf")).any())
