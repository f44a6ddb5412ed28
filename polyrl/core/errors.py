"""Errors that cross service boundaries (raised by one service, caught by another)."""

from __future__ import annotations

__all__ = ["WeightTransferError"]


class WeightTransferError(RuntimeError):
    """A weight transfer failed; the message names the tensors or bucket involved."""
