"""The ``vllm`` rollout backend on a GPU: sleep mode and in-place CUDA IPC weight loads.

Skipped unless this process sees a CUDA device and the vLLM virtual environment
(``$POLYRL_VLLM_VENV`` or ``.venv-vllm``) imports a CUDA build of vLLM (the CPU build that
``scripts/setup_vllm_venv.sh`` installs does not count). One server is started with
``enable_sleep_mode`` on a tiny model and checked for:

* greedy generation that is deterministic and changes when the weights change;
* ``sleep(1)`` releasing GPU memory (seen by this process) and ``wake_up`` restoring it, with
  the same greedy tokens after;
* ``load_weights`` with CUDA tensors (CUDA IPC handles, opened by the vLLM worker) switching
  to exactly the outputs of a reload of the same weights from disk, and back; also after
  ``sleep(2)``, which discards the weights.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from polyrl.rollout.vllm_backend import VLLMBackend, default_vllm_venv, vllm_available

pytestmark = pytest.mark.slow

TINY = {"size": "nano", "heads": 2, "kv_heads": 1}  # head size 32
PROMPTS = [[272, 86, 440, 691, 511], [30, 40, 50, 60, 70, 80, 90], [100, 200, 300]]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to this process"
    venv = default_vllm_venv()
    if not vllm_available(venv):
        return f"no vLLM installation in {venv} (set POLYRL_VLLM_VENV to a CUDA build's venv)"
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import vllm; from vllm.platforms import current_platform as p; print(p.device_type)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    if probe.returncode != 0:
        return f"'import vllm' fails in {venv}: {probe.stderr.strip()[-300:]}"
    platform = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "?"
    if platform != "cuda":
        return f"the vLLM in {venv} is not a CUDA build (platform {platform!r})"
    return None


_REASON = _skip_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny qwen2 checkpoints of one architecture (seeds 0 and 1)."""
    from polyrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return (
        build_tiny_model("qwen2", root / "v1", seed=0, **TINY),
        build_tiny_model("qwen2", root / "v2", seed=1, **TINY),
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: the backend's client and tasks belong to it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(loop: asyncio.AbstractEventLoop, coro: Any, timeout: float = 600.0) -> Any:
    """Run ``coro`` on ``loop`` (failing after ``timeout`` seconds)."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def backend(models: tuple[Path, Path], loop: asyncio.AbstractEventLoop) -> Iterator[VLLMBackend]:
    """Start a vLLM server on the GPU, with sleep mode, serving the first model."""
    b = VLLMBackend(
        models[0],
        device="cuda",
        dtype="auto",  # bfloat16 on CUDA
        enable_sleep_mode=True,
        gpu_memory_utilization=0.25,
        max_model_len=256,
    )
    run(loop, b.start(), timeout=1200)
    try:
        yield b
    finally:
        run(loop, b.shutdown(), timeout=120)


async def greedy_ids(backend: VLLMBackend) -> list[list[int]]:
    """Return the greedy tokens (12 each) of every prompt."""
    from polyrl.core.rollout_api import GenerateRequest, SamplingParams, collect_outputs

    outs = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams.from_dict(
            {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        )
        req = GenerateRequest(f"gpu-{i}-{os.urandom(4).hex()}", tuple(prompt), params)
        out = await collect_outputs(req, await backend.generate(req, stream=False))
        outs.append(list(out.outputs[0].output_ids))
    return outs


def cuda_tensors(model: Path) -> list[tuple[str, torch.Tensor]]:
    """Return the checkpoint's tensors, on this process's GPU."""
    from safetensors import safe_open

    pairs = []
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), "pt", device="cuda") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                pairs.append((name, f.get_tensor(name)))
    return pairs


def free_gpu_bytes() -> int:
    """Return the GPU's free memory as the driver reports it (all processes)."""
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def test_cuda_server_options(backend: VLLMBackend) -> None:
    """The server runs with the GPU flags the options ask for."""
    cmd = backend.command(1)
    assert "--enable-sleep-mode" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.25"
    assert "--kv-cache-memory-bytes" not in cmd


def test_greedy_is_deterministic(backend: VLLMBackend, loop: asyncio.AbstractEventLoop) -> None:
    """Greedy generation on the GPU gives the same tokens twice."""
    first = run(loop, greedy_ids(backend))
    assert all(len(ids) == 12 for ids in first)
    assert run(loop, greedy_ids(backend)) == first


def test_sleep_level_1_frees_gpu_memory_and_wake_up_restores(
    backend: VLLMBackend, loop: asyncio.AbstractEventLoop
) -> None:
    """Level 1 frees GPU memory (KV cache dropped, weights offloaded); wake_up restores it."""
    before_ids = run(loop, greedy_ids(backend))
    free_awake = free_gpu_bytes()
    report = run(loop, backend.sleep(1))
    free_asleep = free_gpu_bytes()
    # The KV cache alone is most of 25% of the GPU; the weights (offloaded to CPU) are tiny.
    assert free_asleep - free_awake > 1 << 30, (free_awake, free_asleep, report)
    assert report["weight_bytes_released"] > 0
    woke = run(loop, backend.wake_up())
    assert woke["needs_weights"] is False
    assert free_gpu_bytes() < free_asleep - (1 << 30)
    assert run(loop, greedy_ids(backend)) == before_ids  # the offloaded weights came back


def test_cuda_ipc_load_weights_switches_in_place(
    backend: VLLMBackend, models: tuple[Path, Path], loop: asyncio.AbstractEventLoop
) -> None:
    """CUDA tensors loaded in place serve exactly as the same weights reloaded from disk."""
    v1, v2 = models
    run(loop, backend.update_weights(str(v1)))
    ids_v1 = run(loop, greedy_ids(backend))
    run(loop, backend.update_weights(str(v2)))
    ids_v2 = run(loop, greedy_ids(backend))  # the reference: v2 reloaded from disk
    assert ids_v2 != ids_v1
    run(loop, backend.update_weights(str(v1)))
    assert run(loop, greedy_ids(backend)) == ids_v1

    version = backend.weight_version
    assert run(loop, backend.load_weights(cuda_tensors(v2))) == version + 1
    assert run(loop, greedy_ids(backend)) == ids_v2
    assert run(loop, backend.load_weights(cuda_tensors(v1), version=version + 5)) == version + 5
    assert run(loop, greedy_ids(backend)) == ids_v1

    # After sleep(2) the weights are gone; an in-memory load brings the server back.
    run(loop, backend.sleep(2))
    assert run(loop, backend.wake_up())["needs_weights"] is True
    run(loop, backend.load_weights(cuda_tensors(v2)))
    assert run(loop, greedy_ids(backend)) == ids_v2
