"""Benchmark: a full weight update from a model engine into one running rollout replica.

A ~100M-parameter tiny Qwen2 (``size="small"``) is built from its config; the engine
(``build_engine``, world size 1, CPU) streams ``named_tensors()`` through each transport into a
native rollout server in another process, timed from the first bucket to the replica's atomic
switch, after one untimed warm-up update. In the same run the plain memory-copy bandwidth of
the same bytes is measured (each tensor copied into a bucket-sized buffer), giving
``ratio = shm_GBps / memcpy_GBps``.

Run: ``python benchmarks/weight_sync.py [--size small] [--bucket-mb 64 16 256]``. With several
bucket sizes a markdown table row per size is printed; the last stdout line is the JSON of the
first size: ``{"name": "weight_sync", "model_bytes", "memcpy_GBps", "transports": {"shm":
{"seconds", "GBps"}, "dist": {...}, "disk": {...}}, "ratio"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from polyrl.model.engine import build_engine  # noqa: E402
from polyrl.models.tiny import build_tiny_model  # noqa: E402
from polyrl.rollout.launcher import ServerProcess  # noqa: E402
from polyrl.weights import WeightSender, create_transport  # noqa: E402

TRANSPORTS = ("shm", "dist", "disk")


def memcpy_gbps(engine: Any, bucket_bytes: int, repeats: int = 3) -> tuple[int, float]:
    """Copy every tensor's bytes into a bucket-sized buffer; return (bytes, best GB/s)."""
    tensors = [
        t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in engine.named_tensors()
    ]
    total = sum(t.numel() for t in tensors)
    dst = torch.empty(bucket_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for src in tensors:
            for start in range(0, src.numel(), bucket_bytes):
                piece = src[start : start + bucket_bytes]
                dst[: piece.numel()].copy_(piece)
        best = min(best, time.perf_counter() - t0)
    return total, total / best / 1e9


def run(size: str, bucket_mbs: list[float], workdir: Path) -> dict[str, Any]:
    """Run the benchmark for each bucket size; return the result of the first."""
    model_dir = build_tiny_model("qwen2", workdir / f"qwen2-{size}", size=size)
    engine = build_engine(str(model_dir))
    replica = ServerProcess(model_dir, options={"num_threads": 2}).start(timeout=600)
    results = []
    try:
        # One untimed update first: the replica's first switch pays one-off allocation costs
        # that would otherwise be charged to whichever transport happens to run first.
        warm = create_transport("shm", urls=[replica.url], timeout=600)
        try:
            WeightSender(warm, bucket_mb=bucket_mbs[0]).send(engine.named_tensors())
        finally:
            warm.close()
        for mb in bucket_mbs:
            nbytes, memcpy = memcpy_gbps(engine, int(mb * 2**20))
            row: dict[str, Any] = {
                "name": "weight_sync",
                "model_bytes": nbytes,
                "memcpy_GBps": round(memcpy, 3),
                "transports": {},
                "bucket_mb": mb,
            }
            for kind in TRANSPORTS:
                transport = create_transport(kind, urls=[replica.url], timeout=600)
                try:
                    stats = WeightSender(transport, bucket_mb=mb).send(engine.named_tensors())
                finally:
                    transport.close()
                row["transports"][kind] = {
                    "seconds": round(stats.seconds, 3),
                    "GBps": round(stats.bytes / stats.seconds / 1e9, 3),
                }
            row["ratio"] = round(row["transports"]["shm"]["GBps"] / memcpy, 4)
            results.append(row)
            print(
                f"| {mb:g} | {nbytes / 1e6:.0f} MB | {memcpy:.2f} | "
                + " | ".join(
                    f"{row['transports'][k]['seconds']:.2f} s / {row['transports'][k]['GBps']:.2f}"
                    for k in TRANSPORTS
                )
                + f" | {row['ratio']:.3f} |",
                flush=True,
            )
    finally:
        replica.stop()
        engine.close()
    first = dict(results[0])
    first.pop("bucket_mb")
    return first


def main() -> None:
    """Parse arguments, run, print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="tiny model preset (default: small)")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0])
    parser.add_argument("--workdir", default=None, help="where the model is built")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-wsync-"))
    cols = ["bucket MiB", "model", "memcpy GB/s", *(f"{k} s / GB/s" for k in TRANSPORTS), "ratio"]
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|")
    print(json.dumps(run(args.size, args.bucket_mb, workdir)))


if __name__ == "__main__":
    main()
