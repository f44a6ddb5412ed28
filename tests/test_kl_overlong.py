"""KL estimators ``abs`` and ``full`` and DAPO overlong filtering, on hand-built tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.algo import kl_penalty
from polyrl.config import ConfigError, load_config
from polyrl.config.schema import KL_ESTIMATORS
from polyrl.core.batch import Batch
from polyrl.trainer.rl.advantage import advantage_phase, filter_overlong


def test_abs_kl_is_the_absolute_log_ratio():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    ln2 = math.log(2.0)
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([[ln2, ln2]]))


def test_full_kl_matches_the_hand_computed_divergence():
    # Two positions over a vocabulary of 3: KL(p || q) = sum p log(p / q).
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]])
    expected = [
        0.5 * math.log(2.0) + 0.0 + 0.25 * math.log(0.5),  # = 0.25 ln 2
        math.log(2.0),  # the zero-probability tokens add nothing (0 log 0 = 0)
    ]
    out = kl_penalty(p.log(), q.log(), "full")
    assert out.shape == (2,)
    assert torch.allclose(out, torch.tensor(expected), atol=1e-6)
    # Equal distributions: exactly zero; the batch dims are kept.
    same = torch.log_softmax(torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.allclose(kl_penalty(same, same, "full"), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="whole log-distributions"):
        kl_penalty(torch.zeros(3, 1), torch.zeros(3, 1), "full")


def test_new_estimators_are_config_choices_and_full_is_refused_by_the_trainer():
    from polyrl.trainer.rl.checks import check_config

    assert {"abs", "full"} <= set(KL_ESTIMATORS)
    cfg = load_config("grpo", ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=abs"])
    check_config(cfg)  # abs runs in the trainer
    cfg = load_config("grpo", ["actor.use_kl_loss=true", "actor.kl_loss_type=full"])
    with pytest.raises(ConfigError, match=r"actor.kl_loss_type.*whole vocabulary"):
        check_config(cfg)
    with pytest.raises(ConfigError, match="algorithm.overlong_filter"):
        check_config(
            load_config("grpo", ["algorithm.overlong_filter=true", "transfer.enable=true"])
        )


def _batch(finish: list[str] | None) -> Batch:
    # Three responses of one group with a cap of 3: lengths 3 (cut), 2 and 3 (ended on EOS).
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    batch = Batch(
        tensors={
            "loss_mask": mask,
            "response_length": torch.tensor([3, 2, 3]),
            "prompt_length": torch.tensor([1, 1, 1]),
            "attention_mask": torch.ones(3, 4, dtype=torch.long),
            "score": torch.tensor([1.0, 0.0, 0.5]),
            "acc": torch.tensor([1.0, 0.0, 0.0]),
        },
        non_tensors={"uid": np.array(["a", "a", "a"], dtype=object)},
    )
    if finish is not None:
        batch.non_tensors["finish_reason"] = np.array(finish, dtype=object)
    return batch


def test_filter_overlong_masks_only_truncated_rows():
    batch = _batch(["length", "stop", "stop"])
    assert filter_overlong(batch, 3) == 1  # the finish reason tells the EOS-ended row apart
    assert batch["loss_mask"].sum(dim=1).tolist() == [0.0, 2.0, 3.0]
    batch = _batch(None)  # no finish reasons: the length at the cap decides
    assert filter_overlong(batch, 3) == 2
    assert batch["loss_mask"].sum(dim=1).tolist() == [0.0, 2.0, 0.0]


def test_advantage_phase_filters_after_the_group_baseline():
    cfg = load_config("grpo", ["algorithm.overlong_filter=true", "algorithm.norm_adv_by_std=false"])
    batch = _batch(["length", "stop", "stop"])
    written, metrics = advantage_phase(batch, cfg, None, 3)
    assert "loss_mask" in written
    assert metrics["actor/overlong_filtered"] == 1.0
    assert metrics["actor/overlong_filtered_fraction"] == pytest.approx(1 / 3)
    # The group mean is 0.5 with the cut row included: the others' advantages are -0.5 and 0.
    adv = batch["advantages"]
    assert adv[1, 1].item() == pytest.approx(-0.5)
    assert adv[2, 1].item() == pytest.approx(0.0)
    assert batch["loss_mask"][0].sum().item() == 0.0
