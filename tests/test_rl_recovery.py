"""A run that loses an engine worker rebuilds itself from its last checkpoint and goes on.

Real Ray (CPU), the nano tiny model: the actor's engine worker is killed with SIGKILL in the
middle of step 3's update (after the step-2 checkpoint). With ``trainer.max_restarts`` the run
is rebuilt, resumes from step 2, reruns step 3 and logs what an uninterrupted run logs; with 0
it stops with one line that names the worker and the call and says how to resume.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from polyrl.config import load_config
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
    """SIGKILLs rank 0 of the actor's engine group as step 3's update starts (once)."""

    killed = 0

    def step(self, step: int) -> dict[str, float]:
        if step == 3 and not self.killed:
            actor = self.actor
            update = actor.update_actor
            pid = self._groups[0].worker_info[0].pid

            def killing_update(*args: Any, **kwargs: Any) -> Any:
                self.killed += 1
                os.kill(pid, signal.SIGKILL)
                return update(*args, **kwargs)

            actor.update_actor = killing_update  # type: ignore[method-assign]
        return super().step(step)


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


def test_a_killed_engine_worker_is_rebuilt_and_the_run_matches_an_uninterrupted_one(
    tmp_path, ray_session
):
    RLTrainer(_config(tmp_path, "full")).fit()
    trainer = EngineKillingTrainer(_config(tmp_path, "broken", "trainer.max_restarts=2"))
    summary = trainer.fit()
    assert trainer.killed == 1 and summary["steps"] == 4
    a, b = _comparable(tmp_path / "full"), _comparable(tmp_path / "broken")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]  # step 3 logged once, as rerun
    for step in a:
        # The server's own log-probs depend (in the last bits) on how it batched requests.
        gap_a = a[step].pop("rollout/log_prob_gap", 0.0)
        gap_b = b[step].pop("rollout/log_prob_gap", 0.0)
        assert gap_a == pytest.approx(gap_b, abs=1e-6)
        assert a[step] == b[step], step
    records = [
        json.loads(line)
        for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["recovery/restarts"] for r in records if "critic/score/mean" in r] == [0, 0, 1, 1]


def test_without_restarts_a_killed_engine_worker_stops_the_run_in_one_line(tmp_path, ray_session):
    trainer = EngineKillingTrainer(_config(tmp_path, "run", "trainer.max_restarts=0"))
    with pytest.raises(RunAbortedError) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "\n" not in message
    assert "worker rank 0 died during actor.update_actor" in message, message
    assert "trainer.resume_mode=auto" in message and "global_step_2" in message
