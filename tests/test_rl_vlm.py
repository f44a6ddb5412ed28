"""Vision-language RL end to end: GRPO on image rows, resume, TRL's VLM script, bad images."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from polyrl.config import load_config
from polyrl.trainer.rl import RLTrainer

REPO = Path(__file__).resolve().parents[1]


def _overrides(tmp_path: Path, name: str, model: Path, *extra: str) -> list[str]:
    # A random-init model never counts right: score shorter answers, so every group has a
    # spread of rewards and every step a gradient.
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return -len(solution_str) / 10.0\n"
    )
    return [
        f"model.path={model}",
        f"reward.custom_function={reward}:compute_score",
        f"trainer.output_dir={tmp_path / name}",
        "data.num_train=32",
        "data.num_val=8",
        "data.train_batch_size=4",
        "data.val_batch_size=8",
        "rollout.n=4",
        "trainer.loggers=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "trainer.worker_backend=local",
        "reward.num_workers=1",
        *extra,
    ]


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {
            k: v
            for k, v in r.items()
            if not k.startswith(("timing_s/", "perf/throughput")) and k != "time"
        }
        for r in rows
        if "critic/score/mean" in r
    }


@pytest.mark.slow
def test_vlm_grpo_trains_on_images_and_resumes_exactly(tmp_path, tiny_vl_dir):
    common = ["trainer.save_freq=2", "actor.optim.lr=0.003"]
    full = load_config("grpo_vlm", _overrides(tmp_path, "full", tiny_vl_dir, *common))
    full.trainer.total_steps = 3
    RLTrainer(full).fit()
    # The same run stopped after its step-2 checkpoint, then relaunched with resume_mode=auto.
    part = load_config("grpo_vlm", _overrides(tmp_path, "part", tiny_vl_dir, *common))
    part.trainer.total_steps = 2
    RLTrainer(part).fit()
    again = load_config(
        "grpo_vlm",
        _overrides(tmp_path, "part", tiny_vl_dir, *common, "trainer.resume_mode=auto"),
    )
    again.trainer.total_steps = 3
    summary = RLTrainer(again).fit()
    assert summary["resumed_from"] is not None
    a, b = _records(tmp_path / "full"), _records(tmp_path / "part")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        # The server's own log-probs depend (in the last bits) on how it batched requests.
        gap_a = a[step].pop("rollout/log_prob_gap", 0.0)
        gap_b = b[step].pop("rollout/log_prob_gap", 0.0)
        assert gap_a == pytest.approx(gap_b, abs=1e-6)
        assert a[step] == b[step], step
    # The images were in context: the policy's updates moved the vision tower too. (The tiny
    # model is saved in the hub's layout, the export in the in-memory one: load both.)
    from polyrl.models.loader import load_causal_lm

    start = dict(load_causal_lm(tiny_vl_dir).named_parameters())
    trained = dict(load_causal_lm(tmp_path / "full" / "hf_model").named_parameters())
    visual = [k for k in start if ".visual." in k]
    assert visual and any(not start[k].equal(trained[k]) for k in visual)


def _png(color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (56, 56), color)


@pytest.mark.slow
def test_trls_vlm_grpo_script_shape_trains(tmp_path, tiny_vl_dir):
    from datasets import Dataset

    from polyrl import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

    colors = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}
    names = list(colors) * 4
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": "What colour is this?"},
                        ],
                    }
                ]
                for _ in names
            ],
            "image": [_png(colors[n]) for n in names],
            "answer": names,
        }
    )
    seen: list[int] = []

    def says_the_colour(completions, answer, **kwargs):
        seen.append(len(completions))
        return [
            1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer, strict=True)
        ]

    args = GRPOConfig(
        output_dir=str(tmp_path / "vlm-grpo"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model=str(tiny_vl_dir), reward_funcs=says_the_colour, args=args, train_dataset=dataset
    )
    summary = trainer.train()
    assert summary["steps"] == 1 and seen == [8]


@pytest.mark.slow
def test_a_corrupt_image_in_a_training_row_fails_at_load_naming_the_row(tmp_path, tiny_vl_dir):
    from polyrl.data.io import write_rows
    from polyrl.data.tasks import write_task_splits

    train, test = write_task_splits("visual_count", tmp_path / "data", 6, 2, seed=0)
    from polyrl.data.io import read_rows

    rows = read_rows(train)
    buf = io.BytesIO()
    _png((1, 2, 3)).save(buf, format="PNG")
    rows[3]["images"] = [{"bytes": buf.getvalue()[:40]}]  # cut short: corrupt
    write_rows(rows, train)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.cli",
            "train",
            "grpo_vlm",
            f"model.path={tiny_vl_dir}",
            "data.task=",
            f"data.train_files=[{train}]",
            f"data.val_files=[{test}]",
            f"trainer.output_dir={tmp_path / 'out'}",
            "data.truncation=error",
            "trainer.device=cpu",
            "trainer.worker_backend=local",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("polyrl: error:") and "row 3" in last and "image" in last, last
    assert "Traceback" not in proc.stderr


def test_a_text_critic_of_a_frozen_vlm_policy_is_not_asked_to_freeze(tiny_vl_dir, tiny_qwen2_dir):
    from polyrl.model_engine import ModelSpec
    from polyrl.trainer.rl.build import _vision_freeze

    policy = ModelSpec(path=str(tiny_vl_dir), freeze_vision_tower=True)
    assert _vision_freeze(policy, str(tiny_vl_dir)) == {"freeze_vision_tower": True}
    # A text-only critic, reward model or teacher has no vision tower: its engine would refuse.
    assert _vision_freeze(policy, str(tiny_qwen2_dir)) == {"freeze_vision_tower": False}


@pytest.mark.slow
def test_a_smolvlm_grpo_step_trains_on_images(tmp_path, tiny_smolvlm_dir):
    # The second family end to end: data loader, rollout server, engine, one GRPO step.
    # An image fills 2 x 2 tiles plus the global view: 20 image tokens and their markers.
    extra = "data.max_prompt_length=64"
    cfg = load_config("grpo_vlm", _overrides(tmp_path, "smol", tiny_smolvlm_dir, extra))
    cfg.trainer.total_steps = 1
    cfg.data.num_train = 4
    RLTrainer(cfg).fit()
    record = _records(tmp_path / "smol")[1]
    assert record["critic/score/mean"] < 0 and record["actor/grad_norm"] > 0
    from polyrl.models.loader import load_causal_lm

    start = dict(load_causal_lm(tiny_smolvlm_dir).named_parameters())
    trained = dict(load_causal_lm(tmp_path / "smol" / "hf_model").named_parameters())
    tower = [k for k in start if k.startswith(("model.vision_model.", "model.connector."))]
    # The images were in context: the update moved the vision tower too.
    assert tower and any(not start[k].equal(trained[k]) for k in tower)
