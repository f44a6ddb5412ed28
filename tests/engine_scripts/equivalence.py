"""One rank of the world-size-2 equivalence check (launched by tests/test_model_engine.py).

Usage: ``equivalence.py MODEL_DIR OUT_JSON`` with RANK/WORLD_SIZE/MASTER_* in the environment.

The process group is created here, before any engine, the way a controller worker would host
an engine.  For several engine configurations every rank trains on its own share of one batch;
rank 0 compares the loss, the full gradients and inferred log-probs against a plain
single-process Hugging Face model on the whole batch and writes the largest differences.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from engine_common import (
    clean_loss_mask,
    engine_grads,
    exit_rank,
    make_batch,
    make_group_batch,
    reference_log_probs,
    reference_sft,
)

from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss
from polyrl.model_engine.engine import compute_log_probs


def reference(model_dir: str, batch) -> dict:
    """Loss, gradients and log-probs of a plain single-process Hugging Face model on ``batch``."""
    loss, grads, model = reference_sft(model_dir, batch)
    model.eval()
    return {"loss": loss, "grads": grads, "logp": reference_log_probs(model, batch)}


def run_case(model_dir, batch, ref, rows, engine_kwargs, mask=None) -> dict | None:
    """Train this rank's ``rows`` of ``batch`` with one engine config; rank 0 gets the diffs.

    With ``mask`` (positions that carry a loss) inference shares prefixes, and log-probs are
    compared on those positions only.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = build_engine(
        model_dir, EngineConfig(grad_clip=1e9, **engine_kwargs), OptimizerConfig(lr=1e-3)
    )
    local = batch[rows]
    inferred = engine.infer_batch(local, compute_log_probs, share_prefix=mask is not None)
    metrics = engine.train_batch(local, sft_loss)
    grads = engine_grads(engine)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (rows, inferred["log_probs"]))
    engine.close()
    if rank != 0:
        return None
    logp = torch.zeros_like(ref["logp"])
    for share, values in gathered:
        logp[share] = values
    keep = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask
    return {
        "loss_diff": abs(metrics["loss"] - ref["loss"]),
        "grad_diff": max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items()),
        "grad_names_match": sorted(grads) == sorted(ref["grads"]),
        "logp_diff": (logp[keep] - ref["logp"][keep]).abs().max().item(),
        "num_tokens": metrics["num_tokens"],
        "num_micro_batches": metrics["num_micro_batches"],
        "compute_tokens": metrics["compute_tokens"],
    }


def run_lora_case(model_dir, batch, ref, rows, ckpt_dir) -> dict | None:
    """A LoRA engine sharded over both ranks: gradients, merged weights, adapter checkpoint.

    At the start (``B = 0``) the adapted model is the plain one, so the loss and log-probs are
    the reference's and the adapter's gradients follow from the full weights' gradients ``G``:
    ``dL/dB = scale * G @ A.T`` and ``dL/dA = scale * B.T @ G = 0``.
    """
    from torch.distributed.checkpoint import FileSystemReader

    from polyrl.model_engine.heads import read_safetensors

    rank = dist.get_rank()
    spec = {"path": model_dir, "lora_rank": 4, "lora_alpha": 8.0}
    scale = 8.0 / 4
    engine = build_engine(
        spec, EngineConfig(grad_clip=1e9, max_tokens_per_micro_batch=33), OptimizerConfig(lr=1e-2)
    )
    local = batch[rows]
    inferred = engine.infer_batch(local, compute_log_probs)
    start = {k: v.clone() for k, v in engine.adapter_tensors()}
    metrics = engine.train_batch(local, sft_loss)
    grads = engine_grads(engine)
    with engine.adapter_disabled():  # the trained adapter off: the base model again
        base_inferred = engine.infer_batch(local, compute_log_probs)
    adapter = {k: v.clone() for k, v in engine.adapter_tensors()}
    merged = {k: v.clone() for k, v in engine.named_tensors()}
    base = {k: v.clone() for k, v in engine.named_tensors(merge_adapter=False)}
    saved = engine.save_checkpoint(ckpt_dir, 1)
    engine.close()
    resumed = build_engine(spec, EngineConfig(), OptimizerConfig(lr=1e-2))
    resumed.load_checkpoint(saved)
    restored = {k: v.clone() for k, v in resumed.adapter_tensors()}
    resumed.close()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rows, inferred["log_probs"], base_inferred["log_probs"]))
    if rank != 0:
        return None
    logp, base_logp = torch.zeros_like(ref["logp"]), torch.zeros_like(ref["logp"])
    for share, values, base_values in gathered:
        logp[share], base_logp[share] = values, base_values
    grad_b, grad_a, merge = 0.0, 0.0, 0.0
    layers = sorted(k.removesuffix(".lora_A.default.weight") for k in start if ".lora_A." in k)
    for layer in layers:
        a0 = start[f"{layer}.lora_A.default.weight"]
        want_b = scale * ref["grads"][f"{layer}.weight"] @ a0.T
        grad_b = max(grad_b, (grads[f"{layer}.lora_B.default.weight"] - want_b).abs().max().item())
        grad_a = max(grad_a, grads[f"{layer}.lora_A.default.weight"].abs().max().item())
        a, b = adapter[f"{layer}.lora_A.default.weight"], adapter[f"{layer}.lora_B.default.weight"]
        want = base[f"{layer}.weight"] + scale * b @ a
        merge = max(merge, (merged[f"{layer}.weight"] - want).abs().max().item())
    files = read_safetensors(model_dir)
    keys = FileSystemReader(f"{saved}/dcp").read_metadata().state_dict_metadata
    return {
        "loss_diff": abs(metrics["loss"] - ref["loss"]),
        "logp_diff": (logp - ref["logp"]).abs().max().item(),
        "base_logp_diff": (base_logp - ref["logp"]).abs().max().item(),
        "num_layers": len(layers),
        "grad_b_diff": grad_b,
        "grad_a_max": grad_a,
        "b_trained": min(adapter[f"{x}.lora_B.default.weight"].abs().max().item() for x in layers),
        "merge_diff": merge,
        "base_is_the_model": sorted(base) == sorted(files)
        and all(torch.equal(base[k], files[k]) for k in files),
        "checkpoint_model_keys": sorted(k for k in keys if k.startswith("model.")),
        "restored_equal": sorted(restored) == sorted(adapter)
        and all(torch.equal(restored[k], adapter[k]) for k in adapter),
    }


def main() -> None:
    model_dir, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    batch = make_batch(9, 16, 1000, seed=3, left_pad_rows=3)
    ref = reference(model_dir, batch)
    # Uneven shares (6 vs 3 rows) force different micro-batch counts and dummy passes.
    share = {0: list(range(0, 6)), 1: list(range(6, 9))}[rank]
    cases = {
        "padded_mbs2": dict(dynamic_batching=False, micro_batch_size=2),
        # 6 vs 3 micro-batches of one row: rank 1 runs 3 dummy forward/backward passes.
        "padded_mbs1": dict(dynamic_batching=False, micro_batch_size=1),
        "dynamic_trim": dict(max_tokens_per_micro_batch=33),
        "dynamic_pack": dict(max_tokens_per_micro_batch=40, pack_sequences=True),
        "dynamic_trim_gc_hsdp": dict(
            max_tokens_per_micro_batch=48,
            gradient_checkpointing=True,
            parallelism={"fsdp_size": 1},
        ),
    }
    results = {name: run_case(model_dir, batch, ref, share, kw) for name, kw in cases.items()}

    # GRPO layout (4 prompts x 3 responses): the shared-prefix forward under FSDP with sharded
    # parameters, with micro-batches that hold whole and partial groups, and with one-row
    # micro-batches where rank 1 runs dummy passes (two calls each) while rank 0 shares.
    group_batch = make_group_batch(prompts=4, n=3, prompt_width=6, response_width=8, vocab=1000)
    group_ref = reference(model_dir, group_batch)
    mask = clean_loss_mask(group_batch) != 0
    group_cases = {
        "shared_prefix": ({0: range(0, 7), 1: range(7, 12)}, dict(max_tokens_per_micro_batch=42)),
        "shared_prefix_dummies": (
            {0: range(0, 9), 1: range(9, 12)},
            dict(dynamic_batching=False, micro_batch_size=1),
        ),
    }
    for name, (shares, kwargs) in group_cases.items():
        kwargs = {**kwargs, "share_prefix": True}
        rows = list(shares[rank])
        results[name] = run_case(model_dir, group_batch, group_ref, rows, kwargs, mask)

    results["lora"] = run_lora_case(model_dir, batch, ref, share, f"{out_path}.lora_ckpt")

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


if __name__ == "__main__":
    main()
