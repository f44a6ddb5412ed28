"""Rollout backends by name: :func:`register_backend`, :func:`create_backend`.

The request and output types every backend speaks are :mod:`polyrl.core.rollout_api`'s
(re-exported here). Built-in backends are imported lazily, on first use, so that importing
this module stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from polyrl.core.rollout_api import (
    FINISH_REASONS,
    BackendStats,
    DeltaStream,
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RequestOutput,
    RolloutBackend,
    RolloutError,
    SampleDelta,
    SampleOutput,
    SamplingParams,
    _suggest,
    check_request_fits,
    collect_outputs,
)

__all__ = [
    "BackendStats",
    "DeltaStream",
    "EngineUnavailableError",
    "FINISH_REASONS",
    "GenerateRequest",
    "InvalidRequestError",
    "ModelInfo",
    "RequestOutput",
    "RolloutBackend",
    "RolloutError",
    "SampleDelta",
    "SampleOutput",
    "SamplingParams",
    "available_backends",
    "backend_options_class",
    "check_request_fits",
    "collect_outputs",
    "create_backend",
    "register_backend",
]


BackendFactory = Callable[..., RolloutBackend]
_BACKENDS: dict[str, BackendFactory] = {}
# Built-in backends register themselves when their module is imported; this maps a name to
# the module to import on first use, so ``import polyrl.rollout`` never pulls in torch.
_LAZY_BACKENDS: dict[str, str] = {
    "native": "polyrl.rollout.native.backend",
    "vllm": "polyrl.rollout.vllm_backend",
}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Class decorator registering a backend factory under ``name``.

    The factory is called as ``factory(model_dir, **options)`` and returns a
    :class:`RolloutBackend` (not yet started).

    Raises:
        ValueError: ``name`` is already registered by another factory.
    """

    def decorate(factory: BackendFactory) -> BackendFactory:
        existing = _BACKENDS.get(name)
        if existing is not None and existing is not factory:
            raise ValueError(f"rollout backend {name!r} is already registered ({existing!r})")
        _BACKENDS[name] = factory
        return factory

    return decorate


def available_backends() -> list[str]:
    """Names that :func:`create_backend` accepts."""
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def _factory(name: str) -> BackendFactory:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[name])
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown rollout backend {name!r}{_suggest(name, available_backends())}; "
            f"available: {', '.join(available_backends())}"
        )
    return factory


def backend_options_class(name: str) -> type:
    """Return the dataclass whose fields are the options of the backend ``name``.

    Callers that configure a backend (the RL trainer, from ``rollout.*``) map their settings
    onto it by field name, so an option is declared once: on this dataclass.

    Raises:
        ValueError: no backend of that name, or it declares no ``options_class``.
    """
    factory = _factory(name)
    options = getattr(factory, "options_class", None)
    if options is None:
        raise ValueError(f"rollout backend {name!r} declares no options_class")
    return options


def create_backend(name: str, model_dir: str, **options: Any) -> RolloutBackend:
    """Build the backend registered as ``name`` for the model in ``model_dir``.

    Raises:
        ValueError: no backend of that name.
    """
    return _factory(name)(model_dir, **options)
