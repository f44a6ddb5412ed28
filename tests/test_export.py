"""A model comes out: every RL and SFT run ends with a Hugging Face directory, and `polyrl export`
turns any saved checkpoint into one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from polyrl import cli
from polyrl.config import load_config
from polyrl.core.batch import Batch
from polyrl.model_engine import CheckpointConfig, EngineConfig, ModelSpec, build_engine
from polyrl.model_engine import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["12+7=19", "hello world", "a", "The quick brown fox jumps over 13 lazy dogs."]
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 50.0
"""


# ------------------------------------------------------------------------------ helpers
def _inputs(tokenizer) -> dict[str, torch.Tensor]:
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    am = enc["attention_mask"]
    return {
        "input_ids": enc["input_ids"],
        "attention_mask": am,
        "position_ids": (am.cumsum(1) - 1).clamp(min=0),
    }


def _hf_logits(model_dir: str | Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of the directory loaded by plain transformers, on TEXTS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = _inputs(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**inputs).logits, inputs


def _checkpoint_logits(base: Path, step_dir: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the checkpoint loaded through polyrl's own engine (not through the export)."""
    engine = build_engine(
        ModelSpec(path=str(base)),
        EngineConfig(device="cpu", dynamic_batching=False),
        checkpoint=CheckpointConfig(load_optimizer=False),
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the schedule differs; only the weights matter
            engine.load_checkpoint(step_dir)
        out = engine.infer_batch(Batch(tensors=dict(inputs)), lambda o, b: {"logits": o.logits})
        return out["logits"]
    finally:
        engine.close()


def _check_run_export(out: Path, summary: dict, summary_file: str, base: Path) -> None:
    """The run's hf_model: files, architectures, and the final checkpoint's logits."""
    hf_dir = out / "hf_model"
    assert summary["hf_model"] == str(hf_dir)
    assert json.loads((out / summary_file).read_text())["hf_model"] == str(hf_dir)
    names = set(os.listdir(hf_dir))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names, names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names, names
    source = json.loads((base / "config.json").read_text())["architectures"]
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == source
    assert source == ["Qwen2ForCausalLM"]
    logits, inputs = _hf_logits(hf_dir)
    expected = _checkpoint_logits(base, summary["checkpoint"], inputs)
    am = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits[am], expected[am], atol=1e-5, rtol=1e-5)
    # The run trained: its model is not the one it started from.
    assert not torch.allclose(_hf_logits(base)[0][am], logits[am], atol=1e-4)


def _export_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "export", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_cli_export(source: Path, run_hf: Path, out: Path) -> None:
    """`polyrl export SOURCE OUT` in a subprocess equals the run's own export."""
    from safetensors.torch import load_file

    proc = _export_cli(str(source), str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith(f"to {out}"), proc.stdout
    assert sorted(os.listdir(out)) == sorted(os.listdir(run_hf))
    ours, theirs = load_file(out / "model.safetensors"), load_file(run_hf / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (run_hf / "config.json").read_text()
    )
    logits, inputs = _hf_logits(out)
    am = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits[am], _hf_logits(run_hf)[0][am], atol=0, rtol=0)


# ------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """A 2-step GRPO run on the nano model (local engines), checkpoints at steps 1 and 2."""
    from polyrl.trainer.rl import RLTrainer

    tmp = tmp_path_factory.mktemp("rl_export")
    reward = tmp / "reward.py"
    reward.write_text(REWARD)
    out = tmp / "run"
    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={out}",
            f"reward.custom_function={reward}:compute_score",
            "model.tiny_size=nano",
            "data.num_train=32",
            "data.num_val=8",
            "data.train_batch_size=8",
            "rollout.n=4",
            "rollout.max_new_tokens=8",
            "data.max_response_length=8",
            "actor.lr=0.01",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.worker_backend=local",
            "trainer.total_steps=2",
            "trainer.save_freq=1",
            "reward.num_workers=1",
        ],
    )
    assert cfg.trainer.export_hf  # on by default
    return out, RLTrainer(cfg).fit()


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A 2-step SFT run on the nano model, checkpoints at steps 1 and 2."""
    from polyrl.trainer.sft import run_sft

    out = tmp_path_factory.mktemp("sft_export") / "run"
    cfg = load_config(
        "sft_demo",
        [
            f"trainer.output_dir={out}",
            "data.num_train=32",
            "data.num_val=8",
            "trainer.total_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.loggers=[jsonl]",
            "sft.lr=0.01",
        ],
    )
    return out, run_sft(cfg)


@pytest.mark.slow
def test_rl_run_ends_with_the_policy_as_a_hugging_face_model(rl_run):
    out, summary = rl_run
    assert summary["checkpoint"] == str(out / "checkpoints" / "actor" / "global_step_2")
    _check_run_export(out, summary, "rl_summary.json", out / "model")


@pytest.mark.slow
def test_sft_run_ends_with_a_hugging_face_model(sft_run):
    out, summary = sft_run
    assert summary["checkpoint"] == str(out / "checkpoints" / "global_step_2")
    _check_run_export(out, summary, "sft_summary.json", out / "model")


@pytest.mark.slow
def test_polyrl_export_of_an_rl_run_gives_the_runs_model(rl_run, tmp_path):
    out, _ = rl_run
    # The run's output directory: the newest actor checkpoint is taken.
    _check_cli_export(out, out / "hf_model", tmp_path / "from_rl")


@pytest.mark.slow
def test_polyrl_export_of_an_sft_checkpoint_gives_the_runs_model(sft_run, tmp_path):
    out, _ = sft_run
    step = out / "checkpoints" / "global_step_2"
    _check_cli_export(step, out / "hf_model", tmp_path / "from_sft")
    # An older step exports too, with other weights; a bad input is one line and exit 2.
    older = _export_cli(str(out / "checkpoints" / "global_step_1"), str(tmp_path / "step1"))
    assert older.returncode == 0, older.stderr[-2000:]
    from safetensors.torch import load_file

    first = load_file(tmp_path / "step1" / "model.safetensors")
    last = load_file(tmp_path / "from_sft" / "model.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)
    bad = _export_cli(str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"polyrl: error: checkpoint path {str(tmp_path / 'nothing')!r} does not exist"
    ]


# ------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def saved(tiny_qwen2_dir, tmp_path_factory):
    """An actor checkpoint and a critic (value model) checkpoint of the nano model."""
    root = tmp_path_factory.mktemp("saved")
    paths = {}
    for kind in ("causal_lm", "value"):
        engine = build_engine(ModelSpec(path=str(tiny_qwen2_dir), kind=kind))
        try:
            paths[kind] = Path(engine.save_checkpoint(str(root / kind), 3, {}))
        finally:
            engine.close()
    return paths


def _error(capsys, *args: str) -> str:
    code = cli.main(["export", *args])
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polyrl: error: "), captured.err
    assert captured.out == ""
    return lines[0]


def test_polyrl_export_bad_inputs_are_one_line_errors(saved, tiny_qwen2_dir, tmp_path, capsys):
    good = saved["causal_lm"]
    out = str(tmp_path / "out")
    assert "does not exist" in _error(capsys, str(tmp_path / "missing"), out)
    assert "is not a checkpoint" in _error(capsys, str(tiny_qwen2_dir), out)
    incomplete = tmp_path / "global_step_5"
    shutil.copytree(good, incomplete)
    (incomplete / ckpt.COMPLETE_MARKER).unlink()
    assert "not a complete checkpoint" in _error(capsys, str(incomplete), out)
    assert "critic" in _error(capsys, str(saved["value"]), out)
    assert "unknown dtype" in _error(capsys, str(good), out, "--dtype", "int9")
    assert "no config.json" in _error(capsys, str(good), out, "--model", str(tmp_path))

    def broken(name: str, damage) -> str:
        copy = tmp_path / name / "global_step_3"
        shutil.copytree(good, copy)
        damage(copy)
        return _error(capsys, str(copy), out)

    def garble(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:50])

    assert "engine_state.pt" in broken("state", lambda d: garble(d / "engine_state.pt"))
    msg = broken("shards", lambda d: [garble(p) for p in (d / "dcp").glob("*.distcp")])
    assert "cannot load the weights" in msg
    assert "dcp/.metadata" in broken("meta", lambda d: (d / "dcp" / ".metadata").unlink())
    moved = tmp_path / "moved" / "global_step_3"
    shutil.copytree(good, moved)
    configs = json.loads((moved / "configs.json").read_text())
    configs["model"]["path"] = str(tmp_path / "gone")
    (moved / "configs.json").write_text(json.dumps(configs))
    assert "pass --model DIR" in _error(capsys, str(moved), out)
    assert cli.main(["export", str(moved), out, "--model", str(tiny_qwen2_dir)]) == 0
    assert f"to {out}" in capsys.readouterr().out

    # The output: never clobbers anything that is not a model, nor the base model itself.
    assert "--overwrite" in _error(capsys, str(good), out)
    assert cli.main(["export", str(good), out, "--overwrite"]) == 0
    capsys.readouterr()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert "not a model directory" in _error(
        capsys, str(good), str(tmp_path / "notes"), "--overwrite"
    )
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"
    assert "base model" in _error(capsys, str(good), str(tiny_qwen2_dir), "--overwrite")


@pytest.mark.slow
def test_polyrl_export_reshards_a_two_rank_checkpoint(tmp_path, capsys):
    from safetensors.torch import load_file

    from polyrl.trainer.sft import run_sft

    out = tmp_path / "dp2"
    cfg = load_config(
        "sft_demo",
        [
            f"trainer.output_dir={out}",
            "trainer.n_gpus_per_node=2",
            "trainer.worker_backend=local",
            "data.num_train=32",
            "data.num_val=8",
            "trainer.total_steps=1",
            "trainer.save_freq=1",
            "trainer.test_freq=0",
            "trainer.loggers=[jsonl]",
            "sft.lr=0.01",
        ],
    )
    summary = run_sft(cfg)
    assert (
        json.loads((Path(summary["checkpoint"]) / ckpt.COMPLETE_MARKER).read_text())["world_size"]
        == 2
    )
    assert cli.main(["export", str(out / "checkpoints"), str(tmp_path / "one_rank")]) == 0
    ours = load_file(tmp_path / "one_rank" / "model.safetensors")
    theirs = load_file(out / "hf_model" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
