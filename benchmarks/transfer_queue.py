"""Benchmark: the transfer queue against plain Ray object passing for one RL step's batch.

Micro part: a producer actor holds a batch shaped like an RL step (``input_ids``,
``attention_mask``, ``position_ids`` int64 and ``loss_mask``, ``old_log_probs``,
``ref_log_probs``, ``advantages`` float32, all ``(num_samples, seq_len)``).

* put/get: a consumer actor blocks in ``get_meta`` for all samples of a fresh partition, the
  producer ``put``s the batch, the consumer ``get_data``s it and touches every column. Timed from
  the driver's call to the producer until the consumer answers (the producer's own ``put``
  returns a little later, once its storage unit has mapped the block; that wait is not timed).
  Both actors got the queue client once beforehand, as long-lived services hold theirs.
* ray: the producer ``ray.put``s the same batch and the reference is handed to the consumer,
  which ``ray.get``s it and touches every column; timed the same way.

Rounds alternate between the two (both see the same machine load); figures are medians.
MB/s = payload bytes (the tensor bytes) / seconds / 1e6.

Steady state: the object store is bounded (``--object-store-mb``) and pre-faulted by Ray
(``RAY_preallocate_plasma_memory=1``), and ``--warmup`` rounds of each kind run first, so that
both sides write into store pages their processes have mapped before, as a long training run
does. Without this a round lands, by the allocator's luck, either on fresh pages (~50 ms for
20 MiB here: page faults dominate and both sides look alike) or on reused ones (~7 ms), and the
median of either side could come from either mode (ratios from 0.18 to 0.94 in one afternoon).

End-to-end part (``benchmarks/_transfer_e2e.py``): the same GRPO workload on Ray (tiny model,
two engine ranks, one rollout server; ``--e2e-prompts`` x ``--e2e-n`` responses of up to
``--e2e-tokens`` tokens, old and reference log-probs, two updates per step) runs without and
with ``transfer.enable``; the driver's bytes per step (Ray both ways + its own HTTP bodies) and
the step time are medians over ``--e2e-steps`` timed steps after a warm-up step; the payload is
what the queue's storage held at the end of a step.

Run: ``python benchmarks/transfer_queue.py [--samples 512 --seq-len 1024 --rounds 15
--warmup 15 --object-store-mb 256]
[--e2e-prompts 32 --e2e-n 8 --e2e-tokens 256 --e2e-steps 2] [--skip-e2e]``. The last stdout
line is one JSON object, also appended to ``benchmarks/history/transfer_queue.jsonl`` (see
``benchmarks/_report.py``): ``{"name": "transfer_queue", "micro_payload_bytes", "put_get_MBps",
"ray_MBps", "payload_bytes_per_step", "driver_bytes_per_step_with",
"driver_bytes_per_step_without", "driver_fraction_with", "step_s_with", "step_s_without",
"e2e_settings", "ratio": put_get_MBps / ray_MBps}`` (goals: ``driver_fraction_with`` < 0.01,
``ratio`` >= 0.8).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.transfer import TransferQueue, make_transfer_queue  # noqa: E402
from polyrl.transfer.segments import sweep_segments  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.transfer_queue
    from benchmarks._report import report

FIELDS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "loss_mask",
    "old_log_probs",
    "ref_log_probs",
    "advantages",
)


def build_step_batch(num_samples: int, seq_len: int, seed: int = 0) -> Batch:
    """A batch shaped like one RL step (right-padded sequences of random length)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (num_samples,), generator=gen)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.int64)
    return Batch(
        {
            "input_ids": torch.randint(0, 150_000, (num_samples, seq_len), generator=gen),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "loss_mask": mask.to(torch.float32),
            "old_log_probs": -torch.rand(num_samples, seq_len, generator=gen),
            "ref_log_probs": -torch.rand(num_samples, seq_len, generator=gen),
            "advantages": torch.randn(num_samples, seq_len, generator=gen),
        }
    )


def payload_bytes(batch: Batch) -> int:
    """Bytes of the tensor columns."""
    return sum(t.numel() * t.element_size() for t in batch.tensors.values())


def _touch(batch: Batch) -> float:
    # Read one element of every row block of every column so the data is really there.
    return float(
        sum(t.reshape(-1)[:: max(1, t.numel() // 64)].float().sum() for t in batch.tensors.values())
    )


@ray.remote(num_cpus=0)
class Producer:
    """Holds the step batch; puts it into the queue or into Ray's object store."""

    def __init__(self, num_samples: int, seq_len: int) -> None:
        self.batch = build_step_batch(num_samples, seq_len)
        self.queue: TransferQueue | None = None

    def connect(self, queue: TransferQueue) -> None:
        # A service holds its queue client for its lifetime; it is not shipped with every call.
        self.queue = queue

    def nbytes(self) -> int:
        return payload_bytes(self.batch)

    def checksum(self) -> float:
        return _touch(self.batch)

    def put_queue(self, partition: str) -> int:
        assert self.queue is not None
        return len(self.queue.put(self.batch, partition))

    def put_ray(self) -> list[Any]:
        return [ray.put(self.batch)]  # wrapped: the consumer gets the reference, not the value


@ray.remote(num_cpus=0)
class Consumer:
    """Reads a whole step, through the queue or through a Ray reference."""

    def __init__(self) -> None:
        self.queue: TransferQueue | None = None

    def connect(self, queue: TransferQueue) -> None:
        self.queue = queue

    def get_queue(self, partition: str, num_samples: int) -> float:
        assert self.queue is not None
        meta = self.queue.get_meta(list(FIELDS), num_samples, partition, "bench", timeout=120)
        return _touch(self.queue.get_data(meta))

    def get_ray(self, wrapped: list[Any]) -> float:
        return _touch(ray.get(wrapped[0]))


_ACTORS: dict[tuple[int, int], tuple[Any, Any]] = {}
_CONNECTED: dict[tuple[int, int], TransferQueue] = {}


def _actors(num_samples: int, seq_len: int) -> tuple[Any, Any]:
    key = (num_samples, seq_len)
    if key not in _ACTORS:
        _ACTORS[key] = (Producer.remote(num_samples, seq_len), Consumer.remote())
    return _ACTORS[key]


def _put_get_once(queue: TransferQueue, num_samples: int, seq_len: int, tag: str) -> float:
    producer, consumer = _actors(num_samples, seq_len)
    key = (num_samples, seq_len)
    if _CONNECTED.get(key) is not queue:
        ray.get([producer.connect.remote(queue), consumer.connect.remote(queue)])
        _CONNECTED[key] = queue
    partition = f"bench-{tag}"
    # The consumer waits in get_meta first, as a trainer's consumer would.
    done = consumer.get_queue.remote(partition, num_samples)
    start = time.perf_counter()
    put = producer.put_queue.remote(partition)
    value = ray.get(done)
    # Timed until the consumer has the data (as the ray side is); the producer's own
    # acknowledgement may come back a little later and is awaited outside the timing.
    elapsed = time.perf_counter() - start
    ray.get(put)
    queue.clear(partition)
    if value != ray.get(producer.checksum.remote()):
        raise RuntimeError("put/get: the consumer read different data than was put")
    return elapsed


def _ray_once(num_samples: int, seq_len: int) -> float:
    producer, consumer = _actors(num_samples, seq_len)
    start = time.perf_counter()
    ref = producer.put_ray.remote()
    value = ray.get(consumer.get_ray.remote(ref))
    elapsed = time.perf_counter() - start
    del ref
    if value != ray.get(producer.checksum.remote()):
        raise RuntimeError("ray: the consumer read different data than was put")
    return elapsed


def measure_put_get(queue: TransferQueue, num_samples: int, seq_len: int, rounds: int) -> float:
    """Median MB/s of producer put -> consumer get_meta + get_data over ``rounds`` rounds."""
    nbytes = ray.get(_actors(num_samples, seq_len)[0].nbytes.remote())
    times = [_put_get_once(queue, num_samples, seq_len, f"{time.time_ns()}") for _ in range(rounds)]
    return nbytes / statistics.median(times) / 1e6


def measure_ray(num_samples: int, seq_len: int, rounds: int) -> float:
    """Median MB/s of producer ray.put -> reference to consumer -> ray.get over ``rounds``."""
    nbytes = ray.get(_actors(num_samples, seq_len)[0].nbytes.remote())
    times = [_ray_once(num_samples, seq_len) for _ in range(rounds)]
    return nbytes / statistics.median(times) / 1e6


def run_micro(
    queue: TransferQueue, num_samples: int, seq_len: int, rounds: int, warmup: int = 1
) -> dict[str, Any]:
    """Alternate put/get and ray rounds (after ``warmup`` of each); return the micro figures."""
    nbytes = ray.get(_actors(num_samples, seq_len)[0].nbytes.remote())
    for w in range(warmup):
        _put_get_once(queue, num_samples, seq_len, f"warmup{w}")
        _ray_once(num_samples, seq_len)
    put_get, plain = [], []
    for r in range(rounds):
        put_get.append(_put_get_once(queue, num_samples, seq_len, f"r{r}"))
        plain.append(_ray_once(num_samples, seq_len))
    print("put_get: " + " ".join(f"{t * 1000:.1f}ms" for t in put_get))
    print("ray:     " + " ".join(f"{t * 1000:.1f}ms" for t in plain))
    put_get_mbps = nbytes / statistics.median(put_get) / 1e6
    ray_mbps = nbytes / statistics.median(plain) / 1e6
    return {
        "payload_bytes_per_step": nbytes,
        "put_get_MBps": round(put_get_mbps, 1),
        "ray_MBps": round(ray_mbps, 1),
        "ratio": round(put_get_mbps / ray_mbps, 3),
    }


def run_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """GRPO steps without and with the queue (see ``benchmarks/_transfer_e2e.py``)."""
    try:
        from benchmarks._transfer_e2e import measure_rl_steps
    except ImportError:  # run as a script: its own directory is on sys.path
        from _transfer_e2e import measure_rl_steps

    shape = {
        "steps": args.e2e_steps,
        "prompts": args.e2e_prompts,
        "n": args.e2e_n,
        "max_new_tokens": args.e2e_tokens,
    }
    without = measure_rl_steps(False, **shape)
    with_queue = measure_rl_steps(True, **shape)
    for label, run in (("without", without), ("with", with_queue)):
        print(
            f"e2e {label} queue: step {run['step_s']:.2f} s, driver bytes/step "
            f"{run['driver_bytes']:.0f} (Ray {run['driver_ray_bytes']:.0f}, HTTP "
            f"{run['driver_http_bytes']:.0f})"
        )
    payload = with_queue["payload_bytes"]
    return {
        "payload_bytes_per_step": int(payload),
        "driver_bytes_per_step_with": int(with_queue["driver_bytes"]),
        "driver_bytes_per_step_without": int(without["driver_bytes"]),
        "driver_fraction_with": round(with_queue["driver_bytes"] / payload, 5),
        "step_s_with": round(with_queue["step_s"], 3),
        "step_s_without": round(without["step_s"], 3),
        "e2e_settings": shape,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; record and print the result (last stdout line) and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of each kind")
    parser.add_argument("--warmup", type=int, default=15, help="untimed rounds of each kind")
    parser.add_argument(
        "--object-store-mb", type=int, default=256, help="Ray object store size (pre-faulted)"
    )
    parser.add_argument("--units", type=int, default=2, help="storage units of the queue")
    parser.add_argument("--e2e-prompts", type=int, default=32, help="prompts per RL step")
    parser.add_argument("--e2e-n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--e2e-tokens", type=int, default=256, help="max new tokens per response")
    parser.add_argument("--e2e-steps", type=int, default=2, help="timed RL steps per mode")
    parser.add_argument("--skip-e2e", action="store_true", help="micro part only")
    args = parser.parse_args(argv)
    # Read by the raylet at start: fault the whole store in once, so that no round pays for
    # first-touching fresh store pages (see the module docstring).
    os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        configure_logging=False,
        object_store_memory=args.object_store_mb * 2**20,
    )
    result: dict[str, Any] = {"name": "transfer_queue"}
    try:
        queue = make_transfer_queue("ray", num_storage_units=args.units)
        try:
            micro = run_micro(queue, args.samples, args.seq_len, args.rounds, args.warmup)
        finally:
            queue.close()
        result["micro_payload_bytes"] = micro.pop("payload_bytes_per_step")
        result.update(micro)
        if not args.skip_e2e:
            result.update(run_e2e(args))
    finally:
        ray.shutdown()
        sweep_segments(wait_s=5.0)  # Ray kills its workers without their exit handlers
    # "ratio" is put/get over plain Ray (> 1 = the queue is faster); keep it the last key.
    result["ratio"] = result.pop("ratio")
    report(result)
    return result


if __name__ == "__main__":
    main()
