"""Training throughput of the model engine (FSDP2 backend, world size 1).

Two measurements on a tiny random-init Qwen2 (``polyrl.models.tiny``, no network):

1. ``engine_tokens_per_s`` vs ``plain_tokens_per_s``: ``engine.train_batch`` vs a plain Hugging
   Face + torch loop (same model, data, micro-batches, AdamW, clipping) on fixed-length rows.
   Goal: ``ratio = engine / plain >= 0.95``.
2. ``dynamic_vs_padded``: on a variable-length batch, tokens/s of dynamic micro-batching (token
   budget, padding removed) over fixed-size padded micro-batches with the same token budget.
   Goal: ``>= 1.5``.

Timed runs alternate between the contenders and each keeps its best run, and torch uses one
thread by default (``--threads``); both damp noise from other processes on a shared machine.
The last stdout line is the JSON result, also appended to
``benchmarks/history/train_throughput.jsonl`` (see ``benchmarks/_report.py``).

Usage: ``python benchmarks/train_throughput.py [--size micro] [--rounds 8] [--threads 1] ...``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss  # noqa: E402
from polyrl.models.tiny import build_tiny_model  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.train_throughput
    from benchmarks._report import report


def fixed_batch(rows: int, seq_len: int, vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq_len), generator=g)
    ones = torch.ones(rows, seq_len, dtype=torch.long)
    loss_mask = ones.float()
    loss_mask[:, 0] = 0
    pos = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": ones,
            "position_ids": pos,
            "loss_mask": loss_mask,
        }
    )


def variable_batch(rows: int, max_len: int, vocab: int, seed: int) -> Batch:
    """Right-padded rows with RL-like lengths: mostly short, a long tail up to ``max_len``."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.rand(rows, generator=g) ** 2 * (max_len - 16) + 16).long()
    lengths[0] = max_len  # the padded baseline pads every micro-batch to the longest row
    ids = torch.zeros(rows, max_len, dtype=torch.long)
    am = torch.zeros(rows, max_len, dtype=torch.long)
    pos = torch.zeros(rows, max_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        am[i, :n] = 1
        pos[i, :n] = torch.arange(n)
    loss_mask = am.float()
    loss_mask[:, 0] = 0
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": am,
            "position_ids": pos,
            "loss_mask": loss_mask,
        }
    )


class PlainLoop:
    """The baseline: Hugging Face model + AdamW + gradient clipping, nothing else."""

    def __init__(self, model_dir: str, lr: float, clip: float, micro_rows: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.config.use_cache = False
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.clip = clip
        self.micro_rows = micro_rows

    def train_batch(self, batch: Batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        mask = batch["loss_mask"][:, 1:]
        total = mask.sum()
        loss_sum = 0.0
        for s in range(0, len(batch), self.micro_rows):
            ids = batch["input_ids"][s : s + self.micro_rows]
            logits = self.model(
                input_ids=ids,
                attention_mask=batch["attention_mask"][s : s + self.micro_rows],
                position_ids=batch["position_ids"][s : s + self.micro_rows],
            ).logits
            nll = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                ids[:, 1:].reshape(-1),
                reduction="none",
            )
            loss = (nll * mask[s : s + self.micro_rows].reshape(-1)).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return loss_sum


def timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="tiny model dir (built if absent)")
    ap.add_argument("--size", default="micro", help="tiny model preset")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-rows", type=int, default=8)
    ap.add_argument("--var-rows", type=int, default=16)
    ap.add_argument("--var-max-len", type=int, default=384)
    ap.add_argument("--var-micro-rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1, help="train steps per timed run")
    ap.add_argument("--var-steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8, help="timed runs per contender (best kept)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both contenders (0: torch default); 1 keeps the "
        "comparison stable on a shared machine",
    )
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory(prefix="polyrl-bench-")
    model_dir = args.model_dir or str(
        build_tiny_model("qwen2", os.path.join(tmp.name, "m"), args.size)
    )
    vocab = 1000
    lr, clip = 1e-4, 1.0

    # 1. engine vs plain loop on fixed-length rows, same micro-batches (micro_rows rows each).
    batch = fixed_batch(args.rows, args.seq_len, vocab, seed=0)
    tokens = float(batch["attention_mask"].sum())
    engine = build_engine(
        model_dir,
        EngineConfig(max_tokens_per_micro_batch=args.micro_rows * args.seq_len, grad_clip=clip),
        OptimizerConfig(lr=lr),
    )
    plain = PlainLoop(model_dir, lr, clip, args.micro_rows)
    for _ in range(2):  # warm-up (allocator, kernels, FSDP lazy init)
        engine.train_batch(batch, sft_loss)
        plain.train_batch(batch)
    runs = {
        "engine": lambda: engine.train_batch(batch, sft_loss),
        "plain": lambda: plain.train_batch(batch),
    }
    best = {"engine": float("inf"), "plain": float("inf")}
    for r in range(args.rounds):
        for name in ("engine", "plain") if r % 2 == 0 else ("plain", "engine"):
            best[name] = min(best[name], timed(runs[name], args.steps))
    best_engine, best_plain = best["engine"], best["plain"]
    engine_tps = tokens * args.steps / best_engine
    plain_tps = tokens * args.steps / best_plain
    print(
        f"fixed batch {args.rows}x{args.seq_len}: engine {engine_tps:.0f} tok/s, "
        f"plain {plain_tps:.0f} tok/s"
    )
    engine.close()

    # 2. dynamic vs padded micro-batches on a variable-length batch, same token budget.
    var = variable_batch(args.var_rows, args.var_max_len, vocab, seed=1)
    real = float(var["attention_mask"].sum())
    budget = args.var_micro_rows * args.var_max_len
    dynamic = build_engine(
        model_dir,
        EngineConfig(max_tokens_per_micro_batch=budget, grad_clip=clip),
        OptimizerConfig(lr=lr),
    )
    padded = build_engine(
        model_dir,
        EngineConfig(dynamic_batching=False, micro_batch_size=args.var_micro_rows, grad_clip=clip),
        OptimizerConfig(lr=lr),
    )
    for eng in (dynamic, padded):
        eng.train_batch(var, sft_loss)
    best_dyn, best_pad = float("inf"), float("inf")
    for r in range(args.rounds):
        order = [dynamic, padded] if r % 2 == 0 else [padded, dynamic]
        for eng in order:
            t = timed(lambda e=eng: e.train_batch(var, sft_loss), args.var_steps)
            if eng is dynamic:
                best_dyn = min(best_dyn, t)
            else:
                best_pad = min(best_pad, t)
    dyn_tps = real * args.var_steps / best_dyn
    pad_tps = real * args.var_steps / best_pad
    fill = real / var["attention_mask"].numel()
    print(
        f"variable batch {args.var_rows}x<={args.var_max_len} ({fill:.0%} real tokens): "
        f"dynamic {dyn_tps:.0f} tok/s, padded {pad_tps:.0f} tok/s"
    )
    padded.close()
    dynamic.close()
    tmp.cleanup()

    result = {
        "name": "train_throughput",
        "engine_tokens_per_s": round(engine_tps, 1),
        "plain_tokens_per_s": round(plain_tps, 1),
        "ratio": round(engine_tps / plain_tps, 4),
        "dynamic_vs_padded": round(dyn_tps / pad_tps, 4),
    }
    report(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
