"""The `make demo` job, run for real in a subprocess with a smaller config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_job_runs_sft_then_grpo_and_evaluates_both(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.demo",
            "demo",
            f"trainer.output_dir={out}",
            "data.num_val=16",
            "sft.total_steps=10",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "rollout.n=4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(last) == {"name", "seconds", "sft_accuracy", "rl_accuracy", "plot"}
    assert last["name"] == "demo" and last["seconds"] > 0
    for key in ("sft_accuracy", "rl_accuracy"):
        assert 0.0 <= last[key] <= 1.0
    assert Path(last["plot"]).stat().st_size > 1000
    detail = json.loads((out / "demo_summary.json").read_text())
    assert (detail["sft_steps"], detail["rl_steps"]) == (10, 2)
    assert "held-out accuracy" in proc.stdout and "sft+grpo" in proc.stdout
    # The RL phase really trained and pushed weights: its records show updates and versions.
    records = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["rollout/weight_version"] for r in steps] == [0, 1]
