"""The SFT runner (``polyrl.trainer.sft.SFTRunner``) on the Megatron backend at TP 2.

The runner drives :class:`~polyrl.workers.engine.EngineWorker` ranks through the same dispatch
as the RL trainer: at tensor-parallel size 2 both ranks of the replica must get all rows, and
two steps must match those of two data-parallel ranks (TP 1) on the same batches.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs polyrl[megatron] (make test-megatron)")

import torch  # noqa: E402

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.model_engine import (  # noqa: E402
    CheckpointConfig,
    EngineConfig,
    ModelSpec,
    OptimizerConfig,
    ParallelismConfig,
)
from polyrl.models.tiny import build_tiny_model  # noqa: E402
from polyrl.trainer.sft import SFTRunner  # noqa: E402


def _batch(step: int) -> Batch:
    """Six right-padded rows of random tokens; the first four positions are the prompt."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 200, (6, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[3:, 9:] = 0
    loss = mask.float()
    loss[:, :4] = 0
    return Batch(tensors={"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss})


def _train(model: str, tp: int) -> list[dict[str, float]]:
    runner = SFTRunner(
        ModelSpec(path=model),
        EngineConfig(
            backend="megatron", device="cpu", parallelism=ParallelismConfig(tensor_parallel_size=tp)
        ),
        OptimizerConfig(lr=1e-3),
        CheckpointConfig(),
        world_size=2,
        worker_backend="local",
    )
    try:
        return [runner.train_step(_batch(step)) for step in range(2)]
    finally:
        runner.close()


@pytest.mark.timeout(1200)
def test_sft_runner_at_tp2_matches_two_data_parallel_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    model = str(build_tiny_model("qwen2", tmp_path / "qwen2", size="nano"))
    data_parallel, tensor_parallel = _train(model, 1), _train(model, 2)
    for dp, tp in zip(data_parallel, tensor_parallel, strict=True):
        assert tp["num_tokens"] == dp["num_tokens"] > 0
        for key in ("loss", "grad_norm"):
            assert tp[key] == pytest.approx(dp[key], rel=1e-5), (key, dp, tp)
