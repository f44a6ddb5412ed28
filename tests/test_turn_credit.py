"""Per-turn credit: turn rewards kept per turn, and turn_grpo on hand-computed trajectories."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrl.algo.advantages import get_advantage_estimator, turn_spans
from polyrl.core.batch import Batch
from polyrl.core.columns import ADVANTAGES, LOSS_MASK, RETURNS, TOKEN_LEVEL_SCORES, UID
from polyrl.trainer.rl.advantage import compute_advantages, place_turn_rewards

# Row 0: three turns (rewards 0, 1, 2); row 1: two turns (rewards 1, 0); same group.
MASK = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1, 0, 1, 1, 0, 0, 0]], dtype=torch.float32)
REWARDS = torch.zeros(2, 7)
REWARDS[0, 1], REWARDS[0, 4], REWARDS[0, 6] = 0.0, 1.0, 2.0
REWARDS[1, 0], REWARDS[1, 3] = 1.0, 0.0


def test_turn_spans_are_the_masks_runs():
    assert turn_spans(MASK[0]) == [(0, 2), (3, 5), (6, 7)]
    assert turn_spans(MASK[1]) == [(0, 1), (2, 4)]
    assert turn_spans(torch.zeros(3)) == []


def test_turn_grpo_by_hand():
    est = get_advantage_estimator("turn_grpo")
    adv, ret = est(REWARDS, MASK, index=["a", "a"], gamma=0.5)
    # Returns: row 0: G2 = 2, G1 = 1 + .5 * 2 = 2, G0 = 0 + .5 * 2 = 1; row 1: G1 = 0, G0 = 1.
    assert ret[0].tolist() == [1, 1, 0, 2, 2, 0, 2]
    assert ret[1].tolist() == [1, 0, 0, 0, 0, 0, 0]
    # Turn 0: returns (1, 1): no difference, 0. Turn 1: (2, 0): mean 1, Bessel std sqrt(2).
    # Turn 2: row 0 alone: 0.
    s = 1 / math.sqrt(2)
    assert adv[0].tolist() == pytest.approx([0, 0, 0, s, s, 0, 0], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([0, 0, -s, -s, 0, 0, 0], abs=1e-5)
    adv, _ = est(REWARDS, MASK, index=["a", "a"], gamma=0.5, norm_adv_by_std=False)
    assert adv[0].tolist() == pytest.approx([0, 0, 0, 1, 1, 0, 0])
    assert adv[1].tolist() == pytest.approx([0, 0, -1, -1, 0, 0, 0])
    # Other groups are separate: the same rows in two groups have no peers.
    adv, _ = est(REWARDS, MASK, index=["a", "b"], gamma=0.5)
    assert not adv.any()


def test_turn_grpo_with_one_turn_is_grpo():
    torch.manual_seed(0)
    mask = torch.zeros(6, 5)
    for i, n in enumerate([5, 3, 4, 2, 5, 1]):
        mask[i, :n] = 1
    rewards = torch.zeros(6, 5)
    rewards[torch.arange(6), mask.sum(1).long() - 1] = torch.randn(6)
    index = [0, 0, 0, 1, 1, 1]
    a, _ = get_advantage_estimator("turn_grpo")(rewards, mask, index=index)
    b, _ = get_advantage_estimator("grpo")(rewards, mask, index=index)
    assert torch.allclose(a, b, atol=1e-5)


def test_turn_rewards_are_placed_per_turn_and_sum_to_the_score():
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 0, 1]], dtype=torch.float32)
    scores = torch.tensor([3.5, 3.5])
    turn_rewards = np.empty(2, dtype=object)
    turn_rewards[0], turn_rewards[1] = [1.0, 2.0], [1.0]  # row 1: two turns, one reward
    out, placed = place_turn_rewards(scores, mask, turn_rewards)
    assert placed == 1
    # Row 0: each reward on its turn's last token; the scorer's extra 0.5 on the last token.
    assert out[0].tolist() == [0, 0, 1.0, 0, 2.5]
    assert out[1].tolist() == [0, 0, 0, 0, 3.5]  # disagreeing counts: the usual layout


def test_compute_advantages_with_turn_grpo_from_the_config():
    from polyrl.config import load_config

    cfg = load_config("grpo", ["algorithm.adv_estimator=turn_grpo", "algorithm.gamma=0.5"])
    batch = Batch(
        tensors={LOSS_MASK: MASK.clone(), TOKEN_LEVEL_SCORES: REWARDS.clone()},
        non_tensors={UID: np.array(["a", "a"], dtype=object)},
    )
    compute_advantages(batch, cfg, kl_ctrl=None, baseline=None)
    s = 1 / math.sqrt(2)
    assert batch[ADVANTAGES][0].tolist() == pytest.approx([0, 0, 0, s, s, 0, 0], abs=1e-5)
    assert batch[RETURNS][0].tolist() == [1, 1, 0, 2, 2, 0, 2]


@pytest.mark.slow
def test_grpo_with_turn_credit_trains_on_an_environments_step_rewards(tmp_path, monkeypatch):
    """The env loop's step rewards reach turn_grpo per turn in a real GRPO run."""
    import dataclasses
    import json

    from polyrl.agent.envs import Env, register_env
    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    @register_env("test_short_turns")
    class ShortTurns(Env):
        """Three turns; each step rewards a short turn (a dense per-turn signal)."""

        def reset(self, seed=None, **kwargs):
            self.turns = 0
            return "Say something short."

        def step(self, action):
            self.turns += 1
            return "Again.", -len(action) / 20.0, self.turns >= 3, {}

    out = tmp_path / "run"
    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={out}",
            "agent.enable=true",
            "agent.default_loop=env",
            "algorithm.adv_estimator=turn_grpo",
            "algorithm.gamma=0.9",
            "agent.max_turns=3",
            "model.tiny_size=nano",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=4",
            "rollout.max_new_tokens=6",
            "data.max_response_length=96",
            "data.max_prompt_length=256",
            "trainer.total_steps=1",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.worker_backend=local",
            "reward.num_workers=1",
        ],
    )
    stops = list(range(20, 1024, 3))  # the random model's turns end early: all 3 are played
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, stop_token_ids=stops))
    from polyrl.agent import env_loop

    original = env_loop.EnvAgentLoop.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "env": "test_short_turns"})

    # The demo rows name no environment: the loop's default becomes this one.
    monkeypatch.setattr(env_loop.EnvAgentLoop, "__init__", init)
    RLTrainer(cfg).fit()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "critic/score/mean" in r]
    assert len(steps) == 1
    for r in steps:
        # A turn cut by max_new_tokens ends its episode early, still with one reward per turn.
        assert r["num_turns/mean"] > 2.0 and r["turn_credit/rows_per_turn"] == 1.0
        assert r["critic/score/mean"] < 0 and r["actor/grad_norm"] > 0
