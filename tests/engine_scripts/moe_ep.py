"""One rank of the expert-parallel parity check (launched by tests/test_moe.py).

Usage: ``moe_ep.py MODEL_DIR OUT_DIR EP`` with RANK/WORLD_SIZE/MASTER_* in the environment.

Every rank trains its rows (rows ``rank::world`` of one fixed batch) for three optimizer steps
with ``expert_parallel_size=EP``; before each step the whole batch's per-token log-probs are
gathered. Rank 0 writes the log-probs, losses and gradient norms, then the whole HF-named
tensors from ``named_tensors`` (expert shards gathered), to ``OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_common import exit_rank, make_batch

from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss

STEPS = 3


def main() -> None:
    model_dir, out_dir, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    engine = build_engine(
        model_dir,
        EngineConfig(grad_clip=1.0, parallelism={"expert_parallel_size": ep}),
        OptimizerConfig(lr=1e-3),
    )
    batch = make_batch(8, 20, vocab=1000, seed=3)
    rows = list(range(rank, len(batch), world))
    local = batch[rows]
    logps, losses, norms = [], [], []
    for _ in range(STEPS):
        inferred = engine.infer_batch(local)["log_probs"]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (rows, inferred))
        full = torch.zeros(batch["input_ids"].shape)
        for share, values in gathered:
            full[share] = values
        logps.append(full.tolist())
        metrics = engine.train_batch(local, sft_loss)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    tensors = dict(engine.named_tensors())
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "result.json").write_text(
            json.dumps({"logps": logps, "losses": losses, "norms": norms})
        )
        torch.save(tensors, out_dir / "tensors.pt")
    dist.barrier()
    engine.close()
    exit_rank(0)


if __name__ == "__main__":
    main()
