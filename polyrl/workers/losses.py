"""The loss registry of the engine workers: losses travel to a worker by name, never as code.

A loss is ``fn(model_output, batch, **kwargs) -> (loss, metrics)`` (see
:data:`polyrl.model_engine.engine.LossFn`). The driver sends its registered name (plus keyword
arguments) to :meth:`~polyrl.workers.engine.EngineWorker.update_actor` and the other update
methods; the worker looks it up here with :func:`resolve_loss`. The built-in losses are
registered at import of this module, which the engine worker's module imports, so their names
resolve in a worker process spawned fresh:

* ``"sft"`` -- :func:`polyrl.model_engine.engine.sft_loss`;
* ``"rl_actor"``, ``"rl_critic"``, ``"rl_prm"`` -- the RL losses of
  :mod:`polyrl.workers.rl_losses` (:data:`ACTOR_LOSS`, :data:`CRITIC_LOSS`, :data:`PRM_LOSS`).

User code registers its own with :func:`register_loss` (in the worker process too, e.g. at
import of the module that defines it) or passes an import path ``"package.module:function"``
that the worker imports. An import path into polyrl itself is refused: polyrl's losses are
registered, and the workers must not import a layer above them (the trainer) by a string that
the import contracts cannot see.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from polyrl.core.registry import Registry
from polyrl.model_engine.engine import LossFn, sft_loss
from polyrl.workers.rl_losses import actor_loss, critic_loss, prm_loss

__all__ = [
    "ACTOR_LOSS",
    "CRITIC_LOSS",
    "LOSSES",
    "PRM_LOSS",
    "SFT_LOSS",
    "available_losses",
    "register_loss",
    "resolve_loss",
]

#: Loss functions ``fn(model_output, batch, **kwargs) -> (loss, metrics)`` by name.
LOSSES: Registry[Callable[..., Any]] = Registry(
    "loss", hint="or give an import path 'package.module:function'"
)
available_losses = LOSSES.names

#: Registered name of the SFT loss (:func:`~polyrl.model_engine.engine.sft_loss`).
SFT_LOSS = "sft"
#: Registered name of the RL policy loss (:func:`~polyrl.workers.rl_losses.actor_loss`).
ACTOR_LOSS = "rl_actor"
#: Registered name of the RL value loss (:func:`~polyrl.workers.rl_losses.critic_loss`).
CRITIC_LOSS = "rl_critic"
#: Registered name of PRIME's PRM loss (:func:`~polyrl.workers.rl_losses.prm_loss`).
PRM_LOSS = "rl_prm"


def register_loss(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(model_output, batch, **kwargs) -> (loss, metrics)`` under ``name``.

    The registration must happen in the worker process too (e.g. at import of the module that
    defines the loss); otherwise pass the loss as ``"module:function"``.
    """
    if not isinstance(name, str) or ":" in name:
        raise ValueError(f"loss name must be a non-empty str without ':', got {name!r}")
    register = LOSSES.register(name)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"@register_loss({name!r}) must decorate a callable, got {fn!r}")
        return register(fn)

    return deco


for _name, _fn in (
    (SFT_LOSS, sft_loss),
    (ACTOR_LOSS, actor_loss),
    (CRITIC_LOSS, critic_loss),
    (PRM_LOSS, prm_loss),
):
    register_loss(_name)(_fn)


def _import_loss(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"loss import path must look like 'package.module:function', got {path!r}")
    if module_name.split(".")[0] == __name__.split(".")[0]:
        # polyrl's own losses are registered; a path would let the glue layer import the
        # layer above it (the trainer) where the import contracts cannot see it.
        raise ValueError(
            f"loss {path!r}: polyrl's losses travel by registered name, not import path; "
            f"registered: {', '.join(available_losses())}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import the module of loss {path!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"loss {path!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"loss {path!r} is not callable (got {type(obj).__name__})")
    return obj


def resolve_loss(name: str, kwargs: Mapping[str, Any] | None = None) -> LossFn:
    """Return the loss function ``name`` with ``kwargs`` bound.

    Args:
        name: a registered name (see :func:`available_losses`) or ``"package.module:function"``
            (outside polyrl).
        kwargs: keyword arguments of the loss beyond ``(model_output, batch)``.

    Raises:
        ValueError: unknown name, unimportable path, a path into polyrl, or ``kwargs`` the
            function does not accept.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss must be a registered name or 'module:function', got {name!r}")
    fn = _import_loss(name) if ":" in name else LOSSES.get(name)
    kwargs = dict(kwargs or {})
    if kwargs:
        try:
            inspect.signature(fn).bind(None, None, **kwargs)
        except TypeError as exc:
            raise ValueError(
                f"loss {name!r} does not accept kwargs {sorted(kwargs)}: {exc}"
            ) from None
        except ValueError:
            pass  # no introspectable signature (a builtin): let the call report bad kwargs
        return functools.partial(fn, **kwargs)
    return fn
