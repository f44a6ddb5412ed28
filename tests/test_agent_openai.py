"""Agents written against the stock openai client, recorded through the proxy and trained."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import textwrap

import pytest

from polyrl.agent import collate_trajectories, run_agent_loops
from polyrl.rollout.client import RolloutClient

# A third of the vocabulary ends a turn: the random tiny model writes short turns.
STOP_IDS = list(range(20, 1024, 3))

AGENTS = '''
import asyncio

SEEN = []  # per episode: the server's token ids of each call, as the proxy returned them


def _ids(completion):
    return list(completion.model_extra["token_ids"])


async def two_calls(client, task):
    """Two calls with a local tool round-trip between them (the usual chat agent)."""
    msgs = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    reply = first.choices[0].message.content or ""
    msgs += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"tool says: {len(reply)}"},
    ]
    second = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
    answer = second.choices[0].message.content or ""
    SEEN.append(_ids(first) + _ids(second))
    # Dense and learnable by a random tiny model: fewer tokens (an earlier stop) score higher.
    tokens = first.usage.completion_tokens + second.usage.completion_tokens
    return -tokens / 12.0, {"chars": len(reply) + len(answer), "x": "text"}


async def raises(client, task):
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    raise RuntimeError("the agent broke")


async def hangs(client, task):
    await asyncio.sleep(60)
    return 1.0


async def rewrites(client, task):
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "one"}], max_tokens=2
    )
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "another"}], max_tokens=2
    )
    return 1.0


SEGMENTS = []  # per episode of `summarises`: the server's ids of each extending chain


async def summarises(client, task):
    """Two calls, then a rewritten history (a summary) and one call extending it."""

    async def call(msgs):
        out = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        return out.choices[0].message.content or "", _ids(out)

    msgs = [{"role": "user", "content": task["question"]}]
    reply, a = await call(msgs)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    reply, b = await call(msgs)
    msgs = [{"role": "user", "content": f"summary: {len(reply)} chars so far"}]
    reply, c = await call(msgs)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "finish"}]
    _, d = await call(msgs)
    SEGMENTS.append([a + b, c + d])
    return 0.5


async def no_reward(client, task):
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return "great"


async def silent(client, task):
    return 1.0
'''


@pytest.fixture
def agents(tmp_path, monkeypatch):
    """The module of test agents, importable as ``openai_test_agents``."""
    (tmp_path / "openai_test_agents.py").write_text(textwrap.dedent(AGENTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("openai_test_agents", None)
    import openai_test_agents

    yield openai_test_agents
    sys.modules.pop("openai_test_agents", None)


def _episodes(url, tok, entrypoint, samples, **kwargs):
    async def main():
        async with RolloutClient([url], health_interval=0) as client:
            return await run_agent_loops(
                samples,
                client,
                tok,
                default_agent="openai_agent",
                loop_kwargs={
                    "openai_agent": {
                        "entrypoint": entrypoint,
                        "max_response_length": 64,
                        "sampling_params": {"temperature": 1.0, "stop_token_ids": STOP_IDS},
                        **kwargs,
                    }
                },
            )

    return asyncio.run(main())


def test_an_openai_agents_episode_is_one_token_exact_trajectory(
    agent_server, tiny_qwen2_tokenizer, agents
):
    samples = [
        {"question": f"what is {i}?", "seed": 10 + i, "input_ids": [1, 2, 3]} for i in range(3)
    ]
    trajs = _episodes(
        agent_server.url, tiny_qwen2_tokenizer, "openai_test_agents:two_calls", samples
    )
    assert len(agents.SEEN) == 3
    seen = sorted(map(tuple, agents.SEEN))
    trained = []
    for t in trajs:
        t.validate()
        assert t.num_turns == 2 and t.agent_name == "openai_agent"
        assert t.metrics["agent/failed"] == 0.0 and t.metrics["agent/calls"] == 2.0
        assert t.metrics["agent_info/chars"] >= 0 and "agent_info/x" not in t.metrics
        assert t.reward is not None and t.reward <= 0.0
        # model tokens (mask 1), then the template's tokens for the tool message (mask 0),
        # then model tokens again: one trajectory, the second prompt extended the first.
        mask = t.response_mask
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(t.rollout_log_probs, mask, strict=True) if m == 0)
        trained.append(tuple(i for i, m in zip(t.response_ids, mask, strict=True) if m == 1))
    # Every trained token is what the server generated, in order, and nothing else is trained.
    assert sorted(trained) == seen
    batch = collate_trajectories(trajs, pad_token_id=0)
    assert batch.meta["agent_metrics"]["agent/failed/mean"] == 0.0


def test_failing_hanging_and_non_extending_agents_are_counted_never_trained(
    agent_server, tiny_qwen2_tokenizer, agents
):
    cases = {
        "raises": "error",
        "hangs": "timed_out",
        "rewrites": "non_extending",
        "no_reward": "bad_reward",
        "silent": "no_calls",
    }
    for name, why in cases.items():
        sample = {"question": "q", "seed": 1, "raw_prompt": [{"role": "user", "content": "q"}]}
        (t,) = _episodes(
            agent_server.url,
            tiny_qwen2_tokenizer,
            f"openai_test_agents:{name}",
            [sample],
            timeout_s=1.0,
            non_extending="refuse",
        )
        t.validate()
        assert t.response_ids == [] and t.reward == 0.0, name
        assert t.finish_reason == f"agent_{why}", name
        assert t.metrics["agent/failed"] == 1.0 and t.metrics[f"agent/{why}"] == 1.0, name
        assert t.prompt_ids  # the dataset's prompt: the row keeps its place in its group


def test_a_rewritten_history_splits_the_episode_into_linked_samples(
    agent_server, tiny_qwen2_tokenizer, agents
):
    from polyrl.core.columns import EPISODE

    samples = [{"question": f"q{i}", "seed": 3 + i, "input_ids": [1, 2]} for i in range(2)]
    trajs = _episodes(
        agent_server.url, tiny_qwen2_tokenizer, "openai_test_agents:summarises", samples
    )
    # Each episode is two linked samples (one per extending chain), in sample order.
    assert [t.episode for t in trajs] == [0, 0, 1, 1]
    assert len(agents.SEGMENTS) == 2
    expected = sorted(tuple(map(tuple, seg)) for seg in agents.SEGMENTS)
    got = []
    for first, second in (trajs[:2], trajs[2:]):
        for t in (first, second):
            assert t.reward == 0.5 and t.num_turns == 2
            assert t.metrics["agent/linked_samples"] == 2.0 and t.metrics["agent/failed"] == 0.0
            mask = t.response_mask
            assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # model, user msg, model
        # The second sample's prompt is the rewritten history, not the first's context.
        assert first.prompt_ids != second.prompt_ids
        got.append(
            tuple(
                tuple(i for i, m in zip(t.response_ids, t.response_mask, strict=True) if m == 1)
                for t in (first, second)
            )
        )
    # Token for token what the server generated, each chain in its own sample.
    assert sorted(got) == expected
    batch = collate_trajectories(trajs, pad_token_id=0)
    assert batch.non_tensors[EPISODE].tolist() == [0, 0, 1, 1]
    from polyrl.trainer.rl.rollout import _episode_heads

    assert _episode_heads(batch) == [0, 2]  # validation counts each episode once


def test_linked_samples_share_their_episodes_group_advantage():
    """A hand-built group: 4 episodes (rewards 1, 0, 1, 0) in 7 rows. The baseline counts
    each episode once: mean 0.5, Bessel std sqrt(1/3), advantages +-0.866 on every row of an
    episode (the row-weighted mean 5/7 would give other numbers)."""
    import torch

    from polyrl.trainer.rl.advantage import episode_advantages

    episodes = [0, 0, 1, 2, 2, 2, 3]
    reward = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}
    lengths = [2, 3, 1, 4, 2, 1, 3]
    mask = torch.zeros(7, 5)
    rewards = torch.zeros(7, 5)
    for row, (e, n) in enumerate(zip(episodes, lengths, strict=True)):
        mask[row, :n] = 1
        rewards[row, n - 1] = reward[e]  # the episode's reward on each row's last token
    adv, returns = episode_advantages("grpo", rewards, mask, ["g"] * 7, episodes)
    expected = {0: 0.8660254, 1: -0.8660254, 2: 0.8660254, 3: -0.8660254}
    for row, e in enumerate(episodes):
        assert torch.allclose(adv[row], expected[e] * mask[row], atol=1e-5), (row, adv[row])
    assert torch.equal(adv, returns)
    # Without links the caller estimates as usual; an estimator with no per-episode number
    # is refused with what to do instead.
    assert episode_advantages("grpo", rewards, mask, ["g"] * 7, list(range(7))) is None
    with pytest.raises(ValueError, match="agent.non_extending=refuse"):
        episode_advantages("turn_grpo", rewards, mask, ["g"] * 7, episodes)


def test_linked_samples_refuse_estimators_without_an_episode_advantage():
    from polyrl.config import load_config
    from polyrl.config.options import ConfigError
    from polyrl.trainer.rl.checks import check_linked_samples

    spec = "agent.entrypoint=examples/openai_agent.py:agent"
    with pytest.raises(ConfigError, match="algorithm.adv_estimator"):
        check_linked_samples(load_config("grpo", [spec, "algorithm.adv_estimator=turn_grpo"]))
    check_linked_samples(
        load_config(
            "grpo", [spec, "algorithm.adv_estimator=turn_grpo", "agent.non_extending=refuse"]
        )
    )


def test_entrypoint_alone_makes_the_agent_the_rollout():
    from polyrl.config import load_config
    from polyrl.config.options import ConfigError

    cfg = load_config("grpo", ["agent.entrypoint=examples/openai_agent.py:agent"])
    assert cfg.agent.enable and cfg.agent.default_loop == "openai_agent"
    with pytest.raises(ConfigError, match="agent.entrypoint"):
        load_config("grpo", ["agent.default_loop=openai_agent"])
    from polyrl.agent.openai_agent import load_entrypoint

    with pytest.raises(ValueError, match="async function"):
        load_entrypoint("json:dumps")


@pytest.mark.slow
def test_grpo_trains_an_openai_agent_token_exactly(tmp_path, agents, monkeypatch):
    """A few GRPO steps of the two-call agent on real servers: the reward (shorter answers
    score higher) rises, and every trained token id is one the server generated."""
    import polyrl.agent.base as agent_base
    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    batches = []
    collate = agent_base.collate_trajectories

    def keep(trajectories, pad_token_id):
        batch = collate(trajectories, pad_token_id)
        ids, mask = batch["input_ids"].clone(), batch["loss_mask"].clone()
        batches.append((ids, mask, [t.agent_name for t in trajectories]))
        return batch

    monkeypatch.setattr(agent_base, "collate_trajectories", keep)
    agents.SEEN.clear()
    out = tmp_path / "run"
    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={out}",
            "agent.entrypoint=openai_test_agents:two_calls",
            "agent.timeout_s=60",
            "model.tiny_size=nano",
            "data.num_train=64",
            "data.train_batch_size=4",
            "rollout.n=4",
            "rollout.max_new_tokens=6",
            "data.max_response_length=48",
            "data.max_prompt_length=256",
            "trainer.total_steps=5",
            "actor.lr=0.05",
            "actor.ppo_mini_batch_size=2",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.worker_backend=local",
            "reward.num_workers=1",
        ],
    )
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, stop_token_ids=STOP_IDS)
    )
    # The demo rows have no "question": the agent asks the dataset's prompt text instead.
    monkeypatch.setattr(
        agents,
        "two_calls",
        _with_question(agents.two_calls),
    )
    RLTrainer(cfg).fit()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "critic/score/mean" in r]
    assert len(steps) == 5
    scores = [r["critic/score/mean"] for r in steps]
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2, scores
    for r in steps:
        assert r["agent/failed/mean"] == 0.0 and r["agent/calls/mean"] == 2.0
        assert r["actor/num_tokens"] < r["perf/response_tokens"]  # tool tokens are masked
    trained = []
    for ids, mask, names in batches:
        assert set(names) == {"openai_agent"}
        # loss_mask spans prompt + response: 1 exactly on the model's tokens.
        trained += [tuple(ids[row][mask[row] > 0].tolist()) for row in range(len(ids))]
    assert sorted(trained) == sorted(map(tuple, agents.SEEN))


def _with_question(fn):
    async def agent(client, task):
        text = task["raw_prompt"][0]["content"]
        return await fn(client, {**task, "question": str(text)})

    return agent
