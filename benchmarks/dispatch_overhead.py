"""Dispatch overhead of the single controller on Ray, and the bytes the driver sees.

Prints human-readable lines, then, as the LAST stdout line, one JSON object (also appended to
``benchmarks/history/dispatch_overhead.jsonl``, see ``benchmarks/_report.py``)::

    {"name": "dispatch_overhead", "noop_ms": ..., "dp_compute_64mb_ms": ...,
     "plain_ray_64mb_ms": ..., "ratio": ..., "driver_bytes_chain": ..., "payload_bytes": ...}

What is measured (medians over ``--repeats`` runs after warm-up, 2 workers, 0.5 CPU each):

``noop_ms``
    a blocking ``ONE_TO_ALL`` call of a method that does nothing: the controller's per-call cost
    (dispatch, two actor calls, failure-aware wait, collect).
``dp_compute_64mb_ms``
    a blocking ``DP_COMPUTE`` call with a 64 MiB Batch (``rows x width`` float32): split in two,
    each worker returns the per-row sums, results gathered in order.
``plain_ray_64mb_ms``
    the same work with plain Ray: two bare actors with the same method, the driver splits the
    Batch with ``chunk(2)``, calls both with ``.remote``, ``ray.get`` s and concatenates.
``ratio``
    ``plain_ray_64mb_ms / dp_compute_64mb_ms`` (goal >= 0.8).
``driver_bytes_chain``
    bytes the driver process received while running a three-call chain of non-blocking
    ``DP_COMPUTE`` calls (``x + 1`` -> ``x * 2`` -> per-row sums) on the 64 MiB Batch, including
    the final ``get``. Counted with :class:`polyrl.controller.DriverTrafficMeter`: the size of
    every Ray object the driver deserialised (every ``ray.get`` result, inline or from the object
    store, passes through Ray's single deserialisation entry point) plus the growth of the
    driver's in-process memory store, where results small enough to be returned inline land
    even if never read -- a conservative upper bound. The script also asserts that none of the
    intermediate results' object ids were deserialised in the driver.
``payload_bytes``
    size of the Batch's tensor data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from polyrl.controller import (  # noqa: E402
    Dispatch,
    DriverTrafficMeter,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from polyrl.core.batch import Batch  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.dispatch_overhead
    from benchmarks._report import report


class BenchWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch=Dispatch.DP_COMPUTE)
    def row_sum(self, batch: Batch) -> Batch:
        return Batch({"s": batch["x"].sum(-1)})

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def add_one(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] + 1})

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def double(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"] * 2})

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def row_sum_async(self, batch: Batch) -> Batch:
        return Batch({"s": batch["x"].sum(-1)})


@ray.remote(num_cpus=0.5)
class PlainActor:
    def row_sum(self, batch: Batch) -> Batch:
        return Batch({"s": batch["x"].sum(-1)})


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _interleaved(first, second, repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        first()
        second()
    a, b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        first()
        a.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        second()
        b.append((time.perf_counter() - start) * 1e3)
    return a, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--noop-repeats", type=int, default=200)
    args = parser.parse_args()

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=1 << 30,
        configure_logging=False,
        log_to_driver=False,
    )
    batch = Batch({"x": torch.randn(args.rows, args.width)})
    payload = batch["x"].numel() * batch["x"].element_size()
    expected = batch["x"].sum(-1)
    pool = ResourcePool("bench", 2, cpus_per_worker=0.5)
    group = WorkerGroup(BenchWorker, pool=pool)
    plain = [PlainActor.remote() for _ in range(2)]
    try:
        noop_ms = _median_ms(group.noop, args.noop_repeats, warmup=20)
        print(f"noop ONE_TO_ALL: {noop_ms:.3f} ms")

        out = group.row_sum(batch)
        torch.testing.assert_close(out["s"], expected)

        def plain_call() -> Batch:
            halves = batch.chunk(2)
            refs = [a.row_sum.remote(h) for a, h in zip(plain, halves, strict=True)]
            return Batch.concat(ray.get(refs))

        torch.testing.assert_close(plain_call()["s"], expected)
        # Interleave the two so machine noise and object-store warm-up hit both alike.
        dp_times, plain_times = _interleaved(
            lambda: group.row_sum(batch), plain_call, args.repeats, warmup=5
        )
        dp_ms, plain_ms = statistics.median(dp_times), statistics.median(plain_times)
        print(f"DP_COMPUTE 64 MiB: {dp_ms:.2f} ms  (runs: {[round(t, 1) for t in dp_times]})")
        print(f"plain Ray 64 MiB: {plain_ms:.2f} ms  (runs: {[round(t, 1) for t in plain_times]})")
        print(f"ratio plain/dp = {plain_ms / dp_ms:.3f}")

        # Warm the chain once (first remote use of each method), then measure a fresh one.
        group.row_sum_async(group.double(group.add_one(batch))).get()
        meter = DriverTrafficMeter()
        with meter:
            a = group.add_one(batch)
            b = group.double(a)
            c = group.row_sum_async(b)
            result = c.get()
        torch.testing.assert_close(result["s"], ((batch["x"] + 1) * 2).sum(-1))
        intermediate = {h.hex() for f in (a, b) for h in f.handles() if h is not None}
        leaked = intermediate & meter.fetched_ids
        if leaked:
            raise AssertionError(f"the driver fetched intermediate results: {sorted(leaked)}")
        print(
            f"chain: driver deserialised {meter.deserialized_bytes} B in {meter.objects} objects, "
            f"{meter.inline_bytes} B arrived inline; payload {payload} B "
            f"({100 * meter.total_bytes / payload:.3f}%)"
        )
    finally:
        group.shutdown()
        pool.release()
        ray.shutdown()
    report(
        {
            "name": "dispatch_overhead",
            "noop_ms": round(noop_ms, 4),
            "dp_compute_64mb_ms": round(dp_ms, 3),
            "plain_ray_64mb_ms": round(plain_ms, 3),
            "ratio": round(plain_ms / dp_ms, 4),
            "driver_bytes_chain": int(meter.total_bytes),
            "payload_bytes": int(payload),
        }
    )


if __name__ == "__main__":
    main()
