"""One rank of the checkpoint/resume check (launched by tests/test_model_engine.py).

Usage: ``ckpt_run.py MODEL_DIR CKPT_ROOT OUT_JSON TOTAL_STEPS [--save-and-die-at N] [--resume]``.

Trains ``TOTAL_STEPS`` steps of SFT on batches drawn by a seeded sampler whose state is saved as
the checkpoint's ``extra_state``; attention dropout is on, so RNG state matters too.  With
``--save-and-die-at N`` it saves after step N and SIGKILLs itself; with ``--resume`` it continues
from the newest checkpoint.  Rank 0 writes ``{step: [loss, grad_norm, lr]}`` to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
import torch.distributed as dist
from engine_common import exit_rank, make_batch

from polyrl.model_engine import (
    EngineConfig,
    ModelSpec,
    OptimizerConfig,
    build_engine,
    sft_loss,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("ckpt_root")
    ap.add_argument("out")
    ap.add_argument("total", type=int)
    ap.add_argument("--save-and-die-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    engine = build_engine(
        ModelSpec(path=args.model_dir, override_config={"attention_dropout": 0.2}),
        EngineConfig(max_tokens_per_micro_batch=40, grad_clip=1.0),
        OptimizerConfig(lr=3e-3, scheduler="cosine", warmup_steps=2, total_steps=args.total),
    )
    sampler = np.random.RandomState(1234)
    start = 0
    if args.resume:
        info = engine.load_checkpoint(args.ckpt_root)
        start = info["step"]
        sampler.set_state(info["extra_state"]["sampler"])
    record = {}
    for step in range(start + 1, args.total + 1):
        batch = make_batch(8, 16, 1000, seed=int(sampler.randint(1 << 30)), left_pad_rows=2)
        metrics = engine.train_batch(engine.shard_batch(batch), sft_loss)
        engine.lr_scheduler_step()
        record[step] = [metrics["loss"], metrics["grad_norm"], metrics["lr"]]
        if step == args.save_and_die_at:
            engine.save_checkpoint(
                args.ckpt_root, step, extra_state={"sampler": sampler.get_state()}
            )
            break
    if engine.rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    if args.save_and_die_at:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    engine.close()
    exit_rank()


if __name__ == "__main__":
    main()
