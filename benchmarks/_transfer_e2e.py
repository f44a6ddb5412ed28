"""End-to-end half of ``benchmarks/transfer_queue.py``: GRPO steps with and without the queue.

The same RL workload runs twice on Ray (engine workers are Ray actors, one native rollout
server subprocess): once with the driver carrying the data (``transfer.enable=false``) and once
through the transfer queue. Around each timed step the driver's traffic is counted:

* Ray, both ways (:class:`~polyrl.controller.DriverTrafficMeter`: arguments and ``ray.put``
  it serialises, objects it deserialises, inline replies that land in its memory store);
* HTTP bodies its own rollout client sends and receives (generation requests and responses
  without the queue; only sleep/wake/weight-update control calls with it).

The payload of a step is what the queue's storage units held at the end of the step (every
field of every sample: tokens, masks, log-probs, values, advantages, per-row objects).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any


def measure_rl_steps(
    transfer: bool,
    steps: int = 3,
    prompts: int = 16,
    n: int = 8,
    max_new_tokens: int = 32,
    world_size: int = 2,
) -> dict[str, Any]:
    """Run one warm-up and ``steps`` timed GRPO steps; return per-step medians.

    Returns ``{"step_s", "driver_bytes", "driver_ray_bytes", "driver_http_bytes",
    "payload_bytes" (with the queue only), "metrics": last step's metrics}``.
    """
    import ray

    from polyrl.config import load_config
    from polyrl.controller import DriverTrafficMeter
    from polyrl.trainer.rl import RLTrainer

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, world_size), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="polyrl-transfer-bench-") as out:
        cfg = load_config(
            "demo",
            [
                f"trainer.output_dir={out}",
                f"trainer.total_steps={steps + 1}",
                "trainer.worker_backend=ray",
                f"trainer.n_gpus_per_node={world_size}",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "trainer.save_freq=0",
                "trainer.loggers=[jsonl]",
                f"data.train_batch_size={prompts}",
                f"rollout.n={n}",
                f"rollout.max_new_tokens={max_new_tokens}",
                f"data.max_response_length={max_new_tokens}",
                f"actor.ppo_mini_batch_size={prompts // 2}",  # two updates: old log-probs too
                "actor.use_kl_loss=true",  # reference log-probs too
                "reward.num_workers=1",
                f"transfer.enable={str(transfer).lower()}",
            ],
        )
        trainer = RLTrainer(cfg)
        times, ray_bytes, http_bytes, payloads = [], [], [], []
        metrics: dict[str, float] = {}
        try:
            trainer.setup()
            for step in range(1, steps + 2):
                client = trainer.producer.client
                http_before = client.bytes_sent + client.bytes_received
                meter = DriverTrafficMeter()
                tick = time.perf_counter()
                with meter:
                    metrics = trainer.step(step)
                elapsed = time.perf_counter() - tick
                if step == 1:
                    continue  # warm-up
                times.append(elapsed)
                ray_bytes.append(meter.both_ways_bytes)
                http_bytes.append(client.bytes_sent + client.bytes_received - http_before)
                if "transfer/storage_bytes" in metrics:
                    payloads.append(metrics["transfer/storage_bytes"])
        finally:
            trainer.close()
    result = {
        "step_s": statistics.median(times),
        "driver_ray_bytes": statistics.median(ray_bytes),
        "driver_http_bytes": statistics.median(http_bytes),
        "driver_bytes": statistics.median(
            r + h for r, h in zip(ray_bytes, http_bytes, strict=True)
        ),
        "metrics": metrics,
    }
    if payloads:
        result["payload_bytes"] = statistics.median(payloads)
    return result
