"""The run loop shared by the RL, SFT and preference trainers, tested once on a toy trainer.

The toy trainer (no model) counts: each step adds the step number to ``x``, its checkpoint
holds ``x``. What the loop owns -- resume from the newest complete checkpoint, dropping the
records logged after it, the tracker's records and console line, the validation and save
cadence, the progress bar, the plot and the summary -- is checked here; the trainers' own
resume tests (``test_sft.py``, ``test_preference.py``, ``test_rl_trainer.py``,
``test_async_rl.py``, ``test_lora.py``) check that their step, validation and checkpoints
restore exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.model_engine import checkpoint as ckpt
from polyrl.trainer.checkpointing import checkpoint_root
from polyrl.trainer.run_loop import LoopTrainer, RunLoop, first_and_last
from polyrl.trainer.tracking import read_metrics


class Crash(RuntimeError):
    """The simulated kill."""


class Counter:
    """A :class:`LoopTrainer` whose state is one number; ``crash_saving`` kills it mid-save."""

    def __init__(
        self, root: Path, total: int = 5, *, val: bool = True, crash_saving: int = 0
    ) -> None:
        self.root, self.total_steps, self.has_validation = root, total, val
        self.crash_saving = crash_saving
        self.x = 0
        self.calls: list[tuple[str, int]] = []
        self.closed = False

    def setup(self) -> None:
        self.calls.append(("setup", self.x))

    def load(self, path: str) -> int:
        info = json.loads((Path(path) / ckpt.COMPLETE_MARKER).read_text())
        self.x = info["x"]
        self.calls.append(("load", info["step"]))
        return info["step"]

    def step(self, step: int) -> dict[str, float]:
        self.x += step
        self.calls.append(("step", step))
        return {"train/loss": 1.0 / step, "train/x": float(self.x)}

    def validate(self) -> dict[str, float]:
        self.calls.append(("validate", self.x))
        return {"val/x": float(self.x)}

    def save(self, step: int) -> str:
        self.calls.append(("save", step))
        path = self.root / f"global_step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        if step == self.crash_saving:
            raise Crash(f"killed while saving step {step}")  # before the completion marker
        ckpt.write_complete_marker(str(path), {"step": step, "x": self.x})
        return str(path)

    def progress(self, metrics: Mapping[str, float]) -> dict[str, str]:
        return {"x": f"{metrics['train/x']:.0f}"}

    def finish(self) -> str | None:
        self.calls.append(("finish", self.x))
        return None

    def close(self) -> None:
        self.closed = True

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return first_and_last(records, "val/x", "val_x")


def _cfg(out: Path, *extra: str, **trainer: Any) -> PolyRLConfig:
    cfg = PolyRLConfig()
    settings = {
        "output_dir": str(out),
        "loggers": ["console", "jsonl"],
        "save_freq": 2,
        "test_freq": 2,
        "val_before_train": True,
        "plot_metrics": ["train/loss"],
        **trainer,
    }
    for key, value in settings.items():
        setattr(cfg.trainer, key, value)
    return cfg


def _loop(cfg: PolyRLConfig, **kwargs: Any) -> RunLoop:
    out = Path(cfg.trainer.output_dir)
    return RunLoop(cfg, "toy", out, checkpoint_root(out), plot_keys=["train/loss"], **kwargs)


def _without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def test_the_counter_is_a_loop_trainer(tmp_path):
    trainer: LoopTrainer = Counter(tmp_path)  # the Protocol, checked by the type checker
    assert trainer.total_steps == 5


def test_cadence_records_console_progress_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _cfg(out)
    toy = Counter(checkpoint_root(out))
    summary = _loop(cfg, step_key="training/global_step", summary_metrics=True).run(toy)

    # Validation before training, every test_freq steps and at the last; saves every
    # save_freq steps and at the last; every step logged before it is saved.
    assert toy.calls == [
        ("setup", 0),
        ("validate", 0),
        ("step", 1),
        ("step", 2),
        ("validate", 3),
        ("save", 2),
        ("step", 3),
        ("step", 4),
        ("validate", 10),
        ("save", 4),
        ("step", 5),
        ("validate", 15),
        ("save", 5),
        ("finish", 15),
    ]
    assert toy.closed
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    # The step's metrics, then the validation's, then the step number under step_key.
    assert list(records[2]) == ["step", "time", "train/loss", "train/x", "val/x"] + [
        "training/global_step"
    ]
    assert records[0] == {"step": 0, "time": records[0]["time"], "val/x": 0.0}
    assert "val/x" not in records[3] and records[5]["training/global_step"] == 5.0

    std = capsys.readouterr()
    lines = [line for line in std.out.splitlines() if line.startswith("step ")]
    assert lines[0] == "step 0/5 | val/x 0" and len(lines) == 6
    assert lines[3].startswith("step 3/5 | train/loss 0.3333 | train/x 6")
    assert "5/5" in std.err and "x=15" in std.err  # the progress bar and its postfix
    assert [s for s, _ in ckpt.list_checkpoints(str(checkpoint_root(out)))] == [2, 4, 5]

    written = json.loads((out / "toy_summary.json").read_text())
    assert written == summary
    assert list(summary) == [
        "steps",
        "resumed_from",
        "first_val_x",
        "last_val_x",
        "checkpoint",
        "hf_model",
        "metrics",
        "plot",
        "elapsed_s",
    ]
    assert summary["steps"] == 5 and summary["resumed_from"] is None
    assert summary["first_val_x"] == 0.0 and summary["last_val_x"] == 15.0
    assert summary["checkpoint"] == str(checkpoint_root(out) / "global_step_5")
    assert summary["metrics"] == str(out / "metrics.jsonl")
    assert summary["plot"] == str(out / "learning_curves.png") and Path(summary["plot"]).is_file()
    assert "[toy] done: steps=5 resumed_from=None first_val_x=0.0 last_val_x=15.0" in std.out


def test_console_keys_restrict_the_line_to_them_and_val(tmp_path, capsys):
    out = tmp_path / "run"
    _loop(_cfg(out, loggers=["console"]), console_keys=["train/x"]).run(Counter(tmp_path / "c"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert lines[1:3] == ["step 1/5 | train/x 1", "step 2/5 | train/x 3 | val/x 3"]
    # Without the jsonl logger the summary and plot come from this process's records.
    summary = json.loads((out / "toy_summary.json").read_text())
    assert summary["last_val_x"] == 15.0
    assert [r["step"] for r in read_metrics(out / ".toy_history.jsonl")] == [0, 1, 2, 3, 4, 5]


def test_no_validation_and_no_saves(tmp_path):
    out = tmp_path / "run"
    toy = Counter(checkpoint_root(out), total=3, val=False)
    summary = _loop(_cfg(out, save_freq=0)).run(toy)
    assert [c for c, _ in toy.calls] == ["setup", "step", "step", "step", "finish"]
    assert summary["checkpoint"] is None and summary["steps"] == 3
    assert summary["first_val_x"] is None and summary["last_val_x"] is None
    toy = Counter(checkpoint_root(out), total=3)
    _loop(_cfg(out, save_freq=0, test_freq=0)).run(toy)
    assert "validate" not in [c for c, _ in toy.calls]


def test_save_interval_s_saves_after_a_step_that_ends_that_long_after_the_last_save(tmp_path):
    out = tmp_path / "run"
    # Any time at all has passed since the last save: every step saves.
    toy = Counter(checkpoint_root(out), total=3, val=False)
    summary = _loop(_cfg(out, save_freq=0, save_interval_s=1e-9)).run(toy)
    assert [s for c, s in toy.calls if c == "save"] == [1, 2, 3]
    assert summary["checkpoint"].endswith("global_step_3")
    # Never that long: only save_freq's steps.
    toy = Counter(checkpoint_root(tmp_path / "other"), total=3, val=False)
    _loop(_cfg(tmp_path / "other", save_freq=2, save_interval_s=1e9)).run(toy)
    assert [s for c, s in toy.calls if c == "save"] == [2, 3]


def test_a_run_killed_while_saving_resumes_from_the_newest_complete_checkpoint(tmp_path):
    full = tmp_path / "full"
    _loop(_cfg(full)).run(Counter(checkpoint_root(full)))

    out = tmp_path / "run"
    toy = Counter(checkpoint_root(out), crash_saving=4)
    with pytest.raises(Crash):
        _loop(_cfg(out)).run(toy)
    assert toy.closed  # closed on the way out, and the tracker flushed step 4
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert (checkpoint_root(out) / "global_step_4").is_dir()  # half-written: no marker

    resumed = Counter(checkpoint_root(out))
    summary = _loop(_cfg(out, resume_mode="auto")).run(resumed)
    # Restored after setup from step 2 (x = 3), no validation before training, steps 3-5 re-run.
    assert resumed.calls[:3] == [("setup", 0), ("load", 2), ("step", 3)]
    assert resumed.x == 15
    assert summary["resumed_from"] == str(checkpoint_root(out) / "global_step_2")
    assert summary["steps"] == 5 and summary["last_val_x"] == 15.0
    # The records logged after the checkpoint (steps 3, 4) were dropped and logged again:
    # the file reads as the uninterrupted run's.
    after, before = read_metrics(out / "metrics.jsonl"), read_metrics(full / "metrics.jsonl")
    assert _without_time(after) == _without_time(before)
    assert [s for s, _ in ckpt.list_checkpoints(str(checkpoint_root(out)))] == [2, 4, 5]

    # A finished run resumes to nothing left to do.
    done = Counter(checkpoint_root(out))
    summary = _loop(_cfg(out, resume_mode="auto")).run(done)
    assert [c for c, _ in done.calls] == ["setup", "load", "finish"]
    assert _without_time(read_metrics(out / "metrics.jsonl")) == _without_time(before)


def test_a_bad_resume_path_fails_when_the_loop_is_built(tmp_path):
    with pytest.raises(ConfigError, match="trainer.resume_mode"):
        _loop(_cfg(tmp_path, resume_mode=str(tmp_path / "nowhere")))


class Died(RuntimeError):
    """The simulated worker death (what a trainer names as recoverable)."""


class Flaky(Counter):
    """A :class:`~polyrl.trainer.run_loop.RecoverableTrainer`: step ``die_at`` raises
    :class:`Died` (wrapped, as a remote call's error is) the first ``deaths`` times."""

    recoverable = (Died,)

    def __init__(self, root: Path, die_at: int, deaths: int = 1, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.die_at, self.deaths = die_at, deaths

    def step(self, step: int) -> dict[str, float]:
        if step == self.die_at and self.deaths:
            self.deaths -= 1
            try:
                raise Died("rank 0 gone")
            except Died as exc:
                raise RuntimeError("the call failed") from exc
        return super().step(step)

    def rebuild(self) -> None:
        self.calls.append(("rebuild", self.x))
        self.x = 0  # what setup builds afresh; load restores the rest

    def describe_failure(self, error: BaseException) -> str:
        return f"worker rank 0 died ({error})"


def test_a_recoverable_failure_reruns_the_steps_since_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    toy = Flaky(checkpoint_root(out), die_at=3)
    summary = _loop(_cfg(out, max_restarts=1, restart_backoff_s=0.0)).run(toy)
    assert summary["steps"] == 5 and toy.x == 15  # each step counted once
    at = toy.calls.index(("rebuild", 3))
    assert toy.calls[at - 1 : at + 4] == [
        ("save", 2),
        ("rebuild", 3),
        ("load", 2),
        ("step", 3),
        ("step", 4),
    ]
    records = [r for r in read_metrics(out / "metrics.jsonl") if "train/x" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["recovery/restarts"] for r in records] == [0, 0, 1, 1, 1]


def test_a_failure_before_any_checkpoint_reruns_from_the_start(tmp_path):
    out = tmp_path / "run"
    toy = Flaky(checkpoint_root(out), die_at=1)
    _loop(_cfg(out, max_restarts=1, restart_backoff_s=0.0)).run(toy)
    assert toy.x == 15 and ("load", 0) not in toy.calls
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/x" in r] == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_restarts_spent_stop_the_run_in_one_line_that_says_how_to_resume(tmp_path):
    from polyrl.core.errors import RunAbortedError

    out = tmp_path / "run"
    toy = Flaky(checkpoint_root(out), die_at=3, deaths=5)
    with pytest.raises(RunAbortedError) as caught:
        _loop(_cfg(out, max_restarts=2, restart_backoff_s=0.0)).run(toy)
    message = str(caught.value)
    assert "\n" not in message and "worker rank 0 died (rank 0 gone)" in message
    assert "after 2 restart(s)" in message and "trainer.resume_mode=auto" in message
    assert "global_step_2" in message and toy.closed
    # The relaunch of the same command (resume defaults to auto) continues from step 2.
    again = Counter(checkpoint_root(out))
    assert _loop(_cfg(out)).run(again)["resumed_from"].endswith("global_step_2")


def test_unrecoverable_failures_and_max_restarts_0_are_not_retried(tmp_path):
    from polyrl.core.errors import RunAbortedError

    out = tmp_path / "run"
    toy = Flaky(checkpoint_root(out), die_at=3)
    with pytest.raises(RunAbortedError, match="trainer.max_restarts=0"):
        _loop(_cfg(out, max_restarts=0)).run(toy)
    assert ("rebuild", 3) not in toy.calls
    plain = Counter(checkpoint_root(tmp_path / "other"), crash_saving=2)
    with pytest.raises(Crash):  # not a recoverable error: as before
        _loop(_cfg(tmp_path / "other", max_restarts=3)).run(plain)


def test_the_command_line_prints_an_aborted_run_as_one_line_exit_2(monkeypatch, capsys):
    import polyrl.cli as cli
    from polyrl.core.errors import RunAbortedError

    def build() -> Any:
        parser = real()
        sub = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]

        def fail(args: Any) -> None:
            try:
                raise KeyError("remote")
            except KeyError as exc:
                raise RunAbortedError(
                    "worker rank 0 died during actor.update_actor; resume"
                ) from exc

        sub.set_defaults(handler=fail)
        return parser

    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", build)
    assert cli.main(["train", "demo"]) == 2
    err = capsys.readouterr().err
    assert err == "polyrl: error: worker rank 0 died during actor.update_actor; resume\n"
    with pytest.raises(RunAbortedError):  # --debug: the traceback
        cli.main(["--debug", "train", "demo"])


def test_a_worker_death_is_one_line_with_where_and_a_plain_log_tail():
    from polyrl.controller import WorkerDiedError
    from polyrl.trainer.rl.supervisor import ReplicaLostError, describe_failure

    log = ":actor_name:_RayHost\n\x1b[36mloading\x1b[0m\r\nstep 1\r 50%\r100%\n\nlast words\n"
    died = WorkerDiedError(
        0, "actor.update_actor", "killed", pid=42, node_id="f" * 40, node_ip="10.0.0.7"
    )
    died.log_tail = log
    assert describe_failure(died) == (
        "worker rank 0 (pid 42 on node 10.0.0.7 (id ffffffffffff)) died during "
        "actor.update_actor (killed); its log ends: loading | 100% | last words"
    )
    lost = describe_failure(ReplicaLostError("http://127.0.0.1:1", "restarts spent", log))
    assert lost == (
        "rollout replica http://127.0.0.1:1 lost: restarts spent; its log ends: loading | "
        "100% | last words"
    )
    assert describe_failure(WorkerDiedError(1, None, "gone")).endswith("; its log is empty")
