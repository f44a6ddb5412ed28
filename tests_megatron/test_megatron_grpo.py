"""GRPO end to end with ``actor.engine_backend=megatron`` on CPU, and an exact resume.

A random-init tiny model on the demo's arithmetic prompts, rewarded for short answers (a signal
it can follow from the start); 4 steps straight vs 2 steps, a checkpoint, and a resumed run to
4: steps 3 and 4 must log the same numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs polyrl[megatron] (make test-megatron)")

REPO = Path(__file__).resolve().parents[1]


def _train(tmp_path: Path, out: str, steps: int, *extra: str) -> dict[int, dict]:
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return -len(solution_str) / 50.0\n"
    )
    args = [
        "actor.engine_backend=megatron",
        f"trainer.total_steps={steps}",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
        f"trainer.output_dir={tmp_path / out}",
        "data.num_train=128",
        "data.train_batch_size=8",
        "rollout.n=4",
        f"reward.custom_function={reward}:compute_score",
        "actor.use_kl_loss=false",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_COMPILE_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "demo", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").open()]
    return {r["step"]: r for r in rows if "critic/score/mean" in r}


def test_grpo_runs_and_resumes_exactly(tmp_path):
    straight = _train(tmp_path, "a", 4)
    assert sorted(straight) == [1, 2, 3, 4]
    assert all(r["actor/grad_norm"] > 0 for r in straight.values())
    _train(tmp_path, "b", 2)
    resumed = _train(tmp_path, "b", 4, "trainer.resume=true")
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/grad_norm", "actor/entropy", "actor/pg_loss"):
            assert resumed[step][key] == straight[step][key], (step, key)
    assert (tmp_path / "a" / "hf_model" / "config.json").is_file()
