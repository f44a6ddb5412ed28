"""Errors that cross service boundaries (raised by one service, caught by another)."""

from __future__ import annotations

__all__ = ["RunAbortedError", "WeightTransferError"]


class WeightTransferError(RuntimeError):
    """A weight transfer failed; the message names the tensors or bucket involved."""


class RunAbortedError(RuntimeError):
    """A run stopped on a failure it could not recover from (a worker died, restarts spent).

    The message is one line that names what failed and how to resume; the command line prints
    it as ``polyrl: error: ...`` (exit 2) without a traceback unless ``--debug`` is given.
    """
