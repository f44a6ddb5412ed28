"""CUDA-IPC weight transfer from this process into a rollout replica serving on the GPU.

The sender packs fp32 GPU tensors into two GPU buckets shared by IPC handle; the replica
(another process, serving in bf16 like every production replica) converts each bucket into its
staged shadows while copying, and switches atomically at commit; it reports the buckets as
received over ``cuda_ipc``. While
the buckets go over, the replica keeps serving the old version; afterwards its greedy tokens
and log-probs equal those of a replica started from the new weights. A second update (back to
the first weights) reuses the transport's buffers and their cached IPC handles.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from safetensors import safe_open

from polyrl.rollout.client import RolloutClient
from polyrl.rollout.launcher import ServerProcess
from polyrl.weights import WeightSender, create_transport

OPTIONS = {
    "device": "cuda",
    "dtype": "bfloat16",
    "num_threads": 1,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "kv_cache_tokens": 4096,
}
PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
BUCKET_MB = 0.25  # several buckets for the nano model: both slots are used and reused


def outputs(url: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs for every prompt."""

    async def go():
        async with RolloutClient([url]) as client:
            results = [await client.generate(p, GREEDY) for p in PROMPTS]
        return [(r.outputs[0].output_ids, r.outputs[0].logprobs) for r in results]

    return asyncio.run(go())


def version(url: str) -> int:
    """The weight version a replica serves."""
    return int(httpx.get(url + "/health", timeout=30).json()["weight_version"])


def gpu_tensors(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, moved to the GPU (what a trainer on the GPU would send)."""
    out = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out.append((name, f.get_tensor(name).to("cuda")))
    return out


def assert_same_outputs(got, want) -> None:
    """Equal tokens; equal log-probs (the same bf16 weights: fp32 rounded once, either way)."""
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-3)


@pytest.fixture(scope="module")
def replicas(tiny_dir, tiny_dir_seed1):
    """A replica on the seed-0 weights (accepts cuda_ipc) and a reference on the seed-1 ones."""
    target = ServerProcess(tiny_dir, options=OPTIONS, env={"POLYRL_WEIGHTS_CUDA_IPC": "1"})
    ref = ServerProcess(tiny_dir_seed1, options=OPTIONS)
    try:
        target.start(timeout=300)
        ref.start(timeout=300)
        yield target.url, ref.url
    finally:
        for p in (target, ref):
            p.stop()


def test_cuda_ipc_update_switches_atomically_and_matches_the_reference(
    replicas, tiny_dir, tiny_dir_seed1
):
    url, ref_url = replicas
    before = version(url)
    old = outputs(url)
    want = outputs(ref_url)
    assert [ids for ids, _ in old] != [ids for ids, _ in want]  # the two seeds really differ

    served_during: list[int] = []

    def on_bucket(meta) -> None:
        # Asked while the transfer is open: the replica must still serve the old version.
        served_during.append(version(url))

    transport = create_transport("cuda_ipc", urls=[url], timeout=120)
    try:
        stats = WeightSender(
            transport, bucket_mb=BUCKET_MB, checksum=True, on_bucket=on_bucket
        ).send(gpu_tensors(tiny_dir_seed1))
        assert stats.buckets > 2 and stats.tensors > 0
        assert served_during and set(served_during) == {before}
        assert stats.replica_versions == [before + 1]
        assert version(url) == before + 1
        # The replica's own count, not a log line: every bucket came over CUDA IPC.
        assert transport.received == [{"cuda_ipc": stats.buckets}]
        assert_same_outputs(outputs(url), want)

        # Back to the first weights through the same transport (reused buffers and handles).
        stats = WeightSender(transport, bucket_mb=BUCKET_MB, checksum=True).send(
            gpu_tensors(tiny_dir)
        )
        assert stats.replica_versions == [before + 2]
        assert_same_outputs(outputs(url), old)
    finally:
        transport.close()
