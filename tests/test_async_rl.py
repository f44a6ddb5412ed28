"""Asynchronous RL: the replay buffer, the staleness gate, and one_step_off / async runs.

The end-to-end runs use real rollout servers (HTTP subprocesses), real engines and, for the
Ray run, real Ray; the checks read what the run recorded: ``async_samples.jsonl`` (every trained
group with the weight versions of its tokens) and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_rl_trainer import _e2e_overrides

from polyrl.config import ConfigError, load_config
from polyrl.trainer.rl.asynchronous import AheadRollout, gate_limit, staleness_metrics
from polyrl.transfer.replay import BufferClosedError, ReplayBuffer

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ replay buffer
def _filled(buffer: ReplayBuffer, versions: list[int], stds: list[float] | None = None) -> list:
    serials = buffer.reserve([{"index": i} for i in range(len(versions))])
    for k, (serial, version) in enumerate(zip(serials, versions, strict=True)):
        buffer.fill(serial, f"group{serial}", version, (stds or [0.0] * len(versions))[k])
    return serials


def test_fifo_waits_for_its_oldest_group_even_when_younger_ones_are_ready():
    buffer = ReplayBuffer(max_staleness=1)
    a, b, c = buffer.reserve([{"index": 7}, {"index": 8}, {"index": 9}])
    buffer.fill(b, "b", 0)
    buffer.fill(c, "c", 0)
    with pytest.raises(TimeoutError):
        buffer.take(2, trainer_version=0, timeout=0.2)
    threading.Timer(0.2, buffer.fill, args=(a, "a", 0)).start()
    taken = buffer.take(2, trainer_version=0, timeout=5)
    assert [e.item for e in taken] == ["a", "b"]
    assert [e.payload["index"] for e in taken] == [7, 8]
    assert buffer.counts() == {"reserved": 0, "ready": 1, "dropped_stale": 0}


def test_other_samplers_order_by_freshness_or_reward_variance_and_take_due_groups_first():
    fresh = ReplayBuffer(max_staleness=2, sampling="freshest")
    _filled(fresh, [0, 2, 1])
    # At version 2 the group of version 0 is at the bound: it goes first, then the newest.
    assert [e.version for e in fresh.take(2, trainer_version=2)] == [0, 2]
    varied = ReplayBuffer(sampling="reward_variance")
    _filled(varied, [0, 0, 0], stds=[0.1, 0.9, 0.5])
    assert [e.score_std for e in varied.take(2, trainer_version=0)] == [0.9, 0.5]


def test_stale_groups_are_dropped_and_counted_and_reuse_goes_to_the_back():
    buffer = ReplayBuffer(max_staleness=1, sampling="freshest", max_reuse=2)
    _filled(buffer, [0, 3, 3])
    first = buffer.take(2, trainer_version=3)
    assert buffer.counts()["dropped_stale"] == 1  # version 0 is 3 behind
    assert [e.uses for e in first] == [1, 1]
    second = buffer.take(2, trainer_version=3)
    assert sorted(e.serial for e in second) == sorted(e.serial for e in first)
    assert [e.uses for e in second] == [2, 2]
    assert buffer.counts()["ready"] == 0  # used max_reuse times: gone


def test_state_round_trip_keeps_filled_groups_and_regenerates_unfilled_ones():
    buffer = ReplayBuffer(max_staleness=1)
    serials = buffer.reserve([{"index": i, "seed": 10 + i} for i in range(3)])
    buffer.fill(serials[1], {"rows": [1, 2]}, 4)
    restored = ReplayBuffer(max_staleness=1)
    restored.load_state_dict(buffer.state_dict())
    assert restored.unfilled() == [(0, {"index": 0, "seed": 10}), (2, {"index": 2, "seed": 12})]
    assert restored.next_serial == 3
    with pytest.raises(ValueError, match="reward_variance"):
        ReplayBuffer(sampling="reward_variance").load_state_dict(buffer.state_dict())
    with pytest.raises(KeyError, match="filled already"):
        restored.fill(1, "again", 4)


def test_generation_phases_number_versions_and_checkpoint_in_the_trainer_layout(tmp_path):
    """The step calls every phase alike: what differs by mode is in the phases' hooks."""
    from types import SimpleNamespace

    from polyrl.data.sampler import StatefulSampler
    from polyrl.trainer.rl.generation import SyncGeneration

    sync = SyncGeneration()
    assert sync.weight_version(step=3, updates=2) == 3  # a warm-up step pushed nothing
    assert sync.state_dict() == {}
    sync.load_state_dict({"ahead": {"buffer": {}}}, 2, 2)  # an async checkpoint resumes in sync
    cfg = load_config("demo", ["trainer.mode=async", "data.train_batch_size=2"])
    sampler = StatefulSampler(8, 2, shuffle=False)
    producer = SimpleNamespace(resume_aborted=False)
    ahead = AheadRollout(cfg, producer, list(range(8)), sampler, 4, tmp_path)
    assert ahead.weight_version(step=3, updates=2) == 2  # versions count updates
    ahead._reserve_batch()  # the rollout thread drew one batch
    state = ahead.state_dict()
    # The layout checkpoints have always had: the buffer under "ahead", the sampler position
    # taken with it replacing the trainer's own.
    assert set(state) == {"ahead", "sampler"} and set(state["ahead"]) == {"buffer"}
    assert state["sampler"] == sampler.state_dict()
    resumed = AheadRollout(cfg, producer, list(range(8)), sampler, 4, tmp_path)
    resumed.load_state_dict(state, step=1, version=1)
    assert [s for s, _ in resumed.buffer.unfilled()] == [0, 1]
    assert (resumed.completed_steps, resumed.version) == (1, 1)
    with pytest.raises(ConfigError, match="trainer.mode=sync run"):
        resumed.load_state_dict({"sampler": state["sampler"]}, step=1, version=1)


def test_a_failed_producer_or_a_closed_buffer_wakes_the_trainer():
    buffer = ReplayBuffer()
    buffer.reserve([{"index": 0}])
    threading.Timer(0.1, buffer.fail, args=(OSError("server gone"),)).start()
    with pytest.raises(RuntimeError, match="server gone"):
        buffer.take(1, trainer_version=0, timeout=5)
    closed = ReplayBuffer()
    closed.close()
    with pytest.raises(BufferClosedError):
        closed.take(1, trainer_version=0)


def test_gate_bounds_staleness_by_construction():
    # Group i is trained in step i // B + 1 by weights of version (step - 1); it starts when
    # the completed steps K (= the weight version it sees, at least) satisfy i < gate_limit.
    batch, bound = 4, 2
    for completed in range(6):
        limit = gate_limit(completed, bound, batch)
        for i in range(limit):
            trained_at_version = i // batch
            assert trained_at_version - completed <= bound
        assert (limit // batch) - completed == bound + 1  # the first group it holds back
    metrics = staleness_metrics(5, [3, 4, 5], [4, 5, 5])
    assert metrics == {
        "async/staleness_mean": 1.0,
        "async/staleness_max": 2.0,
        "async/span_max": 1.0,
    }


def test_modes_refuse_what_they_cannot_run_with():
    for override, key in [
        ("rollout.sleep_during_training=true", "rollout.sleep_during_training"),
        ("transfer.enable=true", "transfer.enable"),
        ("algorithm.filter_groups=true", "algorithm.filter_groups"),
    ]:
        from polyrl.trainer.rl.checks import check_mode

        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_mode(load_config("demo", ["trainer.mode=async", override]))
    cfg = load_config("demo", ["trainer.mode=async", "async.max_staleness=3"])
    assert cfg.async_rl.max_staleness == 3  # ``async.*`` is the command-line spelling
    with pytest.raises(ConfigError, match="trainer.mode"):
        load_config("demo", ["trainer.mode=asynchronous"])


def test_the_proximal_pass_runs_only_when_a_step_makes_several_updates():
    """With one update per step the proximal policy is the update's own detached forward."""
    from polyrl.trainer.rl.loop import RLTrainer

    def needs(*overrides: str) -> bool:
        return RLTrainer(load_config("demo", ["trainer.mode=async", *overrides])).need_old_log_probs

    assert not needs("async.correction=decoupled")  # demo: one mini-batch, one epoch
    assert not needs("async.correction=tis")
    assert needs("async.correction=decoupled", "actor.ppo_mini_batch_size=16")
    assert needs("async.correction=tis", "actor.ppo_epochs=2")


# ------------------------------------------------------------------------------ end to end
def _overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    # The RL trainer tests' small run (dense short-text reward), on local workers by default.
    return _e2e_overrides(tmp_path, name, "trainer.worker_backend=local", *extra)


def _samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "async_samples.jsonl").read_text().splitlines()]


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def _check_once_and_fresh(out: Path, steps: int, batch: int, bound: int) -> list[dict]:
    samples = _samples(out)
    # Every group reserved for the run was trained exactly once, in its step.
    assert sorted(s["serial"] for s in samples) == list(range(steps * batch))
    assert [s["step"] for s in samples] == [1 + s["serial"] // batch for s in samples]
    for s in samples:
        behind = [s["trainer_version"] - v for v in s["first_versions"]]
        assert 0 <= min(behind) and max(behind) <= bound, s
        assert len(s["first_versions"]) == 4  # rollout.n responses, none lost
    return samples


@pytest.mark.slow
def test_async_grpo_raises_the_reward_within_the_staleness_bound(tmp_path):
    # With the producer in a process of its own (async.producer=process): the groups it
    # streams back are trained each once, fresh enough, and the reward rises.
    from polyrl.trainer.rl.loop import RLTrainer

    cfg = load_config(
        "demo",
        _overrides(
            tmp_path,
            "async",
            "trainer.mode=async",
            "async.producer=process",
            "async.max_staleness=2",
            "trainer.total_steps=10",
            "actor.lr=0.01",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
        ),
    )
    RLTrainer(cfg).fit()
    out = tmp_path / "async"
    _check_once_and_fresh(out, steps=10, batch=8, bound=2)
    records = _records(out)
    scores = [r["critic/score/mean"] for r in records]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.05, scores
    assert max(r["async/staleness_max"] for r in records) <= 2
    assert records[-1]["async/staleness_max"] >= 1  # it did run ahead
    assert all(r["actor/rollout_is_mean"] > 0 for r in records)  # the correction is on


@pytest.mark.slow
def test_one_step_off_grpo_on_ray_trains_on_weights_one_step_old(tmp_path, ray_session):
    from polyrl.trainer.rl.loop import RLTrainer

    cfg = load_config(
        "demo",
        _overrides(
            tmp_path,
            "osf",
            "trainer.mode=one_step_off",
            "trainer.worker_backend=ray",
            "trainer.total_steps=8",
            "actor.lr=0.01",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
        ),
    )
    RLTrainer(cfg).fit()
    out = tmp_path / "osf"
    samples = _check_once_and_fresh(out, steps=8, batch=8, bound=1)
    for s in samples:
        # Generated entirely with the weights of the step before the one that trains on them.
        expected = max(s["trainer_version"] - 1, 0)
        assert set(s["first_versions"]) == set(s["last_versions"]) == {expected}, s
    scores = [r["critic/score/mean"] for r in _records(out)]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.05, scores


@pytest.mark.slow
def test_killed_async_run_with_resumed_partial_rollouts_trains_every_group_once(tmp_path):
    common = [
        "trainer.mode=async",
        "async.partial_rollout=resume",
        "async.max_staleness=1",
        "trainer.total_steps=4",
        "trainer.save_freq=2",
        "actor.lr=0.003",
        # Long responses, so weight pushes land in the middle of generations.
        "rollout.max_new_tokens=32",
        "data.max_response_length=32",
    ]
    out = tmp_path / "run"
    overrides = _overrides(tmp_path, "run", *common)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "demo", *overrides]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    # Killed once step 3 is logged: after the step-2 checkpoint, with groups generated ahead.
    while time.monotonic() < deadline:
        if marker.exists() and '"step": 3' in marker.read_text():
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    subprocess.run(
        [*cmd, "trainer.resume_mode=auto"],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
        stdout=subprocess.DEVNULL,
    )
    _check_once_and_fresh(out, steps=4, batch=8, bound=1)
    records = {r["step"]: r for r in _records(out)}
    assert sorted(records) == [1, 2, 3, 4]
    assert all("async/resumed_samples" in r for r in records.values())


def test_an_aborted_sample_resumes_from_its_tokens(agent_server, tiny_qwen2_tokenizer):
    # A weight push with inflight=abort ends in-flight samples with their partial tokens (here
    # an abort call stands for it); the producer continues each one as a new request whose
    # prompt is the old prompt plus those tokens, so nothing is lost or generated twice.
    import asyncio

    import torch

    from polyrl.reward import RewardManager
    from polyrl.trainer.rl.rollout import RolloutProducer

    cfg = load_config(
        "demo", ["rollout.max_new_tokens=384", "data.max_response_length=384", "rollout.n=2"]
    )
    # Nothing is scored here; the producer still needs a scorer (in-process: no workers).
    rewards = RewardManager(num_workers=0)
    producer = RolloutProducer.connect(cfg, [str(agent_server.url)], tiny_qwen2_tokenizer, rewards)
    producer.resume_aborted = True
    item = {"input_ids": torch.tensor(tiny_qwen2_tokenizer.encode("12+34="))}

    async def abort_midway() -> object:
        task = asyncio.ensure_future(producer.sample_prompt(item, 2, 1.0, seed=5, index=0))
        aborted = 0
        while not aborted and not task.done():  # abort once the request is running
            await asyncio.sleep(0.05)
            aborted = await producer.client.abort()
        return await task, aborted

    try:
        result, aborted = producer.run(abort_midway())
    finally:
        producer.stopping = True
        producer.run(producer.client.close())
    lengths = [(len(o.output_ids), o.finish_reason) for o in result.outputs]
    assert aborted >= 1 and producer.resumed_samples >= 1, lengths
    for out in result.outputs:
        assert out.finish_reason in ("length", "stop"), out.finish_reason
        assert 0 < len(out.output_ids) <= 384
        assert len(out.logprobs) == len(out.output_ids)


def test_the_producer_process_samples_and_scores_what_the_thread_producer_does(
    agent_server, tiny_qwen2_dir, tiny_qwen2_tokenizer
):
    # async.producer=process: the same group (prompt row, n, seed) comes back from the child
    # token for token and score for score; the trainer's routing calls reach the child's client.
    import asyncio

    import torch

    from polyrl.core.columns import INPUT_IDS, SCORE
    from polyrl.trainer.rl.producer_process import ProducerProcess
    from polyrl.trainer.rl.rollout import RolloutProducer, reward_manager

    cfg = load_config("demo", ["reward.num_workers=0", "rollout.max_new_tokens=8"])
    url = str(agent_server.url)
    item = {
        "input_ids": torch.tensor(tiny_qwen2_tokenizer.encode("12+34=")),
        "uid": "p0",
        "data_source": "arithmetic",
        "reward_model": {"ground_truth": "46"},
    }
    here = RolloutProducer.connect(cfg, [url], tiny_qwen2_tokenizer, reward_manager(cfg))
    try:
        want, want_metrics = here.run(here.produce_group(item, 3, 1.0, 7))
    finally:
        here.close()
    child = ProducerProcess(cfg, [url], tiny_qwen2_dir)
    try:
        got, got_metrics = child._loop.run_until_complete(child.produce_group(item, 3, 1.0, 7))
        assert torch.equal(got[INPUT_IDS], want[INPUT_IDS])
        assert torch.equal(got[SCORE], want[SCORE])
        assert list(got.non_tensors["response_text"]) == list(want.non_tensors["response_text"])
        assert got_metrics == want_metrics
        assert child.pad_id == here.pad_id
        # Held out of rotation with no wait for a replica: the child's request fails, as itself.
        from polyrl.rollout.client import NoReplicaAvailableError

        child.client.enable_replica(url, enabled=False)
        with pytest.raises(NoReplicaAvailableError, match="held out of rotation"):
            child._loop.run_until_complete(child.produce_group(item, 1, 1.0, 7))
        with pytest.raises(KeyError):
            child.client.enable_replica("http://127.0.0.1:9")
        assert child.client.retries == 0 and child.resumed_samples == 0
    finally:
        child.close()
    assert child.process.exitcode == 0
    with pytest.raises(RuntimeError, match="stopped"):
        asyncio.run(child.produce_group(item, 1, 1.0, 7))


def test_a_producer_process_failure_reaches_the_trainer_as_its_own_type():
    # The trainer's one-line stops dispatch on the type: a dead reward worker in the producer
    # process must not arrive as a plain RuntimeError (it would end in a traceback).
    from polyrl.reward.pool import RewardWorkerDiedError
    from polyrl.trainer.rl.producer_process import _child_error, _portable, _reply_error
    from polyrl.trainer.rl.supervisor import ReplicaLostError

    for exc in (
        RewardWorkerDiedError(4242, -9, 3),
        ReplicaLostError("http://127.0.0.1:9", "restart budget spent", "last line"),
    ):
        try:
            raise exc
        except Exception as raised:  # noqa: BLE001 - formatted with its traceback
            back = _child_error((_reply_error(raised), _portable(raised)))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert "in the rollout producer process" in back.__notes__[0]
    # One that does not survive pickling comes back as text, its type named.
    local = type("LocalOnly", (Exception,), {})
    back = _child_error((_reply_error(local("x")), _portable(local("x"))))
    assert type(back) is RuntimeError and "LocalOnly" in str(back)
