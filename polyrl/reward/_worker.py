"""Code that runs inside reward worker processes (and in-process when ``num_workers=0``).

Kept free of torch/numpy imports so a freshly spawned worker starts quickly.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from polyrl.reward.registry import get_scorer
from polyrl.reward.user_fn import (
    USER_MODULE_PREFIX,
    GarbageResultError,
    ScorerBinding,
    WrongResultTypeError,
    bind_scorer,
    load_user_function,
    normalize_result,
)

# One scoring task: (index, data_source, prompt, response, ground_truth, extra_info).
Item = tuple[int, Any, Any, Any, Any, Any]
# How a worker rebuilds a function: ("spec", "path.py:name") or ("pickle", bytes).
Payload = tuple[str, Any]
# One outcome: (status, score, extras, message); status is "ok", "error", "garbage" or
# "wrong_type" (the function returned a list, a string...: the manager raises).
Outcome = tuple[str, float, dict[str, float], str]

_MAX_MESSAGE_CHARS = 2000


class ScorerResolver:
    """Maps a sample's data_source to a bound scorer: the custom function or the registry."""

    def __init__(self, custom: Callable[..., Any] | None, scorers: dict[str, Any] | None = None):
        self.custom = bind_scorer(custom) if custom is not None else None
        self.scorers: dict[str, Any] = {}
        self.broken: dict[str, str] = {}
        self._bound: dict[str, ScorerBinding] = {}
        self.update(scorers or {})

    def update(self, scorers: dict[str, Any]) -> None:
        """Install (or replace) registry scorers by data_source name."""
        self.scorers.update(scorers)
        for name in scorers:
            self._bound.pop(name, None)
            self.broken.pop(name, None)

    def update_payloads(self, payloads: dict[str, Payload]) -> None:
        """Install shipped scorers; one that cannot be rebuilt fails only its samples."""
        for name, payload in payloads.items():
            try:
                fn = load_payload(payload)
                if fn is None:
                    raise ValueError("empty payload")
                self.update({name: fn})
            except Exception as exc:
                self.broken[name] = f"cannot load the scorer for {name!r}: {_describe(exc)}"

    def resolve(self, data_source: Any) -> ScorerBinding:
        """Return the binding to call for ``data_source``."""
        if self.custom is not None:
            return self.custom
        binding = self._bound.get(data_source)
        if binding is None:
            if data_source in self.broken:
                raise RuntimeError(self.broken[data_source])
            fn = self.scorers.get(data_source) or get_scorer(data_source)
            binding = self._bound[data_source] = bind_scorer(fn)
        return binding


def score_one(item: Item, resolver: ScorerResolver) -> Outcome:
    """Score one sample, turning exceptions and malformed results into a status."""
    _, data_source, prompt, response, ground_truth, extra_info = item
    try:
        binding = resolver.resolve(data_source)
        raw = binding(
            {
                "prompt": prompt,
                "response": response,
                "solution_str": response,
                "ground_truth": ground_truth,
                "data_source": data_source,
                "extra_info": extra_info,
            }
        )
    # A user scorer may raise anything (sys.exit included); it must not end the run.
    except (Exception, SystemExit) as exc:
        return "error", 0.0, {}, _describe(exc)
    try:
        score, extras = normalize_result(raw)
    except WrongResultTypeError as exc:
        return "wrong_type", 0.0, {}, str(exc)[:_MAX_MESSAGE_CHARS]
    except GarbageResultError as exc:
        return "garbage", 0.0, {}, str(exc)[:_MAX_MESSAGE_CHARS]
    return "ok", score, extras, ""


def _describe(exc: BaseException) -> str:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)
    text = "".join(frames).strip()
    return text[-_MAX_MESSAGE_CHARS:]


def make_payload(fn: Callable[..., Any]) -> Payload:
    """Describe how a worker process can rebuild ``fn``.

    Functions loaded with :func:`load_user_function` (or defined in a file it loaded) are
    re-loaded by path; anything else is pickled, which works for module-level functions.

    Raises:
        TypeError: If ``fn`` has to be pickled and cannot be.
    """
    spec = getattr(fn, "__polyrl_spec__", None)
    if not isinstance(spec, str):
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        qualname = getattr(fn, "__qualname__", "")
        if (
            module is not None
            and module.__name__.startswith(USER_MODULE_PREFIX)
            and qualname.isidentifier()
            and getattr(module, qualname, None) is fn
        ):
            spec = f"{module.__file__}:{qualname}"
    if isinstance(spec, str):
        return ("spec", spec)
    try:
        return ("pickle", pickle.dumps(fn))
    except Exception as exc:
        raise TypeError(
            f"{fn!r} cannot be pickled to send to reward worker processes; use a module-level "
            "function (not a lambda, closure or method of an unpicklable object), load it with "
            f"a 'path/to/file.py:function' spec, or use num_workers=0. Pickling failed: {exc}"
        ) from exc


def load_payload(payload: Payload | None) -> Callable[..., Any] | None:
    """Rebuild a function from :func:`make_payload`'s output (``None`` stays ``None``)."""
    if payload is None:
        return None
    kind, data = payload
    if kind == "spec":
        return load_user_function(data)
    return pickle.loads(data)


def worker_main(
    conn: Connection, custom: Payload | None, scorer_payloads: dict[str, Payload]
) -> None:
    """Entry point of a worker process: serve scoring requests until told to stop.

    Protocol (over one duplex pipe). Parent to worker: ``("score", [items])``,
    ``("scorers", {name: payload})``, ``("stop",)``. Worker to parent: ``("ready",)``
    or ``("init_error", message)`` once, then one ``("result", index, status, score,
    extras, message)`` per item, sent as soon as the item is done so the parent can time
    each item separately.
    """
    # Ctrl-C goes to the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "setpgid"):
        # Lead a process group of our own so that killing a timed-out worker also kills
        # any processes its scorer started (the parent signals the whole group).
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
    try:
        from polyrl.reward.scorers import set_math_verify_timeout

        # The parent enforces the per-sample timeout by killing this process, so
        # math-verify's own SIGALRM-based timeout is redundant here.
        set_math_verify_timeout(None)
        resolver = ScorerResolver(load_payload(custom))
        resolver.update_payloads(scorer_payloads)
    except BaseException as exc:
        conn.send(("init_error", _describe(exc)))
        conn.close()
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        kind = message[0]
        if kind == "stop":
            return
        if kind == "scorers":
            resolver.update_payloads(message[1])
            continue
        if kind == "score":
            for item in message[1]:
                status, score, extras, text = score_one(item, resolver)
                conn.send(("result", item[0], status, score, extras, text))
