"""Chunked log-prob/entropy numerics and micro-batch planning/layout of the model engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core.numerics import (
    AGG_MODES,
    agg_loss,
    masked_mean,
    masked_var,
    masked_whiten,
    shifted_token_log_probs,
    token_entropy,
    token_log_probs,
    token_log_probs_and_entropy,
)
from polyrl.model_engine.batching import (
    MicroBatchLayout,
    balance_rows_across_ranks,
    min_micro_batches,
    plan_micro_batches,
    row_spans,
)

FAST = settings(max_examples=30, deadline=None)


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


# ------------------------------------------------------------------------------------ numerics
@FAST
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 9),
    vocab=st.integers(2, 40),
    chunk=st.integers(1, 12),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    seed=st.integers(0, 1000),
)
def test_chunked_equals_unchunked_values_and_grads(rows, cols, vocab, chunk, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, vocab, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (rows, cols), generator=g)
    w_lp = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w_ent = torch.randn(rows, cols, generator=g, dtype=torch.float64)

    ref_in = base.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, labels, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    # fp64 in, fp64 math: chunking must not change anything beyond rounding.
    x64 = base.clone().requires_grad_(True)
    lp64, ent64 = token_log_probs_and_entropy(x64, labels, temperature, chunk_size=chunk)
    ((lp64 * w_lp).sum() + (ent64 * w_ent).sum()).backward()
    torch.testing.assert_close(lp64, ref_lp.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent64, ref_ent.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(x64.grad, ref_in.grad, atol=1e-10, rtol=1e-10)

    # fp32 logits: fp32 results within fp32 rounding of the exact values.
    x32 = base.float().requires_grad_(True)
    lp32, ent32 = token_log_probs_and_entropy(x32, labels, temperature, chunk_size=chunk)
    assert lp32.dtype == torch.float32 and lp32.shape == labels.shape
    ((lp32 * w_lp.float()).sum() + (ent32 * w_ent.float()).sum()).backward()
    torch.testing.assert_close(lp32.double(), ref_lp.detach(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ent32.double(), ref_ent.detach(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(x32.grad.double(), ref_in.grad, atol=5e-5, rtol=1e-5)


def test_single_outputs_match_combined_and_chunk_size_is_irrelevant():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50)
    labels = torch.randint(0, 50, (3, 7))
    lp_a = token_log_probs(logits, labels, 0.8, chunk_size=1)
    lp_b = token_log_probs(logits, labels, 0.8, chunk_size=10_000)
    torch.testing.assert_close(lp_a, lp_b, atol=1e-6, rtol=0)
    ent = token_entropy(logits, 0.8, chunk_size=4)
    _, ref_ent = _reference(logits, labels, 0.8)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    assert token_log_probs_and_entropy(logits, labels, with_entropy=False)[1] is None


def test_low_precision_logits_keep_their_dtype_for_grads():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 33).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 33, (2, 5))
    logp, ent = token_log_probs_and_entropy(logits, labels, 1.3, chunk_size=3)
    (logp.sum() + ent.sum()).backward()
    assert logp.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    ref_lp, ref_ent = _reference(logits.detach().float(), labels, 1.3)
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)


def test_fp64_gradcheck():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs_and_entropy(x, labels, 0.7, chunk_size=2), (logits,)
    )


def test_shifted_log_probs_are_aligned_with_their_tokens():
    torch.manual_seed(3)
    logits = torch.randn(2, 6, 20)
    ids = torch.randint(0, 20, (2, 6))
    logp, ent = shifted_token_log_probs(logits, ids, temperature=0.5, with_entropy=True)
    assert logp.shape == ids.shape and ent.shape == ids.shape
    assert torch.all(logp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    expect = torch.log_softmax(logits[:, 2] / 0.5, -1).gather(-1, ids[:, 3:4]).squeeze(-1)
    torch.testing.assert_close(logp[:, 3], expect, atol=1e-6, rtol=0)


def test_numerics_reject_bad_input():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_log_probs(logits, torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="labels shape"):
        token_log_probs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        token_log_probs(logits, torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="integer"):
        token_log_probs(logits, torch.zeros(2, 3))


def test_masked_mean_ignores_masked_nans():
    values = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert float(masked_mean(values, mask)) == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(values, mask, dim=1), torch.tensor([2.0, 2.0]))


def test_masked_var_and_whiten_use_the_masked_entries_only():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Entries 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5.
    assert float(masked_var(values, mask)) == pytest.approx(5 / 3)
    assert float(masked_var(values, mask, unbiased=False)) == pytest.approx(5 / 4)
    expected = torch.tensor([[-1.5, -0.5, 0.5], [1.5, 0.0, 0.0]]) / (5 / 3) ** 0.5
    torch.testing.assert_close(masked_whiten(values, mask), expected)
    assert float(masked_var(values[:1, :1], mask[:1, :1])) == 0.0  # one entry: no spread


# ---------------------------------------------------------------------------- loss aggregation
NAN = float("nan")
# Row 0: three tokens (sum 6, mean 2); row 1: one token (4); row 2: no token, NaN under the mask.
LMAT = [[1.0, 2.0, 3.0], [4.0, NAN, 0.0], [5.0, NAN, 5.0]]
LMASK = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("mode", "horizon", "counts", "expected"),
    [
        ("token-mean", None, {}, 10 / 4),
        ("token-mean", None, {"num_tokens": 8}, 10 / 8),
        ("seq-mean-token-sum", None, {}, (6 + 4) / 2),  # the empty row does not count
        ("seq-mean-token-sum", None, {"num_seqs": 5}, (6 + 4) / 5),
        ("seq-mean-token-mean", None, {}, (2 + 4) / 2),
        ("seq-mean-token-mean", None, {"num_seqs": 4}, (2 + 4) / 4),
        ("seq-mean-token-sum-norm", None, {}, 10 / (3 * 3)),
        ("seq-mean-token-sum-norm", 5, {}, 10 / (3 * 5)),
        ("seq-mean-token-sum-norm", None, {"num_seqs": 2}, 10 / (2 * 3)),
        ("sum", None, {"num_tokens": 8}, 10.0),
    ],
)
def test_agg_loss_hand_values(mode, horizon, counts, expected):
    assert mode in AGG_MODES
    out = agg_loss(torch.tensor(LMAT), torch.tensor(LMASK), mode, horizon, **counts)
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_weighs_tokens_by_the_mask_and_counts_nonzero_ones():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, NAN]])
    mask = torch.tensor([[0.5, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # sum(L*M) = 0.5 + 2 + 8 = 10.5 over 4 tokens; row means 2.5 / 1.5 and 8 / 2.
    assert agg_loss(values, mask).item() == pytest.approx(10.5 / 4)
    assert agg_loss(values, mask, "seq-mean-token-mean").item() == pytest.approx(
        (2.5 / 1.5 + 4) / 2
    )
    assert agg_loss(values, mask.bool(), "sum").item() == pytest.approx(1 + 2 + 8)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_of_micro_batches_with_global_counts_adds_up(mode):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 7, generator=gen) < 0.5).double()
    mask[4] = 0
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}
    parts = sum(agg_loss(values[i : i + 2], mask[i : i + 2], mode, **counts) for i in (0, 2, 4))
    assert float(parts) == pytest.approx(float(agg_loss(values, mask, mode)), rel=1e-12)


def test_agg_loss_rejects_bad_input():
    values, mask = torch.tensor(LMAT), torch.tensor(LMASK)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'"):
        agg_loss(values, mask, "token_mean")
    with pytest.raises(ValueError, match="loss_mat shape"):
        agg_loss(values[:, :2], mask)
    with pytest.raises(ValueError, match=r"mask must be \(B, T\)"):
        agg_loss(values[0], mask[0])
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        agg_loss(values, mask, num_tokens=-1)
    with pytest.raises(ValueError, match="horizon must be positive"):
        agg_loss(values, mask, "seq-mean-token-sum-norm", 0)


# ------------------------------------------------------------------------------------ planning
@FAST
@given(
    lengths=st.lists(st.integers(1, 30), min_size=0, max_size=25),
    dynamic=st.booleans(),
    packed=st.booleans(),
    mbs=st.integers(1, 6),
    budget=st.integers(30, 120),
    extra=st.integers(0, 5),
)
def test_plans_cover_each_row_once_with_exact_count_and_budget(
    lengths, dynamic, packed, mbs, budget, extra
):
    kw = {"dynamic": dynamic, "micro_batch_size": mbs, "max_tokens": budget, "packed": packed}
    need = min_micro_batches(lengths, **kw)
    k = max(need, 1) + extra
    plan = plan_micro_batches(lengths, k, **kw)
    assert len(plan) == k
    assert sorted(i for g in plan for i in g) == list(range(len(lengths)))
    for group in plan:
        if not group:
            continue
        if dynamic:
            cost = (
                sum(lengths[i] for i in group)
                if packed
                else len(group) * max(lengths[i] for i in group)
            )
            assert cost <= budget
        else:
            assert len(group) <= mbs
    # Empty micro-batches only when there are fewer rows than micro-batches.
    assert sum(1 for g in plan if not g) == max(0, k - len(lengths))
    if need > 1:
        with pytest.raises(ValueError, match="at least"):
            plan_micro_batches(lengths, need - 1, **kw)


def test_dynamic_plan_rejects_sequences_over_budget():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        min_micro_batches([5, 50], dynamic=True, max_tokens=40)


def test_dynamic_plan_cuts_padding():
    lengths = [30, 2, 3, 29, 4, 31, 2, 28]
    plan = plan_micro_batches(lengths, 2, dynamic=True, max_tokens=124)
    # Longest rows together, short rows together: far less padding than arrival order.
    padded = sum(len(g) * max(lengths[i] for i in g) for g in plan)
    assert padded < 0.6 * len(lengths) * max(lengths)


@FAST
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=24),
    dp=st.integers(1, 4),
)
def test_balance_rows_across_ranks(lengths, dp):
    lengths = lengths[: len(lengths) - len(lengths) % dp] or [1] * dp
    groups = balance_rows_across_ranks(lengths, dp)
    assert len(groups) == dp
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len({len(g) for g in groups}) == 1
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= max(lengths)


def test_balance_rows_needs_divisible_count():
    with pytest.raises(ValueError, match="evenly"):
        balance_rows_across_ranks([1, 2, 3], 2)


# ------------------------------------------------------------------------------------ layouts
def _mask(rows: list[tuple[int, int]], t: int) -> torch.Tensor:
    m = torch.zeros(len(rows), t, dtype=torch.long)
    for i, (start, length) in enumerate(rows):
        m[i, start : start + length] = 1
    return m


@pytest.mark.parametrize("mode", ["identity", "trim", "pack"])
def test_layout_round_trip(mode):
    am = _mask([(0, 3), (4, 2), (1, 5)], 6)
    values = torch.arange(18, dtype=torch.float32).view(3, 6) + 1
    layout = MicroBatchLayout.build(am, mode)
    compute = layout.to_compute(values)
    expected_shape = {"identity": (3, 6), "trim": (3, 5), "pack": (1, 10)}[mode]
    assert tuple(compute.shape) == expected_shape
    back = layout.to_batch(compute)
    torch.testing.assert_close(back, values * am)
    if mode == "pack":
        assert compute.tolist() == [[1, 2, 3, 11, 12, 14, 15, 16, 17, 18]]
        assert layout.compute_attention_mask(am) is None
    if mode == "trim":
        assert layout.compute_attention_mask(am).sum(1).tolist() == [3, 2, 5]
    first = layout.first_token_mask()
    assert first.nonzero().tolist() == [[0, 0], [1, 4], [2, 1]]


def test_layout_scatter_is_differentiable():
    am = _mask([(0, 2), (1, 3)], 4)
    layout = MicroBatchLayout.build(am, "trim")
    x = torch.ones(layout.compute_shape, requires_grad=True)
    (layout.to_batch(x) * 2).sum().backward()
    assert x.grad.sum().item() == 2 * 5  # only the 5 real tokens receive gradient


def test_row_spans_rejects_holes_and_empty_rows():
    with pytest.raises(ValueError, match="contiguous"):
        row_spans(torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="no real token"):
        row_spans(torch.tensor([[1, 1, 0], [0, 0, 0]]))
    starts, lengths = row_spans(_mask([(2, 3), (0, 1)], 5))
    assert starts.tolist() == [2, 0] and lengths.tolist() == [3, 1]


def test_packing_checks_position_ids():
    am = _mask([(0, 3), (0, 2)], 3)
    layout = MicroBatchLayout.build(am, "pack")
    layout.check_packable(torch.tensor([[0, 1, 2, 0, 1]]))
    with pytest.raises(ValueError, match="position_ids"):
        layout.check_packable(torch.tensor([[0, 1, 2, 3, 4]]))  # second row continues the first
    with pytest.raises(ValueError, match="position_ids"):
        layout.check_packable(torch.tensor([[0, 2, 3, 0, 1]]))  # a gap inside a sequence
