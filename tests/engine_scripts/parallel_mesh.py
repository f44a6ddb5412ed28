"""One rank of a tensor/sequence-parallel parity run (launched by tests/test_parallel_mesh.py).

Usage: ``parallel_mesh.py MODEL_DIR OUT_JSON TP SP [CKPT_DIR [load]]`` with
RANK/WORLD_SIZE/MASTER_* in the environment.  Three optimizer steps of SFT on fixed batches
(each data-parallel rank trains its share of the rows); before each step and after the last,
log-probs and entropy of the whole batch.  Rank 0 writes losses, gradient norms, log-probs,
entropies and a checksum of every whole tensor ``named_tensors`` yields.  With CKPT_DIR a
checkpoint is saved after the last step and loaded into a fresh engine, whose log-probs are
recorded too; with ``load`` the run only tries to load CKPT_DIR and records the error (a
checkpoint of another mesh shape).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from engine_common import exit_rank, make_batch

from polyrl.core.numerics import agg_loss
from polyrl.model_engine import EngineConfig, ModelSpec, OptimizerConfig, build_engine, sft_loss
from polyrl.model_engine.config import MixedPrecisionConfig, ParallelismConfig
from polyrl.model_engine.engine import compute_log_probs_and_entropy, compute_values, global_counts

VOCAB = 1024
STEPS = 3
#: ``cuda`` for tests_gpu (one GPU per rank, NCCL); fp32 compute either way.
DEVICE = os.environ.get("PARALLEL_MESH_DEVICE", "cpu")
#: ``1``: activation checkpointing (attention re-runs in backward, after the forward returned).
CHECKPOINTING = os.environ.get("PARALLEL_MESH_CHECKPOINTING", "0") == "1"


def sft_with_entropy(output, batch):
    """SFT loss plus an entropy bonus: gradients flow through log-probs and entropy."""
    loss, metrics = sft_loss(output, batch)
    ent = agg_loss(output.entropy, batch["loss_mask"], "token-mean", **global_counts(batch))
    return loss - 0.1 * ent, metrics


def value_loss(output, batch):
    """Squared error of the values against 1 on the loss tokens (token mean, whole batch)."""
    err = (output.values - 1.0) ** 2
    return agg_loss(err, batch["loss_mask"], "token-mean", **global_counts(batch)), {}


def make_engine(model_dir: str, tp: int, sp: int, kind: str = "causal_lm"):
    """An fp32 engine packing micro-batches of at most 48 tokens (several per step)."""
    return build_engine(
        ModelSpec(path=model_dir, kind=kind),
        EngineConfig(
            device=DEVICE,
            mixed_precision=MixedPrecisionConfig(param_dtype="float32"),
            grad_clip=1.0,
            gradient_checkpointing=CHECKPOINTING,
            pack_sequences=True,
            max_tokens_per_micro_batch=48,
            parallelism=ParallelismConfig(
                tensor_parallel_size=tp, ulysses_sequence_parallel_size=sp
            ),
        ),
        OptimizerConfig(lr=1e-3),
    )


def stats(engine, batch) -> dict:
    """Log-probs and entropy of the whole batch, as lists."""
    out = engine.infer_batch(batch, compute_log_probs_and_entropy)
    return {"logp": out["log_probs"].tolist(), "entropy": out["entropy"].tolist()}


def main() -> None:
    model_dir, out_path, tp, sp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ckpt_dir = sys.argv[5] if len(sys.argv) > 5 else None
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo")
    torch.manual_seed(0)
    engine = make_engine(model_dir, tp, sp)
    if len(sys.argv) > 6 and sys.argv[6] == "load":
        try:
            engine.load_checkpoint(ckpt_dir)
            error = None
        except ValueError as exc:
            error = str(exc)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump({"error": error}, f)
        exit_rank(0)
    result: dict = {"steps": [], "mesh": engine.mesh_shape}
    if engine.parallel_mesh is not None:
        expert = engine.parallel_mesh.expert_mesh()
        result["expert_mesh"] = [list(expert.mesh_dim_names), list(expert.shape)]
    for step in range(STEPS):
        batch = make_batch(8, 20, VOCAB, seed=100 + step)
        record = stats(engine, batch)
        metrics = engine.train_batch(engine.shard_batch(batch), sft_with_entropy)
        record.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"])
        result["steps"].append(record)
    final_batch = make_batch(8, 20, VOCAB, seed=999)
    result["final"] = stats(engine, final_batch)
    result["tensors"] = {
        name: [list(t.shape), float(t.double().sum()), float(t.double().abs().sum())]
        for name, t in engine.named_tensors()
    }
    if ckpt_dir:
        engine.save_checkpoint(ckpt_dir, STEPS)
        fresh = make_engine(model_dir, tp, sp)
        fresh.load_checkpoint(ckpt_dir)
        result["resumed"] = stats(fresh, final_batch)
        fresh.close()
    engine.close()
    # A value model (critic): values before and after one step.
    critic = make_engine(model_dir, tp, sp, kind="value")
    result["values"] = critic.infer_batch(final_batch, compute_values)["values"].tolist()
    vmetrics = critic.train_batch(critic.shard_batch(final_batch), value_loss)
    result["value_loss"], result["value_grad_norm"] = vmetrics["loss"], vmetrics["grad_norm"]
    result["values_after"] = critic.infer_batch(final_batch, compute_values)["values"].tolist()
    critic.close()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    exit_rank(0)


if __name__ == "__main__":
    main()
