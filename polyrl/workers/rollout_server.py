"""The rollout replica process: the rollout server with the weight-transfer routes.

The rollout service may not import the weights service, so the ``/weights/*`` endpoints
(:func:`polyrl.weights.server_routes.register_weight_routes`) join its app here, as an
extension of :func:`polyrl.rollout.server.create_app`. Run
``python -m polyrl.workers.rollout_server MODEL_DIR --port 8000`` (same flags as
``python -m polyrl.rollout.server``); :class:`~polyrl.rollout.launcher.ServerProcess` and
``polyrl serve`` start replicas this way, so every replica accepts weight updates.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from polyrl.core.rollout_api import RolloutBackend
from polyrl.rollout import launcher, server
from polyrl.rollout.options import ServerLimits
from polyrl.rollout.server import AppExtension
from polyrl.weights.server_routes import register_weight_routes

__all__ = ["EXTENSIONS", "create_replica_app", "main", "serve_command"]

PROG = "python -m polyrl.workers.rollout_server"

EXTENSIONS: tuple[AppExtension, ...] = (register_weight_routes,)
"""What a replica's app has besides the rollout routes: the ``/weights/*`` endpoints."""


def create_replica_app(
    backend: RolloutBackend,
    tokenizer: Any,
    api_key: str | None = None,
    manage_backend: bool = True,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """Build a replica's app: :func:`polyrl.rollout.server.create_app` plus :data:`EXTENSIONS`."""
    return server.create_app(
        backend,
        tokenizer,
        api_key=api_key,
        manage_backend=manage_backend,
        extensions=EXTENSIONS,
        limits=limits,
    )


def serve_command(model_dir: str, **kwargs: Any) -> int:
    """Run ``polyrl serve`` with the weight routes.

    See :func:`polyrl.rollout.launcher.serve_command` (its replica children run this module).
    """
    return launcher.serve_command(model_dir, extensions=EXTENSIONS, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m polyrl.workers.rollout_server``; returns the exit code."""
    return server.main(argv, extensions=EXTENSIONS, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
