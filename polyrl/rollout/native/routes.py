"""Recording the experts a MoE model routes each token to, for routing replay (R3).

:class:`RouteRecorder` hooks every router of the served model (both the HF forward and the
packed :mod:`.fast_forward` call the MoE blocks as modules, so one hook covers both) and keeps
the step's ``(tokens, k)`` choice per layer while a step records. :class:`RouteLog` holds one
sequence's routes by position: prefill and decode steps write the positions they computed, so
a recomputed (preempted) position is overwritten and a prompt position served from the prefix
cache stays ``-1`` ("not recorded": the trainer routes it normally).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

from polyrl.models.moe import MoEGeometry, moe_geometry, moe_routers

__all__ = ["RouteLog", "RouteRecorder"]


class RouteLog:
    """One sequence's routed experts: ``(positions, layers, k)`` int16, ``-1`` where unknown."""

    def __init__(self, layers: int, top_k: int, capacity: int = 64):
        self._rows = np.full((max(capacity, 1), layers, top_k), -1, dtype=np.int16)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Store ``rows`` (``(n, layers, k)``) as the routes of positions ``start..start+n``."""
        end = start + rows.shape[0]
        if end > self._rows.shape[0]:
            grown = np.full(
                (max(end, 2 * self._rows.shape[0]), *self._rows.shape[1:]), -1, dtype=np.int16
            )
            grown[: self._rows.shape[0]] = self._rows
            self._rows = grown
        self._rows[start:end] = rows

    def copy_prefix(self, other: RouteLog, length: int) -> None:
        """Take ``other``'s first ``length`` positions (a forked sample's shared prompt)."""
        self.write(0, other.take(length))

    def take(self, length: int) -> np.ndarray:
        """Routes of positions ``0..length`` (``-1`` rows where nothing was computed)."""
        if length > self._rows.shape[0]:
            self.write(length, np.empty((0, *self._rows.shape[1:]), dtype=np.int16))
        return self._rows[:length].copy()


class RouteRecorder:
    """Forward hooks keeping each router's top-k expert ids of the current step.

    Recording costs nothing unless :meth:`start` was called for the step: the hooks only keep a
    reference to the router's index tensor, and :meth:`collect` copies them to the host once.
    """

    def __init__(self, model: nn.Module):
        geometry = moe_geometry(model)
        if geometry is None:
            raise ValueError(f"{type(model).__name__} has no MoE routers")
        self.geometry: MoEGeometry = geometry
        self._active = False
        self._step: list[torch.Tensor | None] = [None] * geometry.layers
        self._handles = [
            r.register_forward_hook(functools.partial(self._hook, i))
            for i, r in enumerate(moe_routers(model))
        ]

    def _hook(self, layer: int, module: nn.Module, args: Any, output: Any) -> None:
        if self._active and isinstance(output, tuple) and len(output) == 3:
            self._step[layer] = output[2]

    def new_log(self, capacity: int = 64) -> RouteLog:
        """Return an empty :class:`RouteLog` of this model's shape."""
        return RouteLog(self.geometry.layers, self.geometry.top_k, capacity)

    def start(self) -> None:
        """Record the next forward."""
        self._active = True
        self._step = [None] * self.geometry.layers

    def collect(self) -> np.ndarray:
        """Stop recording; return the forward's ``(tokens, layers, k)`` expert ids (int16)."""
        self._active = False
        if any(t is None for t in self._step):
            raise RuntimeError("a MoE layer's router did not run during the recorded step")
        rows = torch.stack([t for t in self._step if t is not None], dim=1)
        self._step = [None] * self.geometry.layers
        return rows.to("cpu", torch.int16).numpy()

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
