"""Experiment tracking: one :class:`Tracker` fanning step metrics out to pluggable backends.

Backends live in a decorator registry (:func:`register_tracker`).  Built in:

* ``console`` -- one line per step on stdout (written through ``tqdm.write`` so progress bars
  stay intact);
* ``jsonl`` -- ``<run_dir>/metrics.jsonl``, one JSON object per step (``step`` plus metrics;
  non-finite values become ``null``).  :func:`read_metrics` reads it back;
* ``tensorboard`` -- event files under ``<run_dir>/tensorboard``;
* ``wandb`` -- an offline run under ``<run_dir>/wandb`` (``WANDB_MODE`` may override);
* ``mlflow`` -- a local file store under ``<run_dir>/mlruns``.

The last three import their package only when selected and fail with a
:class:`TrackerUnavailableError` naming ``pip install polyrl[tracking]`` when it is missing.

Resuming: give ``resume_step`` and the ``jsonl`` file keeps only the records up to that step, so
steps re-run after a crash are not logged twice.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyrl.core.registry import Registry

__all__ = [
    "METRICS_FILE",
    "RunInfo",
    "TRACKERS",
    "Tracker",
    "TrackerBackend",
    "TrackerUnavailableError",
    "available_trackers",
    "check_trackers",
    "format_metrics",
    "read_metrics",
    "register_tracker",
]

#: File name of the ``jsonl`` backend inside the run directory.
METRICS_FILE = "metrics.jsonl"


def install_hint(extra: str) -> str:
    """Return the command that installs polyrl's ``extra`` the way polyrl was installed.

    A source checkout (``pyproject.toml`` beside the package) takes an editable install of the
    checkout; an installed wheel takes the package from the index.
    """
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return f"{sys.executable} -m pip install -e '{root}[{extra}]'"
    return f"{sys.executable} -m pip install 'polyrl[{extra}]'"


class TrackerUnavailableError(ImportError):
    """A selected tracker backend needs a package that is not installed."""


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every backend knows about the run it records.

    Attributes:
        run_dir: directory for the backend's files (created if missing).
        project: project name (wandb project, mlflow experiment).
        experiment: run name.
        config: the run's configuration as a plain dict (logged as params/config), if any.
        resume_step: when continuing a run, the step it continues from; ``None`` for a new run.
    """

    run_dir: str
    project: str = "polyrl"
    experiment: str = "default"
    config: Mapping[str, Any] | None = None
    resume_step: int | None = None


class TrackerBackend(abc.ABC):
    """One metrics sink.  Subclasses register with :func:`register_tracker`."""

    name: str = ""

    #: Modules the backend imports (checked before a run starts, see check_trackers).
    requires: tuple[str, ...] = ()

    def __init__(self, run: RunInfo) -> None:
        self.run = run

    @abc.abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (finite or not, all floats) for ``step``."""

    def finish(self) -> None:  # noqa: B027 - optional hook, most sinks need no cleanup
        """Flush and close; called once at the end of the run."""


#: Tracker backends by name.
TRACKERS: Registry[type[TrackerBackend]] = Registry(
    "tracker", base=TrackerBackend, name_attr="name"
)
register_tracker = TRACKERS.register
available_trackers = TRACKERS.names


def check_trackers(names: Sequence[str]) -> None:
    """Check that the packages of the trackers ``names`` are installed, before a run starts.

    Finds the modules without importing them (cheap), so a missing package is reported before
    Ray, the replicas and the engines start rather than at the first step.

    Raises:
        TrackerUnavailableError: naming the tracker, the package and the install command.
        UnknownNameError: a name that is not a registered tracker.
    """
    import importlib.util

    for name in names:
        for module in getattr(TRACKERS.get(name), "requires", ()):
            if importlib.util.find_spec(module) is None:
                raise TrackerUnavailableError(
                    f"tracker {name!r} needs the {module!r} package, which is not installed; "
                    f"install it with: {install_hint('tracking')}"
                )


def _need(module: str, backend: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerUnavailableError(
            f"tracker {backend!r} needs the {module.split('.')[0]!r} package, which is not "
            f"installed ({exc}); install it with: {install_hint('tracking')}"
        ) from exc


def _fmt(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e12:
        return str(int(value))
    return f"{value:.4g}"


def format_metrics(metrics: Mapping[str, float], step: int, total: int | None = None) -> str:
    """``step 3/10 | train/loss 1.234 | ...`` -- the console line for one step."""
    head = f"step {step}" if total is None else f"step {step}/{total}"
    return " | ".join([head, *(f"{k} {_fmt(v)}" for k, v in metrics.items())])


# ------------------------------------------------------------------------------ backends
@register_tracker("console")
class ConsoleTracker(TrackerBackend):
    """Prints one line per step on stdout."""

    def __init__(self, run: RunInfo, total_steps: int | None = None) -> None:
        super().__init__(run)
        self.total_steps = total_steps
        #: When set, only these keys (and those under the ``prefixes``) are printed, in this
        #: order; the other backends still record everything.
        self.keys: tuple[str, ...] | None = None
        self.prefixes: tuple[str, ...] = ()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Print ``format_metrics(metrics, step)`` (restricted to :attr:`keys` when set)."""
        from tqdm import tqdm

        if self.keys is not None:
            shown = {k: metrics[k] for k in self.keys if k in metrics}
            shown.update({k: v for k, v in metrics.items() if k.startswith(self.prefixes)})
            metrics = shown
        tqdm.write(format_metrics(metrics, step, self.total_steps), file=sys.stdout)
        sys.stdout.flush()


@register_tracker("jsonl")
class JsonlTracker(TrackerBackend):
    """Appends ``{"step": ..., "time": ..., **metrics}`` lines to ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run: RunInfo, total_steps: int | None = None) -> None:
        super().__init__(run)
        self.path = Path(run.run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if run.resume_step is not None and self.path.is_file():
            kept = [
                json.dumps(record) + "\n"
                for record in read_metrics(self.path)
                if record.get("step", 0) <= run.resume_step
            ]
        # Rewrite through a temp file so a crash here never truncates the old records.
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Append one record and flush it."""
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        """Close the file."""
        if not self._file.closed:
            self._file.close()


@register_tracker("tensorboard")
class TensorBoardTracker(TrackerBackend):
    """Scalars in TensorBoard event files under ``<run_dir>/tensorboard``."""

    requires = ("tensorboard",)

    def __init__(self, run: RunInfo, total_steps: int | None = None) -> None:
        super().__init__(run)
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(run.run_dir, "tensorboard")
        self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=_purge(run))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Add every metric as a scalar."""
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self) -> None:
        """Close the writer."""
        self._writer.close()


def _purge(run: RunInfo) -> int | None:
    # TensorBoard hides events logged after purge_step by an earlier (crashed) writer.
    return None if run.resume_step is None else run.resume_step + 1


@register_tracker("wandb")
class WandbTracker(TrackerBackend):
    """A Weights & Biases run, offline by default (``WANDB_MODE`` overrides), in ``run_dir``."""

    requires = ("wandb",)

    def __init__(self, run: RunInfo, total_steps: int | None = None) -> None:
        super().__init__(run)
        wandb = _need("wandb", "wandb")
        os.makedirs(run.run_dir, exist_ok=True)
        self._run = wandb.init(
            project=run.project,
            name=run.experiment,
            dir=run.run_dir,
            config=dict(run.config or {}),
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="finish_previous",
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log the step's metrics."""
        self._run.log(dict(metrics), step=step)

    def finish(self) -> None:
        """Finish the run (offline runs stay in run_dir for ``wandb sync``)."""
        self._run.finish()


_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /]")


@register_tracker("mlflow")
class MlflowTracker(TrackerBackend):
    """An MLflow run in a local file store under ``<run_dir>/mlruns``."""

    requires = ("mlflow",)

    def __init__(self, run: RunInfo, total_steps: int | None = None) -> None:
        super().__init__(run)
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        # MLflow 3 keeps the file store in maintenance mode behind this opt-in; a run directory
        # of plain files is what a local training run wants.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

        store = Path(run.run_dir).resolve() / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = store.as_uri()
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(run.project)
        exp_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(run.project)
        )
        self.run_id = self._client.create_run(exp_id, run_name=run.experiment).info.run_id
        for key, value in _flatten(run.config or {}).items():
            self._client.log_param(self.run_id, _MLFLOW_BAD.sub("_", key), str(value)[:500])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log the step's metrics in one batch."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [
            Metric(_MLFLOW_BAD.sub("_", k), float(v), stamp, step)
            for k, v in metrics.items()
            if math.isfinite(v)
        ]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def finish(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self.run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


# ------------------------------------------------------------------------------ the fan-out
def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else size if isinstance(size, int) else None
    if callable(item) and count == 1:
        return float(item())
    raise TypeError(
        f"metric {key!r} must be a number or a one-element tensor/array, got {type(value).__name__}"
    )


class Tracker:
    """Sends each step's metrics to every selected backend.

    Args:
        backends: names from :func:`available_trackers` (e.g. ``trainer.loggers``).
        run_dir: directory for the backends' files.
        project: project name.
        experiment: run name.
        config: run configuration (plain dict) for backends that record it.
        resume_step: the step a resumed run continues from (``None`` for a fresh run).
        total_steps: shown by the console line as ``step k/total``.

    Use as a context manager, or call :meth:`finish` at the end.
    """

    @classmethod
    def for_run(
        cls,
        cfg: Any,
        run_dir: str | os.PathLike[str],
        *,
        resume_step: int | None,
        total_steps: int,
    ) -> Tracker:
        """Build the tracker of a training run configured by ``cfg`` (a ``PolyRLConfig``).

        Backends, project and experiment come from ``cfg.trainer``; the whole config is what the
        backends record.
        """
        from polyrl.config import to_dict

        trainer = cfg.trainer
        return cls(
            trainer.loggers,
            run_dir,
            project=trainer.project_name,
            experiment=trainer.experiment_name,
            config=to_dict(cfg),
            resume_step=resume_step,
            total_steps=total_steps,
        )

    def __init__(
        self,
        backends: Sequence[str],
        run_dir: str | os.PathLike[str],
        *,
        project: str = "polyrl",
        experiment: str = "default",
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        total_steps: int | None = None,
    ) -> None:
        if isinstance(backends, str):
            raise TypeError("backends must be a list of tracker names, not a str")
        classes = [TRACKERS.get(name) for name in backends]
        if len(set(backends)) != len(backends):
            raise ValueError(f"tracker names repeat: {list(backends)}")
        self.run = RunInfo(os.fspath(run_dir), project, experiment, config, resume_step)
        Path(self.run.run_dir).mkdir(parents=True, exist_ok=True)
        self.backends: dict[str, TrackerBackend] = {}
        try:
            for name, cls in zip(backends, classes, strict=True):
                self.backends[name] = cls(self.run, total_steps=total_steps)
        except BaseException:
            self.finish()
            raise
        self._finished = False

    @property
    def metrics_path(self) -> Path | None:
        """The ``jsonl`` backend's file, when that backend is on."""
        backend = self.backends.get("jsonl")
        return backend.path if isinstance(backend, JsonlTracker) else None

    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Send ``metrics`` for ``step`` to every backend; returns them as floats."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping, got {type(metrics).__name__}")
        clean = {str(k): _as_float(str(k), v) for k, v in metrics.items()}
        for backend in self.backends.values():
            backend.log(clean, step)
        return clean

    def finish(self) -> None:
        """Finish every backend once (errors of one do not stop the others)."""
        if getattr(self, "_finished", False):
            return
        self._finished = True
        errors = []
        for backend in self.backends.values():
            try:
                backend.finish()
            except Exception as exc:  # noqa: BLE001 - report after closing the rest
                errors.append(f"{backend.name}: {exc}")
        if errors:
            raise RuntimeError("tracker backends failed to finish: " + "; ".join(errors))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the records of a ``metrics.jsonl`` file (a torn last line from a crash is skipped)."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: invalid JSON in a metrics file: {exc}") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
            )
        records.append(record)
    return records
