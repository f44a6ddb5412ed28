"""GRPO on a simulated two-node Ray cluster: the rollout replica on one node, the engines on the
other, weights over a gloo ``dist`` broadcast (the code path NCCL takes between GPU nodes).

Each node of ``ray.cluster_utils.Cluster`` has one logical CPU, and the engine rank and the
replica each ask for one, so they cannot share a node. The same run on a one-node cluster (two
CPUs; weights over shared memory) gives the baseline: the metrics of every step must be equal,
since the transport only moves the same float32 bytes.

Ray allows one cluster per process and the test session already holds one, so each run is this
file run as a script in a subprocess; it prints a JSON summary as its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

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
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


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


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]), sys.argv[2])))
