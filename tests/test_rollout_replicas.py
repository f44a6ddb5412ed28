"""Several replicas: sticky routing, failover when one dies, and `polyrl serve --replicas 2`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from polyrl.rollout.client import NoReplicaAvailableError, RolloutClient
from polyrl.rollout.launcher import start_replicas

OPTIONS = {"num_threads": 1, "max_num_seqs": 64, "max_num_batched_tokens": 256}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def replicas(model_dir):
    procs = start_replicas(model_dir, 2, options=OPTIONS, timeout=180)
    yield procs
    for p in procs:
        p.stop()


def test_sticky_sessions_reuse_the_prefix_cache(replicas):
    urls = [r.url for r in replicas]

    async def go():
        async with RolloutClient(urls, health_interval=0.5) as client:
            history = {s: list(range(40 + s, 80 + s)) for s in range(6)}
            seen: dict[int, set[str]] = {s: set() for s in history}
            cached = []
            for turn in range(3):
                results = await asyncio.gather(
                    *(
                        client.generate(
                            history[s],
                            {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                            session_id=f"conv-{s}",
                        )
                        for s in history
                    )
                )
                for s, res in zip(history, results, strict=True):
                    seen[s].add(res.replica)
                    history[s] += res.outputs[0].output_ids + [300 + turn] * 20
                    if turn > 0:
                        cached.append((turn, res.outputs[0].cached_prompt_tokens))
            # No session affinity: plain requests spread over both replicas.
            spread = await asyncio.gather(
                *(client.generate([5, 6, 7], {"max_new_tokens": 20}) for _ in range(8))
            )
            return seen, cached, {r.replica for r in spread}

    seen, cached, spread = asyncio.run(go())
    assert all(len(v) == 1 for v in seen.values()), seen
    assert len({next(iter(v)) for v in seen.values()}) == 2, "sessions should use both replicas"
    # Every later turn found the earlier turns' full blocks in its replica's prefix cache:
    # turn 1 the 32 tokens of two blocks, turn 2 the 64 of four.
    assert all(c >= 32 * turn for turn, c in cached), cached
    assert spread == set(urls)


def test_a_replica_killed_under_load_loses_no_request(replicas):
    urls = [r.url for r in replicas]

    async def go():
        async with RolloutClient(urls, health_interval=0.5, max_retries=2) as client:
            params = {"max_new_tokens": 64, "ignore_eos": True}
            tasks = [
                asyncio.ensure_future(client.generate([i + 16, 9, 10], params, session_id=str(i)))
                for i in range(48)
            ]
            while sum(r.outstanding for r in client.replicas) < 20:
                await asyncio.sleep(0.01)
            assert client.replicas[0].outstanding > 0
            replicas[0].kill()
            results = await asyncio.gather(*tasks)
            down = [r for r in client.replicas if not r.healthy]
            return results, down

    results, down = asyncio.run(go())
    assert len(results) == 48
    assert all(len(r.outputs[0].output_ids) == 64 for r in results)
    assert {r.replica for r in results} == {replicas[1].url}
    assert [d.url for d in down] == [replicas[0].url]

    async def none_left():
        async with RolloutClient([replicas[0].url], max_retries=1, health_interval=0) as c:
            await c.generate([1, 2], {"max_new_tokens": 2})

    with pytest.raises(NoReplicaAvailableError, match="no healthy|failed on"):
        asyncio.run(none_left())


def test_cli_serve_with_two_replicas_behind_a_router(model_dir, tmp_path):
    ready = tmp_path / "ready.json"
    env = {**os.environ, "POLYRL_API_KEY": "k"}
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "serve",
        str(model_dir),
        "--port",
        "0",
        "--replicas",
        "2",
        "--ready-file",
        str(ready),
        "--threads",
        "1",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "128",
    ]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while not ready.exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "router did not get ready"
            time.sleep(0.1)
        url = json.loads(ready.read_text())["url"]
        auth = {"Authorization": "Bearer k"}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
            assert httpx.post(f"{url}/generate", json={"input_ids": [1]}).status_code == 401
            health = http.get("/health").json()
            assert health["status"] == "ok" and len(health["replicas"]) == 2
            body = {
                "input_ids": [11, 12, 13],
                "sampling_params": {"max_new_tokens": 4},
                "session_id": "s1",
            }
            where = {
                http.post("/generate", json=body).headers["x-polyrl-replica"] for _ in range(4)
            }
            assert len(where) == 1
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            r = http.post("/generate", json={"input_ids": [1, 10**7]})
            assert r.status_code == 400 and "unknown token id" in r.json()["error"]["message"]
            assert http.post("/pause").json()["paused"] is True
            assert http.post("/resume").json()["paused"] is False
            metrics = http.get("/metrics").text
            assert 'polyrl_rollout_requests_running{replica="0",' in metrics
            assert 'polyrl_rollout_requests_running{replica="1",' in metrics
            assert http.post("/abort", json={}).json()["aborted"] == 0
    finally:
        proc.terminate()
        code = proc.wait(30)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]


def test_a_replica_outlives_no_parent_killed_without_cleanup(model_dir, tmp_path):
    """SIGKILL the process that started a replica: the replica notices and shuts down."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from polyrl.rollout.launcher import ServerProcess\n"
        "p = ServerProcess(sys.argv[1], options={'num_threads': 1}).start(timeout=180)\n"
        "print(p.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # serving
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # A zombie (reparented, not yet reaped) has exited too.
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
            time.sleep(0.2)
        else:
            os.kill(child, 9)
            raise AssertionError("the replica kept running after its parent was killed")
    finally:
        parent.kill()


def test_engine_options_travel_as_one_json_object_and_flags_override_them():
    import argparse

    from polyrl.rollout.launcher import ServerProcess
    from polyrl.rollout.options import add_backend_arguments, backend_options

    proc = ServerProcess("/m", options={"max_num_seqs": 3, "dtype": "bfloat16", "seed": None})
    command = proc.command
    raw = command[command.index("--engine-options") + 1]
    assert json.loads(raw) == {"max_num_seqs": 3, "dtype": "bfloat16"}
    parser = argparse.ArgumentParser()
    add_backend_arguments(parser)
    args = parser.parse_args(["--engine-options", raw, "--max-num-seqs", "9"])
    assert backend_options(args) == {"max_num_seqs": 9, "dtype": "bfloat16"}
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(ValueError, match="--engine-options"):
            backend_options(parser.parse_args(["--engine-options", bad]))
    assert "--engine-options" not in ServerProcess("/m").command


def test_each_backend_declares_its_options_class():
    from polyrl.rollout.base import backend_options_class
    from polyrl.rollout.native.engine import NativeEngineConfig

    assert backend_options_class("native") is NativeEngineConfig
    with pytest.raises(ValueError, match="unknown rollout backend"):
        backend_options_class("nope")
