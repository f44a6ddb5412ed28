"""Peak memory per rank of one long-sequence training step under Ulysses sequence parallelism.

A tiny random-init llama (``polyrl.models.tiny``; 4 attention and 4 key/value heads, so up to 4
sequence-parallel ranks) trains one step on one packed row of ``L`` tokens with
``ulysses_sequence_parallel_size`` = 1, 2 and 4 (as many gloo ranks on this CPU, data-parallel
size 1).  Per rank and step the figure is the resident-set high-water mark during the step minus
the resident set just before it (freed heap returned to the OS first with ``malloc_trim`` and
the kernel's high-water mark reset through ``/proc/self/clear_refs``; where that is refused,
``ru_maxrss`` is used and a step can only read higher).  The maximum over ranks is reported.

Two results per sequence-parallel size: the peak at ``--length`` tokens, and the longest length
of a doubling-ish sweep whose step stays under ``--cap-mib``.  ``peak_ratio_sp4`` is the sp=4
peak over the sp=1 peak (lower is better); ``max_len_ratio_sp4`` (also ``ratio``) the sp=4
longest length over sp=1's (higher is better).  On CPU, SDPA with a block-causal mask keeps a
``T x T`` boolean mask on every rank, which sequence parallelism does not divide.

The last stdout line is the JSON result, also appended to
``benchmarks/history/long_context.jsonl`` (see ``benchmarks/_report.py``).

Usage: ``python benchmarks/long_context.py [--length 2048] [--cap-mib 256] [--max-length 65536]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
SP_SIZES = (1, 2, 4)


def _sweep(max_length: int) -> list[int]:
    lengths, n = [], 1024
    while n <= max_length:
        lengths.extend(x for x in (n, n * 3 // 2) if x <= max_length)
        n *= 2
    return lengths


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _reset_peak() -> bool:
    """Return freed heap to the OS and reset the kernel's RSS high-water mark (if allowed)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mib(reset_ok: bool) -> float:
    if reset_ok:
        peak = _status_kib("VmHWM") or 0
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024


def _row(length: int, vocab: int, seed: int):
    import torch

    from polyrl.core.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, length), generator=g)
    ones = torch.ones(1, length, dtype=torch.long)
    loss = ones.float()
    loss[:, 0] = 0
    pos = torch.arange(length)[None]
    return Batch(
        tensors={"input_ids": ids, "attention_mask": ones, "position_ids": pos, "loss_mask": loss}
    )


def worker(args: argparse.Namespace) -> None:
    """One rank: a warm-up step, then the sweep; rank 0 writes every rank's peaks."""
    import torch
    import torch.distributed as dist

    from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss
    from polyrl.model_engine.config import ParallelismConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    lengths = sorted(set(_sweep(args.max_length)) | {args.length})
    engine = build_engine(
        args.model_dir,
        EngineConfig(
            pack_sequences=True,
            max_tokens_per_micro_batch=max(lengths),
            retain_freed_memory=False,
            parallelism=ParallelismConfig(ulysses_sequence_parallel_size=args.sp),
        ),
        OptimizerConfig(lr=1e-4),
    )
    engine.train_batch(_row(256, 1024, 0), sft_loss)  # optimizer state, lazy buffers
    peaks: dict[int, float] = {}
    for length in lengths:
        reset_ok = _reset_peak()
        before = (_status_kib("VmRSS") or 0) / 1024
        engine.train_batch(_row(length, 1024, length), sft_loss)
        step = torch.tensor([_peak_mib(reset_ok) - before], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the worst rank
        peaks[length] = float(step)
        # Every rank stops together (the figure is already reduced).
        if length > args.length and peaks[length] > args.cap_mib:
            break
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(peaks))
    engine.close()
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_size(args: argparse.Namespace, model_dir: str, sp: int, out: Path) -> dict[int, float]:
    port = _free_port()
    cmd = [sys.executable, __file__, "--worker", "--sp", str(sp), "--model-dir", model_dir]
    cmd += ["--out", str(out), "--length", str(args.length), "--cap-mib", str(args.cap_mib)]
    cmd += ["--max-length", str(args.max_length)]
    procs = []
    for rank in range(sp):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(sp),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"sp={sp} failed:\n" + "\n".join(x.decode()[-3000:] for x in logs))
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="tokens of the peak figure")
    parser.add_argument("--cap-mib", type=float, default=256.0, help="per-rank step memory cap")
    parser.add_argument("--max-length", type=int, default=65536, help="longest length tried")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    try:  # run as a script: its own directory is on sys.path
        from _report import report
    except ImportError:  # imported as benchmarks.long_context
        from benchmarks._report import report
    from polyrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            build_tiny_model(
                "llama",
                Path(tmp) / "llama",
                size="nano",
                hidden=64,
                layers=2,
                heads=4,
                kv_heads=4,
                intermediate=128,
            )
        )
        results = {sp: run_size(args, model_dir, sp, Path(tmp) / f"sp{sp}.json") for sp in SP_SIZES}

    def longest(peaks: dict[int, float]) -> int:
        fits = [n for n, mib in peaks.items() if mib <= args.cap_mib]
        return max(fits) if fits else 0

    result: dict = {"name": "long_context", "length": args.length, "cap_mib": args.cap_mib}
    for sp, peaks in results.items():
        result[f"peak_mib_sp{sp}"] = round(peaks[args.length], 1)
        result[f"max_len_sp{sp}"] = longest(peaks)
    base_len = max(result["max_len_sp1"], 1)
    for sp in SP_SIZES[1:]:
        result[f"peak_ratio_sp{sp}"] = round(result[f"peak_mib_sp{sp}"] / result["peak_mib_sp1"], 4)
        result[f"max_len_ratio_sp{sp}"] = round(result[f"max_len_sp{sp}"] / base_len, 4)
    result["ratio"] = result["max_len_ratio_sp4"]
    # The headline keys first, as the history file's readers expect.
    head = ("name", "peak_ratio_sp4", "max_len_ratio_sp4")
    report({**{k: result[k] for k in head}, **{k: v for k, v in result.items() if k not in head}})


if __name__ == "__main__":
    main()
