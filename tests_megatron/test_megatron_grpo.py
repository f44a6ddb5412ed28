"""GRPO end to end with ``actor.engine_backend=megatron`` on CPU, and an exact resume.

A random-init tiny model on the demo's arithmetic prompts, rewarded for short answers (a signal
it can follow from the start); 4 steps straight vs 2 steps, a checkpoint, and a resumed run to
4: steps 3 and 4 must log the same numbers.  At tensor-parallel size 2 (two ranks, one
data-parallel replica) the trainer's dispatch must hand both ranks the same rows: its first step
then matches the one-rank run's.  Whether GRPO raises the demo's own reward (accuracy after the
SFT warm-up) is measured by ``benchmarks/megatron_grpo.py``.
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


#: Extra options of each tensor-parallel size: TP 2 on two ranks is one data-parallel replica.
LAYOUTS = {
    1: (),
    2: ("actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"),
}


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
    # One torch thread per process: the two ranks and the rollout server share few cores.
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCH_COMPILE_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "demo", *args],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").open()]
    return {r["step"]: r for r in rows if "critic/score/mean" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``straight(tp)``: the 4-step run at tensor-parallel size ``tp`` (run once per module)."""
    runs: dict[int, tuple[Path, dict[int, dict]]] = {}

    def get(tp: int) -> tuple[Path, dict[int, dict]]:
        if tp not in runs:
            root = tmp_path_factory.mktemp(f"grpo_tp{tp}")
            runs[tp] = root, _train(root, "a", 4, *LAYOUTS[tp])
        return runs[tp]

    return get


# Three trainer runs of ~70 s each on an idle 2-core machine; the default 600 s is tight.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", sorted(LAYOUTS))
def test_grpo_runs_and_resumes_exactly(straight, tmp_path, tp):
    root, steps = straight(tp)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(r["actor/grad_norm"] > 0 for r in steps.values())
    _train(tmp_path, "b", 2, *LAYOUTS[tp])
    resumed = _train(tmp_path, "b", 4, "trainer.resume=true", *LAYOUTS[tp])
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/grad_norm", "actor/entropy", "actor/pg_loss"):
            assert resumed[step][key] == steps[step][key], (step, key)
    assert (root / "a" / "hf_model" / "config.json").is_file()


@pytest.mark.timeout(1800)
def test_tensor_parallel_ranks_train_on_the_same_rows(straight):
    # Same weights, same sampled answers at step 1: the TP 2 replica must see all 32 rows
    # (each rank its own half would give another gradient) and match one rank to rounding.
    one, two = straight(1)[1][1], straight(2)[1][1]
    assert two["critic/score/mean"] == one["critic/score/mean"]
    for key in ("actor/grad_norm", "actor/entropy", "actor/pg_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key


@pytest.mark.timeout(1800)
def test_expert_parallel_grpo_matches_one_rank(tmp_path):
    # EP ranks are data-parallel for the dense weights (their own rows); the MoE tokens travel
    # between them. One step of the two-rank EP 2 run must match the one-rank run's.
    moe = ("model.tiny_arch=qwen3_moe",)
    one = _train(tmp_path, "ep1", 1, *moe)[1]
    two = _train(
        tmp_path,
        "ep2",
        1,
        *moe,
        "actor.megatron.expert_model_parallel_size=2",
        "trainer.n_gpus_per_node=2",
    )[1]
    assert two["critic/score/mean"] == one["critic/score/mean"]
    for key in ("actor/grad_norm", "actor/entropy", "actor/pg_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
