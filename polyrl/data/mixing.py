"""Weighted prompt sampling: several training files mixed by weight, and a difficulty curriculum.

Level: the data layer, beside :class:`~polyrl.data.sampler.StatefulSampler`, whose interface
(:meth:`~WeightedSampler.next_batch`, ``batches_per_epoch``, ``epoch`` / ``position``,
:meth:`~WeightedSampler.state_dict` / :meth:`~WeightedSampler.load_state_dict`) this sampler
shares, so the trainer draws from and checkpoints either the same way.

Each batch is drawn without replacement from the item probabilities

``p_i  proportional to  (w_s(i) / n_s(i)) * d_i``

with ``w_s`` the weight of item ``i``'s source (its training file), ``n_s`` that source's item
count (so the sources' shares are their weights whatever their sizes; OpenRLHF's
``prompt_probs``), and ``d_i`` the curriculum factor: 1 without a curriculum or for a prompt
not seen yet, else ``max(min_weight, 4 p (1 - p))`` with ``p`` the prompt's recent pass rate
(the mean of its last ``window`` recorded accuracies, :meth:`~WeightedSampler.record`). A prompt
always solved (``p = 1``) or never solved (``p = 0``) carries no GRPO signal, and is drawn
``min_weight`` times as often as one solved half the time.

The draw of batch ``k`` depends only on ``(seed, k)`` and the recorded outcomes, so a sampler
restored from :meth:`~WeightedSampler.state_dict` (which holds both) continues the same
sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["WeightedSampler"]


class WeightedSampler:
    """Yields batches of item indices drawn by source weight and recent pass rate.

    Args:
        sources: the source (training file) of each item, ``0 .. S-1``.
        batch_size: items per batch (distinct within a batch).
        weights: one weight per source (``>= 0``, not all 0); ``None`` weighs every item alike.
        seed: base seed of the draws.
        curriculum: weigh items by their recent pass rate (see the module docstring).
        window: outcomes kept per item for its pass rate.
        min_weight: the curriculum factor of an item always or never solved, in ``(0, 1]``.

    Raises:
        ValueError: bad sizes, weights that do not match the sources, or fewer items with a
            positive weight than ``batch_size``.
    """

    def __init__(
        self,
        sources: Sequence[int],
        batch_size: int,
        weights: Sequence[float] | None = None,
        seed: int = 0,
        curriculum: bool = False,
        window: int = 8,
        min_weight: float = 0.1,
    ) -> None:
        src = np.asarray(sources, dtype=np.int64)
        if src.ndim != 1 or src.size == 0 or int(src.min()) < 0:
            raise ValueError("sources must be a non-empty list of source numbers >= 0")
        if isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        num_sources = int(src.max()) + 1
        w = np.ones(num_sources) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (num_sources,):
            raise ValueError(f"{len(w)} weight(s) for {num_sources} source(s); give one each")
        if np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w.tolist()}")
        counts = np.bincount(src, minlength=num_sources)
        if weights is not None and np.any((counts == 0) & (w > 0)):
            raise ValueError(f"a source with a positive weight has no items (counts {counts})")
        if not 0.0 < min_weight <= 1.0:
            raise ValueError(f"min_weight must be in (0, 1], got {min_weight}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        # Each item's share of its source's weight: the sources' shares are their weights.
        self.base = w[src] / counts[src] if weights is not None else np.ones(src.size)
        self.base = self.base / self.base.sum()
        if int(np.count_nonzero(self.base)) < batch_size:
            raise ValueError(
                f"{np.count_nonzero(self.base)} item(s) with a positive weight for batches of "
                f"{batch_size}"
            )
        self.sources = src
        self.weights = w.tolist()
        self.num_items = int(src.size)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.curriculum = bool(curriculum)
        self.window = int(window)
        self.min_weight = float(min_weight)
        self.batches = 0  # batches handed out
        self.history: dict[int, list[float]] = {}  # item -> its last `window` accuracies
        self._lock = threading.Lock()  # the async rollout thread draws and records too

    @property
    def batches_per_epoch(self) -> int:
        """Batches per "epoch": ``num_items // batch_size`` draws (no item is due once per one)."""
        return max(self.num_items // self.batch_size, 1)

    @property
    def epoch(self) -> int:
        """Epochs drawn so far (whole ``batches_per_epoch`` runs)."""
        return self.batches // self.batches_per_epoch

    @property
    def position(self) -> int:
        """Batches drawn in the current epoch."""
        return self.batches % self.batches_per_epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def pass_rate(self, index: int) -> float | None:
        """Return the item's recent pass rate (``None`` before its first recorded outcome)."""
        kept = self.history.get(int(index))
        return None if not kept else float(np.mean(kept))

    def probabilities(self) -> np.ndarray:
        """Each item's probability of being drawn first in the next batch."""
        p = self.base.copy()
        if self.curriculum:
            for index, kept in self.history.items():
                rate = float(np.mean(kept))
                p[index] *= max(self.min_weight, 4.0 * rate * (1.0 - rate))
        return p / p.sum()

    def next_batch(self) -> list[int]:
        """Draw the next batch (distinct items) and advance."""
        with self._lock:
            rng = np.random.default_rng([self.seed, self.batches])
            chosen = rng.choice(
                self.num_items, self.batch_size, replace=False, p=self.probabilities()
            )
            self.batches += 1
            return [int(i) for i in chosen]

    def record(self, indices: Sequence[int], accuracies: Sequence[float]) -> None:
        """Record each item's outcome (its group's mean accuracy, in ``[0, 1]``)."""
        with self._lock:
            for index, acc in zip(indices, accuracies, strict=True):
                kept = self.history.setdefault(int(index), [])
                kept.append(min(max(float(acc), 0.0), 1.0))
                del kept[: -self.window]

    def state_dict(self) -> dict[str, Any]:
        """Return the draws made, the recorded outcomes and the settings they are valid for."""
        with self._lock:
            return {
                "kind": "weighted",
                "batches": self.batches,
                "history": {str(k): list(v) for k, v in self.history.items()},
                **self._settings(),
            }

    def _settings(self) -> dict[str, Any]:
        return {
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "weights": self.weights,
            "curriculum": self.curriculum,
            "window": self.window,
            "min_weight": self.min_weight,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

        Raises:
            ValueError: keys missing, another sampler's state, or other settings.
        """
        if state.get("kind") != "weighted":
            raise ValueError(
                "sampler state was saved by another sampler (data.train_file_weights or "
                "data.curriculum changed)"
            )
        missing = [k for k in ("batches", "history", *self._settings()) if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}")
        mismatched = {
            k: (state[k], v) for k, v in self._settings().items() if _as_saved(state[k]) != v
        }
        if mismatched:
            detail = ", ".join(f"{k}: saved {s!r} vs {c!r}" for k, (s, c) in mismatched.items())
            raise ValueError(f"sampler state was saved with different settings ({detail})")
        with self._lock:
            self.batches = int(state["batches"])
            self.history = {int(k): [float(x) for x in v] for k, v in state["history"].items()}


def _as_saved(value: Any) -> Any:
    """Return a tuple read back from a checkpoint as the list it was saved as."""
    return list(value) if isinstance(value, tuple) else value
