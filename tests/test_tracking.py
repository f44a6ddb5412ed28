"""Trackers (console, jsonl, optional tensorboard/wandb/mlflow) and learning-curve PNGs."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from polyrl.trainer.plotting import curves, plot_learning_curves
from polyrl.trainer.tracking import (
    METRICS_FILE,
    Tracker,
    TrackerBackend,
    TrackerUnavailableError,
    available_trackers,
    format_metrics,
    read_metrics,
    register_tracker,
)


def test_console_prints_one_line_per_step(tmp_path, capsys):
    with Tracker(["console"], tmp_path, total_steps=10) as tracker:
        tracker.log({"train/loss": 1.23456, "train/tokens": 512, "val/loss": float("nan")}, 3)
        tracker.log({"train/loss": torch.tensor(0.5)}, 4)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 3/10 | train/loss 1.235 | train/tokens 512 | val/loss nan",
        "step 4/10 | train/loss 0.5",
    ]
    assert format_metrics({"a": 2.0}, 7) == "step 7 | a 2"


def test_jsonl_records_and_resume_truncation(tmp_path):
    with Tracker(["jsonl"], tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log({"loss": 1.0 / step, "ok": np.float32(step)}, step)
        tracker.log({"loss": float("inf")}, 6)
        path = tracker.metrics_path
    assert path == tmp_path / METRICS_FILE
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[1]["loss"] == 0.5 and records[4]["ok"] == 5.0
    assert records[5]["loss"] is None  # non-finite values are written as null
    assert all(isinstance(r["time"], float) for r in records)

    # A resumed run keeps what was logged up to its checkpoint and re-logs the rest.
    with Tracker(["jsonl"], tmp_path, resume_step=3) as tracker:
        tracker.log({"loss": 9.0}, 4)
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1.0 / 3),
        (4, 9.0),
    ]
    # A fresh run starts a new file.
    with Tracker(["jsonl"], tmp_path) as tracker:
        tracker.log({"loss": 2.0}, 1)
    assert [r["loss"] for r in read_metrics(path)] == [2.0]


def test_read_metrics_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="m.jsonl:1"):
        read_metrics(path)


def test_bad_input_is_rejected_with_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tracker 'tb'"):
        Tracker(["console", "tb"], tmp_path)
    with pytest.raises(TypeError, match="list of tracker names"):
        Tracker("console", tmp_path)
    with pytest.raises(ValueError, match="repeat"):
        Tracker(["jsonl", "jsonl"], tmp_path)
    with Tracker(["jsonl"], tmp_path) as tracker:
        with pytest.raises(TypeError, match="metric 'hist'"):
            tracker.log({"hist": [1, 2]}, 1)
        with pytest.raises(ValueError, match="step must be an int"):
            tracker.log({"a": 1.0}, -1)


def test_custom_backend_through_the_registry(tmp_path):
    seen: list[tuple[int, dict]] = []

    @register_tracker("test_memory")
    class Memory(TrackerBackend):
        def __init__(self, run, total_steps=None):
            super().__init__(run)
            self.finished = False

        def log(self, metrics, step):
            seen.append((step, dict(metrics)))

        def finish(self):
            seen.append((-1, {"project": self.run.project}))

    assert "test_memory" in available_trackers()
    with Tracker(["test_memory", "jsonl"], tmp_path, project="p") as tracker:
        assert tracker.log({"x": 1}, 2) == {"x": 1.0}
    assert seen == [(2, {"x": 1.0}), (-1, {"project": "p"})]
    with pytest.raises(ValueError, match="already registered"):

        @register_tracker("console")
        class Other(TrackerBackend):
            def log(self, metrics, step):
                pass


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_optional_backends_log_or_name_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if importlib.util.find_spec(name) is None:
        with pytest.raises(TrackerUnavailableError, match=r"pip install -e .*\[tracking\]"):
            Tracker([name], tmp_path)
        return
    with Tracker([name], tmp_path, project="proj", experiment="run", config={"a": {"b": 1}}) as t:
        for step in (1, 2, 3):
            t.log({"train/loss": 1.0 / step}, step)
    subdir = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}[name]
    files = [p for p in (tmp_path / subdir).rglob("*") if p.is_file()]
    assert files, f"{name} wrote nothing under {subdir}"
    if name == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=t.backends["mlflow"].tracking_uri)
        run_id = t.backends["mlflow"].run_id
        history = client.get_metric_history(run_id, "train/loss")
        assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
        assert client.get_run(run_id).data.params["a.b"] == "1"
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        values = [(e.step, e.value) for e in acc.Scalars("train/loss")]
        assert [s for s, _ in values] == [1, 2, 3]
        assert math.isclose(values[1][1], 0.5)


# ------------------------------------------------------------------------------ plotting
def _metrics_file(tmp_path):
    path = tmp_path / METRICS_FILE
    rows = [{"step": s, "train/loss": 3.0 - 0.1 * s} for s in range(1, 11)]
    rows += [{"step": 0, "val/loss": 3.2}, {"step": 10, "val/loss": 2.0, "train/loss": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curves_use_the_last_value_per_step_and_skip_nulls(tmp_path):
    records = read_metrics(_metrics_file(tmp_path))
    found = curves(records, ["train/loss", "val/loss", "missing"])
    assert sorted(found) == ["train/loss", "val/loss"]
    assert found["val/loss"] == ([0, 10], [3.2, 2.0])
    assert found["train/loss"][0] == list(range(1, 11))
    assert found["train/loss"][1][-1] == pytest.approx(2.0)


def test_plot_writes_one_panel_per_present_key(tmp_path):
    import matplotlib.image

    metrics = _metrics_file(tmp_path)
    both = plot_learning_curves(metrics, tmp_path / "both.png", ["train/loss", "val/loss"])
    one = plot_learning_curves(metrics, tmp_path / "one.png", ["val/loss", "nope"], title="t")
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wide = matplotlib.image.imread(both).shape
    narrow = matplotlib.image.imread(one).shape
    assert wide[0] == narrow[0] and wide[1] == 2 * narrow[1]
    assert plot_learning_curves(metrics, tmp_path / "none.png", ["nope"]) is None
    assert not (tmp_path / "none.png").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_learning_curves(tmp_path / "absent.jsonl", tmp_path / "x.png", ["a"])
    with pytest.raises(ValueError, match="non-empty list"):
        plot_learning_curves(metrics, tmp_path / "x.png", "train/loss")


def test_plot_is_a_grid_without_constant_panels(tmp_path):
    import matplotlib.image

    from polyrl.trainer.plotting import grid_shape

    assert [grid_shape(n) for n in (1, 2, 3, 4, 6, 7)] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 3),
        (2, 3),
        (3, 3),
    ]
    path = tmp_path / METRICS_FILE
    rows = [
        {"step": s, **{f"m{k}": float(k * s) for k in range(1, 6)}, "flat": 0.0}
        for s in range(1, 6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = [*(f"m{k}" for k in range(1, 6)), "flat"]
    assert "flat" not in curves(read_metrics(path), keys)  # constant over 5 steps: left out
    five = matplotlib.image.imread(plot_learning_curves(path, tmp_path / "g.png", keys)).shape
    one = matplotlib.image.imread(plot_learning_curves(path, tmp_path / "o.png", ["m1"])).shape
    # 5 panels: 2 rows of 3 columns (not one 5:1 row with a sixth, flat panel).
    assert (five[0], five[1]) == (2 * one[0], 3 * one[1])
