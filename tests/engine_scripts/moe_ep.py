"""One rank of the expert-parallel parity check (launched by tests/test_moe.py).

Usage: ``moe_ep.py MODEL_DIR OUT_DIR EP [FOREIGN_CHECKPOINT]`` with RANK/WORLD_SIZE/MASTER_* in
the environment.

Every rank trains its rows (rows ``rank::world`` of one fixed batch) for three optimizer steps
with ``expert_parallel_size=EP``; before each step the whole batch's per-token log-probs are
gathered. Rank 0 writes the log-probs, losses and gradient norms, then the whole HF-named
tensors from ``named_tensors`` (expert shards gathered), to ``OUT_DIR``.

Checkpoints and export: a checkpoint saved after the first step (``OUT_DIR/ckpt``) is loaded by
a fresh engine, which trains steps two and three again (``resumed_*`` in the result); the
trained engine exports a Hugging Face directory to ``OUT_DIR/hf``. ``FOREIGN_CHECKPOINT``, one
saved on another mesh, must be refused: the error is ``foreign_error``.
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


def _engine(model_dir: str, ep: int):
    return build_engine(
        model_dir,
        EngineConfig(grad_clip=1.0, parallelism={"expert_parallel_size": ep}),
        OptimizerConfig(lr=1e-3),
    )


def _train(engine, batch, rows: list[int], steps: range, out_dir: Path) -> dict[str, list]:
    """Train ``steps`` on this rank's rows; the first step's checkpoint goes to ``out_dir``."""
    world = dist.get_world_size()
    local = batch[rows]
    logps, losses, norms = [], [], []
    for step in steps:
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
        if step == 0:
            engine.save_checkpoint(str(out_dir / "ckpt"), 1)
    return {"logps": logps, "losses": losses, "norms": norms}


def main() -> None:
    model_dir, out_dir, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    foreign = sys.argv[4] if len(sys.argv) > 4 else ""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    engine = _engine(model_dir, ep)
    batch = make_batch(8, 20, vocab=1000, seed=3)
    rows = list(range(rank, len(batch), world))
    result = _train(engine, batch, rows, range(STEPS), out_dir)
    tensors = dict(engine.named_tensors())
    engine.export_hf(str(out_dir / "hf"))
    engine.close()
    # Resume from the step-1 checkpoint in a fresh engine: steps 2 and 3 again.
    fresh = _engine(model_dir, ep)
    fresh.load_checkpoint(str(out_dir / "ckpt"))
    again = _train(fresh, batch, rows, range(1, STEPS), out_dir)
    result.update({f"resumed_{k}": v for k, v in again.items()})
    result["foreign_error"] = None
    if foreign:
        try:
            fresh.load_checkpoint(foreign)
        except ValueError as exc:
            result["foreign_error"] = str(exc)
    fresh.close()
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(result))
        torch.save(tensors, out_dir / "tensors.pt")
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main()
