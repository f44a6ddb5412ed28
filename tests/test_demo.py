"""The `make demo` job, run for real in a subprocess with a smaller config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["sft.total_steps=10", "trainer.total_steps=2", "trainer.test_freq=0", "rollout.n=4"]


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
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(last) == {
        "name",
        "seconds",
        "sft_accuracy",
        "rl_accuracy",
        "sft_sampled_accuracy",
        "rl_sampled_accuracy",
        "plot",
    }
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
    # ... and the replica says what reached it: tensors written into its shared arena.
    assert all(r["perf/weight_sync_received_shm_direct"] > 0 for r in steps)
    # A finished warm-up is kept with what it was trained with: a rerun of the same job (the
    # GPU check's GRPO runs share one) reuses it, another job does not.
    from polyrl.config import load_config
    from polyrl.demo import finished_sft, sft_key

    cfg = load_config("demo", [f"trainer.output_dir={out}", "data.num_val=16", *SMALL])
    assert finished_sft(out / "sft", sft_key(cfg))["steps"] == 10
    other = load_config(
        "demo", [f"trainer.output_dir={out}", "data.num_val=16", "sft.total_steps=11"]
    )
    assert finished_sft(out / "sft", sft_key(other)) is None


@pytest.mark.slow
def test_vlm_demo_runs_with_images_end_to_end(tmp_path):
    out = tmp_path / "demo_vlm"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.demo",
            "demo_vlm",
            f"trainer.output_dir={out}",
            "data.num_train=64",
            "data.num_val=8",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["name"] == "demo_vlm"
    for key in ("sft_accuracy", "rl_accuracy", "sft_sampled_accuracy", "rl_sampled_accuracy"):
        assert 0.0 <= last[key] <= 1.0
    assert "visual_count" in proc.stdout
    records = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/weight_version"] for r in records if "actor/pg_loss" in r] == [0, 1]


def test_the_demo_entry_refuses_bad_input_in_one_line(capsys):
    from polyrl.demo import main

    assert main(["--help"]) == 0
    assert "usage: python -m polyrl.demo" in capsys.readouterr().out
    assert main(["no_such_preset"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown preset 'no_such_preset'" in err[0]
    assert main(["demo", "rollout.n=zero"]) == 2
    assert "rollout.n" in capsys.readouterr().err
