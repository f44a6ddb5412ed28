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
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

__all__ = ["Registry", "UnknownNameError", "did_you_mean"]

T = TypeVar("T")
E = TypeVar("E")  # what a decorator returns: the decorated object, its own type kept


class UnknownNameError(KeyError, ValueError):
    """A name no entry of a registry has (both a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: object, options: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the option closest to ``name``, or ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _definition(entry: object) -> tuple[str, str] | None:
    """Return ``(module, qualname)`` of a named function or class, ``None`` for anything else."""
    module = getattr(entry, "__module__", None)
    qualname = getattr(entry, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<lambda>" in qualname:
        return None
    return module, qualname


def _is_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def _missing_members(entry: object, base: type) -> list[str] | None:
    """Members of ``base`` that the class ``entry`` lacks; ``None`` when ``entry`` is no class.

    A class base needs a subclass (everything is then inherited).  A :class:`typing.Protocol`
    base is checked by structure, as ``issubclass`` cannot for protocols with properties: the
    class needs every public method and property the protocol (and its protocol bases) define.
    """
    if not isinstance(entry, type):
        return None
    if not _is_protocol(base):
        return [] if issubclass(entry, base) else None
    members = {
        name
        for cls in base.__mro__
        if _is_protocol(cls) and cls.__module__ != "typing"
        for name in vars(cls)
        if not name.startswith("_")
    }
    return sorted(name for name in members if not hasattr(entry, name))


class Registry(Generic[T]):
    """Entries of one kind by name.

    Args:
        kind: what an entry is, for error messages (``"rollout backend"``).
        lazy: ``name -> module``: importing the module registers the entry ``name``; it is
            imported on the first :meth:`get` of that name (and listed by :meth:`names`).
        base: entries must be subclasses of this class (``TypeError`` otherwise); of a
            :class:`typing.Protocol`, classes with all its members will do.
        name_attr: set this attribute of each entry to the name it is registered under.
        hint: appended to the unknown-name message (another way to name an entry, say).
    """

    def __init__(
        self,
        kind: str,
        lazy: Mapping[str, str] | None = None,
        *,
        base: type | None = None,
        name_attr: str | None = None,
        hint: str = "",
    ) -> None:
        self.kind = kind
        self.base = base
        self.name_attr = name_attr
        self.hint = hint
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = dict(lazy or {})

    def register(self, *names: str, overwrite: bool = False) -> Callable[[E], E]:
        """Return a decorator that registers its object under every one of ``names``.

        The object is returned unchanged (but for :attr:`name_attr`). Either every name is
        registered or, on an error, none.
        """
        if not names:
            raise ValueError(f"registering needs at least one {self.kind} name")
        for name in names:
            self._check_name(name)

        def decorate(entry: E) -> E:
            for name in names:
                self._check_entry(name, cast(T, entry), overwrite)
            for name in names:
                self._set(name, cast(T, entry))
            return entry

        return decorate

    def add(self, name: str, entry: T, *, overwrite: bool = False) -> None:
        """Register ``entry`` as ``name``.

        An entry defined by the same code as the registered one (same module and qualified
        name: its module was imported again) replaces it without ``overwrite``.

        Raises:
            ValueError: ``name`` is empty or taken by another entry and ``overwrite`` is false.
            TypeError: ``entry`` is not a subclass of :attr:`base`.
        """
        self._check_name(name)
        self._check_entry(name, entry, overwrite)
        self._set(name, entry)

    def _check_name(self, name: object) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")

    def _check_entry(self, name: str, entry: T, overwrite: bool) -> None:
        if self.base is not None:
            missing = _missing_members(entry, self.base)
            if missing is None or missing:
                detail = f" (missing: {', '.join(missing)})" if missing else ""
                raise TypeError(
                    f"{self.kind} {name!r} must be a {self.base.__name__} subclass"
                    f"{' or have all its members' if _is_protocol(self.base) else ''}, got "
                    f"{entry!r}{detail}"
                )
        existing = self._entries.get(name)
        if existing is None or existing is entry or overwrite:
            return
        if _definition(existing) is not None and _definition(existing) == _definition(entry):
            return
        raise ValueError(
            f"{self.kind} {name!r} is already registered ({existing!r}); "
            "pass overwrite=True to replace it"
        )

    def _set(self, name: str, entry: T) -> None:
        self._entries[name] = entry
        if self.name_attr is not None:
            setattr(entry, self.name_attr, name)

    def remove(self, name: str) -> None:
        """Unregister ``name`` (no error when it is not registered)."""
        self._entries.pop(name, None)
        self._lazy.pop(name, None)

    def get(self, name: str) -> T:
        """Return the entry registered as ``name``.

        Raises:
            UnknownNameError: no entry has that name.
        """
        if isinstance(name, str):
            if name not in self._entries and name in self._lazy:
                importlib.import_module(self._lazy[name])
            if name in self._entries:
                return self._entries[name]
        raise UnknownNameError(self.unknown_message(name))

    __getitem__ = get

    def unknown_message(self, name: object) -> str:
        """Return the message for an unknown ``name``: kind, closest match, known names."""
        known = self.names()
        hint = did_you_mean(name, known)
        extra = f"; {self.hint}" if self.hint else ""
        return f"unknown {self.kind} {name!r}{hint} (known: {', '.join(known) or 'none'}){extra}"

    def names(self) -> list[str]:
        """Every registered name (lazy ones included), sorted."""
        return sorted(set(self._entries) | set(self._lazy))

    def items(self) -> list[tuple[str, T]]:
        """``(name, entry)`` of every entry registered so far (lazy ones not imported)."""
        return sorted(self._entries.items())

    def __contains__(self, name: Any) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._lazy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
