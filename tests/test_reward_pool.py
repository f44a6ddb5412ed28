"""The reward worker pool on its own: real worker processes, per-item timeouts, replacement.

The scorer is ``behave`` from ``tests/fixtures/reward_fns.py``: each response says what it does
(``"good"`` scores 1, ``"hang"`` sleeps forever, ``"spin"`` burns CPU forever, ``"exit"`` ends
its process with ``os._exit(1)``, ``"pid"`` returns the worker's pid, ``"sleep:S"`` sleeps S
seconds and scores 1).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import pytest

from polyrl.reward.pool import RewardWorkerDiedError, ScoringPool

BEHAVE = ("spec", f"{Path(__file__).parent / 'fixtures' / 'reward_fns.py'}:behave")
TIMEOUT_S = 0.5


def items(*responses: str, first: int = 0, data_source: str | None = None) -> list[tuple]:
    """Pool items for ``responses``, indexed from ``first``."""
    return [(first + i, data_source, None, r, None, None) for i, r in enumerate(responses)]


def statuses(outcomes: list[tuple]) -> list[str]:
    return [o[0] for o in outcomes]


def assert_gone(pid: int) -> None:
    """The process has ended and was reaped (the pool joins the workers it kills)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.fixture
def pool():
    """``pool(num_workers, **options)`` builds a pool of ``behave`` workers, closed afterwards."""
    made: list[ScoringPool] = []

    def make(num_workers: int = 1, **options) -> ScoringPool:
        options = {"custom": BEHAVE, "timeout_s": TIMEOUT_S, **options}
        made.append(ScoringPool(num_workers, **options))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_outcomes_come_back_in_the_order_of_the_items(pool):
    scoring = pool(2, chunk_size=1)
    # Indices need not be positions: outcomes follow the list, whichever worker finished first.
    batch = [(7, None, None, "good", None, None), (3, None, None, "bad", None, None)]
    batch += items("good", "pid", "bad", "pid", first=10)
    outcomes = scoring.run(batch)
    assert statuses(outcomes) == ["ok"] * 6
    assert [o[1] for o in outcomes][:3] + [outcomes[4][1]] == [1.0, 0.0, 1.0, 0.0]
    assert {outcomes[3][1], outcomes[5][1]} <= {float(pid) for pid in scoring.pids}
    assert scoring.run([]) == []


@pytest.mark.parametrize("kind", ["hang", "spin"])
def test_an_item_over_its_time_is_a_timeout_and_its_worker_is_replaced(pool, kind):
    scoring = pool(1, chunk_size=3)
    (before,) = scoring.pids
    outcomes = scoring.run(items(kind, "good", "good"))
    # The items after the hung one, in the same chunk, go to the replacement worker.
    assert statuses(outcomes) == ["timeout", "ok", "ok"]
    assert f"timeout_s={TIMEOUT_S}" in outcomes[0][3] and "killed" in outcomes[0][3]
    (after,) = scoring.pids
    assert after != before
    assert_gone(before)
    assert statuses(scoring.run(items("good", "good"))) == ["ok", "ok"]


def test_a_worker_that_dies_mid_item_is_replaced_and_the_rest_are_scored(pool):
    scoring = pool(1, chunk_size=4)
    (before,) = scoring.pids
    outcomes = scoring.run(items("good", "exit", "good", "good"))
    assert statuses(outcomes) == ["ok", "error", "ok", "ok"]
    assert "died (exit code 1)" in outcomes[1][3]
    assert [o[1] for o in outcomes] == [1.0, 0.0, 1.0, 1.0]
    assert scoring.pids != [before]
    assert_gone(before)


def test_a_worker_killed_from_outside_loses_nothing(pool):
    scoring = pool(1, chunk_size=3, timeout_s=30.0)
    assert statuses(scoring.run(items("good"))) == ["ok"]  # booted
    (before,) = scoring.pids
    killer = threading.Timer(0.5, os.kill, (before, signal.SIGKILL))
    killer.start()
    outcomes = scoring.run(items("good", "sleep:2", "good"))
    killer.join()
    # The item it died on is scored again by its replacement, and the rest of its chunk.
    assert statuses(outcomes) == ["ok", "ok", "ok"]
    assert [o[1] for o in outcomes] == [1.0, 1.0, 1.0]
    assert scoring.deaths == 1 and scoring.pids != [before]


def test_without_rescoring_a_worker_killed_from_outside_is_an_error_naming_it(pool):
    # An RL run with trainer.max_restarts=0 recovers from no death: the pool says which died.
    scoring = pool(1, chunk_size=3, timeout_s=30.0, rescore_after_death=False)
    assert statuses(scoring.run(items("good"))) == ["ok"]  # booted
    (before,) = scoring.pids
    killer = threading.Timer(0.5, os.kill, (before, signal.SIGKILL))
    killer.start()
    with pytest.raises(RewardWorkerDiedError) as caught:
        scoring.run(items("good", "sleep:2", "good", first=5))
    killer.join()
    assert str(caught.value) == (
        f"reward worker process (pid {before}) died (killed by SIGKILL) while scoring sample 6"
    )
    assert scoring.deaths == 1
    assert statuses(scoring.run(items("good"))) == ["ok"]  # a new worker scores the next run
    assert scoring.pids != [before]


def test_a_batch_that_hangs_everywhere_is_cut_short(pool):
    scoring = pool(2, chunk_size=1)
    before = set(scoring.pids)
    outcomes = scoring.run(items(*["hang"] * 8))
    assert statuses(outcomes) == ["timeout"] * 8
    tried = [o for o in outcomes if o[3].startswith("scoring took longer")]
    skipped = [o for o in outcomes if o[3].startswith("not scored")]
    # Two timeouts with nothing finished mark the scorer hung (three if both workers'
    # items expire in the pass that sees the second).
    assert 2 <= len(tried) <= 3 and len(skipped) == 8 - len(tried)
    assert "taken to be hung" in skipped[0][3]
    assert not before & set(scoring.pids)
    for pid in before:
        assert_gone(pid)


def test_scorers_reach_running_and_replacement_workers(pool):
    scoring = pool(1, custom=None, chunk_size=1)
    scoring.add_scorers({"behaves": BEHAVE})
    assert dict(scoring.scorers) == {"behaves": BEHAVE}
    # The second item kills the worker; its replacement must know the scorer too.
    outcomes = scoring.run(items("good", "exit", "good", data_source="behaves"))
    assert statuses(outcomes) == ["ok", "error", "ok"]


def test_a_worker_that_cannot_start_is_an_error(pool):
    scoring = pool(1, custom=("spec", "/nonexistent/reward.py:f"))
    with pytest.raises(RuntimeError, match="failed to start"):
        scoring.run(items("good"))
    slow = pool(1, startup_timeout_s=0.001)
    with pytest.raises(RuntimeError, match="did not start within"):
        slow.run(items("good"))


def test_close_leaves_no_child_process(pool):
    scoring = pool(2, chunk_size=1)
    scoring.run(items("good", "hang", "good"))  # one worker replaced on the way
    pids = scoring.pids
    assert len(pids) == 2
    scoring.close()
    scoring.close()  # idempotent
    assert scoring.pids == []
    for pid in pids:
        assert_gone(pid)
    assert not {p.pid for p in mp.active_children()} & set(pids)


def test_a_pool_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        ScoringPool(0)


def test_a_script_that_starts_a_pool_at_its_top_level_is_told_to_guard_it(tmp_path):
    # spawn imports the parent's script again in each worker: unguarded, every worker would run
    # the script's training again and die starting up, so the pool refuses before it starts.
    import subprocess
    import sys

    body = "from polyrl.reward.pool import RewardWorkerDiedError, ScoringPool\n\n"
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(body + "ScoringPool(1).close()\n")
    guarded = tmp_path / "guarded.py"
    guarded.write_text(body + 'if __name__ == "__main__":\n    ScoringPool(1).close()\n')
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}

    def run(script: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )

    refused = run(unguarded)
    assert refused.returncode != 0
    assert f"{unguarded}:3 starts training at the script's top level" in refused.stderr
    assert 'put it under `if __name__ == "__main__":`' in refused.stderr
    assert "died during start-up" not in refused.stderr
    assert run(guarded).returncode == 0
