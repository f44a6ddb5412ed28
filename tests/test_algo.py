"""Unit tests for polyrl.algo against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.algo import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    entropy_from_logits,
    get_advantage_estimator,
    get_policy_loss,
    kl_loss,
    kl_penalty,
    list_advantage_estimators,
    register_advantage,
    value_loss,
)

T = torch.tensor


def close(a: torch.Tensor, b: list, tol: float = 1e-5) -> None:
    """Assert tensor ``a`` equals the nested list ``b`` within ``tol``."""
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), atol=tol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_registry_lists_all_and_rejects_unknown() -> None:
    assert {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    } <= set(list_advantage_estimators())
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *a, **k: None)


def test_gae_gamma_lam_one() -> None:
    # t=1: delta=1-0.2=0.8; t=0: delta=0+0.2-0.5=-0.3, A0=-0.3+0.8=0.5; R=A+V=1,1
    adv, ret = get_advantage_estimator("gae")(
        T([[0.0, 1.0]]), T([[1.0, 1.0]]), values=T([[0.5, 0.2]]), whiten=False
    )
    close(adv, [[0.5, 0.8]])
    close(ret, [[1.0, 1.0]])


def test_gae_discounted_and_padding_ignored() -> None:
    # gamma=lam=0.5: A1=0.8; delta0=0.5*0.2-0.5=-0.4, A0=-0.4+0.25*0.8=-0.2; R0=0.3, R1=1.0
    adv, ret = get_advantage_estimator("gae")(
        T([[0.0, 1.0, 5.0]]),
        T([[1.0, 1.0, 0.0]]),
        values=T([[0.5, 0.2, 9.0]]),
        gamma=0.5,
        lam=0.5,
        whiten=False,
    )
    close(adv, [[-0.2, 0.8, 0.0]])
    close(ret, [[0.3, 1.0, 0.0]])


def test_gae_requires_values() -> None:
    with pytest.raises(ValueError, match="gae needs `values`"):
        get_advantage_estimator("gae")(T([[1.0]]), T([[1.0]]))


REWARDS = T([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
MASK = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
INDEX = ["a", "a", "a", "b"]  # scores [1, 0, 1 | 1]; "b" is a singleton group


def test_grpo_std_normalised() -> None:
    # group a: mean 2/3, Bessel std sqrt((1/9+4/9+1/9)/2)=sqrt(1/3)=0.57735
    adv, ret = get_advantage_estimator("grpo")(REWARDS, MASK, INDEX)
    a, b = (1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3)
    close(adv, [[a, a], [b, b], [a, 0.0], [0.0, 0.0]], tol=1e-4)
    close(ret, adv.tolist())


def test_dr_grpo_no_std() -> None:
    adv, _ = get_advantage_estimator("grpo")(REWARDS, MASK, T([0, 0, 0, 1]), norm_adv_by_std=False)
    third = 1 / 3
    close(adv, [[third, third], [-2 * third, -2 * third], [third, 0.0], [0.0, 0.0]])


def test_grpo_all_equal_rewards_gives_zero_not_nan() -> None:
    adv, _ = get_advantage_estimator("grpo")(T([[1.0], [1.0]]), T([[1.0], [1.0]]), [7, 7])
    close(adv, [[0.0], [0.0]])


def test_grpo_zero_length_response_and_bad_index() -> None:
    adv, _ = get_advantage_estimator("grpo")(T([[0.0], [1.0]]), T([[0.0], [1.0]]), [0, 0])
    assert adv[0, 0] == 0.0 and adv[1, 0] > 0
    with pytest.raises(ValueError, match="index has 1 entries"):
        get_advantage_estimator("grpo")(T([[0.0], [1.0]]), T([[1.0], [1.0]]), [0])
    with pytest.raises(ValueError, match="needs `index`"):
        get_advantage_estimator("rloo")(T([[0.0]]), T([[1.0]]))


def test_rloo_leave_one_out() -> None:
    # a: 1-(0+1)/2=0.5, 0-(1+1)/2=-1, 0.5; singleton b -> 0
    adv, _ = get_advantage_estimator("rloo")(REWARDS, MASK, INDEX)
    close(adv, [[0.5, 0.5], [-1.0, -1.0], [0.5, 0.0], [0.0, 0.0]])


def test_reinforce_plus_plus() -> None:
    # gamma=0.5 returns: [[1+0.5*2, 2], [0+0.5*3, 3]] = [[2,2],[1.5,3]]; mean 2.125,
    # Bessel var 1.1875/3, std 0.629153
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(
        T([[1.0, 2.0], [0.0, 3.0]]), torch.ones(2, 2), gamma=0.5
    )
    close(ret, [[2.0, 2.0], [1.5, 3.0]])
    close(adv, [[-0.198680, -0.198680], [-0.993399, 1.390759]], tol=1e-5)


def test_reinforce_plus_plus_baseline() -> None:
    # scores [1,0 | 3,1] -> centred [0.5,-0.5 | 1,-1]; 7 masked tokens
    # [.5,.5,-.5,-.5,1,1,-1]: mean 1/7, Bessel std 0.801784
    adv, ret = get_advantage_estimator("reinforce_plus_plus_baseline")(
        T([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [1.0, 0.0]]),
        T([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
        [0, 0, 1, 1],
    )
    close(
        adv, [[0.445435, 0.445435], [-0.801784, -0.801784], [1.069045, 1.069045], [-1.425393, 0.0]]
    )
    close(ret, adv.tolist())


def test_remax() -> None:
    # row0 return-to-go [1.5, 1] - 1; row1 reward at t=1 is masked -> [0, 0] - 0.5
    adv, ret = get_advantage_estimator("remax")(
        T([[0.5, 1.0], [0.0, 2.0]]), T([[1.0, 1.0], [1.0, 0.0]]), baseline_rewards=T([1.0, 0.5])
    )
    close(ret, [[1.5, 1.0], [0.0, 0.0]])
    close(adv, [[0.5, 0.0], [-0.5, 0.0]])
    with pytest.raises(ValueError, match="baseline_rewards"):
        get_advantage_estimator("remax")(T([[1.0]]), T([[1.0]]))


def test_shape_mismatch_error() -> None:
    with pytest.raises(ValueError, match="response_mask shape"):
        get_advantage_estimator("grpo")(T([[1.0, 2.0]]), T([[1.0]]), [0])


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random right-padded batches with group ids."""
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 5))
    floats = st.floats(-3, 3, allow_nan=False, width=32)
    rewards = T(draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b)))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    mask = (torch.arange(t).unsqueeze(0) < T(lengths).unsqueeze(1)).float()
    index = draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))
    return rewards, mask, index


@settings(max_examples=30, deadline=None)
@given(batches())
def test_property_masked_positions_zero(batch) -> None:
    rewards, mask, index = batch
    extra = {"gae": {"values": rewards * 0.5}, "remax": {"baseline_rewards": rewards[:, 0]}}
    for name in [
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    ]:
        adv, ret = get_advantage_estimator(name)(rewards, mask, index, **extra.get(name, {}))
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all(), name


@settings(max_examples=30, deadline=None)
@given(batches())
def test_property_group_advantages_zero_mean(batch) -> None:
    rewards, mask, index = batch
    full = torch.ones_like(mask)
    for name, kw in [("grpo", {}), ("grpo", {"norm_adv_by_std": False}), ("rloo", {})]:
        adv, _ = get_advantage_estimator(name)(rewards, full, index, **kw)
        seq = adv[:, 0]
        for g in set(index):
            rows = [i for i, x in enumerate(index) if x == g]
            assert abs(float(seq[rows].sum())) < 1e-3 * max(1, len(rows)), (name, kw)


# ---------------------------------------------------------------- losses


def test_ppo_clip_dual_clip_hand_values() -> None:
    ratios = T([[1.5, 0.5, 0.5, 5.0, 1.0]])
    adv = T([[1.0, 1.0, -1.0, -1.0, 100.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    logp = ratios.log().requires_grad_(True)
    loss, m = get_policy_loss("ppo_clip")(logp, torch.zeros_like(logp), adv, mask)
    # per-token: max(-1.5,-1.2)=-1.2 (clip), -0.5, max(0.5,0.8)=0.8 (clip), min(5,3)=3 (dual)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0) / 4)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"] == pytest.approx(0.25)
    assert m["ppo_kl"] == pytest.approx(-0.157152, abs=1e-5)
    loss.backward()
    # only the unclipped token (ratio 0.5, A=1) has gradient: d(-A r)/dlogp /4 = -0.5/4
    close(logp.grad, [[0.0, -0.125, 0.0, 0.0, 0.0]])


def test_ppo_clip_higher() -> None:
    logp, adv, mask = T([[math.log(1.25)]]), T([[1.0]]), T([[1.0]])
    sym, _ = get_policy_loss("ppo_clip")(logp, torch.zeros(1, 1), adv, mask)
    high, _ = get_policy_loss("ppo_clip")(
        logp, torch.zeros(1, 1), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert sym.item() == pytest.approx(-1.2)
    assert high.item() == pytest.approx(-1.25)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss("ppo_clip")(logp, torch.zeros(1, 1), adv, mask, clip_ratio_c=0.5)


def test_gspo_sequence_ratio() -> None:
    logp = T([[0.2, 0.0], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    loss, m = get_policy_loss("gspo")(
        logp, old, adv, mask, clip_ratio_low=0.05, clip_ratio_high=0.05
    )
    # row0: s=exp(0.1)=1.105 clipped to 1.05 -> -1.05 per token; row1: s=1 -> 2
    assert loss.item() == pytest.approx((-1.05 + 2.0) / 2)
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)


def test_gspo_gradient_is_sequence_ratio_over_length() -> None:
    logp = T([[0.02, 0.0]]).requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(
        logp,
        torch.zeros(1, 2),
        T([[1.0, 1.0]]),
        T([[1.0, 1.0]]),
        clip_ratio_low=0.05,
        clip_ratio_high=0.05,
    )
    assert loss.item() == pytest.approx(-math.exp(0.01))
    loss.backward()
    close(logp.grad, [[-0.505025, -0.505025]])


def test_unknown_policy_loss() -> None:
    with pytest.raises(KeyError, match="unknown policy loss"):
        get_policy_loss("nope")


def test_entropy() -> None:
    ent = entropy_from_logits(torch.zeros(1, 2, 4))
    close(ent, [[math.log(4), math.log(4)]])


def test_value_loss_clipped() -> None:
    # tok0: clipped 0.7, max((1-2)^2, (0.7-2)^2)=1.69 (clip); tok1: 1 -> 0.5*(2.69/2)
    loss, m = value_loss(T([[1.0, 2.0]]), T([[0.5, 2.0]]), T([[2.0, 1.0]]), T([[1.0, 1.0]]), 0.2)
    assert loss.item() == pytest.approx(0.6725)
    assert m["vf_clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(T([[1.0]]), T([[1.0]]), T([[1.0]]), T([[1.0]]), -1.0)


# ---------------------------------------------------------------- KL


def test_kl_estimators() -> None:
    logp, ref = T([math.log(0.5), math.log(0.5)]), T([math.log(0.25), math.log(1.0)])
    ln2 = math.log(2)
    close(kl_penalty(logp, ref, "k1"), [ln2, -ln2])
    close(kl_penalty(logp, ref, "k2"), [0.5 * ln2**2, 0.5 * ln2**2])
    # k3 = exp(-d) - 1 + d: d=ln2 -> 0.5-1+ln2; d=-ln2 -> 2-1-ln2
    close(kl_penalty(logp, ref, "k3"), [ln2 - 0.5, 1 - ln2])
    close(kl_penalty(logp, ref, "low_var_kl"), [ln2 - 0.5, 1 - ln2])
    close(kl_penalty(T([-30.0]), T([0.0]), "k3"), [10.0])  # clamped
    with pytest.raises(ValueError, match="unknown KL kind 'k9'"):
        kl_penalty(logp, ref, "k9")


def test_kl_loss_term() -> None:
    out = kl_loss(T([[0.1, 0.3, 9.0]]), torch.zeros(1, 3), T([[1.0, 1.0, 0.0]]), "k1")
    assert out.item() == pytest.approx(0.2)


def test_apply_kl_penalty_fixed() -> None:
    ctrl = FixedKLController(0.5)
    rewards, m = apply_kl_penalty(
        T([[0.0, 1.0], [0.0, 2.0]]),
        T([[0.1, 0.3], [0.2, 0.5]]),
        torch.zeros(2, 2),
        T([[1.0, 1.0], [1.0, 0.0]]),
        ctrl,
        "k1",
    )
    close(rewards, [[-0.05, 0.85], [-0.1, 2.0]])
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.2)
    assert m["actor/reward_kl_penalty_coeff"] == 0.5 and ctrl.value == 0.5


def test_adaptive_kl_controller() -> None:
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    ctrl.update(0.15, n_steps=2)  # error 0.5 clipped to 0.2 -> *1.04
    assert ctrl.value == pytest.approx(0.104)
    ctrl.update(0.09, n_steps=5)  # error -0.1 -> *0.95
    assert ctrl.value == pytest.approx(0.0988)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


# ------------------------------------------------------------------ rollout correction (TIS)
def test_rollout_importance_weights_token_and_sequence_by_hand():
    from polyrl.algo import rollout_importance_weights

    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rollout = T([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    # old - rollout: row 0 ln2, ln4, (masked ln8); row 1 -ln2, (masked).
    old = rollout + T([[math.log(2), math.log(4), math.log(8)], [-math.log(2), 5.0, 5.0]])
    w, m = rollout_importance_weights(old, rollout, mask, "token", threshold=3.0)
    close(w, [[2.0, 3.0, 1.0], [0.5, 1.0, 1.0]])  # truncated at 3; 1 off the mask
    assert m["rollout_is_mean"] == pytest.approx((2 + 4 + 0.5) / 3)
    assert m["rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_is_clipfrac"] == pytest.approx(1 / 3)
    w, m = rollout_importance_weights(old, rollout, mask, "sequence", threshold=3.0)
    # Row 0: exp(ln2 + ln4) = 8, truncated to 3 on both tokens; row 1: 0.5.
    close(w, [[3.0, 3.0, 1.0], [0.5, 1.0, 1.0]])
    assert m["rollout_is_mean"] == pytest.approx((8 + 0.5) / 2)
    assert m["rollout_is_max"] == pytest.approx(8.0)
    assert m["rollout_is_clipfrac"] == pytest.approx(0.5)
    assert not w.requires_grad


def test_rollout_importance_weights_refuse_bad_settings():
    from polyrl.algo import rollout_importance_weights

    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="level"):
        rollout_importance_weights(x, x, mask, "geometric")
    with pytest.raises(ValueError, match="threshold"):
        rollout_importance_weights(x, x, mask, "token", threshold=0.5)
    with pytest.raises(ValueError, match="shape"):
        rollout_importance_weights(x, torch.zeros(1, 3), mask)
