"""Learning-curve PNGs from a run's ``metrics.jsonl`` (matplotlib, Agg canvas, no display)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.trainer.tracking import read_metrics

__all__ = ["curves", "grid_shape", "plot_learning_curves"]

#: Panels per row of the learning-curve grid.
MAX_COLUMNS = 3


def grid_shape(panels: int, max_columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """Return ``(rows, columns)`` of a grid holding ``panels`` panels, rows filled first."""
    if panels < 1:
        raise ValueError(f"panels must be >= 1, got {panels}")
    columns = min(panels, max_columns)
    return -(-panels // columns), columns


def curves(
    records: Sequence[dict[str, Any]], keys: Sequence[str]
) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for each key that has at least one finite value.

    Later records for the same step replace earlier ones (a resumed run re-logs steps). A key
    whose values never change over two or more steps is left out: a flat panel shows nothing
    (a metric that is constant for the whole run, e.g. a zero KL without a KL term).
    """
    out: dict[str, tuple[list[int], list[float]]] = {}
    for key in keys:
        by_step: dict[int, float] = {}
        for record in records:
            value = record.get(key)
            step = record.get("step")
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not isinstance(step, int) or not math.isfinite(value):
                continue
            by_step[step] = float(value)
        if len(by_step) > 1 and len(set(by_step.values())) == 1:
            continue
        if by_step:
            steps = sorted(by_step)
            out[key] = (steps, [by_step[s] for s in steps])
    return out


def plot_learning_curves(
    metrics_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    keys: Sequence[str],
    title: str | None = None,
) -> Path | None:
    """Draw one panel per metric key (x: step) in a grid of up to three columns; write a PNG.

    Keys missing from the file, or constant over the run, are skipped (see :func:`curves`);
    when none is left nothing is written and ``None`` is returned. The PNG is written through
    a temporary file and a rename.
    """
    if isinstance(keys, str) or not keys:
        raise ValueError(f"keys must be a non-empty list of metric names, got {keys!r}")
    if not os.path.isfile(metrics_path):
        raise FileNotFoundError(f"metrics file {os.fspath(metrics_path)!r} does not exist")
    found = curves(read_metrics(metrics_path), keys)
    if not found:
        return None
    # The object-oriented API with an Agg canvas never touches pyplot's global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, columns = grid_shape(len(found))
    fig = Figure(figsize=(5.0 * columns, 3.6 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(found) :]:
        ax.set_visible(False)  # the unused cells of the last row
    for ax, (key, (steps, values)) in zip(axes, found.items(), strict=False):
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out
