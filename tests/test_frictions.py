"""Small frictions a new user met (issue 24, item 7): each fails fast and says what to do."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from polyrl.config import ConfigError, available_presets, load_config
from polyrl.trainer.rl.checks import check_config


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
    from polyrl.trainer.common import check_devices

    cfg = load_config("grpo", ["trainer.device=cpu", "rollout.device=cpu"])
    check_devices(cfg, ("trainer.device", "rollout.device"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"rollout\.device"):
            check_devices(load_config("grpo", ["rollout.device=cuda"]), ("rollout.device",))


def _wait_for(path, pattern: str, proc, timeout_s: float = 120.0) -> re.Match:
    """Wait until the log file ``path`` of ``proc`` has a line matching ``pattern``."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text, re.MULTILINE)
        if found:
            return found
        assert proc.poll() is None, text
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


def test_serve_says_where_and_the_proxy_finds_the_tokenizer_there(tiny_qwen2_dir, tmp_path):
    import httpx

    server_log, proxy_log = tmp_path / "serve.log", tmp_path / "proxy.log"
    served_name = "tiny-policy"  # a name, not a path: the proxy must use the reported root
    with open(server_log, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "polyrl.cli", "serve", str(tiny_qwen2_dir), "--port", "0"]
            + ["--threads", "1", "--kv-cache-tokens", "2048", "--served-model-name", served_name],
            stdout=log,
            stderr=log,
            cwd=tmp_path,
        )
    proxy = None
    try:
        ready = _wait_for(server_log, r"^serving (.+) at (http://127\.0\.0\.1:\d+)$", server)
        assert ready.group(1) == str(tiny_qwen2_dir)
        url = ready.group(2)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        (card,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert card["id"] == served_name and card["root"] == str(tiny_qwen2_dir)
        with open(proxy_log, "w") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "polyrl.cli", "agent-proxy", "--rollout", url]
                + ["--port", "0", "--ready-file", str(tmp_path / "proxy.json")],
                stdout=log,
                stderr=log,
                cwd=tmp_path,
            )
        deadline = time.monotonic() + 60
        while not (tmp_path / "proxy.json").exists():  # up without --tokenizer
            assert proxy.poll() is None, proxy_log.read_text()
            assert time.monotonic() < deadline, proxy_log.read_text()
            time.sleep(0.1)
    finally:
        for proc in (proxy, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    lines = [line for line in server_log.read_text().splitlines() if line.startswith("serving")]
    assert len(lines) == 1


def test_the_proxy_says_when_the_served_model_is_not_a_directory_here(monkeypatch, tmp_path):
    import httpx

    from polyrl.agent.proxy import tokenizer_dir_from_server

    cards = [{"id": "remote-model", "root": "/nowhere/on/this/host"}]

    def fake_get(url, headers=None, timeout=None):
        return httpx.Response(200, json={"data": cards}, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", fake_get)
    with pytest.raises(ValueError, match=r"serves 'remote-model' from '/nowhere/on/this/host'"):
        tokenizer_dir_from_server("http://127.0.0.1:1")
    cards[0]["root"] = str(tmp_path)
    assert tokenizer_dir_from_server("http://127.0.0.1:1") == str(tmp_path)
    cards[0] = {"id": str(tmp_path)}  # a server without root that names its directory
    assert tokenizer_dir_from_server("http://127.0.0.1:1") == str(tmp_path)


def test_polyrl_starts_its_own_ray_unless_given_an_address():
    from polyrl.trainer.common import ray_init_options

    # "local": a new Ray even where `ray start` left a cluster running on this machine (plain
    # ray.init() joins it, then refuses num_cpus).
    own = ray_init_options(load_config("grpo", ["ray.num_cpus=3"]))
    assert own["address"] == "local" and own["num_cpus"] == 3
    joined = ray_init_options(load_config("grpo", ["ray.address=auto", "ray.num_cpus=3"]))
    assert joined["address"] == "auto" and "num_cpus" not in joined
