"""Engine → two rollout replicas (separate processes) over ``shm`` and ``disk``.

After an update every replica's greedy tokens and log-probs equal, bit for bit, those of a
reference replica started directly from the engine's weights; a sender killed mid-transfer
leaves the replicas on the previous version and a retry succeeds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from safetensors import safe_open

from polyrl.model.engine import build_engine
from polyrl.models.tiny import build_tiny_model
from polyrl.rollout.client import RolloutClient
from polyrl.rollout.launcher import ServerProcess, start_replicas
from polyrl.weights import WeightSender, create_transport

pytestmark = pytest.mark.slow

OPTIONS = {"num_threads": 1, "max_num_seqs": 16, "max_num_batched_tokens": 128}
PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
BUCKET_MB = 0.25


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    old = build_tiny_model("qwen2", root / "old", size="nano", seed=0)
    new = build_tiny_model("qwen2", root / "new", size="nano", seed=1)
    return old, new


@pytest.fixture(scope="module")
def servers(dirs):
    old, new = dirs
    procs = start_replicas(old, 2, options=OPTIONS, timeout=180)
    ref = ServerProcess(new, options=OPTIONS)
    try:
        ref.start(timeout=180)
        yield [p.url for p in procs], ref.url
    finally:
        for p in [*procs, ref]:
            p.stop()


def outputs(url: str) -> list[tuple[list[int], list[float]]]:
    async def go():
        async with RolloutClient([url]) as client:
            results = [await client.generate(p, GREEDY) for p in PROMPTS]
        return [(r.outputs[0].output_ids, r.outputs[0].logprobs) for r in results]

    return asyncio.run(go())


def versions(urls: list[str]) -> list[int]:
    return [httpx.get(u + "/health").json()["weight_version"] for u in urls]


def checkpoint_tensors(model_dir):
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def send(kind: str, urls: list[str], tensors) -> object:
    transport = create_transport(kind, urls=urls)
    try:
        return WeightSender(transport, bucket_mb=BUCKET_MB, checksum=True).send(tensors)
    finally:
        transport.close()


def test_shm_update_from_the_engine_matches_the_reference(servers, dirs):
    urls, ref = servers
    before = versions(urls)
    old_out = outputs(urls[0])
    want = outputs(ref)
    assert old_out != want  # the two seeds really differ
    engine = build_engine(str(dirs[1]))
    try:
        stats = send("shm", urls, engine.named_tensors())
    finally:
        engine.close()
    assert stats.replica_versions == [before[0] + 1] * 2
    assert versions(urls) == [before[0] + 1] * 2
    assert stats.buffer_bytes <= 2 * int(BUCKET_MB * 2**20)  # measured staging buffers
    assert stats.buckets > 2
    for url in urls:
        assert outputs(url) == want  # tokens and fp32 log-probs exactly equal


def test_disk_update_switches_back_and_forth(servers, dirs):
    urls, ref = servers
    old_dir, new_dir = dirs
    start = versions(urls)[0]
    stats = send("disk", urls, checkpoint_tensors(old_dir))
    assert versions(urls) == [start + 1] * 2 == stats.replica_versions
    old_out = outputs(urls[1])
    stats = send("disk", urls, checkpoint_tensors(new_dir))
    assert versions(urls) == [start + 2] * 2
    want = outputs(ref)
    assert old_out != want
    for url in urls:
        assert outputs(url) == want


KILLED_SENDER = """
import sys, time
from safetensors import safe_open
from polyrl.weights import WeightSender, create_transport
urls, path = sys.argv[1].split(","), sys.argv[2]
def tensors():
    with safe_open(path, "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
sender = WeightSender(create_transport("shm", urls=urls), bucket_mb=0.05,
                      on_bucket=lambda meta: time.sleep(0.3))
sender.send(tensors())
"""


def test_sender_killed_mid_transfer_keeps_old_version_then_retry(servers, dirs):
    urls, _ = servers
    old_dir = dirs[0]
    start = versions(urls)
    serving = outputs(urls[0])
    weights = str(next(iter(sorted(old_dir.glob("*.safetensors")))))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SENDER, ",".join(urls), weights],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = [httpx.get(u + "/weights/status").json() for u in urls]
            if all(s["buckets"] >= 2 for s in status):
                break
            assert proc.poll() is None, "the sender finished before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail(f"no replica staged two buckets: {status}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert versions(urls) == start
    for url in urls:
        assert outputs(url) == serving  # still the old weights, still serving
    stats = send("shm", urls, checkpoint_tensors(old_dir))
    assert stats.replica_versions == [start[0] + 1] * 2
    assert all(httpx.get(u + "/weights/status").json()["transfer_id"] is None for u in urls)


def test_dist_group_is_created_once_and_reused(servers, dirs):
    urls, ref = servers
    old_dir, new_dir = dirs
    transport = create_transport("dist", urls=urls, timeout=60)
    try:
        sender = WeightSender(transport, bucket_mb=BUCKET_MB, checksum=True)
        start = versions(urls)[0]
        sender.send(checkpoint_tensors(old_dir))
        group = transport._group
        old_out = outputs(urls[0])
        engine = build_engine(str(new_dir))
        try:
            stats = sender.send(engine.named_tensors())
        finally:
            engine.close()
        assert transport._group is group  # no second rendezvous
    finally:
        transport.close()
    assert stats.replica_versions == [start + 2] * 2 == versions(urls)
    want = outputs(ref)
    assert old_out != want
    for url in urls:
        assert outputs(url) == want


def test_world_size_two_engine_group_updates_both_replicas(ray_session, servers, dirs):
    from polyrl.controller import WorkerGroup, WorkerSpec
    from polyrl.weights.workers import WeightSyncWorker

    urls, ref = servers
    old_dir, new_dir = dirs
    send("shm", urls, checkpoint_tensors(old_dir))  # start from the other weights
    start = versions(urls)[0]
    spec = WorkerSpec(
        WeightSyncWorker,
        kwargs={"role": "actor", "model": str(new_dir), "engine": {"device": "cpu"}},
    )
    group = WorkerGroup(spec, world_size=2, name="weights-dp2")
    try:
        infos = group.init_model()
        assert [i["world_size"] for i in infos] == [2, 2]
        results = group.sync_weights("shm", urls, BUCKET_MB, True)
    finally:
        group.shutdown()
    assert results[1] is None
    assert results[0]["replica_versions"] == [start + 1] * 2 == versions(urls)
    assert results[0]["buffer_bytes"] <= 2 * int(BUCKET_MB * 2**20)
    want = outputs(ref)
    for url in urls:
        assert outputs(url) == want
