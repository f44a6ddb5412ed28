"""A short colocated GRPO run on one GPU with the local worker backend: the reward rises.

It is the ``make demo`` job (polyrl/demo.py, preset ``demo``: a nano Qwen2 learns 2-digit
addition, SFT warm-up then GRPO, rewards from the rule-based arithmetic scorer) with the
trainer, its engines and the rollout replica on the GPU, the replica serving in bfloat16 and
sharing the trainer's GPU (``rollout.placement=hybrid``, weights pushed every step by the
transport ``auto`` picks). It runs as a subprocess so its process group, CUDA context and
children start and end with it. Both runs start from one SFT warm-up (the demo reuses a
finished one it finds in its output directory): the first run's, kept in
``outputs/gpu_check/demo_sft`` so that a later device call reuses it too.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The SFT warm-up both runs share (the engines train on CUDA in both, so it is the same job).
SHARED_SFT = Path(os.environ.get("POLYRL_GPU_SFT_DIR", REPO / "outputs" / "gpu_check" / "demo_sft"))
GPU_OVERRIDES = [
    "trainer.device=cuda",
    "trainer.worker_backend=local",
    "rollout.device=cuda",
    "rollout.placement=hybrid",
    "rollout.dtype=bfloat16",
    "rollout.weight_transport=auto",
]
RL_STEPS = 150  # the demo preset's length: its CPU runs raise the batch reward ~0.25 -> ~0.37
WINDOW = 30  # steps averaged at each end (a step's batch mean moves by ~0.05 on its own)


def run_demo(out: Path, overrides: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m polyrl.demo demo`` with ``overrides``; its output lands in ``out``.

    The shared SFT warm-up is copied in first when there is one (the demo checks it was
    trained as this run would train it, else trains its own); a run that trained its own
    leaves it there for the next.
    """
    if (SHARED_SFT / "sft_summary.json").is_file():
        shutil.copytree(SHARED_SFT, out / "sft")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
    }
    command = [
        sys.executable,
        "-m",
        "polyrl.demo",
        "demo",
        f"trainer.output_dir={out}",
        "trainer.test_freq=0",  # no mid-run validation: the held-out eval at the end suffices
        "trainer.val_before_train=false",
        *overrides,
    ]
    proc = subprocess.run(
        command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode == 0 and not (SHARED_SFT / "sft_summary.json").is_file():
        shutil.copytree(out / "sft", SHARED_SFT, dirs_exist_ok=True)
    return proc


def rl_scores(out: Path) -> list[dict]:
    """The RL phase's per-step records that carry a batch reward."""
    lines = (out / "rl" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def test_colocated_grpo_on_one_gpu_raises_the_reward(tmp_path):
    out = tmp_path / "demo"
    proc = run_demo(out, GPU_OVERRIDES + [f"trainer.total_steps={RL_STEPS}"], timeout=560)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    records = rl_scores(out)
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    # auto picks CUDA IPC (the replica shares the trainer's GPU): the replica's own count of
    # what reached it, every step, and nothing by another way.
    for r in records:
        assert r["perf/weight_sync_received_cuda_ipc"] > 0, r
        assert not [k for k in r if k.startswith("perf/weight_sync_received_") and "cuda" not in k]
    # Sleeping freed GPU memory for training: the replica measured it (memory_allocated before
    # and after its sleep), every step.
    freed = [r["rollout/sleep_freed_bytes"] for r in records]
    assert min(freed) > 0, freed
    # New weights reached the replica every step: step k generated with version k - 1.
    assert records[-1]["rollout/weight_version"] == RL_STEPS - 1
    scores = [r["critic/score/mean"] for r in records]
    first = statistics.mean(scores[:WINDOW])
    last = statistics.mean(scores[-WINDOW:])
    print(
        f"batch reward: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}; {summary}"
    )
    assert last > first + 0.03, scores


def test_async_grpo_with_a_cuda_engine_raises_the_reward_within_the_staleness_bound(tmp_path):
    """``trainer.mode=async`` with the engines on the GPU and the replica on the CPU.

    One GPU cannot hold a replica of its own beside the engines (``rollout.placement=separate``
    takes GPUs after the engines'; hybrid sleeps during training, which the overlapped modes
    refuse), so the replica serves on the host: the engine's CUDA weights reach it over shared
    memory while it keeps generating ahead.
    """
    out = tmp_path / "demo"
    staleness = 2
    overrides = [
        "trainer.device=cuda",
        "trainer.worker_backend=local",
        "rollout.device=cpu",
        "trainer.mode=async",
        f"async.max_staleness={staleness}",
        f"trainer.total_steps={RL_STEPS}",
    ]
    proc = run_demo(out, overrides, timeout=560)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    records = rl_scores(out)
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    groups = [json.loads(x) for x in (out / "rl" / "async_samples.jsonl").read_text().splitlines()]
    # Every trained sample is at most `staleness` actor updates behind the step that trains it.
    behind = [g["trainer_version"] - v for g in groups for v in g["first_versions"]]
    assert 1 <= max(behind) <= staleness and min(behind) >= 0, (min(behind), max(behind))
    # Every group reserved for the run (32 prompts a step) was trained exactly once.
    assert sorted(g["serial"] for g in groups) == list(range(RL_STEPS * 32))
    scores = [r["critic/score/mean"] for r in records]
    first = statistics.mean(scores[:WINDOW])
    last = statistics.mean(scores[-WINDOW:])
    print(f"async batch reward: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}")
    assert last > first + 0.03, scores
