"""Weight transfer engine → the polyrl server with ``--backend vllm`` (CPU, tiny model).

The server (a subprocess) fronts a real vLLM server. Every test runs against both ways a
transfer reaches vLLM (the ``weight_load`` option): ``memory`` (the default) receives into a
shared-memory arena that vLLM's worker reads in place at commit, writing no file; ``disk``
stages a safetensors directory and reloads it into vLLM once, at commit. Run with
``make test-vllm``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open
from test_vllm_backend import PROMPTS, greedy, hf_greedy

from polyrl.model_engine.engine import build_engine
from polyrl.rollout.launcher import ServerProcess
from polyrl.weights import WeightSender, create_transport

pytestmark = pytest.mark.slow

BUCKET_MB = 0.25  # the tiny model is ~1 MB: several buckets, tensors split across them


@pytest.fixture(scope="module", params=["memory", "disk"])
def weight_load(request: pytest.FixtureRequest) -> str:
    """How transfers reach vLLM: ``memory`` (in place, no file) or ``disk`` (staged dir)."""
    return str(request.param)


@pytest.fixture(scope="module")
def server(model_dir: Path, vllm_venv: Path, weight_load: str) -> Iterator[str]:
    """Start the polyrl HTTP server with the vLLM backend in its own process; yield its URL."""
    proc = ServerProcess(
        model_dir,
        backend="vllm",
        options={"dtype": "float32", "weight_load": weight_load},
        env={"POLYRL_VLLM_VENV": str(vllm_venv)},
    )
    try:
        proc.start(timeout=600)
        assert proc.url is not None
        yield proc.url
    finally:
        proc.stop(timeout=60)


def version(url: str) -> int:
    """Return the weight version the server reports."""
    return int(httpx.get(url + "/health").json()["weight_version"])


def generate(url: str, prompt: list[int]) -> dict[str, Any]:
    """Return the server's greedy ``/generate`` answer for ``prompt``."""
    body = {"input_ids": prompt, "sampling_params": greedy()}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def assert_serves(url: str, model: Path, want_version: int) -> None:
    """Greedy tokens equal HF ``generate`` on ``model``'s weights; log-probs close."""
    for prompt in PROMPTS:
        out = generate(url, prompt)
        ids, lps = hf_greedy(model, prompt, 12)
        assert out["outputs"][0]["output_ids"] == ids
        assert out["outputs"][0]["logprobs"] == pytest.approx(lps, abs=2e-3)
        assert out["weight_version"] == want_version


def checkpoint_tensors(model: Path) -> Iterator[tuple[str, Any]]:
    """Yield the tensors of a safetensors model directory."""
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def send(kind: str, url: str, tensors: Any, **kw: Any) -> Any:
    """Send ``tensors`` over a fresh transport of ``kind``; return the sender's stats."""
    transport = create_transport(kind, urls=[url], timeout=300)
    try:
        return WeightSender(transport, bucket_mb=BUCKET_MB, checksum=True, **kw).send(tensors)
    finally:
        transport.close()


def staging_dirs() -> list[str]:
    """Return the staging directories present under ``/dev/shm``."""
    return sorted(p.name for p in Path("/dev/shm").glob("polyrl-stage-*"))


def test_updates_over_shm_disk_and_dist_switch_vllm(server, weight_load, model_dir, model_dir_v2):
    """An update from a model engine (or a checkpoint) changes vLLM's greedy outputs to HF's.

    With ``weight_load="memory"`` no safetensors directory is ever written: the tensors land in
    the replica's shared arena, which vLLM's worker reads in place.
    """
    start = version(server)
    assert (
        generate(server, PROMPTS[1])["outputs"][0]["output_ids"]
        != hf_greedy(model_dir_v2, PROMPTS[1], 12)[0]
    )  # the two seeds really differ
    before = staging_dirs()
    # Status requests all along, commits included: the server must not block its event loop on
    # the receiver while a commit waits for vLLM's reload on that same loop.
    stop = threading.Event()
    polls: list[int] = []
    staged: set[str] = set()  # staging directories seen while the transfers ran

    def poll() -> None:
        with httpx.Client(base_url=server, timeout=120) as client:
            while not stop.is_set():
                polls.append(client.get("/weights/status").status_code)
                staged.update(set(staging_dirs()) - set(before))
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    steps = [("shm", model_dir_v2, True), ("disk", model_dir, False), ("dist", model_dir_v2, True)]
    for i, (kind, model, from_engine) in enumerate(steps, start=1):
        if from_engine:
            engine = build_engine(str(model))
            try:
                stats = send(kind, server, engine.named_tensors())
            finally:
                engine.close()
        else:
            stats = send(kind, server, checkpoint_tensors(model))
        if kind == "shm" and weight_load == "memory":
            # Same host: the sender writes every tensor straight into the offered arena.
            assert stats.direct_tensors == stats.tensors > 0 and stats.buckets == 0, stats
        else:
            assert stats.buckets > 2, kind
        assert stats.replica_versions == [start + i] == [version(server)], kind
        assert_serves(server, model, start + i)
        status = httpx.get(server + "/weights/status").json()
        assert status["last"]["outcome"] == "committed", kind
        if weight_load == "memory":
            # The arena (the model, once, in float32) stays for the next transfer.
            assert status["held_bytes"] >= sum(
                t.numel() * 4 for _, t in checkpoint_tensors(model_dir)
            ), kind
    stop.set()
    poller.join(30)
    assert len(polls) > 10 and set(polls) == {200}
    assert set(staging_dirs()) <= set(before)  # each staging directory went after its reload
    if weight_load == "memory":
        assert staged == set()  # no safetensors directory, not even for a moment
    else:
        assert staged  # the disk path really staged directories


def test_interrupted_transfers_keep_the_old_version_then_a_retry_succeeds(
    server, model_dir, model_dir_v2
):
    """A sender that fails, or stalls past the timeout, never reaches vLLM's reload."""
    start = version(server)
    serving = generate(server, PROMPTS[0])
    before = staging_dirs()

    def fails() -> Iterator[tuple[str, Any]]:
        items = list(checkpoint_tensors(model_dir_v2))
        yield from items[: len(items) // 2]
        raise RuntimeError("the sender died")

    with pytest.raises(RuntimeError, match="the sender died"):
        send("shm", server, fails())

    def stalls() -> Iterator[tuple[str, Any]]:
        items = list(checkpoint_tensors(model_dir_v2))
        yield from items[: len(items) // 2]
        deadline = time.monotonic() + 30
        # A killed sender sends nothing more: the replica drops the transfer on its own.
        while httpx.get(server + "/weights/status").json()["transfer_id"] is not None:
            assert time.monotonic() < deadline, "the stalled transfer was never dropped"
            time.sleep(0.1)
        raise RuntimeError("the sender stalled")

    with pytest.raises(RuntimeError, match="the sender stalled"):
        send("disk", server, stalls(), stall_timeout=1.0)
    last = httpx.get(server + "/weights/status").json()["last"]
    assert last["outcome"].startswith("aborted"), last
    assert version(server) == start
    again = generate(server, PROMPTS[0])
    assert again["outputs"] == serving["outputs"]  # same tokens and log-probs
    assert again["weight_version"] == serving["weight_version"] == start
    assert set(staging_dirs()) <= set(before)  # no staging directory left behind
    target = (
        model_dir_v2
        if serving["outputs"][0]["output_ids"] != hf_greedy(model_dir_v2, PROMPTS[0], 12)[0]
        else model_dir
    )
    stats = send("shm", server, checkpoint_tensors(target))
    assert stats.replica_versions == [start + 1]
    assert_serves(server, target, start + 1)
