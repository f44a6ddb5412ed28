"""Rollout backends by name: :func:`register_backend`, :func:`create_backend`.

The request and output types every backend speaks are :mod:`polyrl.core.rollout_api`'s.
Built-in backends are imported lazily, on first use, so that importing
this module stays cheap (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from polyrl.core.registry import Registry
from polyrl.core.rollout_api import RolloutBackend

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend_options_class",
    "check_backend_options",
    "create_backend",
    "register_backend",
]


BackendFactory = Callable[..., RolloutBackend]
#: Backend factories by name, called as ``factory(model_dir, **options)`` and returning a
#: :class:`RolloutBackend` (not yet started). Built-in backends register themselves when their
#: module is imported, on first use, so ``import polyrl.rollout`` never pulls in torch.
BACKENDS: Registry[BackendFactory] = Registry(
    "rollout backend",
    lazy={
        "native": "polyrl.rollout.native.backend",
        "vllm": "polyrl.rollout.vllm_backend",
        "sglang": "polyrl.rollout.sglang_backend",
    },
)
register_backend = BACKENDS.register
available_backends = BACKENDS.names


def check_backend_options(backend: str, options_class: type, options: Mapping[str, Any]) -> None:
    """Refuse options that are not fields of the backend's ``options_class``.

    Raises:
        TypeError: naming the unknown options and the accepted ones.
    """
    names = {f.name for f in dataclasses.fields(options_class)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(
            f"unknown {backend} backend option(s) {unknown}; expected some of {sorted(names)}"
        )


def backend_options_class(name: str) -> type:
    """Return the dataclass whose fields are the options of the backend ``name``.

    Callers that configure a backend (the RL trainer, from ``rollout.*``) map their settings
    onto it by field name, so an option is declared once: on this dataclass.

    Raises:
        ValueError: no backend of that name, or it declares no ``options_class``.
    """
    options = getattr(BACKENDS.get(name), "options_class", None)
    if options is None:
        raise ValueError(f"rollout backend {name!r} declares no options_class")
    return options


def create_backend(name: str, model_dir: str, **options: Any) -> RolloutBackend:
    """Build the backend registered as ``name`` for the model in ``model_dir``."""
    return BACKENDS.get(name)(model_dir, **options)
