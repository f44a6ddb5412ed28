"""The one run loop of the RL, SFT and preference trainers.

A trainer supplies what only it knows -- its set-up, one training step, the held-out
metrics, saving and loading a checkpoint, the export at the end, the fields of its summary --
as a :class:`LoopTrainer`; :class:`RunLoop` owns the rest of a run:

* **resume**: ``trainer.resume_mode`` / ``trainer.resume`` pick the checkpoint (the newest
  complete one under the trainer's checkpoint root for ``auto``; resolved when the loop is built,
  so a bad path fails before anything starts); the trainer restores it and says its step;
* **tracking**: a :class:`~polyrl.trainer.tracking.Tracker` for ``trainer.loggers``; a resumed
  run's tracker drops the records logged after the checkpoint, and every step is logged
  *before* it is saved, so a crash in between re-runs the step from the previous checkpoint and
  the resumed run logs what an uninterrupted one would have;
* **cadence**: validation before training (``trainer.val_before_train``, fresh runs only), every
  ``trainer.test_freq`` steps and at the last step; a checkpoint every ``trainer.save_freq``
  steps and at the last step, and after any step that ends ``trainer.save_interval_s`` after
  the previous save (or the start): a long run without ``save_freq`` still has a checkpoint
  to recover from;
* **display**: the tqdm progress bar (its postfix from the trainer) and the console tracker's
  one line per step;
* **recovery**: a trainer that names the failures it can recover from
  (:attr:`RecoverableTrainer.recoverable`: a dead worker) is rebuilt when one ends a step, up
  to ``trainer.max_restarts`` times, ``trainer.restart_backoff_s`` apart (times the restart's
  number): closed, set up again and loaded from the newest complete checkpoint (from step 0
  without one) -- the resume path of a relaunch, in the same process -- and the steps since
  that checkpoint run again as they first would have (their records are replaced). Past the
  limit, or for a failure the trainer cannot recover from, the run ends with a
  :class:`~polyrl.core.errors.RunAbortedError` that names the worker and the call and says how
  to resume;
* **the end**: ``learning_curves.png`` from the run's metric records (the whole run, across
  resumes) and ``<kind>_summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from polyrl.core.errors import RunAbortedError
from polyrl.trainer.checkpointing import resolve_resume_path

__all__ = [
    "PLOT_FILE",
    "LoopTrainer",
    "RecoverableTrainer",
    "RunLoop",
    "first_and_last",
    "plot_run",
    "series",
]

PLOT_FILE = "learning_curves.png"


class LoopTrainer(Protocol):
    """What a trainer supplies to :class:`RunLoop`.

    The loop calls :meth:`setup`, then :meth:`load` when resuming, then :meth:`step` for each
    remaining step (with :meth:`validate` and :meth:`save` at their cadence), :meth:`finish`
    after the last one, and :meth:`close` in every case.
    """

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (read after :meth:`setup`)."""
        ...

    @property
    def has_validation(self) -> bool:
        """Whether there is held-out data to :meth:`validate` on (read after :meth:`setup`)."""
        ...

    def setup(self) -> None:
        """Build what the steps need (engines, servers); :meth:`close` releases it."""
        ...

    def load(self, path: str) -> int:
        """Restore the checkpoint at ``path``; return the step it was saved at."""
        ...

    def step(self, step: int) -> dict[str, float]:
        """Run training step ``step`` (1-based); return its metrics."""
        ...

    def validate(self) -> dict[str, float]:
        """Return the held-out metrics (``val/...``) of the current model."""
        ...

    def save(self, step: int) -> str:
        """Write the checkpoint of ``step``; return its directory."""
        ...

    def progress(self, metrics: Mapping[str, float]) -> dict[str, str]:
        """Return the progress bar's postfix after a step with ``metrics``."""
        ...

    def finish(self) -> str | None:
        """Work after the last step, before :meth:`close` (the export); the export's path."""
        ...

    def close(self) -> None:
        """Release everything :meth:`setup` built (also after a failure); idempotent."""
        ...

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Return the trainer's own summary fields, from the whole run's metric records."""
        ...


class RecoverableTrainer(LoopTrainer, Protocol):
    """A :class:`LoopTrainer` that :class:`RunLoop` may rebuild after a worker dies.

    :attr:`recoverable` names the errors (anywhere in a failure's chain of causes) after which
    :meth:`rebuild` followed by :meth:`load` of the last checkpoint continues the run as an
    uninterrupted one would have; :meth:`describe_failure` puts one of them into words.
    """

    recoverable: tuple[type[BaseException], ...]

    def rebuild(self) -> None:
        """Close everything, return to the state after construction, and set up again."""
        ...

    def describe_failure(self, error: BaseException) -> str:
        """Return one line naming the failed worker, where it ran and the call it was in."""
        ...


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def recoverable_cause(
    error: BaseException, kinds: tuple[type[BaseException], ...]
) -> BaseException | None:
    """Return the first error of one of ``kinds`` in ``error``'s chain of causes, or ``None``."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if kinds and isinstance(current, kinds):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def series(records: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    """Return the values of ``key`` in ``records``, in order, skipping records without it."""
    return [r[key] for r in records if r.get(key) is not None]


def first_and_last(records: Sequence[Mapping[str, Any]], key: str, name: str) -> dict[str, Any]:
    """Return ``{"first_<name>": ..., "last_<name>": ...}``: ``key``'s first and last values.

    Both are ``None`` when no record holds ``key``.
    """
    values = series(records, key)
    return {
        f"first_{name}": values[0] if values else None,
        f"last_{name}": values[-1] if values else None,
    }


def plot_run(
    tracker: Any,
    history: Sequence[Mapping[str, Any]],
    out_dir: Path,
    keys: Sequence[str],
    title: str,
) -> tuple[Path | None, list[dict[str, Any]], Path]:
    """Draw ``learning_curves.png`` of a finished run; return it, the records and their file.

    The records come from the tracker's metrics file, which spans the whole run including the
    steps before a resume; without a jsonl logger, from ``history`` (this process's records),
    written to ``.<kind>_history.jsonl`` for the plot.
    """
    from polyrl.trainer.plotting import plot_learning_curves
    from polyrl.trainer.tracking import read_metrics

    metrics_file = tracker.metrics_path
    if metrics_file is None:
        metrics_file = out_dir / f".{title.split()[-1]}_history.jsonl"
        metrics_file.write_text("".join(json.dumps(r) + "\n" for r in history))
    plot = plot_learning_curves(metrics_file, out_dir / PLOT_FILE, list(keys), title=title)
    return plot, read_metrics(metrics_file), metrics_file


class RunLoop:
    """Runs a :class:`LoopTrainer` from its first (or resumed) step to the summary.

    Args:
        cfg: the run's :class:`~polyrl.config.PolyRLConfig` (its ``trainer`` group drives the
            loop; the tracker records all of it).
        kind: the trainer's name (``rl``, ``sft``, ``dpo``, ``rm``): the log prefix, the
            progress bar's label, the plot's title and ``<kind>_summary.json``.
        out_dir: the run directory.
        checkpoint_root: where the trainer's checkpoints live (``resume_mode=auto`` takes the
            newest complete one there).
        plot_keys: the metrics drawn in ``learning_curves.png``.
        console_keys: when set, the console line shows only these metrics (and ``val/`` ones).
        step_key: when set, each step's record also holds its step number under this name
            (verl's ``training/global_step``).
        summary_metrics: the summary names the metrics file (``metrics``).
        started: ``time.perf_counter()`` when the run started (the summary's ``elapsed_s``).

    Raises:
        ConfigError: ``trainer.resume_mode`` names a path that holds no complete checkpoint.
    """

    def __init__(
        self,
        cfg: Any,
        kind: str,
        out_dir: Path,
        checkpoint_root: Path,
        *,
        plot_keys: Sequence[str],
        console_keys: Sequence[str] | None = None,
        step_key: str | None = None,
        summary_metrics: bool = False,
        started: float | None = None,
    ) -> None:
        self.cfg = cfg
        self.kind = kind
        self.out_dir = Path(out_dir)
        self.plot_keys = list(plot_keys)
        self.console_keys = tuple(console_keys) if console_keys is not None else None
        self.step_key = step_key
        self.summary_metrics = summary_metrics
        self.started = time.perf_counter() if started is None else started
        self.checkpoint_root = Path(checkpoint_root)
        #: Rebuilds after a worker death so far (``recovery/restarts``).
        self.restarts = 0
        trainer = cfg.trainer
        # Now, before the trainer builds anything: a bad resume path fails fast.
        self.resume_from = resolve_resume_path(trainer.resume_mode, trainer.resume, checkpoint_root)

    def log(self, message: str) -> None:
        """Print ``[<kind>] message`` above the progress bar."""
        from tqdm import tqdm

        tqdm.write(f"[{self.kind}] {message}", file=sys.stdout)
        sys.stdout.flush()

    def _recover(
        self, trainer: RecoverableTrainer, error: BaseException, failure: BaseException
    ) -> int:
        """Rebuild ``trainer`` after ``failure`` and load its last checkpoint; return its step.

        Raises:
            RunAbortedError: ``trainer.max_restarts`` rebuilds were spent (or it is 0), or the
                rebuild failed; the message names the worker and says how to resume.
        """
        cfg = self.cfg.trainer
        what = trainer.describe_failure(failure)
        if self.restarts >= cfg.max_restarts:
            # The run ends here: closed first, a checkpoint still being written at the failure
            # is completed, and it is the one a relaunch resumes from (closed again on the way
            # out: closing is idempotent).
            with contextlib.suppress(Exception):
                trainer.close()
            latest = resolve_resume_path("auto", True, self.checkpoint_root)
            spent = f" after {self.restarts} restart(s)" if self.restarts else ""
            where = f" (newest checkpoint {latest})" if latest else ""
            raise RunAbortedError(
                f"{what}{spent}; trainer.max_restarts={cfg.max_restarts}. Run the same command "
                f"with trainer.resume_mode=auto to continue from the newest checkpoint{where}"
            ) from error
        self.restarts += 1
        delay = cfg.restart_backoff_s * self.restarts
        self.log(f"{what}; restart {self.restarts}/{cfg.max_restarts} in {delay:g}s")
        time.sleep(delay)
        try:
            trainer.rebuild()
            # Looked up again: a checkpoint still being written at the failure may have been
            # completed while the trainer closed.
            latest = resolve_resume_path("auto", True, self.checkpoint_root)
            self.log(f"restarting from {latest or 'step 0 (no checkpoint yet)'}")
            step = trainer.load(latest) if latest is not None else 0
        except Exception as exc:
            raise RunAbortedError(
                f"{what}; the restart failed ({type(exc).__name__}: {_first_line(exc)})."
                " Run the same command with trainer.resume_mode=auto to continue"
            ) from exc
        self.log(f"restarted at step {step}")
        return step

    def _save_due(self, step: int, total: int, last_save: float) -> bool:
        """Whether to checkpoint after ``step``: by ``save_freq``, or ``save_interval_s`` on."""
        cfg = self.cfg.trainer
        if cfg.save_freq and (step % cfg.save_freq == 0 or step == total):
            return True
        interval = cfg.save_interval_s
        return bool(interval) and time.monotonic() - last_save >= interval

    def run(self, trainer: LoopTrainer) -> dict[str, Any]:
        """Run ``trainer`` to its last step; write and return the summary."""
        from tqdm import tqdm

        from polyrl.trainer.tracking import Tracker

        cfg = self.cfg.trainer
        resume_from = self.resume_from
        history: list[dict[str, Any]] = []
        tracker = None
        step = 0
        last_ckpt = resume_from
        try:
            trainer.setup()
            if resume_from is not None:
                step = trainer.load(resume_from)
                self.log(f"resumed from {resume_from} at step {step}")
            total = trainer.total_steps

            def open_tracker(resume_step: int | None) -> Tracker:
                opened = Tracker.for_run(
                    self.cfg, self.out_dir, resume_step=resume_step, total_steps=total
                )
                console = opened.backends.get("console")
                if console is not None and self.console_keys is not None:
                    # One readable line per step; every metric still goes to the other loggers.
                    console.keys = self.console_keys
                    console.prefixes = ("val/",)
                return opened

            tracker = open_tracker(step if resume_from is not None else None)

            def record(metrics: dict[str, float], at: int) -> None:
                history.append({"step": at, **tracker.log(metrics, at)})

            validate = trainer.has_validation and cfg.test_freq > 0
            if validate and cfg.val_before_train and resume_from is None:
                record(trainer.validate(), step)
            bar = tqdm(
                total=total,
                initial=step,
                desc=self.kind,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            kinds = tuple(getattr(trainer, "recoverable", ()))
            last_save = time.monotonic()
            with bar:
                while step < total:
                    try:
                        step += 1
                        metrics = trainer.step(step)
                        if validate and (step % cfg.test_freq == 0 or step == total):
                            metrics.update(trainer.validate())
                        if kinds:
                            metrics["recovery/restarts"] = float(self.restarts)
                        if self.step_key is not None:
                            metrics[self.step_key] = float(step)
                        # Log before saving: a crash in between re-runs the step from the
                        # previous checkpoint, and resuming drops the records logged after it.
                        record(metrics, step)
                        bar.update(1)
                        bar.set_postfix(trainer.progress(metrics))
                        if self._save_due(step, total, last_save):
                            last_ckpt = trainer.save(step)
                            last_save = time.monotonic()
                    except Exception as exc:
                        # A death while saving too: the save is incomplete, so the newest
                        # complete checkpoint is the one before.
                        failure = recoverable_cause(exc, kinds)
                        if failure is None:
                            raise
                        step = self._recover(trainer, exc, failure)  # type: ignore[arg-type]
                        # What was logged after the checkpoint is logged again as it reruns.
                        history[:] = [h for h in history if h["step"] <= step]
                        tracker.finish()
                        tracker = open_tracker(step)
                        bar.n = step
                        bar.refresh()
                        last_save = time.monotonic()
            hf_dir = trainer.finish()
        finally:
            if tracker is not None:
                tracker.finish()
            trainer.close()

        plot, records, metrics_file = plot_run(
            tracker, history, self.out_dir, self.plot_keys, f"polyrl {self.kind}"
        )
        summary: dict[str, Any] = {
            "steps": step,
            "resumed_from": str(resume_from) if resume_from else None,
            **trainer.summarize(records),
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "hf_model": hf_dir,
        }
        if self.summary_metrics:
            summary["metrics"] = str(metrics_file)
        summary["plot"] = str(plot) if plot else None
        summary["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        summary_file = self.out_dir / f"{self.kind}_summary.json"
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")
        self.log("done: " + " ".join(f"{k}={v}" for k, v in summary.items()))
        return summary
