"""Rollout as an HTTP service: engines behind one server/client abstraction.

* :mod:`polyrl.rollout.base` -- the backend registry; requests, sampling parameters, outputs
  and the :class:`~polyrl.core.rollout_api.RolloutBackend` protocol are the core's
  (:mod:`polyrl.core.rollout_api`), so the agent loop and the trainer share them;
* :mod:`polyrl.rollout.native` -- our own continuous-batching engine (paged KV cache);
* :mod:`polyrl.rollout.vllm_backend` and :mod:`polyrl.rollout.sglang_backend` -- vLLM and
  SGLang servers run as child processes, on the shared base of
  :mod:`polyrl.rollout.subprocess_backend`;
* :mod:`polyrl.rollout.server` -- the FastAPI server of one replica (token-in/token-out
  ``/generate``, OpenAI-compatible endpoints, control and metrics), assembled from the routers
  of :mod:`polyrl.rollout.routes`; its process entry point with the weight-transfer routes is
  :mod:`polyrl.workers.rollout_server`;
* :mod:`polyrl.rollout.client` -- :class:`~polyrl.rollout.client.RolloutClient`, the async
  replica manager (balancing, sticky sessions, health checks, retries, backpressure);
* :mod:`polyrl.rollout.router` -- one port in front of several replicas;
* :mod:`polyrl.rollout.launcher` -- replica subprocesses and ``polyrl serve``.

Names are imported lazily so that ``import polyrl.rollout`` does not load torch or FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GenerateRequest",
    "GenerateResult",
    "InvalidRequestError",
    "RolloutBackend",
    "RolloutClient",
    "RolloutHTTPError",
    "SamplingParams",
    "ServerProcess",
    "available_backends",
    "create_backend",
    "register_backend",
]

_WHERE = {
    "GenerateRequest": "polyrl.core.rollout_api",
    "InvalidRequestError": "polyrl.core.rollout_api",
    "RolloutBackend": "polyrl.core.rollout_api",
    "SamplingParams": "polyrl.core.rollout_api",
    "available_backends": "polyrl.rollout.base",
    "create_backend": "polyrl.rollout.base",
    "register_backend": "polyrl.rollout.base",
    "GenerateResult": "polyrl.rollout.client",
    "RolloutClient": "polyrl.rollout.client",
    "RolloutHTTPError": "polyrl.rollout.client",
    "ServerProcess": "polyrl.rollout.launcher",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'polyrl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
