"""Learning-curve PNGs from a run's ``metrics.jsonl`` (matplotlib, Agg canvas, no display)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.trainer.tracking import read_metrics

__all__ = ["curves", "plot_learning_curves"]


def curves(
    records: Sequence[dict[str, Any]], keys: Sequence[str]
) -> dict[str, tuple[list[int], list[float]]]:
    """``{key: (steps, values)}`` for each key that has at least one finite value.

    Later records for the same step replace earlier ones (a resumed run re-logs steps).
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
    """Draw one panel per metric key (x: step) and write a PNG.

    Keys missing from the file are skipped; when none is present nothing is written and
    ``None`` is returned.  The PNG is written through a temporary file and a rename.
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

    n = len(found)
    fig = Figure(figsize=(5.0 * n, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (key, (steps, values)) in zip(axes, found.items(), strict=True):
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
