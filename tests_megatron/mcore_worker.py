"""One rank of a tests_megatron check: run with RANK / WORLD_SIZE / MASTER_* set.

Usage: python mcore_worker.py <check> <model_dir> <out_dir> <tp> <ep>

Checks: ``logprobs`` (engine log-probs vs a plain HF forward), ``step`` (one SFT optimizer step
on the Megatron engine, then on the FSDP2 engine, loss and grad norm of both; then export_hf and
the exported model's log-probs vs the trained engine's; then a checkpoint round trip).  Rank 0
writes ``<out_dir>/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine_scripts"))

from engine_common import make_batch  # noqa: E402

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.model_engine import build_engine  # noqa: E402
from polyrl.model_engine.engine import compute_log_probs, sft_loss  # noqa: E402


def hf_log_probs(model_dir: str, batch: Batch) -> torch.Tensor:
    """Per-token log-probs ``(B, T)`` of a plain HF forward; 0 where nothing predicts a token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids, am, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = logp
    predicted = am.bool() & torch.roll(am.bool(), 1, dims=1)
    predicted[:, 0] = False
    return torch.where(predicted, out, torch.zeros(()))


def gather_full(engine, batch: Batch, local: Batch, values: torch.Tensor) -> torch.Tensor:
    """Every data-parallel rank's rows back into the full batch's order (via row ids)."""
    ids = local["row_id"]
    world = dist.get_world_size()
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    all_vals = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(all_ids, ids)
    dist.all_gather(all_vals, values)
    full = torch.zeros(len(batch), values.shape[1])
    for i, v in zip(all_ids, all_vals, strict=True):
        full[i] = v
    return full


def engine_log_probs(engine, batch: Batch) -> torch.Tensor:
    local = engine.shard_batch(batch)
    result = engine.infer_batch(local, compute_log_probs)
    return gather_full(engine, batch, local, result["log_probs"])


def main() -> None:
    check, model_dir, out_dir, tp, ep = sys.argv[1], sys.argv[2], sys.argv[3], *sys.argv[4:6]
    tp, ep = int(tp), int(ep)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = make_batch(8, 12, 1000, seed=3, left_pad_rows=3)
    # Some real tokens are the pad id (0): HF gives that embedding row no gradient from input
    # lookups (nn.Embedding padding_idx), and so must the Megatron engine.
    ids = batch["input_ids"]
    ids[batch["attention_mask"].bool() & (torch.arange(ids.shape[1]) % 5 == 2)] = 0
    batch["row_id"] = torch.arange(len(batch))
    parallel = {"tensor_parallel_size": tp, "expert_parallel_size": ep}
    engine_cfg = {
        "backend": "megatron",
        "device": "cpu",
        "parallelism": parallel,
        "grad_clip": 1.0,
        "max_tokens_per_micro_batch": 40,
    }
    optim = {"lr": 1e-3, "warmup_steps": 0}
    result: dict = {}
    engine = build_engine(model_dir, engine_cfg, optim)
    result["dp"] = engine.world_size
    mine = engine_log_probs(engine, batch)
    if check == "logprobs":
        if rank == 0:
            ref = hf_log_probs(model_dir, batch)
            result["max_abs_diff"] = float((mine - ref).abs().max())
            result["nonzero"] = int((ref != 0).sum())
    else:
        stats = engine.train_batch(engine.shard_batch(batch), sft_loss)
        result["megatron"] = {k: stats[k] for k in ("loss", "grad_norm", "num_tokens")}
        trained = engine_log_probs(engine, batch)
        export = os.path.join(out_dir, "export")
        engine.export_hf(export)
        ckpt_dir = os.path.join(out_dir, "ckpt")
        engine.save_checkpoint(ckpt_dir, 1, {"note": "x"})
        stats2 = engine.train_batch(engine.shard_batch(batch), sft_loss)
        info = engine.load_checkpoint(ckpt_dir)
        stats3 = engine.train_batch(engine.shard_batch(batch), sft_loss)
        result["resume"] = {
            "step": info["step"],
            "extra": info["extra_state"],
            "loss_after_save": stats2["loss"],
            "loss_after_load": stats3["loss"],
        }
        engine.close()
        fsdp = build_engine(model_dir, {**engine_cfg, "backend": "fsdp2", "parallelism": {}}, optim)
        ref_stats = fsdp.train_batch(fsdp.shard_batch(batch), sft_loss)
        result["fsdp2"] = {k: ref_stats[k] for k in ("loss", "grad_norm", "num_tokens")}
        fsdp.close()
        if rank == 0:
            exported = hf_log_probs(export, batch)
            result["export_max_abs_diff"] = float((exported - trained).abs().max())
    if check == "logprobs":
        engine.close()
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
