"""User modules that extend polyrl's registries (``trainer.imports``).

A user module registers its own advantage estimators, policy losses, scorers, agent loops,
environments, tools or tasks when it is imported. :func:`import_plugins` imports such modules
and remembers them, so that every process that looks a name up can import them too: the
controller sends :func:`plugin_modules` to each worker process it starts, which imports them
before it builds its workers.

An entry is a module name (``my_pkg.my_module``, found on ``sys.path`` / ``PYTHONPATH``) or the
path of a ``.py`` file; a file's directory is put on ``sys.path`` and the file imported under
its stem, so that functions defined there pickle by reference to other processes.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType

__all__ = ["PluginImportError", "import_plugins", "plugin_modules"]

_IMPORTED: list[str] = []


class PluginImportError(ImportError):
    """A user module named in ``trainer.imports`` could not be imported."""


def _is_file(entry: str) -> bool:
    return entry.endswith(".py") or os.sep in entry or "/" in entry


def _import_one(entry: str) -> tuple[ModuleType, str]:
    """Import ``entry``; return the module and the entry as other processes should see it."""
    if not isinstance(entry, str) or not entry.strip():
        raise PluginImportError(f"a module to import must be a non-empty string, got {entry!r}")
    entry = entry.strip()
    name = canonical = entry
    if _is_file(entry):
        path = canonical = os.path.abspath(os.path.expanduser(entry))
        if not path.endswith(".py") or not os.path.isfile(path):
            raise PluginImportError(f"cannot import {entry!r}: no such .py file")
        folder, name = os.path.dirname(path), os.path.basename(path)[: -len(".py")]
        if not name.isidentifier():
            raise PluginImportError(f"cannot import {entry!r}: {name!r} is not a module name")
        if folder not in sys.path:
            sys.path.insert(0, folder)
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise PluginImportError(
                f"cannot import {entry!r}: another module named {name!r} is already imported "
                f"({getattr(loaded, '__file__', loaded)!r}); rename the file"
            )
    try:
        return importlib.import_module(name), canonical
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == name:
            detail = f"no module named {name!r} (is its directory on PYTHONPATH?)"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        raise PluginImportError(f"cannot import {entry!r}: {detail}") from exc


def import_plugins(entries: Iterable[str]) -> list[ModuleType]:
    """Import each user module in ``entries`` (in order) and remember it for worker processes.

    Importing a module twice is a no-op (Python caches modules), so this is safe to call on
    every config validation.

    Raises:
        PluginImportError: an entry is not importable (the message names it and why).
    """
    if isinstance(entries, str):
        entries = [entries]
    modules = []
    for entry in entries:
        module, canonical = _import_one(entry)
        modules.append(module)
        if canonical not in _IMPORTED:
            _IMPORTED.append(canonical)
    return modules


def plugin_modules() -> tuple[str, ...]:
    """Return the entries :func:`import_plugins` has imported in this process, in order."""
    return tuple(_IMPORTED)
