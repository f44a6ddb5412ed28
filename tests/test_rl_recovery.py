"""A run that loses a worker recovers and logs what an uninterrupted run logs.

Real Ray (CPU), the nano tiny model, real SIGKILLs. The actor's engine worker killed in the
middle of step 3's update (after the step-2 checkpoint): with ``trainer.max_restarts`` the run
is rebuilt, resumes from step 2 and reruns step 3. A reward worker killed as a step's scoring
starts: its samples are scored again by its replacement, without a rebuild. An engine worker
that keeps dying: the run stops after ``max_restarts`` rebuilds with one line that names the
worker, its node, the call and its log and says how to resume, and the same command run again
resumes and finishes as the uninterrupted run did. The uninterrupted run is made once.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

from polyrl.config import load_config
from polyrl.controller.worker_group import pid_alive
from polyrl.core.errors import RunAbortedError
from polyrl.trainer.rl import RLTrainer

pytestmark = pytest.mark.slow

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 50.0
"""


def _config(tmp_path: Path, name: str, *extra: str) -> Any:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return load_config(
        "demo",
        [
            f"trainer.output_dir={tmp_path / name}",
            f"reward.custom_function={reward}:compute_score",
            "trainer.worker_backend=ray",
            "trainer.device=cpu",
            "model.tiny_size=nano",
            "trainer.total_steps=4",
            "trainer.save_freq=2",
            "trainer.restart_backoff_s=0",
            "data.num_train=32",
            "data.num_val=4",
            "data.train_batch_size=4",
            "rollout.n=2",
            "rollout.replicas=1",
            "rollout.num_threads=1",
            "rollout.max_new_tokens=8",
            "data.max_response_length=8",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "reward.num_workers=1",
            *extra,
        ],
    )


class EngineKillingTrainer(RLTrainer):
    """SIGKILLs rank 0 of the actor's engine group as the update of the steps in ``at`` starts
    (each once); SIGKILLs the reward worker as the scoring of step ``reward_at`` starts, once
    an engine worker was killed (in the rebuilt run)."""

    killed = 0

    def __init__(self, cfg: Any, at: tuple[int, ...] = (3,), reward_at: int = 0) -> None:
        super().__init__(cfg)
        self.at, self.reward_at = list(at), reward_at
        self.reward_killed = 0

    def step(self, step: int) -> dict[str, float]:
        if step == self.reward_at and self.killed and not self.reward_killed:
            rewards = self.producer.rewards
            score = rewards.score

            def killing_score(batch: Any) -> Any:
                (pid,) = rewards.worker_pids
                os.kill(pid, signal.SIGKILL)
                # Dead before the batch is handed out (the pool reaps it itself).
                wait_until(lambda: not pid_alive(pid), "the reward worker is dead")
                self.reward_killed += 1
                rewards.score = score
                return score(batch)

            rewards.score = killing_score
        if self.at and step == self.at[0]:
            self.at.pop(0)
            actor = self.actor
            update = actor.update_actor
            self.actor_info = self._groups[0].worker_info[0]
            pid = self.actor_info.pid

            def killing_update(*args: Any, **kwargs: Any) -> Any:
                self.killed += 1
                os.kill(pid, signal.SIGKILL)
                return update(*args, **kwargs)

            actor.update_actor = killing_update  # type: ignore[method-assign]
        return super().step(step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_session) -> Path:
    """The run the broken ones must match, made once."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    RLTrainer(_config(tmp_path, "full")).fit()
    return tmp_path / "full"


def _comparable(path: Path) -> dict[int, dict]:
    """Each step's record without what depends on time or on the failure itself."""
    out = {}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "critic/score/mean" not in r:
            continue
        out[r["step"]] = {
            k: v
            for k, v in r.items()
            if not k.startswith(("timing_s/", "perf/", "recovery/")) and k != "time"
        }
    return out


def _assert_same(a: dict, b: dict) -> None:
    """Each step of ``b`` logged what the same step of ``a`` did."""
    for step in b:
        mine, theirs = dict(a[step]), dict(b[step])
        # The server's own log-probs depend (in the last bits) on how it batched requests.
        gap_a = mine.pop("rollout/log_prob_gap", 0.0)
        gap_b = theirs.pop("rollout/log_prob_gap", 0.0)
        assert gap_a == pytest.approx(gap_b, abs=1e-6)
        assert mine == theirs, step


def _records(path: Path) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def test_killed_workers_are_recovered_until_max_restarts_and_a_relaunch_resumes(
    tmp_path, uninterrupted
):
    # One run covers it all: step 3's update loses its engine worker (rebuilt from step 2);
    # the rerun's scoring loses the reward worker (scored again, no rebuild); step 4's update
    # loses the engine worker again: max_restarts=1 is spent, the run stops in one line.
    cfg = _config(tmp_path, "run", "trainer.max_restarts=1")
    trainer = EngineKillingTrainer(cfg, at=(3, 4), reward_at=3)
    with pytest.raises(RunAbortedError) as caught:
        trainer.fit()
    assert trainer.killed == 2 and trainer.reward_killed == 1
    a, b = _comparable(uninterrupted), _comparable(tmp_path / "run")
    assert sorted(b) == [1, 2, 3]  # step 3 logged once, as rerun
    _assert_same(a, b)
    steps = _records(tmp_path / "run")
    assert [r["recovery/restarts"] for r in steps] == [0, 0, 1]
    # The reward worker's death cost no rebuild and no sample: its batch was scored again.
    assert [r["recovery/reward_worker_deaths"] for r in steps] == [0, 0, 1]
    assert [r["reward/errors"] for r in steps] == [0, 0, 0]

    message = str(caught.value)
    assert "\n" not in message and "\x1b[" not in message and "pid=" not in message, message
    info = trainer.actor_info
    where = f"(pid {info.pid} on node {info.node_ip} (id {info.node_id[:12]}))"
    assert f"worker rank 0 {where} died during " in message, message
    assert "its log " in message and "after 1 restart(s); trainer.max_restarts=1" in message
    assert "trainer.resume_mode=auto" in message and "global_step_2" in message
    # Ray's colour codes and worker prefixes reach no file of the run.
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".json", ".log", ".txt", ".yaml"):
            text = path.read_text(errors="replace")
            assert "\x1b[" not in text and "pid=" not in text, path

    # The same command again: it resumes from the newest checkpoint and finishes the run as
    # the uninterrupted one did.
    summary = RLTrainer(_config(tmp_path, "run", "trainer.max_restarts=1")).fit()
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("global_step_2")
    b = _comparable(tmp_path / "run")
    assert sorted(b) == [1, 2, 3, 4]
    _assert_same(a, b)
