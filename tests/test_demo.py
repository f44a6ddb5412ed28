"""The `make demo` job, run for real in a subprocess with a smaller config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_job_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.demo",
            "demo",
            f"trainer.output_dir={out}",
            "data.val_batch_size=4",
            "rollout.n=2",
            "data.task=countdown",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["prompts"] == 4
    assert summary["samples_per_prompt"] == 2
    assert 0.0 <= summary["score_mean"] <= 1.0
    assert summary["reward_errors"] == 0
    assert (out / "data" / "test.parquet").exists()
    assert "[demo] summary:" in proc.stdout
