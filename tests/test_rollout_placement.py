"""Where the RL trainer's rollout replicas run and with which settings (issue 22, item 1-3).

CPU-only: a replica's GPUs, device, dtype, tensor parallelism and sleep mode are checked in the
command line and environment it is launched with; the transport ``auto`` picks is checked for
each placement. ``tests_gpu/`` runs the same paths on a GPU.
"""

from __future__ import annotations

import json
import os

import pytest

from polyrl.config import ConfigError, load_config
from polyrl.trainer.rl.build import (
    RolloutServers,
    local_replica_gpus,
    replica_count,
    replica_options,
    replica_processes,
    rollout_device,
    rollout_dtype,
    rollout_placement,
    sleeps_during_training,
    weight_transport,
)
from polyrl.weights.base import CUDA_IPC_ENV

GPU_RUN = ["trainer.device=cuda", "trainer.worker_backend=local"]


def _engine_options(process) -> dict:
    command = process.command
    return json.loads(command[command.index("--engine-options") + 1])


def test_rollout_settings_follow_the_trainer_device_when_auto():
    cpu = load_config("demo", ["trainer.device=cpu"])
    assert (rollout_device(cpu), rollout_placement(cpu), rollout_dtype(cpu)) == (
        "cpu",
        "separate",
        cpu.model.dtype,
    )
    assert not sleeps_during_training(cpu) and replica_count(cpu) == 1
    gpu = load_config("demo", [*GPU_RUN, "trainer.n_gpus_per_node=8"])
    assert (rollout_device(gpu), rollout_placement(gpu), rollout_dtype(gpu)) == (
        "cuda",
        "hybrid",
        "bfloat16",
    )
    # Hybrid: every training GPU serves too, and the replicas sleep while the engines train.
    assert sleeps_during_training(gpu) and replica_count(gpu) == 8
    tp = load_config(
        "demo",
        [*GPU_RUN, "trainer.n_gpus_per_node=8", "rollout.backend=vllm"]
        + ["rollout.tensor_parallel_size=2"],
    )
    assert replica_count(tp) == 4
    explicit = load_config(
        "demo",
        [*GPU_RUN, "rollout.device=cpu", "rollout.dtype=float32", "rollout.replicas=3"],
    )
    assert (rollout_device(explicit), rollout_placement(explicit)) == ("cpu", "separate")
    assert rollout_dtype(explicit) == "float32" and replica_count(explicit) == 3


@pytest.mark.parametrize(
    ("placement", "replicas", "per", "engines", "visible", "expected"),
    [
        ("hybrid", 8, 1, 8, list("01234567"), [[str(i)] for i in range(8)]),
        ("hybrid", 4, 2, 8, list("01234567"), [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]),
        ("separate", 2, 2, 4, list("01234567"), [["4", "5"], ["6", "7"]]),
        # Physical ids come from CUDA_VISIBLE_DEVICES: rank i trains on its i-th entry.
        ("separate", 1, 1, 2, ["3", "5", "6"], [["6"]]),
        ("hybrid", 2, 1, 2, ["3", "5", "6"], [["3"], ["5"]]),
        ("separate", 3, 0, 2, [], [[], [], []]),  # CPU replicas hold no GPU
    ],
)
def test_local_replica_gpus(placement, replicas, per, engines, visible, expected):
    assert local_replica_gpus(placement, replicas, per, engines, visible) == expected


def test_local_replica_gpus_refuses_replicas_that_do_not_fit():
    with pytest.raises(ConfigError, match=r"need 4 GPUs but only 2 .*spare") as err:
        local_replica_gpus("separate", 2, 2, 6, list("01234567"))
    assert err.value.key == "rollout.replicas"
    with pytest.raises(ConfigError, match="trainer's"):
        local_replica_gpus("hybrid", 3, 1, 2, list("0123"))


def test_native_replicas_on_gpus_get_their_device_dtype_and_gpus(tmp_path):
    cfg = load_config("demo", [*GPU_RUN, "trainer.n_gpus_per_node=2"])
    processes = replica_processes(cfg, tmp_path, visible=["2", "3"])
    # Each replica sees its own GPU, and may map the trainer's CUDA IPC handles (auto
    # transport in hybrid placement).
    assert [p.env for p in processes] == [
        {"CUDA_VISIBLE_DEVICES": "2", CUDA_IPC_ENV: "1"},
        {"CUDA_VISIBLE_DEVICES": "3", CUDA_IPC_ENV: "1"},
    ]
    nccl = load_config("demo", [*GPU_RUN, "rollout.weight_transport=dist"])
    assert [p.env for p in replica_processes(nccl, tmp_path, visible=["0"])] == [
        {"CUDA_VISIBLE_DEVICES": "0"}
    ]
    for process in processes:
        assert process.command[process.command.index("--backend") + 1] == "native"
        options = _engine_options(process)
        assert options["device"] == "cuda" and options["dtype"] == "bfloat16"
        # The native engine has no tensor parallelism or GPU memory share: not passed.
        assert "tensor_parallel_size" not in options and "gpu_memory_utilization" not in options
        assert "matmul_dtype" not in options  # bf16 weights already compute in bf16


def test_cpu_replicas_keep_the_demo_settings_and_the_environment(tmp_path):
    cfg = load_config("demo", ["trainer.device=cpu", "rollout.num_threads=1"])
    (process,) = replica_processes(cfg, tmp_path)
    assert process.env == {}
    options = _engine_options(process)
    assert options["device"] == "cpu" and options["dtype"] == cfg.model.dtype
    assert options["num_threads"] == 1 and "max_model_len" not in options


def test_vllm_replicas_get_tensor_parallelism_memory_share_and_sleep_mode(tmp_path):
    cfg = load_config(
        "demo",
        [
            *GPU_RUN,
            "trainer.n_gpus_per_node=4",
            "rollout.backend=vllm",
            "rollout.tensor_parallel_size=2",
            "rollout.gpu_memory_utilization=0.6",
            "rollout.max_model_len=2048",
            "rollout.enforce_eager=true",
            "rollout.enable_prefix_caching=false",
        ],
    )
    processes = replica_processes(cfg, tmp_path, visible=list("0123"))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in processes] == ["0,1", "2,3"]
    options = _engine_options(processes[0])
    expected = {
        "device": "cuda",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 2048,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "enable_sleep_mode": True,
    }
    assert {k: options.get(k) for k in expected} == expected
    separate = load_config("demo", [*GPU_RUN, "rollout.backend=vllm", "rollout.placement=separate"])
    assert replica_options(separate)["enable_sleep_mode"] is False
    # On CPU the GPU-only settings stay at the backend's defaults (vLLM-CPU runs eager).
    cpu = replica_options(load_config("demo", ["trainer.device=cpu", "rollout.backend=vllm"]))
    assert "enforce_eager" not in cpu and cpu["device"] == "cpu"


def test_rollout_options_that_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size.*native backend"):
        load_config("demo", ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="gpus_per_replica.*fewer than tensor_parallel_size"):
        load_config(
            "demo",
            [
                "rollout.backend=vllm",
                "rollout.tensor_parallel_size=4",
                "rollout.gpus_per_replica=2",
            ],
        )
    with pytest.raises(ConfigError, match="placement"):
        load_config("demo", ["rollout.placement=colocated"])


@pytest.mark.parametrize(
    ("overrides", "servers", "expected"),
    [
        # Hybrid on GPUs: the replicas share the trainer's GPUs, weights go by CUDA IPC.
        (GPU_RUN, RolloutServers(["u"], placement="hybrid"), ("cuda_ipc", {})),
        # Separate GPUs on the trainer's node: an NCCL broadcast.
        (
            [*GPU_RUN, "rollout.placement=separate"],
            RolloutServers(["u"], placement="separate"),
            ("dist", {"backend": "nccl"}),
        ),
        # Hybrid, with replicas on other nodes: each rank sends to the replicas on its own GPU
        # over CUDA IPC (NCCL cannot hold a replica and the rank on its GPU in one group).
        (
            GPU_RUN,
            RolloutServers(["u"], "key", same_host=False, placement="hybrid"),
            ("cuda_ipc", {"api_key": "key"}),
        ),
        (["trainer.device=cpu"], RolloutServers(["u"]), ("shm", {})),
        (
            ["trainer.device=cpu"],
            RolloutServers(["u"], "key", same_host=False),
            ("dist", {"backend": "gloo", "host": "10.0.0.1", "api_key": "key"}),
        ),
        # A transport named explicitly is kept; dist between GPUs is NCCL.
        (
            ["trainer.device=cpu", "rollout.weight_transport=disk"],
            RolloutServers(["u"]),
            ("disk", {}),
        ),
        (
            [*GPU_RUN, "rollout.weight_transport=dist"],
            RolloutServers(["u"], placement="hybrid"),
            ("dist", {"backend": "gloo"}),
        ),
        (
            [*GPU_RUN, "rollout.weight_transport=dist", "rollout.placement=separate"],
            RolloutServers(["u"], placement="separate"),
            ("dist", {"backend": "nccl"}),
        ),
    ],
)
def test_auto_weight_transport_for_each_placement(overrides, servers, expected):
    cfg = load_config("demo", overrides)
    assert weight_transport(cfg, servers, trainer_host="10.0.0.1") == expected


def test_external_servers_use_the_key_from_the_environment(tmp_path, monkeypatch):
    from polyrl.rollout.options import API_KEY_ENV
    from polyrl.trainer.rl.build import start_replicas

    monkeypatch.setenv(API_KEY_ENV, "secret")
    cfg = load_config("demo", ["trainer.device=cpu", "rollout.urls=[http://10.1.2.3:8000]"])
    closers: list = []
    servers = start_replicas(cfg, tmp_path, closers)
    assert servers.urls == ["http://10.1.2.3:8000"] and servers.api_key == "secret"
    assert not servers.same_host and closers == []
    assert weight_transport(cfg, servers)[0] == "dist"
    monkeypatch.delenv(API_KEY_ENV)
    local = load_config("demo", ["trainer.device=cpu", "rollout.urls=[http://127.0.0.1:8000]"])
    assert start_replicas(local, tmp_path, closers).same_host
    assert os.environ.get(API_KEY_ENV) is None


@pytest.mark.slow
def test_the_trainers_replicas_refuse_requests_without_the_runs_key(tmp_path):
    import httpx

    from polyrl.trainer.rl import RLTrainer

    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={tmp_path}",
            "trainer.device=cpu",
            "trainer.worker_backend=local",
            "trainer.loggers=[jsonl]",
            "trainer.val_before_train=false",
            "data.num_train=16",
            "data.train_batch_size=4",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "data.max_response_length=4",
            "reward.num_workers=1",
        ],
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.setup()
        (url,) = trainer.servers.urls
        key = trainer.servers.api_key
        assert key and len(key) >= 32
        for method, path in (("get", "/v1/models"), ("post", "/pause"), ("get", "/weights/status")):
            assert httpx.request(method, url + path, timeout=10).status_code == 401, path
            wrong = {"Authorization": "Bearer not-the-key"}
            assert httpx.request(method, url + path, headers=wrong, timeout=10).status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert ok.status_code == 200
        # The run itself holds the key: a step generates, scores and syncs weights.
        assert trainer.step(1)["rollout/weight_version"] == 0
    finally:
        trainer.close()
