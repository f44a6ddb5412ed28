"""RL runs that lose a rollout replica: the trainer restarts it and the run goes on.

Real replica subprocesses, reward workers and engines on the nano tiny model (local worker
backend); a replica is killed with SIGKILL at a chosen point of a step through a subclass of the
trainer (the kill is real, the timing is the test's). A replica whose Ray *actor* is killed is
tested in ``tests/test_rl_recovery.py``, against an uninterrupted run.
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
from polyrl.trainer.rl import RLTrainer
from polyrl.trainer.rl.supervisor import ReplicaLostError, describe_failure
from polyrl.trainer.run_loop import recoverable_cause

pytestmark = pytest.mark.slow

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 50.0
"""

BATCH, N = 4, 2


def _config(tmp_path: Path, *extra: str) -> Any:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return load_config(
        "demo",
        [
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.custom_function={reward}:compute_score",
            "trainer.worker_backend=local",
            "trainer.total_steps=3",
            "trainer.save_freq=0",
            "data.num_train=32",
            "data.num_val=4",
            f"data.train_batch_size={BATCH}",
            f"rollout.n={N}",
            "rollout.max_new_tokens=8",
            "data.max_response_length=8",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "reward.num_workers=1",
            "rollout.restart_timeout_s=120",
            *extra,
        ],
    )


def _kill(process: Any) -> None:
    os.kill(process.process.pid, signal.SIGKILL)


class KillingTrainer(RLTrainer):
    """Kills replica ``victim`` at ``when``: ``generate`` (once, at the ``after``-th request of
    step 2's generation) or ``sync`` (as each of the first ``kills`` pushes of step ``after``'s
    weight sync starts).

    Records each step's row count and, before closing, each replica's weight version.
    """

    def __init__(
        self, cfg: Any, when: str, victim: int = 0, after: int = 3, kills: int = 1
    ) -> None:
        super().__init__(cfg)
        self.when, self.victim, self.after, self.kills = when, victim, after, kills
        self.rows: list[int] = []
        self.versions: list[int] = []
        self.killed = False

    def setup(self) -> None:
        super().setup()
        client = self.producer.client
        send, generate = client.send, self.rollout.generate
        sent = {"n": 0, "step": 0}

        async def killing_send(method: str, path: str, **kwargs: Any) -> Any:
            if path == "/generate" and sent["step"] == 2 and self.when == "generate":
                sent["n"] += 1
                if sent["n"] == self.after and not self.killed:
                    self.killed = True
                    _kill(self.servers.processes[self.victim])
            return await send(method, path, **kwargs)

        def counting_generate(step: int, timing: Any) -> Any:
            sent["step"] = step
            rows, metrics = generate(step, timing)
            self.rows.append(len(rows))  # a Batch, or StoredRows with the transfer queue
            return rows, metrics

        client.send = killing_send
        self.rollout.generate = counting_generate

    def sync_weights(self, version: int) -> dict[str, float]:
        if self.when == "sync" and version == self.after and not self.killed:
            self.killed = True
            actor = self.actor

            kills = {"left": self.kills}

            class Killing:
                def sync_weights(inner, **kwargs: Any) -> Any:  # noqa: N805
                    if kills["left"]:
                        kills["left"] -= 1
                        _kill(self.servers.processes[self.victim])
                    return actor.sync_weights(**kwargs)

            try:
                return self.replicas.sync_weights(Killing(), version)
            finally:
                self.replicas.actor = actor
        return super().sync_weights(version)

    def close(self) -> None:
        if self.replicas is not None and not self.versions:
            for url in self.replicas.urls:
                try:
                    self.versions.append(httpx.get(f"{url}/health").json()["weight_version"])
                except httpx.HTTPError:
                    self.versions.append(-1)  # unreachable
        super().close()

    replicas: Any = None


def _records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def test_two_replicas_one_killed_mid_generation(tmp_path):
    trainer = KillingTrainer(_config(tmp_path, "rollout.replicas=2"), "generate")
    summary = trainer.fit()
    records = _records(tmp_path)
    assert summary["steps"] == 3 and trainer.killed
    assert [r["step"] for r in records] == [1, 2, 3]
    assert trainer.rows == [BATCH * N] * 3  # no prompt lost
    assert records[-1]["rollout/replica_restarts"] == 1
    assert records[1]["rollout/request_retries"] >= 1
    assert trainer.versions == [3, 3]


def test_a_lone_replica_killed_mid_generation_is_waited_for(tmp_path):
    trainer = KillingTrainer(_config(tmp_path, "rollout.replicas=1"), "generate")
    trainer.fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and trainer.killed
    assert trainer.rows == [BATCH * N] * 3
    assert records[1]["rollout/replica_restarts"] == 1
    # Step 2 sampled the weights of step 1's sync, the restarted replica included.
    assert records[1]["rollout/weight_version"] == 1
    assert trainer.versions == [3]


def test_a_lone_replica_killed_during_the_sync(tmp_path):
    trainer = KillingTrainer(_config(tmp_path, "rollout.replicas=1"), "sync", after=1)
    trainer.fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert trainer.rows == [BATCH * N] * 3
    assert records[0]["rollout/replica_restarts"] == 1
    assert records[1]["rollout/weight_version"] == 1  # step 2 sampled the synced weights
    assert trainer.versions == [3]


def test_a_replica_that_keeps_dying_fails_the_run_naming_it(tmp_path):
    cfg = _config(
        tmp_path, "rollout.replicas=1", "rollout.max_replica_restarts=1", "trainer.max_restarts=0"
    )
    trainer = KillingTrainer(cfg, "sync", after=1, kills=5)
    with pytest.raises(RuntimeError, match="max_replica_restarts") as caught:
        trainer.fit()
    url = trainer.servers.urls[0] if trainer.servers else ""
    message = str(caught.value)
    assert f"rollout replica {url} lost" in message
    assert "restarting the replica on port" in message  # the log tail


class KillingAfterSync(KillingTrainer):
    """Kills the replica right after the push of ``version`` 1: the async rollout thread is
    generating ahead then, and the trainer soon waits for groups only a restart can serve."""

    def sync_weights(self, version: int) -> dict[str, float]:
        metrics = super().sync_weights(version)
        if version == 1 and not self.killed:
            self.killed = True
            _kill(self.servers.processes[self.victim])
        return metrics


@pytest.mark.parametrize("mode", ["async", "one_step_off"])
def test_async_a_lone_replica_killed_while_generating_ahead_is_restarted(tmp_path, mode):
    # one_step_off waits for the batch in flight before its sync (the restart then pushes the
    # updated actor's weights early, as the version about to be synced).
    steps = 4
    cfg = _config(
        tmp_path,
        "rollout.replicas=1",
        f"trainer.mode={mode}",
        "async.max_staleness=1",
        f"trainer.total_steps={steps}",
    )
    trainer = KillingAfterSync(cfg, "never")
    trainer.fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and trainer.killed
    assert trainer.rows == [BATCH * N] * steps
    assert records[-1]["rollout/replica_restarts"] == 1
    assert records[-1]["rollout/request_retries"] >= 1  # the rollout thread's lost requests
    lines = (tmp_path / "run" / "async_samples.jsonl").read_text().splitlines()
    groups = [json.loads(line) for line in lines]
    assert sorted(g["serial"] for g in groups) == list(range(steps * BATCH))  # each once
    behind = [g["trainer_version"] - v for g in groups for v in g["first_versions"]]
    assert 0 <= min(behind) and max(behind) <= 1
    assert trainer.versions == [steps]


def test_transfer_queue_workers_wait_for_a_lone_replica_restarted_mid_step(tmp_path):
    # The queue's rollout workers have clients of their own: the trainer restarts the replica
    # while they generate (the step's sync, which would restart it, comes after).
    cfg = _config(tmp_path, "rollout.replicas=1", "transfer.enable=true")
    trainer = KillingAfterSync(cfg, "never")
    trainer.fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and trainer.killed
    assert trainer.rows == [BATCH * N] * 3
    assert records[-1]["rollout/replica_restarts"] == 1
    assert records[1]["rollout/request_retries"] >= 1  # the worker's lost requests, retried
    assert records[1]["rollout/weight_version"] == 1  # step 2 sampled the pushed weights
    assert trainer.versions == [3]


def _server_child(group: Any, rank: int) -> int:
    """The pid of the rollout server that rank ``rank``'s Ray actor runs as its child."""
    actor_pid = group.worker_info[rank].pid
    children = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and _parent_of(p) == actor_pid
        and "rollout_server" in (p / "cmdline").read_text(errors="replace")
    ]
    assert len(children) == 1, children
    return children[0]


def test_on_ray_the_rank_restarts_a_lone_server_while_queue_workers_wait(tmp_path, ray_session):
    # The in-process case of the test above on Ray: the rank's actor restarts its server, and
    # the transfer queue's rollout workers, Ray actors with clients of their own, are routed
    # like the driver's (the restarted replica held out of their rotation until its push).
    # trainer.max_restarts=0 recovers no dead worker, but a crashed server in a live actor is
    # still restarted (rollout.max_replica_restarts); a dead actor is not recreated.
    cfg = _config(
        tmp_path,
        "trainer.worker_backend=ray",
        "trainer.device=cpu",
        "rollout.replicas=1",
        "rollout.num_threads=1",
        "transfer.enable=true",
        "trainer.max_restarts=0",
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.setup()
        group = trainer.servers.group
        trainer.step(1)
        # The server of rank 0 is a child process of that Ray actor: kill it as a crash would.
        os.kill(_server_child(group, 0), signal.SIGKILL)
        metrics = trainer.step(2)
        assert metrics["rollout/replica_restarts"] == 1
        assert metrics["rollout/request_retries"] >= 1  # the workers' lost requests
        assert metrics["rollout/weight_version"] == 1  # step 2 sampled the pushed weights
        [url] = trainer.replicas.urls
        assert httpx.get(f"{url}/health", timeout=10).json()["weight_version"] == 2
        assert all(state["alive"] for state in group.server_state())

        # Now the actor itself dies (its server with it): the step fails naming it.
        pid = group.worker_info[0].pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception) as caught:
            trainer.step(3)
        lost = recoverable_cause(caught.value, (ReplicaLostError,))
        assert lost is not None, caught.value
        line = describe_failure(lost)
        assert f"its Ray actor (rollout rank 0, pid {pid} on node " in line, line
        assert "trainer.max_restarts=0 recreates no dead worker" in line, line
        assert f"; its log ends: rollout server of rank 0 serves {url} " in line, line
    finally:
        trainer.close()


def _parent_of(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_a_hung_replica_counts_as_dead_and_its_restart_replaces_it(tiny_qwen2_dir):
    from polyrl.rollout.launcher import ServerProcess
    from polyrl.trainer.rl.supervisor import LocalReplica, ReplicaSupervisor

    process = ServerProcess(tiny_qwen2_dir, options={"num_threads": 1}).start(timeout=120)
    try:
        supervisor = ReplicaSupervisor([LocalReplica(process)], 120.0, 1, unresponsive_s=1.0)
        assert supervisor.dead() == []
        os.kill(process.process.pid, signal.SIGSTOP)  # running, but answers nothing
        assert supervisor.dead() == []  # silent for less than a second so far
        # Stopped, it never answers again: it counts as hung once silent for 1 s.
        [hung] = wait_until(supervisor.dead, "the stopped replica counts as dead")
        old, new = supervisor.restart(hung)
        assert process.alive and supervisor.restarts == 1
        assert httpx.get(f"{new}/health", timeout=10).json()["status"] == "ok"
        assert supervisor.dead() == []
    finally:
        process.stop()
