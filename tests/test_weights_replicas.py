"""Engine → two rollout replicas (separate processes) over ``shm``, ``dist`` and ``disk``.

After an update every replica's greedy tokens and log-probs equal, bit for bit, those of a
reference replica started directly from the engine's weights; a sender killed mid-transfer
leaves the replicas on the previous version (staged) or refusing requests (inplace) and a
retry succeeds; peak extra memory on both sides is measured (process RSS) and bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from safetensors import safe_open

from polyrl.model_engine.engine import build_engine
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


def send(
    kind: str,
    urls: list[str],
    tensors,
    bucket_mb: float = BUCKET_MB,
    transport_options: dict | None = None,
    **kw,
) -> object:
    transport = create_transport(kind, urls=urls, timeout=60, **(transport_options or {}))
    try:
        return WeightSender(transport, bucket_mb=bucket_mb, checksum=True, **kw).send(tensors)
    finally:
        transport.close()


def last(url: str) -> dict:
    return httpx.get(url + "/weights/status").json()["last"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buckets"])
def test_shm_update_from_the_engine_matches_the_reference(servers, dirs, direct):
    urls, ref = servers
    old_dir, new_dir = dirs
    send("disk", urls, checkpoint_tensors(old_dir))  # start from the other weights
    before = versions(urls)
    old_out = outputs(urls[0])
    want = outputs(ref)
    assert old_out != want  # the two seeds really differ
    engine = build_engine(str(new_dir))
    try:
        stats = send("shm", urls, engine.named_tensors(), transport_options={"direct": direct})
    finally:
        engine.close()
    assert stats.replica_versions == [before[0] + 1] * 2
    assert versions(urls) == [before[0] + 1] * 2
    assert stats.buffer_bytes <= 2 * int(BUCKET_MB * 2**20)  # measured staging buffers
    if direct:  # every tensor written straight into both replicas' shadows: no bucket
        assert stats.direct_tensors == stats.tensors > 0 and stats.buckets == 0
        assert stats.buffer_bytes == 0
    else:
        assert stats.direct_tensors == 0 and stats.buckets > 2
    for url in urls:
        assert outputs(url) == want  # tokens and fp32 log-probs exactly equal
        assert last(url)["peak_extra_bytes"] == 0  # shm is read in place, no receive buffer
        assert last(url)["bytes"] == stats.bytes


def test_shm_direct_arenas_alternate_and_are_removed_with_the_replica(dirs, tmp_path):
    old_dir, new_dir = dirs
    arena_dir = tmp_path / "arenas"
    arena_dir.mkdir()
    env = {"POLYRL_WEIGHTS_ARENA_DIR": str(arena_dir)}
    proc = ServerProcess(old_dir, options=OPTIONS, env=env)
    proc.start(timeout=180)
    transport = create_transport("shm", urls=[proc.url], timeout=60)
    try:
        sender = WeightSender(transport, bucket_mb=BUCKET_MB, checksum=True)
        seen = []
        for weights in (new_dir, old_dir, new_dir, old_dir):
            stats = sender.send(checkpoint_tensors(weights))
            assert stats.direct_tensors == stats.tensors and stats.buckets == 0
            seen.append(sorted(p.name for p in arena_dir.iterdir()))
        # First update: shadows in a new arena, the loaded weights become the shadows; second:
        # those shadows are replaced by a second arena; from then on the two alternate.
        assert len(seen[0]) == 1 and len(seen[1]) == 2 and seen[2] == seen[3] == seen[1]
        # The sender keeps both arenas mapped (they alternate as the offered shadows).
        assert sorted(transport._writers) == [str(arena_dir / n) for n in seen[3]]
        want = outputs(proc.url)
        r = httpx.post(proc.url + "/sleep", json={"level": 2})  # drops weights and shadows
        assert r.status_code == 200
        assert list(arena_dir.iterdir()) == []  # both arenas freed
        # No weights to shadow: nothing is offered, the buckets bring them back.
        stats = sender.send(checkpoint_tensors(old_dir))
        assert stats.direct_tensors == 0 and stats.buckets > 0
        assert transport._writers == {}  # the released arenas were unmapped here too
        assert httpx.post(proc.url + "/wake_up", json={}).status_code == 200
        # Bit for bit: storage restored after sleep level 2 keeps the dropped storage's address
        # alignment, which the CPU kernels' code paths (and fp32 rounding) depend on.
        assert outputs(proc.url) == want
        stats = sender.send(checkpoint_tensors(new_dir))  # and direct writes resume
        assert stats.direct_tensors == stats.tensors
    finally:
        transport.close()
        proc.stop()
    assert list(arena_dir.iterdir()) == []  # a stopped replica leaves nothing in /dev/shm


def test_disk_update_switches_back_and_forth(servers, dirs):
    urls, ref = servers
    old_dir, new_dir = dirs
    start = versions(urls)[0]
    stats = send("disk", urls, checkpoint_tensors(old_dir))
    assert versions(urls) == [start + 1] * 2 == stats.replica_versions
    old_out = outputs(urls[1])
    stats = send("disk", urls, checkpoint_tensors(new_dir))
    assert versions(urls) == [start + 2] * 2
    for url in urls:  # two reused receive buffers of one bucket each
        assert 0 < last(url)["peak_extra_bytes"] <= 2 * int(BUCKET_MB * 2**20)
    want = outputs(ref)
    assert old_out != want
    for url in urls:
        assert outputs(url) == want


KILLED_DIRECT_SENDER = """
import sys, time
from safetensors import safe_open
from polyrl.weights import WeightSender, create_transport
urls, path = sys.argv[1].split(","), sys.argv[2]
def tensors():
    with safe_open(path, "pt") as f:
        for i, name in enumerate(f.keys()):
            yield name, f.get_tensor(name)
            if i == 2:  # three tensors are in the replicas' shadows now
                print("WROTE", flush=True)
                time.sleep(120)
transport = create_transport("shm", urls=urls)
WeightSender(transport, checksum=True).send(tensors())
"""


def test_direct_sender_killed_mid_transfer_keeps_old_version_then_retry(servers, dirs):
    urls, ref = servers
    old_dir, new_dir = dirs
    send("disk", urls, checkpoint_tensors(old_dir))
    start = versions(urls)
    serving = outputs(urls[0])
    weights = str(next(iter(sorted(new_dir.glob("*.safetensors")))))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DIRECT_SENDER, ",".join(urls), weights],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "WROTE"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert versions(urls) == start
    for url in urls:  # new bytes sit in the shadows, the serving weights are untouched
        assert outputs(url) == serving
    stats = send("shm", urls, checkpoint_tensors(new_dir))  # the retry supersedes it
    assert stats.direct_tensors == stats.tensors
    assert stats.replica_versions == [start[0] + 1] * 2
    want = outputs(ref)
    for url in urls:
        assert outputs(url) == want


KILLED_SENDER = """
import json, sys, time
from safetensors import safe_open
from polyrl.weights import WeightSender, create_transport
urls, path, kind, opts = sys.argv[1].split(","), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
def tensors():
    with safe_open(path, "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
transport = create_transport(kind, urls=urls, **opts.pop("transport", {}))
sender = WeightSender(transport, bucket_mb=0.05, on_bucket=lambda meta: time.sleep(0.3), **opts)
sender.send(tensors())
"""


def start_and_kill_sender(urls, weights, kind, opts):
    """Run a sender in a subprocess, SIGKILL it once every replica holds two buckets."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SENDER, ",".join(urls), weights, kind, json.dumps(opts)],
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


@pytest.mark.parametrize("kind", ["shm", "dist", "disk"])
def test_sender_killed_mid_transfer_keeps_old_version_then_retry(servers, dirs, kind, tmp_path):
    urls, _ = servers
    old_dir = dirs[0]
    start = versions(urls)
    serving = outputs(urls[0])
    weights = str(next(iter(sorted(old_dir.glob("*.safetensors")))))
    opts = {"transport": {"directory": str(tmp_path)}} if kind == "disk" else {}
    if kind == "shm":  # the bucket path (direct writes: the test above)
        opts = {"transport": {"direct": False}}
    start_and_kill_sender(urls, weights, kind, opts)
    time.sleep(0.5)
    assert versions(urls) == start
    for url in urls:
        assert outputs(url) == serving  # still the old weights, still serving
    stats = send(kind, urls, checkpoint_tensors(old_dir))
    assert stats.replica_versions == [start[0] + 1] * 2
    assert all(httpx.get(u + "/weights/status").json()["transfer_id"] is None for u in urls)


def test_inplace_sender_killed_refuses_requests_until_a_retry(servers, dirs, tmp_path):
    urls, ref = servers
    old_dir, new_dir = dirs
    send("disk", urls, checkpoint_tensors(new_dir))  # serving the "new" weights
    start = versions(urls)
    weights = str(next(iter(sorted(old_dir.glob("*.safetensors")))))
    start_and_kill_sender(urls, weights, "shm", {"mode": "inplace", "stall_timeout": 1.0})
    deadline = time.monotonic() + 20
    while any(httpx.get(u + "/weights/status").json()["transfer_id"] for u in urls):
        assert time.monotonic() < deadline, "the stalled transfer was never dropped"
        time.sleep(0.1)
    assert versions(urls) == start
    for url in urls:
        r = httpx.post(url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {}})
        assert r.status_code == 503
        assert "interrupted" in r.json()["error"]["message"]
    stats = send("shm", urls, checkpoint_tensors(new_dir), mode="inplace")
    assert stats.replica_versions == [start[0] + 1] * 2
    want = outputs(ref)
    for url in urls:
        assert outputs(url) == want


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
    from polyrl.workers.engine import EngineWorker

    urls, ref = servers
    old_dir, new_dir = dirs
    want = outputs(ref)
    spec = WorkerSpec(
        EngineWorker,
        kwargs={"role": "actor", "model": str(new_dir), "engine": {"device": "cpu"}},
    )
    group = WorkerGroup(spec, world_size=2, name="weights-dp2")
    try:
        infos = group.init_model()
        assert [i["world_size"] for i in infos] == [2, 2]
        for kind, mode in (("shm", "staged"), ("dist", "inplace"), ("disk", "staged")):
            send("disk", urls, checkpoint_tensors(old_dir))  # start from the other weights
            start = versions(urls)[0]
            results = group.sync_weights(kind, urls, BUCKET_MB, True, mode=mode)
            assert results[1] is None
            assert results[0]["replica_versions"] == [start + 1] * 2 == versions(urls), kind
            assert results[0]["buffer_bytes"] <= 2 * int(BUCKET_MB * 2**20)
            for url in urls:
                assert outputs(url) == want, kind
        # Each replica from the rank named for it (hybrid placement: the rank on its GPU), each
        # rank's transport kept across syncs, and the replicas' dtype on the wire.
        send("disk", urls, checkpoint_tensors(old_dir))
        for n in (1, 2):
            start = versions(urls)[0]
            results = group.sync_weights("shm", urls, BUCKET_MB, True, senders=[0, 1])
            assert [r["urls"] for r in results] == [[urls[0]], [urls[1]]]
            assert [r["transfers"] for r in results] == [n, n]  # one transport per rank
            assert [set(r["received"]) for r in results] == [{"shm_direct"}, {"shm_direct"}]
            assert versions(urls) == [start + 1] * 2
        for url in urls:
            assert outputs(url) == want
        fp32 = results[0]["bytes"]
        bf16 = group.sync_weights("shm", urls, BUCKET_MB, True, dtype="bfloat16")
        assert bf16[1] is None and bf16[0]["urls"] == urls
        assert bf16[0]["bytes"] <= 0.55 * fp32
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """One replica serving a ~10 MB model, for memory measurements."""
    root = tmp_path_factory.mktemp("weights-micro")
    old = build_tiny_model("qwen2", root / "old", size="micro", seed=0)
    new = build_tiny_model("qwen2", root / "new", size="micro", seed=1)
    proc = ServerProcess(old, options=OPTIONS)
    try:
        proc.start(timeout=180)
        yield proc.url, dict(checkpoint_tensors(old)), dict(checkpoint_tensors(new))
    finally:
        proc.stop()


MIB = 2**20


def test_shm_segments_stay_mapped_across_updates_and_are_dropped_when_gone(micro):
    url, old, new = micro

    def mapped() -> list[str]:
        return httpx.get(url + "/weights/status").json()["shm_mapped"]

    first = create_transport("shm", urls=[url], timeout=60)
    try:
        # inplace: no shadows on this replica (the memory test below measures their first use)
        sender = WeightSender(first, bucket_mb=1, checksum=True, mode="inplace")
        sender.send(iter(new.items()))
        names = sorted(seg.name for seg in first._segments.values())
        assert len(names) == 2 and sorted(mapped()) == names  # both buckets, kept after commit
        sender.send(iter(old.items()))
        # Mapped once per transport, not once per transfer: the same two mappings.
        assert sorted(mapped()) == names
    finally:
        first.close()  # unlinks its segments
    second = create_transport("shm", urls=[url], timeout=60)
    try:
        WeightSender(second, bucket_mb=1, checksum=True, mode="inplace").send(iter(new.items()))
        now = sorted(mapped())
        assert now == sorted(seg.name for seg in second._segments.values())
        assert not set(now) & set(names)  # the closed sender's segments were unmapped
    finally:
        second.close()


def test_peak_extra_memory_is_bounded_on_both_sides(micro):
    url, old, new = micro
    model = sum(t.numel() * t.element_size() for t in old.values())
    bucket = 1 * MIB
    slack = 1 * MIB  # allocator and HTTP noise in the RSS
    assert model > 2 * bucket + 2 * slack  # the bounds below could not hold by accident
    transports = {k: create_transport(k, urls=[url], timeout=60) for k in ("shm", "dist", "disk")}
    try:

        def update(kind: str, mode: str, tensors: dict, measure: bool = True):
            sender = WeightSender(
                transports[kind], bucket_mb=1, mode=mode, checksum=True, measure_memory=measure
            )
            stats = sender.send(iter(tensors.items()))
            got = last(url)
            assert got["outcome"] == "committed"
            direct = stats.direct_tensors == stats.tensors
            # Direct writes (shm, staged) use no bucket at all; every other path two.
            assert stats.buffer_bytes == (0 if direct else 2 * bucket)
            assert stats.peak_temp_bytes == 0
            assert got["peak_extra_bytes"] <= 2 * bucket  # counted receive buffers
            # Direct writes map the replica's shadow arena here: its pages show in this
            # process's RSS as shared memory but are the replica's (allocated once, there).
            sender_rss = stats.rss_peak_delta
            if sender_rss is not None:
                sender_rss -= stats.shared_mapped_bytes if direct else 0
            return sender_rss, got["rss_peak_delta"], direct

        # Unmeasured warm-up per transport: one-off process costs (thread pools, the gloo
        # group, lazily imported modules) are not per-update memory.
        for kind in transports:
            update(kind, "inplace", new, measure=False)
        rows = {}
        for kind, mode, tensors in [
            ("shm", "inplace", old),
            ("dist", "inplace", new),
            ("disk", "inplace", old),
            ("shm", "staged", new),  # first staged update: allocates the shadows (one model)
            ("dist", "staged", old),  # later ones reuse them
            ("shm", "staged", new),  # direct writes into the shadows' shared arena, reused
        ]:
            rows[(kind, mode, len(rows))] = update(kind, mode, tensors)
    finally:
        for t in transports.values():
            t.close()
    print(rows)
    assert [direct for _, _, direct in rows.values()] == [False] * 3 + [True, False, True]
    for (kind, mode, i), (sender, replica, _) in rows.items():
        # The sender's two bucket buffers were touched in the warm-up: nothing new here.
        assert sender is not None and sender <= 2 * bucket + slack, (kind, mode, sender)
        if i == 3:
            assert replica >= 0.9 * model, (kind, mode, replica)  # the shadow copy
        else:
            assert replica is not None and replica <= 2 * bucket + slack, (kind, mode, replica)
    assert httpx.get(url + "/weights/status").json()["held_bytes"] == model
