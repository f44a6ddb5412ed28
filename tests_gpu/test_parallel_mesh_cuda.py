"""Tensor and Ulysses sequence parallelism on CUDA (NCCL), one GPU per rank, against one rank.

The same rank script as tests/test_parallel_mesh.py (tests/engine_scripts/parallel_mesh.py,
``PARALLEL_MESH_DEVICE=cuda``, fp32 compute): three optimizer steps of a tiny llama as one rank
and on a mesh per axis; log-probs, entropy, losses and gradient norms must match.  A mesh
needing more GPUs than the machine has is skipped (NCCL runs one rank per GPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "engine_scripts"
sys.path.insert(0, str(SCRIPTS))

from engine_common import launch, tiny_model  # noqa: E402

# GPU kernels reorder reductions differently per shard shape: looser than the CPU test's 1e-5.
LOGP_ATOL = 1e-4
RTOL = 1e-3


def _run(model_dir: str, out: Path, world: int, tp: int, sp: int) -> dict:
    os.environ["PARALLEL_MESH_DEVICE"] = "cuda"
    try:
        codes = launch("parallel_mesh.py", [model_dir, str(out), str(tp), str(sp)], world)
    finally:
        del os.environ["PARALLEL_MESH_DEVICE"]
    assert codes == [0] * world, "\n".join(launch.last_logs)  # type: ignore[attr-defined]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "llama"
    return tiny_model(out, arch="llama", hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128)


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory) -> dict:
    return _run(llama_dir, tmp_path_factory.mktemp("ref") / "ref.json", 1, 1, 1)


@pytest.mark.parametrize(
    ("world", "tp", "sp"),
    [(2, 2, 1), (2, 1, 2), (4, 2, 1), (4, 1, 2), (4, 1, 4), (4, 2, 2)],
    ids=["tp2", "sp2", "dp2xtp2", "dp2xsp2", "sp4", "tp2xsp2"],
)
def test_parallel_mesh_matches_one_rank_on_cuda(llama_dir, reference, tmp_path, world, tp, sp):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    got = _run(llama_dir, tmp_path / "out.json", world, tp, sp)
    assert got["mesh"] == {"dp_shard": world // (tp * sp), "sp": sp, "tp": tp}
    for ref, step in zip(reference["steps"], got["steps"], strict=True):
        for key in ("logp", "entropy"):
            diff = (torch.tensor(step[key]) - torch.tensor(ref[key])).abs().max().item()
            assert diff <= LOGP_ATOL, (key, diff)
        assert abs(step["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"])
        assert abs(step["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"]
    assert sorted(got["tensors"]) == sorted(reference["tensors"])
