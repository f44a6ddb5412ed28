"""The vLLM backend without vLLM: its GPU options, and in-memory weight loads.

* the server's command line and environment for given options (``VLLMBackend.command`` and
  ``_environment`` need no server);
* the shared-memory layout: :func:`polyrl.rollout.vllm_weights.pack_weights` on one side, the
  worker extension's reader (:func:`polyrl.rollout.vllm_ext.iter_shared`, what vLLM's workers
  run) on the other;
* :class:`~polyrl.weights.staging.SharedArenaTarget` and the route choice of
  ``register_weight_routes``;
* ``VLLMBackend.load_weights`` against a stand-in for vLLM's HTTP control endpoints, which runs
  the worker extension's reader on what it is sent.

The same paths against a real vLLM server: ``tests_vllm/test_vllm_weights.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import save_file
from test_weights_core import LoopbackTransport
from test_weights_staging import DirBackend

from polyrl.core.arena import SharedArena
from polyrl.core.rollout_api import InvalidRequestError
from polyrl.rollout.vllm_backend import VLLMBackend, VLLMOptions
from polyrl.rollout.vllm_ext import iter_shared
from polyrl.rollout.vllm_weights import pack_weights
from polyrl.weights import WeightReceiver, WeightSender, WeightTransferError
from polyrl.weights.receiver import LoadFnTarget
from polyrl.weights.server_routes import register_weight_routes
from polyrl.weights.staging import SafetensorsDirTarget, SharedArenaTarget

CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "eos_token_id": 2,
}


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(40, 16, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=gen),
        "model.norm.weight": torch.randn(16, generator=gen),
    }


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file(checkpoint(0), str(d / "model.safetensors"))
    return d


def flag(cmd: list[str], name: str) -> str | None:
    """The value after ``name`` in ``cmd`` (``None`` when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd else None


# ------------------------------------------------------------------------ command and env


def test_cuda_options_become_vllm_flags(model_dir, monkeypatch):
    monkeypatch.delenv("POLYRL_VLLM_ARGS", raising=False)
    b = VLLMBackend(
        model_dir,
        device="cuda",
        dtype="auto",
        tensor_parallel_size=2,
        enable_sleep_mode=True,
        gpu_memory_utilization=0.6,
        enforce_eager=False,
        max_model_len=96,
    )
    cmd = b.command(8123)
    assert flag(cmd, "--tensor-parallel-size") == "2"
    assert flag(cmd, "--gpu-memory-utilization") == "0.6"
    assert "--enable-sleep-mode" in cmd
    assert flag(cmd, "--dtype") == "bfloat16"  # auto on CUDA
    assert flag(cmd, "--max-model-len") == "96"
    assert flag(cmd, "--port") == "8123"
    assert "--enforce-eager" not in cmd
    assert "--kv-cache-memory-bytes" not in cmd  # vLLM sizes it from gpu_memory_utilization
    assert "--no-enable-chunked-prefill" not in cmd  # the CPU workaround stays on CPU


def test_cuda_kv_cache_tokens_without_utilization_sizes_the_cache(model_dir):
    b = VLLMBackend(model_dir, device="cuda", dtype="bfloat16", kv_cache_tokens=1000)
    cmd = b.command(1)
    # 2 (K and V) x 1 layer x 1 kv head x 8 dims x 2 bytes x 1000 tokens, at least 1 MiB.
    assert flag(cmd, "--kv-cache-memory-bytes") == str(1 << 20)
    assert "--gpu-memory-utilization" not in cmd and "--tensor-parallel-size" not in cmd
    assert "--enable-sleep-mode" not in cmd
    assert "--kv-cache-memory-bytes" not in VLLMBackend(model_dir, device="cuda").command(1)


def test_cpu_gets_no_gpu_flags_and_a_sized_kv_cache(model_dir, tiny_vl_dir, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # would override the flag in whole GiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    b = VLLMBackend(
        model_dir,
        device="cpu",
        gpu_memory_utilization=0.5,  # a config shared with GPU runs: ignored here
        enable_sleep_mode=True,
        kv_cache_tokens=1 << 16,
        omp_threads_bind="0-1",
    )
    cmd = b.command(1)
    for gpu_flag in ("--gpu-memory-utilization", "--tensor-parallel-size", "--enable-sleep-mode"):
        assert gpu_flag not in cmd
    assert flag(cmd, "--kv-cache-memory-bytes") == str(2 * 1 * 1 * 8 * 4 * (1 << 16))
    assert flag(cmd, "--dtype") == "float32"
    assert "--enforce-eager" in cmd and "--no-enable-chunked-prefill" in cmd
    # The token-in route that carries images: vision models only (older vLLMs lack the flag).
    assert "--enable-scale-out" not in cmd
    assert "--enable-scale-out" in VLLMBackend(tiny_vl_dir, device="cpu").command(1)
    env = b._environment("/ext")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["PYTHONPATH"] == "/ext" and env["VLLM_SERVER_DEV_MODE"] == "1"
    # The default budget on CPU is 65536 tokens.
    cmd = VLLMBackend(model_dir).command(1)
    assert flag(cmd, "--kv-cache-memory-bytes") == str(2 * 1 * 1 * 8 * 4 * 65536)


def test_cuda_environment_keeps_the_launchers_gpus(model_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = VLLMBackend(model_dir, device="cuda", tensor_parallel_size=2)._environment("/x")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert not [k for k in env if k.startswith("VLLM_CPU_")]
    # cuda:i picks the i-th of the GPUs this process was given.
    assert VLLMBackend(model_dir, device="cuda:1")._environment("/x")["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ValueError, match="shows only 2 GPU"):
        VLLMBackend(model_dir, device="cuda:2")._environment("/x")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    env = VLLMBackend(model_dir, device="cuda:1")._environment("/x")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in VLLMBackend(model_dir, device="cuda")._environment("/x")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0: expected an int >= 1"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size=True"),
        ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2: expected 1 on device 'cpu'"),
        ({"tensor_parallel_size": 2, "device": "cuda:0"}, "names one GPU"),
        ({"gpu_memory_utilization": 0.0, "device": "cuda"}, r"a fraction in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5, "device": "cuda"}, r"a fraction in \(0, 1\]"),
        ({"gpu_memory_utilization": True, "device": "cuda"}, r"a fraction in \(0, 1\]"),
        ({"enable_sleep_mode": "yes"}, "enable_sleep_mode='yes': expected true or false"),
        ({"weight_load": "nfs"}, "weight_load='nfs': expected one of memory, disk"),
        ({"kv_cache_tokens": 0}, "kv_cache_tokens=0"),
    ],
)
def test_bad_gpu_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        VLLMOptions(**options)


def test_good_gpu_options():
    o = VLLMOptions(device="cuda", tensor_parallel_size=4, gpu_memory_utilization=1)
    assert o.tensor_parallel_size == 4 and o.weight_load == "memory"


# ------------------------------------------------------------------ shared-memory layout


def test_pack_and_read_round_trip():
    base = torch.randn(8, 6)
    pairs = [
        ("model.embed_tokens.weight", torch.randn(10, 4)),
        ("a.bf16", torch.randn(3, 5).to(torch.bfloat16)),
        ("a.strided", base.t()),  # not contiguous: copied as its logical values
        ("a.scalar", torch.tensor(3.5)),
        ("a.empty", torch.empty(0, 4)),
        ("a.int", torch.arange(7, dtype=torch.int64)),
    ]
    packed = pack_weights(pairs)
    try:
        layout = json.loads(json.dumps(packed.layout))  # it travels as JSON
        (segment,) = layout["segments"]
        assert Path(segment["path"]).exists()
        assert all(e["offset"] % 64 == 0 for e in layout["tensors"])
        got = list(iter_shared(layout, tie_lm_head=True))
        names = [n for n, _ in got]
        assert names == [n for n, _ in pairs] + ["lm_head.weight"]  # the tied head, last
        for (name, want), (_, tensor) in zip(pairs, got, strict=False):
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor, want), name
        assert torch.equal(got[-1][1], pairs[0][1])
        assert [n for n, _ in iter_shared(layout, tie_lm_head=False)] == [n for n, _ in pairs]
        assert packed.copied_bytes > 0
    finally:
        path = packed.layout["segments"][0]["path"]
        packed.close()
    assert not os.path.exists(path)  # the fresh arena went with the load


def test_tensors_already_in_an_arena_are_not_copied():
    arena = SharedArena(4096)
    try:
        a = arena.view(0, (4, 8), torch.float32)
        b = arena.view(1024, (16,), torch.bfloat16)
        a.copy_(torch.randn(4, 8))
        b.copy_(torch.randn(16))
        outside = torch.randn(5)
        packed = pack_weights([("a", a), ("b", b), ("c", outside)])
        segs = packed.layout["segments"]
        assert segs[0] == {"path": str(arena.path), "size": arena.nbytes}
        assert len(segs) == 2 and packed.copied_bytes == 64  # only "c" was copied
        assert [e["offset"] for e in packed.layout["tensors"][:2]] == [0, 1024]
        got = dict(iter_shared(packed.layout, tie_lm_head=False))
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
        assert torch.equal(got["c"], outside)
        packed.close()
        assert arena.path.exists()  # not ours to remove
    finally:
        arena.unlink()


def test_a_layout_pointing_outside_its_segment_is_refused():
    packed = pack_weights([("a", torch.zeros(4))])
    try:
        layout = json.loads(json.dumps(packed.layout))
        layout["tensors"][0]["shape"] = [1000]
        with pytest.raises(ValueError, match="lies outside its segment"):
            list(iter_shared(layout, tie_lm_head=False))
    finally:
        packed.close()


# ----------------------------------------------------------------- SharedArenaTarget


class MemoryBackend(DirBackend):
    """A stand-in for vLLM: ``load_weights`` packs and reads as the worker would."""

    def __init__(self, model_dir: Path, dtype: str = "float32"):
        super().__init__(model_dir, tied=True)
        self.dtype = dtype
        self.loads: list[dict[str, Any]] = []
        self.weight_load = "memory"

    @property
    def weight_receive(self) -> str:  # as VLLMBackend's: it follows weight_load
        return "safetensors_dir" if self.weight_load == "disk" else "shared_arena"

    def serving_dtype(self) -> str:
        return self.dtype

    async def load_weights(self, pairs, version=None) -> int:
        packed = pack_weights(pairs)
        try:
            layout = json.loads(json.dumps(packed.layout))
            self.weights = {n: t.clone() for n, t in iter_shared(layout, tie_lm_head=True)}
            self.loads.append({"layout": layout, "copied": packed.copied_bytes})
        finally:
            packed.close()
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version


def arena_setup(model_dir: Path, loop, tmp_path: Path, dtype: str = "float32"):
    backend = MemoryBackend(model_dir, dtype)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    target = SharedArenaTarget(backend, run, arena_root=tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    return backend, target, LoopbackTransport(WeightReceiver(target))


@pytest.mark.parametrize(("wire", "serving"), [(None, "float32"), (torch.bfloat16, "bfloat16")])
def test_arena_target_loads_the_set_in_place(model_dir, loop, tmp_path, wire, serving):
    backend, target, transport = arena_setup(model_dir, loop, tmp_path, serving)
    new = checkpoint(1)
    sender = WeightSender(
        transport, bucket_mb=1024 / 2**20, dtype=wire, checksum=True, inflight="pause"
    )
    stats = sender.send(iter(new.items()), version=3)
    assert stats.replica_versions == [3] and backend.weight_version == 3 and stats.buckets >= 4
    assert backend.calls == ["pause", "resume"]
    ((load),) = backend.loads
    assert load["copied"] == 0  # every tensor was read where it was received
    (segment,) = load["layout"]["segments"]
    assert segment["path"].startswith(str(tmp_path / "shm" / "polyrl-arena-"))
    assert set(backend.weights) == {*new, "lm_head.weight"}
    for name, tensor in new.items():
        want = tensor.to(getattr(torch, serving))
        if wire is not None:
            want = tensor.to(wire).to(getattr(torch, serving))
        assert backend.weights[name].dtype == want.dtype
        assert torch.equal(backend.weights[name], want), name
    assert torch.equal(
        backend.weights["lm_head.weight"], backend.weights["model.embed_tokens.weight"]
    )
    # The arena stays for the next transfer (one model's size) and is reused by it.
    held = target.held_bytes()
    assert held >= sum(t.numel() for t in new.values()) * (4 if serving == "float32" else 2)
    sender.send(iter(checkpoint(2).items()))
    assert backend.weight_version == 4
    assert backend.loads[1]["layout"]["segments"] == backend.loads[0]["layout"]["segments"]
    assert torch.equal(
        backend.weights["model.norm.weight"],
        checkpoint(2)["model.norm.weight"].to(getattr(torch, serving)),
    )
    assert not list(tmp_path.glob("**/polyrl-stage-*"))  # no safetensors directory
    target.close()
    assert list((tmp_path / "shm").iterdir()) == []


def test_arena_target_offers_its_arena_for_direct_writes(model_dir, loop, tmp_path):
    backend, target, transport = arena_setup(model_dir, loop, tmp_path)
    receiver = transport.receiver
    receiver.begin("t1", -1)
    offer = receiver.offer_direct("t1")
    assert offer is not None and Path(offer["path"]).exists()
    assert set(offer["tensors"]) == set(checkpoint(0))
    offset, shape, dtype = offer["tensors"]["model.norm.weight"]
    assert shape == [16] and dtype == "float32"
    # A same-host sender writes into the file; the backend then reads the same bytes.
    from polyrl.core.arena import ArenaWriter

    writer = ArenaWriter(offer["path"])
    new = checkpoint(5)
    crcs = {}
    for name, tensor in new.items():
        off, _, dt = offer["tensors"][name]
        crcs[name] = writer.write(off, tensor, getattr(torch, dt), checksum=True)
    writer.close()
    assert receiver.commit("t1", -1, 0, crcs) == 1
    for name, tensor in new.items():
        assert torch.equal(backend.weights[name], tensor), name
    target.close()


def test_arena_target_refuses_unknown_misshapen_and_missing(model_dir, loop, tmp_path):
    backend, target, transport = arena_setup(model_dir, loop, tmp_path)
    sender = WeightSender(transport, bucket_mb=1024 / 2**20)
    new = checkpoint(1)
    with pytest.raises(WeightTransferError, match="unknown tensor 'model.bogus.weight'"):
        sender.send(iter([*new.items(), ("model.bogus.weight", torch.zeros(3))]))
    with pytest.raises(WeightTransferError, match=r"'model.norm.weight' has shape \[8\]"):
        sender.send(iter([*list(new.items())[:3], ("model.norm.weight", torch.zeros(8))]))
    with pytest.raises(WeightTransferError, match=r"missing .*'model.norm.weight'"):
        sender.send(iter(list(new.items())[:3]))
    assert backend.loads == [] and backend.weight_version == 0
    # An explicit tied head is accepted (a temporary beside the arena).
    sender.send(iter([*new.items(), ("lm_head.weight", new["model.embed_tokens.weight"] * 2)]))
    assert torch.equal(backend.weights["lm_head.weight"], new["model.embed_tokens.weight"] * 2)
    assert backend.loads[-1]["copied"] > 0
    target.close()


def test_routes_prefer_memory_for_vllm_and_keep_disk_reachable(model_dir):
    backend = MemoryBackend(model_dir)
    receiver = register_weight_routes(FastAPI(), backend)
    assert isinstance(receiver.target, SharedArenaTarget)
    backend.weight_load = "disk"
    receiver = register_weight_routes(FastAPI(), backend)
    assert isinstance(receiver.target, SafetensorsDirTarget)

    class DirOnly:  # a backend that only reloads directories
        weight_receive = "safetensors_dir"
        model_dir = backend.model_dir
        weight_version = 0

        async def update_weights(self, path, version=None):
            return 1

    assert isinstance(register_weight_routes(FastAPI(), DirOnly()).target, SafetensorsDirTarget)


def test_routes_follow_what_the_backend_declares(model_dir):
    from polyrl.rollout.native.backend import NativeBackend
    from polyrl.rollout.sglang_backend import SGLangBackend

    assert NativeBackend.weight_receive == "stream"
    assert SGLangBackend.weight_receive == "safetensors_dir"
    assert VLLMBackend(model_dir).weight_receive == "shared_arena"
    assert VLLMBackend(model_dir, weight_load="disk").weight_receive == "safetensors_dir"

    class Undeclared:  # load_weights alone no longer picks a path
        weight_version = 0

        async def load_weights(self, pairs, version=None):
            return 1

    with pytest.raises(TypeError, match="declares weight_receive=None: set it to one of stream"):
        register_weight_routes(FastAPI(), Undeclared())
    Undeclared.weight_receive = "stream"  # but no engine to stream into
    with pytest.raises(TypeError, match="weight_receive='stream' but has no engine"):
        register_weight_routes(FastAPI(), Undeclared())
    Undeclared.weight_receive = "load_fn"
    assert isinstance(register_weight_routes(FastAPI(), Undeclared()).target, LoadFnTarget)
    Undeclared.weight_receive = "none"
    app = FastAPI()
    assert register_weight_routes(app, Undeclared()) is None
    assert not [r for r in app.routes if getattr(r, "path", "").startswith("/weights")]


# --------------------------------------------------------- VLLMBackend.load_weights


class FakeServer:
    """vLLM's control endpoints as ``VLLMBackend._call`` sees them; loads like the worker."""

    def __init__(self):
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.paths: list[str] = []

    async def __call__(self, method, path, *, params=None, json_body=None, timeout=300.0):
        self.calls.append(path if json_body is None else f"{path}:{json_body['method']}")
        if path == "/collective_rpc":
            assert json_body["method"] == "polyrl_load_shared"
            (layout_json,) = json_body["args"]
            layout = json.loads(layout_json)
            self.paths += [s["path"] for s in layout["segments"]]
            self.loaded = {n: t.clone() for n, t in iter_shared(layout, tie_lm_head=True)}
            return [{"tensors": len(self.loaded)}]
        return None


def run_async(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_backend_load_weights_is_one_atomic_switch(model_dir):
    b = VLLMBackend(model_dir)
    server = b._call = FakeServer()
    new = checkpoint(3)
    assert run_async(b.load_weights(list(new.items()))) == 1
    assert server.calls == [
        "/pause",
        "/collective_rpc:polyrl_load_shared",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert b.weight_version == 1
    for name, tensor in new.items():
        assert torch.equal(server.loaded[name], tensor), name
    assert torch.equal(server.loaded["lm_head.weight"], new["model.embed_tokens.weight"])
    assert server.paths and not any(os.path.exists(p) for p in server.paths)  # removed after
    assert run_async(b.load_weights(list(new.items()), version=7)) == 7


def test_backend_load_weights_refuses_a_wrong_set_before_vllm(model_dir):
    b = VLLMBackend(model_dir)
    server = b._call = FakeServer()
    new = checkpoint(3)
    with pytest.raises(InvalidRequestError, match=r"missing .*model.norm.weight"):
        run_async(b.load_weights(list(new.items())[:3]))
    with pytest.raises(InvalidRequestError, match="unknown tensor 'x'"):
        run_async(b.load_weights([*new.items(), ("x", torch.zeros(1))]))
    with pytest.raises(InvalidRequestError, match="appears twice"):
        run_async(b.load_weights([*new.items(), ("model.norm.weight", torch.zeros(16))]))
    with pytest.raises(InvalidRequestError, match="version must be an int >= 0"):
        run_async(b.load_weights(list(new.items()), version=-2))
    assert server.calls == [] and b.weight_version == 0


def test_vllm_metrics_skip_gauges_that_read_nan():
    from polyrl.rollout.vllm_backend import _parse_metrics

    text = (
        'vllm:num_requests_running{model_name="m"} 2\n'
        'vllm:num_requests_waiting{model_name="m"} NaN\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    assert _parse_metrics(text) == {"running": 2.0, "kv_usage": 0.25}
