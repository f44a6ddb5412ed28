"""The one registry type: named plug-ins (backends, losses, estimators, tools, ...).

Every extension point of polyrl is a :class:`Registry`: a plug-in registers itself under a
name with a decorator, and users name it in a config. An unknown name raises
:class:`UnknownNameError` naming the kind, the closest known name and every known name.
Built-in entries whose modules are costly to import (torch, an engine) can be registered
lazily: the registry imports their module the first time the name is asked for.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

__all__ = ["Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name no entry of a registry has (both a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Entries of one kind by name.

    Args:
        kind: what an entry is, for error messages (``"rollout backend"``).
        lazy: ``name -> module``: importing the module registers the entry ``name``; it is
            imported on the first :meth:`get` of that name (and listed by :meth:`names`).
    """

    def __init__(self, kind: str, lazy: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = dict(lazy or {})

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[T], T]:
        """Return a decorator that registers its object as ``name`` (returned unchanged)."""

        def decorate(entry: T) -> T:
            self.add(name, entry, overwrite=overwrite)
            return entry

        return decorate

    def add(self, name: str, entry: T, *, overwrite: bool = False) -> None:
        """Register ``entry`` as ``name``.

        Raises:
            ValueError: ``name`` is taken by another entry and ``overwrite`` is false.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not entry and not overwrite:
            raise ValueError(
                f"{self.kind} {name!r} is already registered ({existing!r}); "
                "pass overwrite=True to replace it"
            )
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Unregister ``name`` (no error when it is not registered)."""
        self._entries.pop(name, None)
        self._lazy.pop(name, None)

    def get(self, name: str) -> T:
        """Return the entry registered as ``name``.

        Raises:
            UnknownNameError: no entry has that name.
        """
        if name not in self._entries and name in self._lazy:
            importlib.import_module(self._lazy[name])
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: object) -> str:
        """Return the message for an unknown ``name``: kind, closest match, known names."""
        known = self.names()
        close = difflib.get_close_matches(name, known, n=1) if isinstance(name, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}{hint} (known: {', '.join(known) or 'none'})"

    def names(self) -> list[str]:
        """Every registered name (lazy ones included), sorted."""
        return sorted(set(self._entries) | set(self._lazy))

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` of every entry registered so far (lazy ones not imported)."""
        return sorted(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
