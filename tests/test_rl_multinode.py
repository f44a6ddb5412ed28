"""GRPO on a simulated two-node Ray cluster: the rollout replica on one node, the engines on the
other, weights over a gloo ``dist`` broadcast (the code path NCCL takes between GPU nodes).

Each node of ``ray.cluster_utils.Cluster`` has one logical CPU, and the engine rank and the
replica each ask for one, so they cannot share a node. The same run on a one-node cluster (two
CPUs; weights over shared memory) gives the baseline: the metrics of every step must be equal,
since the transport only moves the same float32 bytes. After its steps the two-node run loses
the rank on the node the driver is not on (SIGKILL): the line that tells of its death carries
the end of that rank's log, read on its node.

Ray allows one cluster per process and the test session already holds one, so each run is this
file run as a script in a subprocess; it prints a JSON summary as its last line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest

#: A dense reward a random model learns from at once, so that every step moves the weights.
_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 50.0
"""

#: Metrics that measure time, speed or memory: they differ between any two runs.
_VOLATILE = ("timing", "perf/", "memory", "/seconds", "_gbps", "throughput", "_s")


def _run(nodes: int, out_dir: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 3 - nodes, "include_dashboard": False},
    )
    if nodes == 2:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, configure_logging=False)
    reward = os.path.join(out_dir, "reward.py")
    with open(reward, "w") as f:
        f.write(_REWARD)
    try:
        cfg = load_config(
            "demo",
            [
                f"trainer.output_dir={out_dir}",
                "trainer.device=cpu",
                "trainer.worker_backend=ray",
                "trainer.loggers=[jsonl]",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "trainer.total_steps=3",
                "data.num_train=32",
                "data.train_batch_size=4",
                "rollout.n=4",
                "rollout.max_new_tokens=8",
                "data.max_response_length=8",
                "rollout.num_threads=1",
                "reward.num_workers=1",
                f"reward.custom_function={reward}:compute_score",
                "actor.lr=0.01",
            ],
        )
        trainer = RLTrainer(cfg)
        records = []
        try:
            trainer.setup()
            engine_nodes = [w.node_id for w in trainer._groups[0].worker_info]
            replica_nodes = [w.node_id for w in trainer.servers.group.worker_info]
            transport = [trainer.replicas.transport, trainer.replicas.transport_options]
            for step in range(1, 4):
                records.append(trainer.step(step))
            death = _kill_the_remote_rank(trainer) if nodes == 2 else None
        finally:
            trainer.close()
        alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        return {
            "nodes": alive,
            "engine_nodes": engine_nodes,
            "replica_nodes": replica_nodes,
            "transport": transport[0],
            "transport_backend": transport[1].get("backend"),
            "records": records,
            "death": death,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _kill_the_remote_rank(trainer: Any) -> dict:
    """SIGKILL the first rank on the node the driver is not on; return how its death reads.

    Both nodes are processes of this machine, so the kill is a plain one; the rank's log is the
    other node's (its Ray log folder), read there by a task.
    """
    import ray
    from waiting import wait_until

    from polyrl.controller import WorkerDiedError
    from polyrl.controller.worker_group import pid_alive
    from polyrl.trainer.rl.supervisor import describe_failure

    here = ray.get_runtime_context().get_node_id()
    calls = [(g, "empty_cache") for g in trainer._groups]
    calls.append((trainer.servers.group, "server_state"))
    group, method, info = next(
        (g, m, info) for g, m in calls for info in g.worker_info if info.node_id != here
    )
    os.kill(info.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(info.pid), "the remote rank to die", timeout=30)
    try:
        group.call_rank(info.rank, method, timeout=60)
    except WorkerDiedError as exc:
        return {"pid": info.pid, "method": method, "line": describe_failure(exc)}
    raise AssertionError(f"{method} answered from a dead rank")


def _start(nodes: int, out: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(nodes), out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def _result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not any(part in k for part in _VOLATILE)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_across_two_nodes_equals_the_one_node_run():
    # Both runs at once: most of each is start-up (clusters, servers, engines) spent waiting.
    with tempfile.TemporaryDirectory() as out_two, tempfile.TemporaryDirectory() as out_one:
        procs = (_start(2, out_two), _start(1, out_one))
        try:
            two, one = (_result(p) for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert len(two["nodes"]) == 2
    # The replica and the engines run on different nodes; weights cross over gloo dist.
    assert set(two["engine_nodes"]).isdisjoint(two["replica_nodes"])
    assert (two["transport"], two["transport_backend"]) == ("dist", "gloo")
    assert len(one["nodes"]) == 1 and one["transport"] == "shm"
    assert len(two["records"]) == len(one["records"]) == 3
    for step, (a, b) in enumerate(zip(one["records"], two["records"], strict=True), start=1):
        assert _stable(a) == _stable(b), f"step {step} differs"
        assert a["rollout/weight_version"] == step - 1
    # The policy moved: the runs agree on something that changes.
    assert one["records"][0]["actor/entropy"] != one["records"][2]["actor/entropy"]
    assert all(r["actor/grad_norm"] > 0 for r in one["records"])
    # A rank of the driver's node has its log read from this machine's Ray log folder; one of
    # the other node's, by a task on that node.
    death = two["death"]
    assert f"(pid {death['pid']} on node " in death["line"], death
    # The call is named as the group's (``actor.empty_cache``) or a replica's (``server_state``).
    assert re.search(rf"died during (\w+\.)?{death['method']} \(", death["line"]), death
    # An engine rank's log ends with its model loading, a replica actor's with its server.
    assert "; its log ends: " in death["line"], death
    assert "Loading weights" in death["line"] or "serves http" in death["line"], death


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]), sys.argv[2])))
