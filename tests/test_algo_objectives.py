"""The newer policy objectives and the rollout masks, against hand-computed values.

Each case is small enough to work out by hand; the expected numbers below are those sums
written out, not a second implementation of the formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.algo import get_policy_loss, list_policy_losses
from polyrl.algo.losses import rollout_rejection_mask

NEW = ("cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov")


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_the_new_objectives_are_registered_by_name():
    assert set(NEW) <= set(list_policy_losses())


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    logp = _leaf([[math.log(0.5), math.log(0.25), math.log(0.1)]])
    old = torch.log(torch.tensor([[0.25, 0.5, 0.1]], dtype=torch.float64))  # r = 2, 0.5, 1
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, m = get_policy_loss("cispo")(
        logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    # Weights clip(r, 0.8, 1.28) = 1.28, 0.8, 1; loss -w A logp, token mean.
    expected = (
        -(1.28 * 1.0 * math.log(0.5)) - (0.8 * -1.0 * math.log(0.25)) - (1.0 * 2.0 * math.log(0.1))
    ) / 3
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # The clipped tokens still get -w A / N (PPO's clip would give the first one none).
    assert logp.grad.tolist()[0] == pytest.approx([-1.28 / 3, 0.8 / 3, -2.0 / 3])
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)


def test_sapo_gates_softly_with_a_temperature_per_advantage_sign():
    logp = _leaf([[math.log(2.0), math.log(0.5)]])
    old = torch.zeros(1, 2, dtype=torch.float64)  # r = 2, 0.5
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, _ = get_policy_loss("sapo")(logp, old, adv, mask, tau_pos=1.0, tau_neg=2.0)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    # Token 0: tau 1, f = 4 sigmoid(1); token 1: tau 2, f = 2 sigmoid(-1); loss -f A.
    expected = (-(4.0 * sig(1.0)) * 1.0 - (2.0 * sig(-1.0)) * -1.0) / 2
    assert loss.item() == pytest.approx(expected)
    # On-policy the gate's slope is 1: the gradient is the plain policy gradient -A / N.
    on = _leaf([[-1.0, -2.0]])
    loss, _ = get_policy_loss("sapo")(on, on.detach(), adv, mask, tau_pos=1.0, tau_neg=2.0)
    loss.backward()
    assert on.grad.tolist()[0] == pytest.approx([-0.5, 0.5])
    with pytest.raises(ValueError, match="tau"):
        get_policy_loss("sapo")(on, on.detach(), adv, mask, tau_pos=0.0)


def test_gmpo_takes_the_geometric_mean_of_ratios_clipped_in_log_space():
    log_ratio = torch.tensor([[0.5, -0.1], [0.5, -0.6]], dtype=torch.float64)
    logp = _leaf([[-1.0, -1.0], [-1.0, -1.0]])
    old = logp.detach() - log_ratio
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, m = get_policy_loss("gmpo")(logp, old, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4)
    # Row 0 (A > 0): min(l, clip(l)) = 0.4, -0.1 -> R = exp(0.15), loss -R.
    # Row 1 (A < 0): max(l, clip(l)) = 0.5, -0.4 -> R = exp(0.05), loss +R.
    expected = (-math.exp(0.15) + math.exp(0.05)) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["pg_clipfrac"] == pytest.approx(1 / 4)  # row 0's first token
    assert m["pg_clipfrac_lower"] == pytest.approx(2 / 4)  # both of row 1's
    loss.backward()
    # Row 0: only the unclipped token moves R: d(-R)/dl_1 = -R / 2 / 2 (seq mean of 2 rows).
    assert logp.grad[0].tolist() == pytest.approx([0.0, -math.exp(0.15) / 4])


def test_gpg_is_the_plain_policy_gradient():
    logp = _leaf([[-1.0, -2.0, -3.0]])
    adv = torch.tensor([[1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = get_policy_loss("gpg")(logp, logp.detach() + 1.0, adv, mask)
    assert loss.item() == pytest.approx((1.0 * 1.0 - 1.0 * 2.0) / 2)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, 0.5, 0.0])


def _cov_case():
    # mean logp = -1.05, mean A = 0: covariances 1.9, -1.9, -1.9, 1.9.
    logp = _leaf([[-0.1, -2.0, -0.1, -2.0]])
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]], dtype=torch.float64)
    return logp, adv, torch.ones(1, 4, dtype=torch.float64)


def test_clip_cov_detaches_high_covariance_tokens():
    logp, adv, mask = _cov_case()
    loss, m = get_policy_loss("clip_cov")(
        logp, logp.detach(), adv, mask, clip_cov_ratio=0.5, clip_cov_lb=1.0, clip_cov_ub=5.0
    )
    # floor(0.5 * 4) = 2 of the 2 candidates (tokens 0 and 3) lose their gradient.
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5, 0.5, 0.0])
    assert loss.item() == pytest.approx((-2.0 + 2.0) / 4)
    assert m["clip_cov_frac"] == pytest.approx(0.5)
    # floor(0.25 * 4) = 1: one of the two, drawn with the seed.
    logp, adv, mask = _cov_case()
    loss, m = get_policy_loss("clip_cov")(
        logp, logp.detach(), adv, mask, clip_cov_ratio=0.25, seed=0
    )
    loss.backward()
    zeros = [i for i, g in enumerate(logp.grad.tolist()[0]) if g == 0.0]
    assert len(zeros) == 1 and zeros[0] in (0, 3)
    assert m["clip_cov_frac"] == pytest.approx(0.25)


def test_clip_cov_draws_from_its_seed_not_the_global_rng():
    # 64 candidates (covariance 1.9 each as in _cov_case), 8 of them detached.
    logp0 = torch.tensor([[-0.1, -2.0] * 64], dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0] * 32 + [-2.0, -2.0] * 32], dtype=torch.float64)
    mask = torch.ones_like(adv)

    def detached(seed: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)  # a resume's global RNG state differs from the run's
        logp = logp0.clone().requires_grad_(True)
        loss, _ = get_policy_loss("clip_cov")(
            logp, logp.detach(), adv, mask, clip_cov_ratio=8 / 128, seed=seed
        )
        loss.backward()
        return [i for i, g in enumerate(logp.grad[0].tolist()) if g == 0.0]

    first = detached(seed=7, global_seed=0)
    assert len(first) == 8
    # The same seed draws the same tokens whatever the global RNG state; another seed others.
    assert all(detached(seed=7, global_seed=g) == first for g in (1, 2, 3))
    assert detached(seed=8, global_seed=0) != first


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp = _leaf([[-0.1, -2.0, -0.1, -2.0]])
    adv = torch.tensor([[2.0, 2.0, -2.0, -3.0]], dtype=torch.float64)
    # mean A = -0.25: covariances 0.95*2.25, -0.95*2.25, 0.95*-1.75, -0.95*-2.75 (largest).
    d = torch.tensor([[0.1, 0.2, -0.1, -0.3]], dtype=torch.float64)  # logp - old
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, m = get_policy_loss("kl_cov")(
        logp, logp.detach() - d, adv, mask, kl_cov_ratio=0.25, kl_cov_coef=1.0
    )
    expected = (
        -2.0 * math.exp(0.1)
        - 2.0 * math.exp(0.2)
        + 2.0 * math.exp(-0.1)
        + (3.0 * math.exp(-0.3) + 1.0 * 0.3)
    ) / 4
    assert loss.item() == pytest.approx(expected)
    assert m["kl_cov_frac"] == pytest.approx(0.25)
    # Ratio 0 selects nothing: the unclipped surrogate alone.
    plain, m = get_policy_loss("kl_cov")(logp, logp.detach() - d, adv, mask, kl_cov_ratio=0.0)
    assert plain.item() == pytest.approx(expected - 0.3 / 4)
    assert m["kl_cov_frac"] == 0.0


def _mismatch():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.6, 0.6, 0.6, 0.6]]))
    # Row 0: rho = 2.5, 1, 1, 0.5/0.9; row 1: rho = 3, 3 on its two masked tokens.
    rollout = torch.log(torch.tensor([[0.2, 0.5, 0.5, 0.9], [0.2, 0.2, 0.6, 0.6]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    return old, rollout, mask


def test_token_mask_mis_drops_tokens_out_of_the_band():
    old, rollout, mask = _mismatch()
    keep, weights, m = rollout_rejection_mask(old, rollout, mask, "token", 2.0)
    # Band [0.5, 2]: 2.5 and the two 3s leave it; 0.556 stays.
    assert keep.tolist() == [[False, True, True, True], [False, False, False, False]]
    assert torch.all(weights == 1.0)
    assert m["rollout_rs_masked_frac"] == pytest.approx(3 / 6)
    assert m["rollout_rs_seq_rejected"] == 0.0  # row 1 lost its tokens, not rejected whole


def test_icepop_masks_both_sides_and_weights_the_kept_tokens():
    old, rollout, mask = _mismatch()
    keep, weights, m = rollout_rejection_mask(old, rollout, mask, "icepop", 2.0, 0.6)
    # Band [0.6, 2]: 0.556 now leaves it too.
    assert keep[0].tolist() == [False, True, True, False]
    assert weights[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])
    keep, weights, _ = rollout_rejection_mask(old, rollout, mask, "icepop", 2.0, 0.5)
    assert keep[0].tolist() == [False, True, True, True]
    assert weights[0, 3].item() == pytest.approx(0.5 / 0.9)


def test_sequence_and_geometric_modes_reject_whole_responses_and_count_them():
    old, rollout, mask = _mismatch()
    # Sequence ratios: row 0 2.5 * 0.556 = 1.39 (kept), row 1 3 * 3 = 9 (rejected).
    keep, _, m = rollout_rejection_mask(old, rollout, mask, "sequence", 2.0)
    assert keep.tolist() == [[True] * 4, [False] * 4]
    assert m["rollout_rs_seq_rejected"] == 1.0
    assert m["rollout_rs_seq_rejected_frac"] == pytest.approx(0.5)
    assert m["rollout_rs_masked_frac"] == pytest.approx(2 / 6)
    # Geometric means: row 0 1.39 ** (1/4) = 1.086, row 1 3.
    keep, _, m = rollout_rejection_mask(old, rollout, mask, "geometric", 1.05)
    assert m["rollout_rs_seq_rejected"] == 2.0
    keep, _, m = rollout_rejection_mask(old, rollout, mask, "geometric", 1.1)
    assert keep.tolist() == [[True] * 4, [False] * 4]
    # The veto rejects row 0 for its 0.556 token, whatever the mode.
    keep, _, m = rollout_rejection_mask(old, rollout, mask, None, 2.0, veto_threshold=0.6)
    assert keep.tolist() == [[False] * 4, [True, True, False, False]]
    with pytest.raises(ValueError, match="rollout_rs"):
        rollout_rejection_mask(old, rollout, mask, "tokens", 2.0)
    with pytest.raises(ValueError, match="band"):
        rollout_rejection_mask(old, rollout, mask, "token", 2.0, 1.5)


class _Output:
    def __init__(self, log_probs):
        self.log_probs = log_probs

    def log_probs_and_entropy(self):
        return self.log_probs, None


def test_actor_loss_rejects_by_the_band_and_passes_each_loss_its_options():
    from polyrl.core.batch import Batch
    from polyrl.trainer.rl_losses import actor_loss

    old, rollout, mask = _mismatch()
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])
    batch = Batch(
        tensors={
            "advantages": adv,
            "loss_mask": mask,
            "old_log_probs": old,
            "rollout_log_probs": rollout,
        }
    )
    logp = old.clone().requires_grad_(True)
    loss, m = actor_loss(
        _Output(logp), batch, clip_ratio_c=None, rollout_rs="sequence", rollout_rs_threshold=2.0
    )
    # Row 1 is rejected; its tokens still count in the token mean: -(4 * 1) / 6.
    assert loss.item() == pytest.approx(-4 / 6)
    assert m["rollout_rs_seq_rejected_frac"] == pytest.approx(0.5)
    assert m["rollout_rs_masked_frac"] == pytest.approx(2 / 6)
    # Each objective takes the options it names and ignores the others'.
    options = {"tau_pos": 1.0, "tau_neg": 1.05, "clip_cov_ratio": 0.5, "kl_cov_ratio": 0.5}
    for name in NEW:
        loss, _ = actor_loss(_Output(logp), batch, policy_loss=name, policy_loss_options=options)
        assert torch.isfinite(loss), name
    with pytest.raises(KeyError, match="rollout_log_probs"):
        actor_loss(
            _Output(logp),
            Batch(tensors={"advantages": adv, "loss_mask": mask}),
            rollout_rs="token",
        )


def test_icepop_weights_once_with_or_without_tis():
    from polyrl.core.batch import Batch
    from polyrl.trainer.rl_losses import actor_loss

    old = torch.log(torch.tensor([[0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.4, 0.1]]))  # rho = 1.25 (kept), 5 (masked)
    batch = Batch(
        tensors={
            "advantages": torch.tensor([[1.0, 1.0]]),
            "loss_mask": torch.ones(1, 2),
            "old_log_probs": old,
            "rollout_log_probs": rollout,
        }
    )
    logp = old.clone().requires_grad_(True)
    alone, m = actor_loss(_Output(logp), batch, clip_ratio_c=None, rollout_rs="icepop")
    with_tis, _ = actor_loss(
        _Output(logp), batch, clip_ratio_c=None, rollout_rs="icepop", rollout_is="token"
    )
    # Token 0 weighs 1.25 either way (not 1.25 ** 2); token 1 is masked: -(1.25 * 1) / 2.
    assert alone.item() == pytest.approx(-1.25 / 2)
    assert with_tis.item() == pytest.approx(-1.25 / 2)
    assert m["rollout_rs_masked_frac"] == pytest.approx(0.5)


def test_distillation_subtracts_the_per_token_reverse_kl():
    from polyrl.algo.distill import distill_advantages

    adv = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    student = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.25, 0.5, 0.5]]))
    teacher = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.25, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out, m = distill_advantages(adv, student, teacher, mask, coef=0.5)
    # k = log(0.5/0.25) = log 2 and log(0.2/0.4) = -log 2 on row 0, 0 on row 1.
    ln2 = math.log(2.0)
    assert out[0].tolist() == pytest.approx([1.0 - 0.5 * ln2, 1.0 + 0.5 * ln2, 0.0])
    assert out[1].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert m["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["opd/reverse_kl_seq"] == pytest.approx(0.0, abs=1e-7)
    _, m = distill_advantages(adv, student, teacher, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))
    assert m["opd/reverse_kl"] == pytest.approx(ln2)
    with pytest.raises(ValueError, match=">= 0"):
        distill_advantages(adv, student, teacher, mask, coef=-1.0)


def test_topk_reverse_kl_renormalises_both_on_the_teachers_support():
    from polyrl.algo.distill import topk_reverse_kl

    student = torch.log(torch.tensor([[0.3, 0.1], [0.4, 0.2]])).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.2, 0.2], [0.2, 0.1]]))
    kl = topk_reverse_kl(student, teacher)
    # Row 0: q_s = (0.75, 0.25), q_T = (0.5, 0.5); row 1: the same shape on the support.
    assert kl[0].item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    kl[0].backward()
    # The gradient reaches both support tokens, in opposite directions (they compete).
    g = student.grad[0]
    assert g[0].item() > 0 > g[1].item()
    with pytest.raises(ValueError, match="one shape"):
        topk_reverse_kl(student, teacher[:, :1])


def test_model_output_scores_candidate_tokens_like_the_sampled_ones():
    from polyrl.model_engine.batching import MicroBatchLayout
    from polyrl.model_engine.engine import ModelOutput

    torch.manual_seed(0)
    ids = torch.tensor([[0, 5, 3, 7, 1], [4, 2, 6, 1, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    for mode in ("pack", "identity"):
        layout = MicroBatchLayout.build(attn, mode)
        compute_ids = layout.to_compute(ids)
        raw = torch.randn(*layout.compute_shape, 9)
        out = ModelOutput(
            kind="causal_lm",
            raw=raw,
            layout=layout,
            compute_input_ids=compute_ids,
            attention_mask=attn,
            temperature=0.5,
        )
        # Candidate 0 is the token itself, candidate 1 a fixed other token.
        candidates = torch.stack([ids, torch.full_like(ids, 8)], dim=-1)
        got = out.log_probs_of(candidates)
        assert torch.allclose(got[..., 0], out.log_probs, atol=1e-6)
        # Row 0's token at column 2 is predicted by the logits of column 1 (its first token).
        at = layout.to_batch(raw)[0, 1] / 0.5
        assert got[0, 2, 1].item() == pytest.approx(torch.log_softmax(at, -1)[8].item(), abs=1e-6)
        assert got[0, 1].abs().sum() == 0 and got[1, 0].abs().sum() == 0  # nothing predicts them
