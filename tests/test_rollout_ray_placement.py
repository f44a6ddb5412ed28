"""On Ray the RL trainer's rollout replicas are Ray actors placed by a resource pool.

Separate placement: a pool of their own (``rl-rollout``); hybrid: the training pool's bundles,
shared (:meth:`~polyrl.controller.ResourcePool.share`). Each replica server is a child of its
actor, bound to the node's address with the run's API key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from polyrl.config import load_config
from polyrl.trainer.rl import RLTrainer

pytestmark = pytest.mark.slow


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        f"trainer.output_dir={tmp_path}",
        "trainer.device=cpu",
        "trainer.worker_backend=ray",
        "trainer.loggers=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.total_steps=2",
        "data.num_train=16",
        "data.train_batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "data.max_response_length=4",
        "rollout.num_threads=1",
        "reward.num_workers=1",
        *extra,
    ]


def _check_key(url: str, api_key: str) -> None:
    import httpx

    # /health answers without the key; everything else requires it.
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    response = httpx.get(
        f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10
    )
    assert response.status_code == 200


def _weight_versions(trainer: RLTrainer) -> list[int]:
    import httpx

    headers = {"Authorization": f"Bearer {trainer.servers.api_key}"}
    return [
        httpx.get(f"{url}/weights/status", headers=headers, timeout=10).json()["weight_version"]
        for url in trainer.servers.urls
    ]


def _children(pid: int) -> set[int]:
    """Return the processes whose parent is ``pid`` (from any of its threads)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 is the parent pid, after the parenthesised command name.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def test_separate_replicas_are_ray_actors_of_their_own_pool(tmp_path, ray_session):
    trainer = RLTrainer(load_config("demo", _overrides(tmp_path, "rollout.replicas=2")))
    try:
        trainer.setup()
        servers = trainer.servers
        group = servers.group
        assert group is not None and group.backend == "ray" and group.world_size == 2
        assert group.pool.name == "rl-rollout" and group.pool.is_reserved
        assert group.pool._owner is None  # its own reservation
        assert len(servers.urls) == 2 and servers.api_key
        node_ip = ray_session.util.get_node_ip_address()
        assert all(u.startswith(f"http://{node_ip}:") for u in servers.urls)
        for url in servers.urls:
            _check_key(url, servers.api_key)
        actor_pids = [w.pid for w in group.worker_info]
        assert os.getpid() not in actor_pids
        for command, actor_pid in zip(group.server_command(), actor_pids, strict=True):
            argv = command["command"]
            assert argv[argv.index("--host") + 1] == node_ip
            options = json.loads(argv[argv.index("--engine-options") + 1])
            assert options["device"] == "cpu" and options["num_threads"] == 1
            # The server is a child process of its actor, not of the driver.
            assert _children(actor_pid) and not _children(actor_pid) & _children(os.getpid())
        assert servers.same_host and trainer.replicas.transport == "shm"
        assert trainer.replicas.transport_options == {"api_key": servers.api_key}
        metrics = trainer.step(1)
        assert metrics["rollout/weight_version"] == 0
        assert _weight_versions(trainer) == [1, 1]  # the step ends by syncing its weights
    finally:
        trainer.close()
    assert trainer.servers.group is None


def test_hybrid_replicas_run_in_the_training_bundles_and_sleep(tmp_path, ray_session):
    cfg = load_config(
        "demo", _overrides(tmp_path, "rollout.placement=hybrid", "trainer.n_gpus_per_node=2")
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.setup()
        group = trainer.servers.group
        engines = trainer._groups[0]
        # One rollout rank beside each training rank, in the same placement group bundles.
        assert group.world_size == engines.world_size == 2
        assert group.pool._owner is engines.pool
        assert group.pool.placement_group() is engines.pool.placement_group()
        assert engines.pool.max_colocate_count == 2
        assert [w.node_id for w in group.worker_info] == [w.node_id for w in engines.worker_info]
        # CPU ranks hold no GPU: one replica, led by rank 0.
        assert len(trainer.servers.urls) == 1 and trainer.servers.placement == "hybrid"
        commands = group.server_command()
        assert commands[1] is None
        options = json.loads(
            commands[0]["command"][commands[0]["command"].index("--engine-options") + 1]
        )
        assert options["device"] == "cpu"
        records = [trainer.step(step) for step in (1, 2)]
        # Hybrid: the replica slept while the engines trained and woke with the new weights.
        assert [r["rollout/weight_version"] for r in records] == [0, 1]
        assert _weight_versions(trainer) == [2]
    finally:
        trainer.close()
