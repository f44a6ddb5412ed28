"""Two simulated Ray nodes: a SPREAD pool puts one worker on each and gloo runs across them.

Ray allows one cluster connection per process and the test session already holds one, so the
test runs this file as a script in a subprocess; the script builds a two-node
``ray.cluster_utils.Cluster``, drives a worker group on it and prints a JSON summary as its
last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from polyrl.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
from polyrl.core.batch import Batch


class NodeWorker(Worker):
    @register
    def where(self) -> dict:
        return {
            "rank": self.rank,
            "node_id": self.node_id,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "pid": os.getpid(),
        }

    @register
    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=Dispatch.DP_COMPUTE)
    def tag(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 3, "rank": torch.full((len(batch),), self.rank)})


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, configure_logging=False)
    try:
        pool = ResourcePool("spread", 2, cpus_per_worker=1, strategy="SPREAD")
        group = WorkerGroup(NodeWorker, pool=pool, dead_worker_timeout_s=30)
        try:
            where = group.where()
            reduced = group.all_reduce(1.0)
            out = group.tag(Batch({"x": torch.arange(5.0)}))
            pids = [w.pid for w in group.worker_info]
            info_nodes = [w.node_id for w in group.worker_info]
        finally:
            group.shutdown()
            pool.release()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        print(
            json.dumps(
                {
                    "cluster_nodes": sorted(nodes),
                    "where": where,
                    "info_nodes": info_nodes,
                    "all_reduce": reduced,
                    "x": out["x"].tolist(),
                    "rank": out["rank"].tolist(),
                    "pids": pids,
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spread_pool_places_one_worker_per_node_and_all_reduces_across_them():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["cluster_nodes"]) == 2
    nodes = [w["node_id"] for w in result["where"]]
    assert len(set(nodes)) == 2 and set(nodes) == set(result["cluster_nodes"])
    assert nodes == result["info_nodes"]
    assert [w["rank"] for w in result["where"]] == [0, 1]
    assert [(w["local_rank"], w["local_world_size"]) for w in result["where"]] == [(0, 1), (0, 1)]
    assert result["all_reduce"] == [3.0, 3.0]
    assert result["x"] == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert result["rank"] == [0, 0, 0, 1, 1]
    for pid in result["pids"]:  # the cluster and its workers are gone with the subprocess
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


if __name__ == "__main__":
    main()
