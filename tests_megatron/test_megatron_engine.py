"""The Megatron-Core engine backend on CPU: 2 gloo processes, tiny fp32 models.

Needs the ``megatron`` extra (``make test-megatron`` builds .venv-megatron); skipped without it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs polyrl[megatron] (make test-megatron)")

from polyrl.models.tiny import build_tiny_model  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mcore_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(check: str, model_dir: Path, out_dir: Path, tp: int, ep: int, world: int = 2):
    """Run the worker on ``world`` gloo ranks; return rank 0's result."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCH_COMPILE_DISABLE": "1",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(WORKER), check, str(model_dir), str(out_dir), str(tp), str(ep)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-6000:]
    return json.loads((out_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mcore_models")
    return {
        "qwen2": build_tiny_model("qwen2", root / "qwen2", size="nano"),
        "qwen3": build_tiny_model("qwen3", root / "qwen3", size="nano"),
        "llama": build_tiny_model("llama", root / "llama", size="nano"),
        "qwen3_moe": build_tiny_model("qwen3_moe", root / "qwen3_moe", size="nano"),
    }


LOGPROB_CASES = [
    ("qwen2", 1, 1),
    ("qwen2", 2, 1),
    ("qwen3", 2, 1),
    ("llama", 2, 1),
    ("qwen3_moe", 1, 2),
]


@pytest.mark.parametrize(("arch", "tp", "ep"), LOGPROB_CASES)
def test_log_probs_match_hf(models, tmp_path, arch, tp, ep):
    res = run_ranks("logprobs", models[arch], tmp_path, tp, ep)
    print(f"{arch} tp={tp} ep={ep}: {res}")
    assert res["nonzero"] > 20
    assert res["max_abs_diff"] <= 1e-5, res


STEP_CASES = [("qwen2", 2, 1), ("qwen3_moe", 1, 2)]


@pytest.mark.parametrize(("arch", "tp", "ep"), STEP_CASES)
def test_step_matches_fsdp2_and_exports(models, tmp_path, arch, tp, ep):
    res = run_ranks("step", models[arch], tmp_path, tp, ep)
    print(f"{arch} tp={tp} ep={ep}: {res}")
    mg, fs = res["megatron"], res["fsdp2"]
    assert mg["num_tokens"] == fs["num_tokens"]
    assert abs(mg["loss"] - fs["loss"]) <= 1e-4 * abs(fs["loss"]), res
    assert abs(mg["grad_norm"] - fs["grad_norm"]) <= 1e-4 * abs(fs["grad_norm"]), res
    assert res["export_max_abs_diff"] <= 1e-5, res
    resume = res["resume"]
    assert resume["step"] == 1 and resume["extra"] == {"note": "x"}
    assert resume["loss_after_load"] == pytest.approx(resume["loss_after_save"], rel=1e-6, abs=0)
