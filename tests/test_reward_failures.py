"""No silent reward failure: too many failed samples stop the run, hung scorers cost one timeout.

Unit tests drive :class:`~polyrl.reward.RewardManager` directly; the end-to-end ones run a
short GRPO job (local backend, nano model) through ``python -m polyrl.cli`` or the trainer.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.config import load_config
from polyrl.reward import RewardFailureError, RewardManager

REPO = Path(__file__).resolve().parents[1]

REWARDS = {
    "raise": """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("scorer broke on purpose")
""",
    "string": """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return "not a number"
""",
    "hang": """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(1000)
""",
    # Fails on every fourth call, well under the default limit of 0.5.
    "some": """
import itertools

_calls = itertools.count()

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if next(_calls) % 4 == 0:
        raise ValueError("one in four fails")
    return -len(solution_str) / 50.0
""",
}


def reward_file(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"reward_{kind}.py"
    path.write_text(REWARDS[kind])
    return f"{path}:compute_score"


# ------------------------------------------------------------------------------ the manager
@pytest.mark.parametrize("kind", ["raise", "string"])
def test_too_many_failures_raise_one_line_naming_the_first(tmp_path, kind):
    samples = [{"response": "x", "data_source": "my_source"} for _ in range(6)]
    with RewardManager(
        reward_file(tmp_path, kind), num_workers=1, max_failure_fraction=0.5
    ) as manager:
        with pytest.raises(RewardFailureError) as info:
            manager.score_samples(samples)
    err = info.value
    message = str(err)
    assert "\n" not in message
    assert "6 of 6 samples (100%" in message
    assert "max_failure_fraction=0.5" in message
    assert "data_source 'my_source'" in message
    if kind == "raise":
        assert "6 errors" in message and "ValueError: scorer broke on purpose" in message
        assert "Traceback" in err.first_failure
    else:
        assert "6 garbage results" in message and "returned str 'not a number'" in message
    assert (err.failed, err.total, err.first_index) == (6, 6, 0)
    # It crosses process boundaries (a Ray actor's error reaches the driver) intact.
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == message and copy.first_data_source == "my_source"


def test_failures_up_to_the_fraction_are_reported_not_raised(tmp_path):
    with RewardManager(
        reward_file(tmp_path, "some"), num_workers=1, max_failure_fraction=0.25
    ) as manager:
        result = manager.score_samples([{"response": "x"}] * 8)  # 2 of 8 fail: the limit
        assert result.statuses.count("error") == 2
        assert result.metrics["reward/errors"] == 2.0
        assert result.metrics["reward/timeouts"] == result.metrics["reward/garbage"] == 0.0
        with pytest.raises(RewardFailureError, match="3 of 9 samples"):
            manager.score_samples([{"response": "x"}] * 9)  # calls 8 to 16: 3 fail


def test_without_a_fraction_nothing_raises(tmp_path):
    with RewardManager(reward_file(tmp_path, "raise"), num_workers=0) as manager:
        result = manager.score_samples([{"response": "x"}] * 3)
    assert result.statuses == ["error"] * 3


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half"])
def test_max_failure_fraction_is_checked(bad):
    with pytest.raises(ValueError, match="max_failure_fraction"):
        RewardManager(num_workers=0, max_failure_fraction=bad)


def test_a_batch_that_hangs_everywhere_costs_about_one_timeout(tmp_path):
    with RewardManager(reward_file(tmp_path, "hang"), num_workers=2, timeout_s=2.0) as manager:
        before = set(manager.worker_pids)
        start = time.perf_counter()
        result = manager.score_samples([{"response": "x"}] * 16)
        elapsed = time.perf_counter() - start
        # Sequentially, 16 samples on 2 workers would take 8 timeouts (16 s and more); the 14
        # samples skipped below show it without a clock.
        assert elapsed < 14.0, elapsed
        assert result.statuses == ["timeout"] * 16
        assert result.metrics["reward/timeouts"] == 16.0
        assert "timeout_s=2.0" in result.failures[0]
        skipped = [m for m in result.failures.values() if m.startswith("not scored")]
        assert len(skipped) == 14 and "taken to be hung" in skipped[0]
        assert not before & set(manager.worker_pids)  # the hung workers were replaced
        for pid in before:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_one_hung_sample_among_good_ones_does_not_skip_the_rest(tmp_path):
    spec = f"{REPO / 'tests' / 'fixtures' / 'reward_fns.py'}:behave"
    with RewardManager(spec, num_workers=2, timeout_s=1.0, chunk_size=1) as manager:
        result = manager.score_samples(
            [{"response": r} for r in ["hang", "good", "good", "good", "hang", "good"]]
        )
    assert result.statuses == ["timeout", "ok", "ok", "ok", "timeout", "ok"]
    assert not any(m.startswith("not scored") for m in result.failures.values())


# ------------------------------------------------------------------------------ end to end
def _overrides(tmp_path: Path, reward: str, *extra: str) -> list[str]:
    return [
        f"trainer.output_dir={tmp_path / 'run'}",
        f"reward.custom_function={reward}",
        "data.num_train=64",
        "data.num_val=8",
        "data.train_batch_size=8",
        "data.val_batch_size=8",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "data.max_response_length=8",
        "trainer.loggers=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.worker_backend=local",
        "reward.num_workers=1",
        "reward.timeout_s=1",
        *extra,
    ]


@pytest.mark.slow
# "string" (garbage) is checked without the CLI above: the CLI path is the same for every kind.
@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_a_reward_failing_on_every_sample_stops_the_cli_run(tmp_path, kind):
    args = _overrides(tmp_path, reward_file(tmp_path, kind), "trainer.total_steps=3")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", "demo", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("polyrl: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    # The run ends on that line; the scorer's own traceback may be logged above it, the CLI's not.
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert "cli.py" not in proc.stderr
    line = errors[0]
    assert "of 32 samples (100%" in line and "data_source 'arithmetic'" in line
    expected = {
        "raise": "ValueError: scorer broke on purpose",
        "string": "returned str 'not a number'",
        "hang": "took longer than timeout_s=1.0",
    }[kind]
    assert expected in line
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or "critic/score/mean" not in metrics.read_text()  # no step
    assert elapsed < 120, elapsed


@pytest.mark.slow
def test_a_run_with_failures_under_the_limit_goes_on_and_records_them(tmp_path):
    from polyrl.trainer.rl import RLTrainer

    cfg = load_config(
        "demo", _overrides(tmp_path, reward_file(tmp_path, "some"), "trainer.total_steps=2")
    )
    RLTrainer(cfg).fit()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "critic/score/mean" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/errors"] > 0
        assert record["reward/timeouts"] == 0.0
        assert record["reward/garbage"] == 0.0
