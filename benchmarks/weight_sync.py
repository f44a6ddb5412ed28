"""Benchmark: a full weight update from a model engine into one running rollout replica.

A ~100M-parameter tiny Qwen2 (``size="small"``) is built from its config; the engine
(``build_engine``, world size 1, CPU) streams ``named_tensors()`` through each transport into a
native rollout server in another process, timed from ``begin`` to the replica's switch, in both
receiver staging modes (``staged``: atomic, into reused shadows, pointer swap; ``inplace``:
paused, straight into the live parameters). Transports are created once and reused, as a
trainer would; every (transport, mode) gets one untimed warm-up update. In the same run, in
alternating rounds, the plain memory-copy bandwidth of the same bytes is measured: every tensor
copied to its own place in a model-sized buffer (``memcpy_GBps``, the baseline of ``ratio``).
Until 2026-11-24 the baseline copied every tensor into the start of one bucket-sized buffer;
that rewrites the same few MB, which stay in the last-level cache, and read ~1.8x the bandwidth
of a real copy here (18.3 vs 10.2 GB/s): it is still reported, as ``memcpy_reused_dst_GBps``,
to compare with older rows. Figures are medians over rounds.

Run: ``python benchmarks/weight_sync.py [--size small] [--bucket-mb 64 16 256] [--rounds 3]
[--threads 1]`` (torch threads of the benchmark process and of the replica).
``shm`` is the transport's default: direct writes into the replica's shadows (one copy, see
``polyrl/weights/arena.py``) in ``staged`` mode, its bucket path in ``inplace`` mode; the
bucket path in ``staged`` mode is timed too, as ``shm_buckets``.

A markdown table row per bucket size is printed; the last stdout line is the JSON of the first
size, also appended to ``benchmarks/history/weight_sync.jsonl`` (see ``benchmarks/_report.py``):
``{"name": "weight_sync", "bucket_mb", "model_bytes", "memcpy_GBps", "memcpy_reused_dst_GBps",
"transports": {"shm": {"seconds", "GBps"}, "dist": {...}, "disk": {...}}, "shm_buckets":
{...}, "ratio", "default_mode": "staged", "inplace": {"shm": {...}, ...}, "ratio_inplace",
"ratio_shm_buckets", "ratio_vs_reused_dst", "faults_per_update": {"shm_staged": {"sender",
"replica"}, ...}}`` where ``transports``/``ratio`` are the default ``staged`` mode and
``ratio = shm_GBps / memcpy_GBps``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

from polyrl.model_engine.engine import build_engine  # noqa: E402
from polyrl.models.tiny import build_tiny_model  # noqa: E402
from polyrl.rollout.launcher import ServerProcess  # noqa: E402
from polyrl.weights import WeightSender, create_transport  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.weight_sync
    from benchmarks._report import report

TRANSPORTS = ("shm", "dist", "disk")
MODES = ("staged", "inplace")
#: The shm transport with direct writes off (its bucket path), staged only, for comparison.
SHM_BUCKETS = "shm_buckets"


def memcpy_seconds(tensors: list[torch.Tensor], dst: torch.Tensor) -> float:
    """Copy every tensor's bytes to its own place in the model-sized ``dst``; return seconds."""
    t0 = time.perf_counter()
    offset = 0
    for src in tensors:
        dst[offset : offset + src.numel()].copy_(src)
        offset += src.numel()
    return time.perf_counter() - t0


def memcpy_reused_seconds(tensors: list[torch.Tensor], dst: torch.Tensor) -> float:
    """Copy every tensor into the start of the bucket-sized ``dst`` (the old baseline)."""
    bucket = dst.numel()
    t0 = time.perf_counter()
    for src in tensors:
        for start in range(0, src.numel(), bucket):
            piece = src[start : start + bucket]
            dst[: piece.numel()].copy_(piece)
    return time.perf_counter() - t0


def own_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def replica_faults(url: str) -> int:
    """Minor page faults of the replica process so far (from ``/weights/status``)."""
    return int(httpx.get(url + "/weights/status").json()["minor_faults"])


def run(
    size: str, bucket_mbs: list[float], workdir: Path, rounds: int, threads: int
) -> dict[str, Any]:
    """Run the benchmark for each bucket size; return the result of the first."""
    # The same intra-op threads for the baseline and the sender; on a small shared machine
    # more than one thread per process makes every copy wait on OpenMP barriers.
    torch.set_num_threads(threads)
    model_dir = build_tiny_model("qwen2", workdir / f"qwen2-{size}", size=size)
    engine = build_engine(str(model_dir))
    replica = ServerProcess(model_dir, options={"num_threads": threads}).start(timeout=600)
    transports = {k: create_transport(k, urls=[replica.url], timeout=600) for k in TRANSPORTS}
    transports[SHM_BUCKETS] = create_transport("shm", urls=[replica.url], timeout=600, direct=False)
    results = []
    try:
        for mb in bucket_mbs:
            flat = [
                t.detach().contiguous().reshape(-1).view(torch.uint8)
                for _, t in engine.named_tensors()
            ]
            nbytes = sum(t.numel() for t in flat)
            dst = torch.empty(nbytes, dtype=torch.uint8)
            bucket_dst = torch.empty(int(mb * 2**20), dtype=torch.uint8)
            senders = {
                (k, m): WeightSender(transports[k], bucket_mb=mb, mode=m)
                for k in TRANSPORTS
                for m in MODES
            }
            senders[(SHM_BUCKETS, "staged")] = WeightSender(
                transports[SHM_BUCKETS], bucket_mb=mb, mode="staged"
            )
            for sender in senders.values():  # warm-up: buffers, groups, shadows
                sender.send(engine.named_tensors())
            memcpy_seconds(flat, dst)  # warm-up
            memcpy_reused_seconds(flat, bucket_dst)
            copies: list[float] = []
            reused: list[float] = []
            times: dict[tuple[str, str], list[float]] = {key: [] for key in senders}
            faults: dict[tuple[str, str], list[tuple[int, int]]] = {key: [] for key in senders}
            for _ in range(rounds):  # alternate: baseline, then every transport and mode
                copies.append(memcpy_seconds(flat, dst))
                reused.append(memcpy_reused_seconds(flat, bucket_dst))
                for key, sender in senders.items():
                    before = (own_faults(), replica_faults(replica.url))
                    times[key].append(sender.send(engine.named_tensors()).seconds)
                    after = (own_faults(), replica_faults(replica.url))
                    faults[key].append((after[0] - before[0], after[1] - before[1]))
            memcpy = nbytes / statistics.median(copies) / 1e9

            def figures(key: tuple[str, str], times=times, nbytes=nbytes) -> dict[str, float]:
                sec = statistics.median(times[key])
                return {"seconds": round(sec, 4), "GBps": round(nbytes / sec / 1e9, 3)}

            row: dict[str, Any] = {
                "name": "weight_sync",
                "model_bytes": nbytes,
                "memcpy_GBps": round(memcpy, 3),
                "memcpy_reused_dst_GBps": round(nbytes / statistics.median(reused) / 1e9, 3),
                "transports": {k: figures((k, "staged")) for k in TRANSPORTS},
                SHM_BUCKETS: figures((SHM_BUCKETS, "staged")),
                "default_mode": "staged",
                "inplace": {k: figures((k, "inplace")) for k in TRANSPORTS},
                "bucket_mb": mb,
                "rounds": rounds,
                "threads": threads,
            }
            # Page faults per update (medians; machine-independent, unlike the timings).
            row["faults_per_update"] = {
                f"{k}_{m}": {
                    side: int(statistics.median(f[i] for f in faults[(k, m)]))
                    for i, side in enumerate(("sender", "replica"))
                }
                for k, m in senders
            }
            row["ratio"] = round(row["transports"]["shm"]["GBps"] / memcpy, 4)
            row["ratio_inplace"] = round(row["inplace"]["shm"]["GBps"] / memcpy, 4)
            row["ratio_shm_buckets"] = round(row[SHM_BUCKETS]["GBps"] / memcpy, 4)
            row["ratio_vs_reused_dst"] = round(
                row["transports"]["shm"]["GBps"] / row["memcpy_reused_dst_GBps"], 4
            )
            results.append(row)
            cells = [row[SHM_BUCKETS]] + [
                row[group][k] for group in ("transports", "inplace") for k in TRANSPORTS
            ]
            print(
                f"| {mb:g} | {nbytes / 1e6:.0f} MB | {memcpy:.2f} | "
                + " | ".join(f"{c['seconds']:.3f} s / {c['GBps']:.2f}" for c in cells)
                + f" | {row['ratio']:.3f} | {row['ratio_inplace']:.3f} |",
                flush=True,
            )
    finally:
        for t in transports.values():
            t.close()
        replica.stop()
        engine.close()
    return results[0]


def main() -> None:
    """Parse arguments, run, record and print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="tiny model preset (default: small)")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (medians)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of this process and the replica"
    )
    parser.add_argument("--workdir", default=None, help="where the model is built")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-wsync-"))
    cols = [
        "bucket MiB",
        "model",
        "memcpy GB/s",
        "shm buckets staged s / GB/s",
        *(f"{k} staged s / GB/s" for k in TRANSPORTS),
        *(f"{k} inplace s / GB/s" for k in TRANSPORTS),
        "ratio staged",
        "ratio inplace",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    report(run(args.size, args.bucket_mb, workdir, args.rounds, args.threads))


if __name__ == "__main__":
    main()
