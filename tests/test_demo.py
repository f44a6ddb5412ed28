"""The `make demo` job, run for real in a subprocess with a smaller config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_job_serves_scores_trains_and_updates_the_server(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.demo",
            "demo",
            f"trainer.output_dir={out}",
            "data.val_batch_size=8",
            "rollout.n=2",
            "trainer.total_steps=40",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["prompts"] == 8
    assert summary["samples_per_prompt"] == 2
    # The server really switched to the SFT weights, and SFT really learned something.
    assert summary["before"]["weight_version"] == 0
    assert summary["after"]["weight_version"] == 1
    assert summary["val_loss_last"] < summary["val_loss_first"] - 1.0
    for phase in ("before", "after"):
        assert 0.0 <= summary[phase]["score_mean"] <= 1.0
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert "[demo] summary:" in proc.stdout
