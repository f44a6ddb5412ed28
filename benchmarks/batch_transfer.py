"""Benchmark: moving a 64 MiB Batch between two Ray actors, polyrl pickling vs torch pickling.

A producer actor builds the payload once; each round the driver asks it for the payload and hands
the resulting ObjectRef to a consumer actor, which ``ray.get``s it and touches one element per
tensor column.  A round is timed from the producer call to the consumer's answer, so it covers
serialisation, the object store, deserialisation and the touch.  The baseline sends the very same
tensors as a plain dict, which Ray pickles through torch's own reducer.

Run: ``python benchmarks/batch_transfer.py``.  The last stdout line is one JSON object,
also appended to ``benchmarks/history/batch_transfer.jsonl`` (see ``benchmarks/_report.py``):
``{"name": "batch_transfer", "polyrl_s": ..., "torch_pickle_s": ..., "ratio": ...}``.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from polyrl.core.batch import Batch  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.batch_transfer
    from benchmarks._report import report

ROWS = 1024
ROUNDS = 7


def build_payload() -> Batch:
    """64 MiB of tensor columns (fp32 hidden, bf16 log-probs, int64 ids) plus prompts."""
    gen = torch.Generator().manual_seed(0)
    return Batch(
        {
            "hidden": torch.randn(ROWS, 15 * 1024, generator=gen),  # 60 MiB
            "logp": torch.randn(ROWS, 1024, generator=gen).bfloat16(),  # 2 MiB
            "ids": torch.randint(0, 50_000, (ROWS, 256), generator=gen),  # 2 MiB
        },
        {"prompt": [f"prompt number {i}" for i in range(ROWS)]},
        meta={"weight_version": 1},
    )


@ray.remote(num_cpus=1)
class Producer:
    def __init__(self) -> None:
        self.batch = build_payload()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.batch.tensors.values())

    def as_batch(self) -> Batch:
        return self.batch

    def as_torch_pickled(self) -> dict:
        # Same tensors, but as a plain dict: Ray falls back to torch's tensor pickling.
        return {
            "tensors": dict(self.batch.tensors.items()),
            "non_tensors": self.batch.non_tensors,
            "meta": self.batch.meta,
        }


@ray.remote(num_cpus=1)
class Consumer:
    def touch(self, wrapped: list) -> float:
        obj = ray.get(wrapped[0])
        tensors = obj.tensors if isinstance(obj, Batch) else obj["tensors"]
        return float(sum(t.reshape(-1)[-1].float() for t in tensors.values()))


def one_round(producer, consumer, method: str) -> tuple[float, float]:
    start = time.perf_counter()
    ref = getattr(producer, method).remote()
    value = ray.get(consumer.touch.remote([ref]))
    elapsed = time.perf_counter() - start
    del ref
    return elapsed, value


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        nbytes = ray.get(producer.nbytes.remote())
        print(f"payload: {nbytes / 2**20:.1f} MiB of tensors, {ROUNDS} rounds each")
        # Warm-up: actor start-up, imports, first object-store allocation.
        warm_a = one_round(producer, consumer, "as_batch")[1]
        warm_b = one_round(producer, consumer, "as_torch_pickled")[1]
        if warm_a != warm_b:
            raise RuntimeError(f"payloads differ after transfer: {warm_a} vs {warm_b}")
        times: dict[str, list[float]] = {"as_batch": [], "as_torch_pickled": []}
        for _ in range(ROUNDS):  # interleaved so both see the same machine load
            for method in times:
                times[method].append(one_round(producer, consumer, method)[0])
        for method, ts in times.items():
            print(f"{method}: " + " ".join(f"{t * 1000:.1f}ms" for t in ts))
        polyrl_s = statistics.median(times["as_batch"])
        torch_s = statistics.median(times["as_torch_pickled"])
    finally:
        ray.shutdown()
    report(
        {
            "name": "batch_transfer",
            "polyrl_s": polyrl_s,
            "torch_pickle_s": torch_s,
            "ratio": torch_s / polyrl_s,
        }
    )


if __name__ == "__main__":
    main()
