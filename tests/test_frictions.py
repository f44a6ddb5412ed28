"""Small frictions a new user met (issue 24, item 7): each fails fast and says what to do."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from polyrl.config import ConfigError, available_presets, load_config
from polyrl.trainer.rl.build import check_config


def test_every_algorithm_named_in_the_train_help_has_a_preset():
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = re.search(r"RL training \(([^)]*)\)", " ".join(out.split()))
    assert listed, out
    names = {"REINFORCE++": "reinforce_plus_plus"}
    for algorithm in (a.strip() for a in listed.group(1).split(",")):
        preset = names.get(algorithm, algorithm.lower())
        assert preset in available_presets(), algorithm
        cfg = load_config(preset, ["trainer.device=cpu"])
        check_config(cfg)
        expected = {"ppo": "gae"}.get(preset, preset)
        assert cfg.algorithm.adv_estimator == expected, preset


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
@pytest.mark.parametrize("key", ["trainer.device", "rollout.device"])
def test_cuda_on_a_machine_without_cuda_fails_at_once(key, tmp_path):
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.cli",
            "train",
            "grpo",
            f"{key}=cuda",
            f"trainer.output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "no CUDA device" in lines[0], proc.stderr
    # Fails before Ray, replicas or engines start (it used to wait 75 s for Ray's GPUs).
    assert time.perf_counter() - started < 20
    assert not (tmp_path / "rl_config.yaml").exists()


def test_a_missing_tracker_package_is_reported_before_anything_starts(monkeypatch, tmp_path):
    import importlib.util

    from polyrl.trainer.tracking import TrackerUnavailableError, check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(TrackerUnavailableError, match=r"'wandb'.*pip install -e '.*\[tracking\]'"):
        check_trackers(["console", "wandb"])
    cfg = load_config("grpo", ["trainer.device=cpu", "trainer.loggers=[console,wandb]"])
    with pytest.raises(TrackerUnavailableError):
        check_config(cfg)
    check_trackers(["console", "jsonl"])  # no package needed


def test_device_check_names_the_option():
    from polyrl.trainer.sft import check_devices

    cfg = load_config("grpo", ["trainer.device=cpu", "rollout.device=cpu"])
    check_devices(cfg, ("trainer.device", "rollout.device"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"rollout\.device"):
            check_devices(load_config("grpo", ["rollout.device=cuda"]), ("rollout.device",))
