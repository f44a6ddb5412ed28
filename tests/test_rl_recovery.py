"""A run that loses a worker recovers and logs what an uninterrupted run logs.

Real Ray (CPU), the nano tiny model, runs of three steps, real SIGKILLs, one uninterrupted run
made once for all.
With ``trainer.max_restarts=2`` one run loses each kind of worker: the rollout replica's Ray
actor in the middle of step 2's generation (a new actor takes its place, the requests it lost
are sent again), the actor's engine worker in the middle of step 3's update (after the step-2
checkpoint: the run is rebuilt, resumes from step 2 and reruns step 3) and the reward worker as
the rerun's scoring starts (its samples are scored again by its replacement, without a
rebuild); it finishes and each step logged what the uninterrupted run's did. With
``trainer.max_restarts=0`` a killed reward worker stops the run with one line that names it and
says how to resume, and the same command run again resumes and finishes as the uninterrupted
run did. That a run stops once ``max_restarts`` rebuilds are spent is tested without Ray, in
``tests/test_run_loop.py``; that a killed replica actor stops a run with ``max_restarts=0``, in
``tests/test_rl_replica_restart.py``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from waiting import wait_until

from polyrl.config import load_config
from polyrl.controller.worker_group import pid_alive
from polyrl.core.errors import RunAbortedError
from polyrl.reward.pool import RewardWorkerDiedError
from polyrl.trainer.rl import RLTrainer
from polyrl.trainer.run_loop import recoverable_cause

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
            "trainer.total_steps=3",
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


class KillingTrainer(RLTrainer):
    """SIGKILLs workers of the run, each once, at chosen points (the kills are real, their
    timing is the test's):

    * ``replica_at``: the Ray actor of rollout rank 0 (its server goes with it) as the third
      generation request of that step is sent;
    * ``engine_at``: rank 0 of the actor's engine group as that step's update starts;
    * ``reward_at``: the reward worker as that step's scoring starts; with ``after_rebuild``
      only in the run rebuilt after the engine kill (its rerun of the step).
    """

    def __init__(
        self,
        cfg: Any,
        *,
        replica_at: int = 0,
        engine_at: int = 0,
        reward_at: int = 0,
        after_rebuild: bool = False,
    ) -> None:
        super().__init__(cfg)
        self.replica_at, self.engine_at, self.reward_at = replica_at, engine_at, reward_at
        self.after_rebuild = after_rebuild
        self.killed: dict[str, int] = {}  # what was killed: its pid
        self.engine_info: Any = None
        self.new_replica_pid: int | None = None
        self._generating = 0

    def setup(self) -> None:
        super().setup()  # again in each rebuild: the new client is wrapped too
        client = self.producer.client
        send = client.send
        sent = {"n": 0}

        async def killing_send(method: str, path: str, **kwargs: Any) -> Any:
            if path == "/generate" and self.replica_at and self._generating == self.replica_at:
                sent["n"] += 1
                if sent["n"] == 3 and "replica" not in self.killed:
                    pid = self.killed["replica"] = self.servers.group.worker_info[0].pid
                    os.kill(pid, signal.SIGKILL)
                    # Its server, a child kept alive by a lifeline, goes with it: this request
                    # and the rest of the step's are lost and must be sent again.
                    url = self.replicas.urls[0]
                    wait_until(lambda: not _serves(url), "the replica to stop serving")
            return await send(method, path, **kwargs)

        client.send = killing_send

    def step(self, step: int) -> dict[str, float]:
        self._generating = step
        if (
            step == self.reward_at
            and "reward" not in self.killed
            and ("engine" in self.killed or not self.after_rebuild)
        ):
            rewards = self.producer.rewards
            score = rewards.score

            def killing_score(batch: Any) -> Any:
                # A worker that dies still starting (as in the first step of a rebuilt or
                # resumed run) is replaced as a failed start: score once, so that it has started.
                score(batch)
                (pid,) = rewards.worker_pids
                os.kill(pid, signal.SIGKILL)
                # Dead before the batch is handed out (the pool reaps it itself).
                wait_until(lambda: not pid_alive(pid), "the reward worker is dead")
                self.killed["reward"] = pid
                rewards.score = score
                return score(batch)

            rewards.score = killing_score
        if step == self.engine_at and "engine" not in self.killed:
            actor = self.actor
            update = actor.update_actor
            self.engine_info = self._groups[0].worker_info[0]

            def killing_update(*args: Any, **kwargs: Any) -> Any:
                self.killed["engine"] = self.engine_info.pid
                os.kill(self.engine_info.pid, signal.SIGKILL)
                return update(*args, **kwargs)

            actor.update_actor = killing_update  # type: ignore[method-assign]
        metrics = super().step(step)
        if step == self.replica_at:
            self.new_replica_pid = self.servers.group.worker_info[0].pid
        return metrics


def _serves(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, ray_session) -> Path:
    """The run the broken ones must match, made once."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    RLTrainer(_config(tmp_path, "full")).fit()
    return tmp_path / "full"


#: What counts the failures themselves: a replica restart and the requests it made send again.
_FAILURE_COUNTS = ("rollout/replica_restarts", "rollout/request_retries")


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
            if not k.startswith(("timing_s/", "perf/", "recovery/"))
            and k not in ("time", *_FAILURE_COUNTS)
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


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def test_a_run_that_loses_each_kind_of_worker_logs_what_an_uninterrupted_run_logs(
    tmp_path, uninterrupted, capsys
):
    cfg = _config(tmp_path, "run", "trainer.max_restarts=2")
    trainer = KillingTrainer(cfg, replica_at=2, engine_at=3, reward_at=3, after_rebuild=True)
    summary = trainer.fit()
    assert summary["steps"] == 3 and set(trainer.killed) == {"replica", "engine", "reward"}
    # A new actor serves rollout rank 0 from the killed one's step on.
    assert trainer.new_replica_pid not in (None, trainer.killed["replica"])
    a, b = _comparable(uninterrupted), _comparable(tmp_path / "run")
    assert sorted(b) == [1, 2, 3]  # step 3 logged once, as rerun
    _assert_same(a, b)

    # The counters say what happened. The replica's: in step 2 (the rebuild after step 3
    # started the servers, and their counts, anew).
    steps = _records(tmp_path / "run")
    assert _series(steps, "recovery/replica_actors_recreated") == [0, 1, 0]
    assert _series(steps, "rollout/replica_restarts") == [0, 1, 0]
    assert steps[1]["rollout/request_retries"] >= 1  # the requests the dead replica lost
    assert _series(steps, "recovery/restarts") == [0, 0, 1]
    # The reward worker's death cost no rebuild and no sample: its batch was scored again.
    assert _series(steps, "recovery/reward_worker_deaths") == [0, 0, 1]
    assert _series(steps, "reward/errors") == [0, 0, 0]

    # The rebuild said which worker died, where, in which call, and what its log ended with.
    out = capsys.readouterr().out
    info = trainer.engine_info
    where = f"(pid {info.pid} on node {info.node_ip} (id {info.node_id[:12]}))"
    [line] = [x for x in out.splitlines() if "restart 1/2" in x]
    assert f"worker rank 0 {where} died during actor.update_actor (" in line, line
    assert "; its log ends: " in line and "\x1b[" not in line, line


def test_with_max_restarts_0_a_killed_reward_worker_or_engine_stops_the_run_and_relaunches_resume(
    tmp_path, uninterrupted
):
    # Its samples are not scored again: the run stops in one line that names the worker and
    # says how to resume (a killed replica actor: tests/test_rl_replica_restart.py).
    cfg = _config(tmp_path, "run", "trainer.max_restarts=0")
    trainer = KillingTrainer(cfg, reward_at=3)
    with pytest.raises(RunAbortedError) as caught:
        trainer.fit()
    assert recoverable_cause(caught.value, (RewardWorkerDiedError,)) is not None
    message = str(caught.value)
    assert "\n" not in message and "\x1b[" not in message and "pid=" not in message, message
    pid = trainer.killed["reward"]
    assert message.startswith(f"reward worker process (pid {pid}) died (killed by SIGKILL) ")
    assert "; trainer.max_restarts=0. " in message and "restart(s)" not in message, message
    assert "trainer.resume_mode=auto" in message and "global_step_2" in message, message
    a = _comparable(uninterrupted)
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]  # step 3 not logged
    _assert_same(a, _comparable(tmp_path / "run"))
    # Ray's colour codes and worker prefixes reach no file of the run.
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".json", ".log", ".txt", ".yaml"):
            text = path.read_text(errors="replace")
            assert "\x1b[" not in text and "pid=" not in text, path

    # The same command again resumes from step 2; this time its engine worker dies in step 3's
    # update: with max_restarts=0 the run stops again, in one line naming the rank.
    again = KillingTrainer(_config(tmp_path, "run", "trainer.max_restarts=0"), engine_at=3)
    with pytest.raises(RunAbortedError) as caught:
        again.fit()
    message = str(caught.value)
    info = again.engine_info
    where = f"(pid {info.pid} on node {info.node_ip} (id {info.node_id[:12]}))"
    assert "\n" not in message and "\x1b[" not in message, message
    assert message.startswith(f"worker rank 0 {where} died during actor.update_actor ("), message
    assert "; trainer.max_restarts=0. " in message and "global_step_2" in message, message
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]

    # And once more: it resumes from the newest checkpoint and finishes the run as the
    # uninterrupted one did.
    summary = RLTrainer(_config(tmp_path, "run", "trainer.max_restarts=0")).fit()
    assert summary["steps"] == 3 and summary["resumed_from"].endswith("global_step_2")
    b = _comparable(tmp_path / "run")
    assert sorted(b) == [1, 2, 3]
    _assert_same(a, b)
