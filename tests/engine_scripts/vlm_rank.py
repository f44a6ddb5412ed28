"""One rank of the world-size-2 vision-language engine check (tests/test_engine_vlm.py).

Usage: ``vlm_rank.py MODEL_DIR OUT_JSON [CASE,CASE...]`` with RANK/WORLD_SIZE/MASTER_* in the
environment (default: every case).

Rank 0 gets rows 0 and 3 (two samples of one image prompt: packed, its image is encoded once),
rank 1 rows 1 and 2 (an image prompt and the text prompt): with one row per micro-batch, rank
1's text-only micro-batch meets rank 0's image one, so the dummy vision runs must keep FSDP's
collectives matched.  For each engine configuration the
ranks infer log-probs and take one training step; rank 0 writes the largest difference from the
HF model's own log-probs and whether the training step gave finite, equal-on-all-ranks results.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from engine_common import exit_rank
from vlm_common import reference_log_probs, vlm_batch

from polyrl.model_engine import EngineConfig, ModelSpec, OptimizerConfig, build_engine, sft_loss
from polyrl.model_engine.engine import compute_log_probs
from polyrl.models.processor import load_vision_processor

PACKED = {"dynamic_batching": True, "pack_sequences": True, "max_tokens_per_micro_batch": 64}
ROWS = {"dynamic_batching": False, "micro_batch_size": 1}
#: name: (ModelSpec options, EngineConfig options)
CASES = {
    "rows": ({}, ROWS),
    "packed": ({}, PACKED),
    # A frozen tower: no vision gradients on either rank, text-only micro-batches included.
    "frozen_rows": ({"freeze_vision_tower": True}, ROWS),
}


def main() -> None:
    """Run every case and write rank 0's results."""
    model_dir, out_path = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    proc = load_vision_processor(model_dir)
    batch = vlm_batch(proc)
    rows = [[0, 3], [1, 2]][rank]
    results = {}
    if rank == 0:
        from transformers import AutoModelForImageTextToText

        ref_model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        ref = reference_log_probs(ref_model, proc, batch)
    for name in names:
        spec, kwargs = CASES[name]
        engine = build_engine(
            ModelSpec(path=model_dir, **spec),
            EngineConfig(device="cpu", grad_clip=1e9, **kwargs),
            OptimizerConfig(lr=1e-3),
        )
        local = batch[rows]
        logp = engine.infer_batch(local, compute_log_probs)["log_probs"]
        before = {k: v.clone() for k, v in engine.named_tensors()}
        metrics = engine.train_batch(local, sft_loss)
        moved = sorted(
            {
                k.split(".")[1] if k.startswith("model.") else k
                for k, v in engine.named_tensors()
                if not torch.equal(v, before[k])
            }
        )
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (rows, logp))
        if rank == 0:
            got = torch.zeros_like(ref)
            for share, values in gathered:
                got[share] = values
            results[name] = {
                "logp_diff": float((got - ref).abs().max()),
                "grad_norm": float(metrics["grad_norm"]),
                "loss": float(metrics["loss"]),
                "moved": moved,
            }
        engine.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_rank(0)


if __name__ == "__main__":
    main()
