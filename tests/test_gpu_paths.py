"""The GPU paths' device naming, routing, pools and sleep/wake order, tested on CPU.

What a first GPU run would trip on, checked with the same functions the CUDA code calls:
unindexed CUDA devices (NCCL's ``set_device``), CUDA IPC handles opened by a replica that
numbers GPUs differently, IPC routing from a rank on another GPU, engine pools without GPUs on
the local backend, two NCCL ranks on one GPU, a transport made per sync, fp32 on the wire, the
hybrid sleep/wake order and host copies made afresh each sleep. Where a GPU itself is needed
(``torch.cuda.current_device``, GPU memory) a stand-in named ``Fake...`` / ``fake_...`` plays
it; the CUDA-only remainder is in ``tests_gpu/``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl.config import load_config
from polyrl.core.cuda import (
    HostStash,
    indexed_device,
    local_cuda_index,
    process_group_backend,
    remap_ipc_device,
)
from polyrl.trainer.rl.build import (
    RolloutServers,
    engine_pool,
    hybrid_senders,
    local_replica_gpus,
    replica_options,
    weight_transport,
)
from polyrl.weights.transports import DistTransport, group_device
from polyrl.workers.weight_sync import WeightSync, replicas_of_rank

GPU_RUN = ["trainer.device=cuda", "trainer.n_gpus_per_node=4"]


# ------------------------------------------------------------------ 1. indexed devices
def fake_current_device() -> int:
    """Stands in for ``torch.cuda.current_device`` (needs a GPU): this process is on GPU 2."""
    return 2


def test_cuda_without_an_index_resolves_to_the_current_gpu():
    assert indexed_device("cuda", fake_current_device) == torch.device("cuda", 2)
    assert indexed_device(None, fake_current_device) == torch.device("cuda", 2)
    assert indexed_device("cuda:1", fake_current_device) == torch.device("cuda", 1)
    assert indexed_device("cpu", fake_current_device) == torch.device("cpu")


def test_both_ends_of_an_nccl_group_use_an_indexed_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", fake_current_device)
    # The replica's /weights/dist/init carries no device; the sender says "cuda".
    for device in (None, "cuda"):
        assert group_device("nccl", device) == torch.device("cuda", 2)
    assert group_device("gloo", "cuda") == torch.device("cpu")
    sender = DistTransport(["http://127.0.0.1:9"], backend="nccl", device="cuda")
    try:
        assert sender.device.index == 2
    finally:
        sender.close()


# ------------------------------------------------------------------ 2. IPC routing and handles
def test_an_ipc_handle_opens_on_the_receivers_index_of_the_senders_gpu():
    # The sender (all GPUs visible) made the buffer on its cuda:3; the replica sees two GPUs.
    replica_gpus = ["GPU-aaa", "GPU-bbb"]
    assert local_cuda_index("GPU-bbb", replica_gpus, fallback=3) == 1
    assert local_cuda_index(None, replica_gpus, fallback=3) == 3  # an older sender
    with pytest.raises(RuntimeError, match="GPU-ccc.*cannot see"):
        local_cuda_index("GPU-ccc", replica_gpus, fallback=3)
    args = ("cls", (4,), (1,), 0, "storage", torch.uint8, 3, b"handle")
    assert remap_ipc_device(args, 1)[6] == 1
    with pytest.raises(ValueError, match="device index"):
        remap_ipc_device(args[:3], 1)


@pytest.mark.parametrize(("world", "replicas", "per"), [(1, 1, 1), (4, 4, 1), (8, 4, 2), (4, 2, 2)])
def test_each_hybrid_replica_is_sent_to_from_a_rank_on_its_gpu(world, replicas, per):
    visible = [str(g) for g in (3, 5, 6, 7, 0, 1, 2, 4)][:world]
    gpus = local_replica_gpus("hybrid", replicas, per, world, visible)
    senders = hybrid_senders("hybrid", replicas, per)
    urls = [f"http://r{i}" for i in range(replicas)]
    for rank in range(world):
        mine = replicas_of_rank(rank, urls, senders)
        # A local rank r computes on visible GPU r: it sends only to replicas holding it.
        for url in mine:
            assert visible[rank] in gpus[urls.index(url)]
    assert sorted(u for r in range(world) for u in replicas_of_rank(r, urls, senders)) == urls
    assert hybrid_senders("separate", replicas, per) == []


def test_without_senders_rank_zero_sends_to_every_replica():
    urls = ["http://a", "http://b"]
    assert replicas_of_rank(0, urls, None) == urls
    assert replicas_of_rank(1, urls, None) == []
    with pytest.raises(ValueError, match="one sending rank per replica"):
        replicas_of_rank(0, urls, [0])


# ------------------------------------------------------------------ 3. engine pools on GPUs
def test_the_local_backend_gives_engine_ranks_a_gpu_when_training_on_cuda():
    cfg = load_config("demo", [*GPU_RUN, "trainer.worker_backend=local"])
    pool = engine_pool(cfg, "rl-actor")
    assert pool.gpus_per_worker == 1.0 and pool.pins_gpu and pool.world_size == 4
    cpu_cfg = load_config("demo", ["trainer.device=cpu", "trainer.worker_backend=local"])
    assert not engine_pool(cpu_cfg, "rl-actor").use_gpu
    # A rank on a GPU runs NCCL for CUDA tensors (gloo alone cannot run FSDP2 there).
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"


# ------------------------------------------------------- 4. never two NCCL ranks on a GPU
@pytest.mark.parametrize("same_host", [True, False])
@pytest.mark.parametrize("named", ["auto", "dist"])
def test_hybrid_placement_never_puts_a_replica_in_an_nccl_group(same_host, named):
    cfg = load_config("demo", [*GPU_RUN, f"rollout.weight_transport={named}"])
    servers = RolloutServers(["u"], same_host=same_host, placement="hybrid", senders=[0])
    name, options = weight_transport(cfg, servers, trainer_host="10.0.0.1")
    assert options.get("backend") != "nccl"
    if named == "auto":
        assert name == "cuda_ipc"  # each rank sends to the replicas on its own GPU


# ------------------------------------------------------- 5, 7. one transport, replica dtype
def test_one_transport_serves_every_sync_to_the_same_replicas():
    sync = WeightSync()
    first = sync._transport_for("disk", ["http://a"], {})
    assert sync._transport_for("disk", ["http://a"], {}) is first
    assert sync.transports_made == 1
    # A restarted replica (new URL) gets a new transport; the old one is closed.
    second = sync._transport_for("disk", ["http://b"], {})
    assert second is not first and sync.transports_made == 2
    assert first._http.is_closed
    sync.close()
    assert second._http.is_closed


class FakeNcclGroup:
    """Stands in for an NCCL communicator (needs GPUs): records its shutdown."""

    shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_a_closed_dist_transport_shuts_its_group_down():
    transport = DistTransport(["http://127.0.0.1:9"])
    group = transport._group = FakeNcclGroup()
    transport.close()
    assert transport._group is None and group.shut_down


def test_the_wire_dtype_is_the_replicas():
    from polyrl.trainer.rl.generation import Replicas

    gpu = Replicas(load_config("demo", GPU_RUN), ["http://r0"], FakeGpuProducer(), ("x", {}))
    assert gpu.wire_dtype == "bfloat16"  # the replicas' default on CUDA, not the fp32 master
    cpu = Replicas(
        load_config("demo", ["trainer.device=cpu", "rollout.dtype=bfloat16"]),
        ["http://r0"],
        FakeGpuProducer(),
        ("shm", {}),
    )
    assert cpu.wire_dtype == "bfloat16"


# ------------------------------------------------------------------ 6. hybrid sleep/wake order
class FakeGpuClient:
    """Stands in for the replicas' GPU memory: records what is woken and put to sleep."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def enable_replica(self, url: str, enabled: bool = True) -> None:
        pass

    async def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        self.log.append(("replicas.sleep", level))
        return []

    async def wake_up(self, tags: Any = None) -> list[dict[str, Any]]:
        self.log.append(("replicas.wake", tuple(tags) if tags else ("weights", "kv_cache")))
        return []


class FakeGpuProducer:
    """Carries :class:`FakeGpuClient` the way the rollout producer carries its client."""

    def __init__(self, log: list[Any] | None = None) -> None:
        self.client = FakeGpuClient(log if log is not None else [])
        self.watch = None

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)


class FakeGpuActor:
    """Stands in for the actor's GPU memory operations; records the calls in order."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def empty_cache(self) -> None:
        self.log.append(("actor.empty_cache",))

    def offload(self, params: bool, optimizer: bool) -> None:
        self.log.append(("actor.offload", params, optimizer))

    def reload(self, params: bool, optimizer: bool) -> None:
        self.log.append(("actor.reload", params, optimizer))

    def sync_weights(self, **kwargs: Any) -> list[dict[str, Any] | None]:
        self.log.append(("actor.push", kwargs["dtype"], tuple(kwargs["senders"] or ())))
        return [{"bytes": 1, "buckets": 1}, None]


@pytest.mark.parametrize("offload", [False, True])
def test_a_hybrid_sync_frees_the_gpu_in_order(offload):
    from polyrl.trainer.rl.generation import Replicas

    flags = [f"actor.offload_params={offload}", f"actor.offload_optimizer={offload}"]
    cfg = load_config("demo", [*GPU_RUN, *flags])
    log: list[Any] = []
    urls = ["http://r0", "http://r1"]
    replicas = Replicas(cfg, urls, FakeGpuProducer(log), ("cuda_ipc", {}), senders=[0, 2])
    replicas.sync_weights(FakeGpuActor(log), version=1)
    push = ("actor.push", "bfloat16", (0, 2))
    if offload:
        expected = [
            ("actor.offload", False, True),
            ("replicas.wake", ("weights",)),
            push,
            ("actor.offload", True, False),
            ("replicas.wake", ("kv_cache",)),
        ]
    else:
        expected = [
            ("actor.empty_cache",),
            ("replicas.wake", ("weights",)),
            push,
            ("actor.empty_cache",),
            ("replicas.wake", ("kv_cache",)),
        ]
    assert log == expected
    log.clear()
    replicas.sleep()  # the replicas' samples are in: the actor gets its memory back
    assert log == [("replicas.sleep", 1)] + ([("actor.reload", True, True)] if offload else [])


def test_sglang_replicas_release_their_weights_when_they_sleep_in_hybrid():
    hybrid = replica_options(load_config("demo", [*GPU_RUN, "rollout.backend=sglang"]))
    assert hybrid["enable_sleep_mode"] and hybrid["weights_cpu_backup"]
    separate = replica_options(
        load_config("demo", [*GPU_RUN, "rollout.backend=sglang", "rollout.placement=separate"])
    )
    assert not separate["weights_cpu_backup"]


# ------------------------------------------------------------------ 8. host copies made once
def test_sleep_copies_reuse_their_host_buffers():
    weights = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    stash = HostStash(pin=False)  # pinned on CUDA; the reuse logic is the same
    for step in range(3):
        for name, tensor in weights.items():
            stash.save(name, tensor + step)
        for name, tensor in weights.items():
            assert torch.equal(stash.load(name, "cpu"), tensor + step)
    assert stash.allocations == 2
    assert stash.nbytes == (12 + 5) * 4


# ------------------------------------------------------------------ the GPU check script
def _gpu_check(tmp_path, *parts: str, **env: str):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check.sh"), *parts],
        cwd=repo,
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, (out / "gpu_report.md").read_text()


def test_the_gpu_check_dry_run_lists_what_each_call_would_run(tmp_path):
    proc, report = _gpu_check(tmp_path, "grpo", "bench", POLYRL_GPU_DRY_RUN="1")
    assert proc.returncode == 0, report
    assert report.count("- WOULD RUN tests_gpu/test_grpo_cuda.py::") == 2
    assert "benchmarks/gpu_step.py" in report and "dry run: not run" in report


def test_the_gpu_check_reports_skipped_gpu_tests_as_not_run(tmp_path):
    # Here, without CUDA: every test skips, which the report must never count as a pass.
    proc, report = _gpu_check(tmp_path, "fast", POLYRL_GPU_CALL_S="240")
    assert proc.returncode == 1, report
    assert "CUDA is not available here" in report
    lines = [line for line in report.splitlines() if line.startswith("- ")]
    ran = [line for line in lines if line.startswith(("- PASSED", "- FAILED", "- NOT RUN"))]
    assert ran and all(line.startswith("- NOT RUN") for line in ran), ran
    assert any("test_weights_cuda_ipc.py" in line for line in ran)
    assert any("test_vllm_gpu.py" in line and "whole module" in line for line in ran)
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    refused = subprocess.run(["bash", str(script), "everything"], capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown part 'everything'" in refused.stderr
