"""Process-level CPU settings: core shares and keeping freed host memory."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from polyrl.core.cpu import cores_per_process

# Trains a tiny model on CPU for a few steps and prints each step's minor page faults (each step
# allocates and frees tens of MiB of activations and logits); argv[1] is the engine's
# retain_freed_memory setting.
_PROBE = r"""
import json, resource, sys, tempfile
sys.path.insert(0, sys.argv[2])
import torch
from engine_common import make_batch, tiny_model
from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss
torch.set_num_threads(1)
model_dir = tiny_model(tempfile.mkdtemp(), hidden=64, intermediate=256)
engine = build_engine(
    model_dir,
    EngineConfig(device="cpu", retain_freed_memory=sys.argv[1] == "1"),
    OptimizerConfig(lr=1e-3),
)
batch = make_batch(32, 256, 1000, seed=0, min_len=200)
faults = []
for step in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.train_batch(batch, sft_loss)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults}))
engine.close()
"""


def _faults_per_step(retain: bool) -> float:
    """Median minor page faults of a training step after the first (which maps everything)."""
    scripts = Path(__file__).resolve().parent / "engine_scripts"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(int(retain)), str(scripts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["faults"][1:])


def test_cpu_engine_keeps_freed_memory_instead_of_faulting_it_back():
    # Without it, glibc hands the step's big tensors back to the OS and every page of them
    # faults (and is zeroed) again next step: ~20-40k faults. With it a step faults none, except
    # pages the kernel reclaimed meanwhile (this VM runs DAMON pageout: a few hundred at most).
    off, on = _faults_per_step(False), _faults_per_step(True)
    assert off > 5000, off
    assert on < 2000 and on < off / 10, (on, off)


def test_cores_per_process_divides_the_affinity_set():
    import os

    cores = len(os.sched_getaffinity(0))
    assert cores_per_process(1) == cores
    assert cores_per_process(cores * 4) == 1
    assert cores_per_process(0) == cores
