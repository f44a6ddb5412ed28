"""The option framework of polyrl's typed config: declaring, checking and mapping options.

Every option is a dataclass field built with :func:`option`, which stores a one-line description
(and optional constraints) in the field metadata. Groups subclass :class:`ConfigGroup`, whose
``__post_init__`` checks types, enumerated choices and numeric bounds, so a bad value fails when
the object is built, whether it came from YAML, a command-line override or Python code.
:func:`constructor_kwargs` maps a group onto the constructor it configures by field name.

The catalogue of groups built with it is :mod:`polyrl.config.schema`; this module knows none of
them.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Union

__all__ = [
    "ConfigError",
    "ConfigGroup",
    "canonical_mapping",
    "canonical_path",
    "check_value",
    "constructor_kwargs",
    "deferred_registry_checks",
    "deferred_validation",
    "option",
    "option_help",
    "resolved_type_hints",
    "type_name",
    "validate_tree",
]


def constructor_kwargs(target: type, *sections: Any, **explicit: Any) -> dict[str, Any]:
    """Keyword arguments for the dataclass ``target`` from config sections, by field name.

    A config section maps onto the constructor it configures: every field of ``target`` that
    a section has under the same name (or under the name its ``option(maps_to=)`` gives) is
    taken from it (later sections win), then ``explicit`` values (for what the config
    computes). Adding an option then touches its config field and the constructor that uses
    it, nothing between.
    """
    names = {f.name for f in dataclasses.fields(target)}
    out: dict[str, Any] = {}
    for section in sections:
        for f in dataclasses.fields(section):
            name = f.metadata.get("maps_to", f.name)
            if name in names:
                out[name] = getattr(section, f.name)
    unknown = sorted(set(explicit) - names)
    if unknown:
        raise TypeError(f"{target.__name__} has no field(s) {unknown}")
    out.update(explicit)
    return out


class ConfigError(ValueError):
    """A configuration value, key, preset or override is invalid.

    Attributes:
        detail: What is wrong, without the key or source.
        key: Dotted path of the offending option, when known (``"data.max_prompt_length"``).
        source: Where the value came from (``"override 'a=b'"``, ``"preset file '/x.yaml'"``).
    """

    def __init__(self, detail: str, key: str | None = None, source: str | None = None) -> None:
        self.detail = detail
        self.key = key
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        msg = f"{self.key}: {self.detail}" if self.key else self.detail
        if self.source:
            msg += f" (in {self.source})"
        return msg

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep key and source when the error crosses a process boundary (Ray, multiprocessing).
        return (type(self), (self.detail, self.key, self.source))

    def prefixed(self, prefix: str) -> ConfigError:
        """Return a copy whose key is nested under ``prefix`` (the group's dotted path)."""
        if not prefix:
            return self
        key = f"{prefix}.{self.key}" if self.key else None
        return ConfigError(self.detail, key=key, source=self.source)

    def with_source(self, source: str | None) -> ConfigError:
        """Return a copy that names where the bad value came from (keeps an existing source)."""
        if self.source or not source:
            return self
        return ConfigError(self.detail, key=self.key, source=source)


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    choices: Sequence[Any] | None = None,
    registry: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    maps_to: str | None = None,
) -> Any:
    """Declare a config option: a dataclass field with a default and a one-line description.

    Args:
        default: The default value. Mutable values (lists, dicts, dataclass instances) are
            deep-copied for each new object; a dataclass *class* means "a fresh default
            instance of that group".
        help: One-line description shown by ``polyrl config describe``. Required.
        default_factory: Alternative to ``default`` (a zero-argument callable).
        choices: Allowed values; for list options, allowed values of each element. With
            ``registry``, the built-in names (listed by ``polyrl config describe``).
        registry: ``"package.module:NAME"`` of the :class:`~polyrl.core.registry.Registry`
            whose names are the allowed values: a name a user module registers (see
            ``trainer.imports``) is accepted too. The module is imported only to check a name
            that is not among ``choices``, so the built-in names cost no import.
        ge: Inclusive lower bound for numbers.
        gt: Exclusive lower bound for numbers.
        le: Inclusive upper bound for numbers.
        lt: Exclusive upper bound for numbers.
        maps_to: The constructor argument the option sets when it differs from the option's
            name (``optimizer`` sets ``OptimizerConfig.name``); see :func:`constructor_kwargs`.

    Returns:
        A ``dataclasses.field`` carrying ``help``, ``choices`` and bounds in its metadata.
    """
    if not isinstance(help, str) or not help.strip():
        raise TypeError("option() needs a non-empty one-line help string")
    metadata: dict[str, Any] = {"help": help.strip()}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if registry is not None:
        module, sep, attr = registry.partition(":")
        if not module or not sep or not attr:
            raise TypeError(
                f"option(registry=) must look like 'package.module:NAME', got {registry!r}"
            )
        metadata["registry"] = registry
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if bounds:
        metadata["bounds"] = bounds
    if maps_to is not None:
        metadata["maps_to"] = maps_to
    has_default = default is not dataclasses.MISSING
    has_factory = default_factory is not dataclasses.MISSING
    if has_default == has_factory:
        raise TypeError("option() needs exactly one of default or default_factory")
    if has_factory:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if isinstance(default, list | dict | set) or dataclasses.is_dataclass(default):
        template = copy.deepcopy(default)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(template), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option_help(cls: type, name: str) -> str:
    """Return the help string of option ``name`` on config class ``cls``."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("help", ""))
    raise KeyError(f"{cls.__name__} has no option {name!r}")


@functools.cache
def resolved_type_hints(cls: type) -> dict[str, Any]:
    """Field annotations of a dataclass with string (``from __future__``) annotations resolved."""
    return typing.get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def type_name(tp: Any, choices: Sequence[Any] | None = None, open_choices: bool = False) -> str:
    """Readable name of an option type, e.g. ``list[str]`` or ``{qwen2,llama}`` for choices.

    ``open_choices``: the choices are the built-in names of a registry, which takes any
    registered name too (``{grpo,rloo} | registered``).
    """
    if choices:
        inner = "{" + ",".join(str(c) if c != "" else "''" for c in choices) + "}"
        if open_choices:
            inner += " | registered"
        origin = typing.get_origin(tp)
        if origin in (list, tuple):
            return f"list[{inner}]"
        return inner
    if tp is Any:
        return "any"
    if tp is type(None):
        return "None"
    if _is_union(tp):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _describe_value(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def check_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotated type ``tp`` strictly; return it (ints -> floats).

    This is the no-guessing check used when a group object is built: ``True`` is not an ``int``,
    ``"3"`` is not an ``int``. The loader converts YAML and command-line text before this runs.

    Raises:
        ConfigError: naming ``key``, the expected type and the value given.
    """
    expected = type_name(tp)
    bad = ConfigError(f"expected {expected}, got {_describe_value(value)}", key=key)
    if tp is Any:
        return value
    if _is_union(tp):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return check_value(value, arg, key)
            except ConfigError:
                continue
        raise bad
    origin = typing.get_origin(tp)
    if origin is Literal:
        args = typing.get_args(tp)
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise bad
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (elem,) = typing.get_args(tp) or (Any,)
        return [check_value(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {
            check_value(k, kt, f"{key} (a key)"): check_value(v, vt, f"{key}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise bad
    raise ConfigError(f"unsupported option type {tp!r}", key=key)


def _check_bounds(value: Any, bounds: dict[str, float], key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and math.isnan(value):
        raise ConfigError("expected a number, got nan", key=key)
    tests = {
        "ge": (lambda v, b: v >= b, ">="),
        "gt": (lambda v, b: v > b, ">"),
        "le": (lambda v, b: v <= b, "<="),
        "lt": (lambda v, b: v < b, "<"),
    }
    for name, bound in bounds.items():
        ok, symbol = tests[name]
        if not ok(value, bound):
            raise ConfigError(f"value {value!r} out of range; expected {symbol} {bound}", key=key)


def _check_choices(value: Any, choices: tuple[Any, ...], key: str) -> None:
    allowed = ", ".join(repr(c) for c in choices)
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if item not in choices:
            where = f" at index {i}" if isinstance(value, list) else ""
            raise ConfigError(f"invalid value {item!r}{where}; expected one of: {allowed}", key=key)


@functools.cache
def _registry(spec: str) -> Any:
    """Return the :class:`~polyrl.core.registry.Registry` named ``"package.module:NAME"``."""
    import importlib

    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_registered(value: Any, builtin: tuple[Any, ...], spec: str, key: str) -> None:
    """Check every name in ``value`` is built in or registered in the registry ``spec``."""
    from polyrl.core.registry import did_you_mean

    items = value if isinstance(value, list) else [value]
    unknown = [(i, v) for i, v in enumerate(items) if v not in builtin]
    if not unknown:
        return  # the built-in names need no import
    registry = _registry(spec)
    for i, item in unknown:
        if item in registry:
            continue
        where = f" at index {i}" if isinstance(value, list) else ""
        known = registry.names()
        raise ConfigError(
            f"unknown {registry.kind} {item!r}{where}{did_you_mean(item, known)} "
            f"(known: {', '.join(known)}); to use one of your own, list the module that "
            "registers it in trainer.imports",
            key=key,
        )


def _check_registry_fields(obj: Any) -> None:
    """Check the registry-backed options of group ``obj`` (see ``option(registry=)``)."""
    for name, (f, _) in _group_fields(type(obj)).items():
        if "registry" in f.metadata:
            _check_registered(
                getattr(obj, name), f.metadata.get("choices", ()), f.metadata["registry"], name
            )


@functools.cache
def _group_fields(cls: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """``name -> (field, resolved type)`` of a config group class."""
    hints = resolved_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _group_class(tp: Any) -> type | None:
    """Return the :class:`ConfigGroup` class an option of type ``tp`` (or ``tp | None``) holds."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else None
    if isinstance(tp, type) and issubclass(tp, ConfigGroup) and dataclasses.is_dataclass(tp):
        return tp
    return None


def _group_from_mapping(cls: type, value: Any, key: str, default: Any = None) -> Any:
    """Build group ``cls`` from a mapping of its options (nested mappings for nested groups).

    Options the mapping leaves out keep ``default``'s values when it is a ``cls`` (the field's
    own default: a critic's ``optim`` has the critic's learning rate), else the class defaults.
    """
    from polyrl.core.registry import did_you_mean

    value = canonical_mapping(cls, value)
    names = _group_fields(cls)
    for name in value:
        if name not in names:
            hint = did_you_mean(name, names)
            raise ConfigError(f"unknown option {name!r} of {cls.__name__}{hint}", key=key)
    try:
        if isinstance(default, cls):
            return dataclasses.replace(default, **value)
        return cls(**value)
    except ConfigError as exc:
        raise exc.prefixed(key) from None


def _field_default(field: dataclasses.Field[Any]) -> Any:
    """Return the default value of ``field`` (a fresh one from its factory), or ``None``."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def canonical_path(cls: type, parts: Sequence[str]) -> list[str]:
    """Return the dotted path ``parts`` under group ``cls`` with every alias spelled out.

    Under :class:`~polyrl.config.schema.PolyRLConfig`, ``["actor", "lr"]`` is ``["actor",
    "optim", "lr"]`` (see :attr:`ConfigGroup.aliases`); a path without an alias, or one that
    names no option, comes back unchanged.
    """
    out: list[str] = []
    rest = list(parts)
    group: Any = cls
    while rest:
        part = rest.pop(0)
        aliases = getattr(group, "aliases", {})
        if part in aliases:
            rest[:0] = aliases[part].split(".")
            continue
        out.append(part)
        spec = _group_fields(group).get(part) if dataclasses.is_dataclass(group) else None
        group = _group_class(spec[1]) if spec is not None else None
    return out


def canonical_mapping(cls: type, mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """Return a mapping of group ``cls``'s options with its aliases nested under their paths.

    For :class:`~polyrl.config.schema.ActorConfig`, ``{"lr": 1e-5, "ppo_epochs": 2}`` is
    ``{"optim": {"lr": 1e-5}, "ppo_epochs": 2}``. Keys keep their order; a later key wins over
    an earlier one that sets the same option. Only this level is rewritten: nested groups
    rewrite their own mapping when they are built.

    Raises:
        ConfigError: an alias sets an option inside a group the mapping also gives whole.
    """
    aliases = getattr(cls, "aliases", {})
    out: dict[Any, Any] = {}
    for key, value in mapping.items():
        path = aliases[key].split(".") if isinstance(key, str) and key in aliases else [key]
        *parents, leaf = path
        node = out
        for part in parents:
            sub = node.get(part)
            if sub is not None and not isinstance(sub, Mapping):
                raise ConfigError(f"sets an option of '{part}', which is given whole", key=key)
            node[part] = node = dict(sub or {})
        if isinstance(node.get(leaf), Mapping) and isinstance(value, Mapping):
            value = {**node[leaf], **value}
        node[leaf] = value
    return out


def _checked(field: dataclasses.Field[Any], tp: Any, value: Any, key: str) -> Any:
    """Return ``value`` checked (type, choices, bounds) for ``field``; mappings become groups."""
    group = _group_class(tp)
    if group is not None and isinstance(value, dict):
        value = _group_from_mapping(group, value, key, _field_default(field))
    value = check_value(value, tp, key)
    if "registry" in field.metadata:
        # Under deferred validation (the loader) the user's modules are not imported yet:
        # validate_tree checks the names once they are.
        if not (_DEFER_VALIDATE.get() or _DEFER_REGISTRY.get()):
            _check_registered(
                value, field.metadata.get("choices", ()), field.metadata["registry"], key
            )
    elif "choices" in field.metadata:
        _check_choices(value, field.metadata["choices"], key)
    if "bounds" in field.metadata:
        _check_bounds(value, field.metadata["bounds"], key)
    return value


_DEFER_VALIDATE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "polyrl_defer_validate", default=False
)


_DEFER_REGISTRY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "polyrl_defer_registry", default=False
)


@contextlib.contextmanager
def deferred_registry_checks() -> Iterator[None]:
    """Build groups without checking registry-backed names inside the block.

    The loader reads a preset in this mode: the names a user module registers are known only
    once ``trainer.imports`` is imported, which :func:`validate_tree` does before it checks them.
    """
    token = _DEFER_REGISTRY.set(True)
    try:
        yield
    finally:
        _DEFER_REGISTRY.reset(token)


@contextlib.contextmanager
def deferred_validation() -> Iterator[None]:
    """Build groups without their cross-field :meth:`ConfigGroup.validate` inside the block.

    Per-option checks still run, but for registry-backed names (see
    :func:`deferred_registry_checks`). The loader applies a list of overrides in this mode, so
    that their order does not matter (``rollout.tensor_parallel_size=2`` may come before
    ``rollout.backend=vllm``, ``algorithm.adv_estimator=mine`` before ``trainer.imports=[m]``),
    then calls :func:`validate_tree` once.
    """
    token = _DEFER_VALIDATE.set(True)
    try:
        yield
    finally:
        _DEFER_VALIDATE.reset(token)


def validate_tree(obj: Any, prefix: str = "") -> None:
    """Run :meth:`ConfigGroup.validate` on ``obj`` and every group under it.

    Raises:
        ConfigError: keyed by the option's dotted path from ``obj``.
    """
    try:
        obj.prepare()
    except ConfigError as exc:
        raise exc.prefixed(prefix[:-1]) from None
    for name, (_, tp) in _group_fields(type(obj)).items():
        if _group_class(tp) is not None and isinstance(getattr(obj, name), ConfigGroup):
            validate_tree(getattr(obj, name), f"{prefix}{name}.")
    try:
        _check_registry_fields(obj)
        obj.validate()
    except ConfigError as exc:
        raise exc.prefixed(prefix[:-1]) from None


class ConfigGroup:
    """Base class of every option group; validates fields after ``__init__`` and on assignment.

    Subclasses are ``@dataclasses.dataclass`` classes whose fields are declared with
    :func:`option`. For checks that involve several fields, override :meth:`validate` (raise
    :class:`ConfigError` with ``key=`` the field name) instead of ``__post_init__``.

    A group option also takes a mapping of that group's options
    (``PolyRLConfig(rollout={"n": 4})``). Assigning an option after construction
    (``cfg.actor.optim.lr = 1e-6``) checks its type, choices and bounds the same way, naming
    ``Group.option`` in the error; the cross-field :meth:`validate` runs when a group is built
    (and the trainers check the whole config before they start).

    :attr:`aliases` keeps other spellings of options working: an option moved into a nested
    group keeps its old flat name in mappings, YAML, ``key=value`` overrides and attribute
    access (``cfg.actor.lr`` reads ``cfg.actor.optim.lr``).
    """

    aliases: typing.ClassVar[dict[str, str]] = {}
    """``{other spelling: canonical dotted path inside the group}``, e.g. ``{"lr": "optim.lr"}``.
    Subclasses set it without an annotation (a plain class attribute, not a field)."""

    def __post_init__(self) -> None:
        for name, (f, tp) in _group_fields(type(self)).items():
            # Normalise ints given for float options so equality and YAML output are stable.
            object.__setattr__(self, name, _checked(f, tp, getattr(self, name), name))
        if not _DEFER_VALIDATE.get():
            self.validate()

    def __getattr__(self, name: str) -> Any:
        # Called only for a name that is no attribute: an alias reads the option it names.
        path = type(self).aliases.get(name)
        if path is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        obj: Any = self
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def __setattr__(self, name: str, value: Any) -> None:
        path = type(self).aliases.get(name)
        if path is not None:
            *parents, leaf = path.split(".")
            owner: Any = self
            for part in parents:
                owner = getattr(owner, part)
            try:
                setattr(owner, leaf, value)
            except ConfigError as exc:  # name the option as the caller spelt it
                raise ConfigError(exc.detail, key=f"{type(self).__name__}.{name}") from None
            return
        spec = _group_fields(type(self)).get(name)
        if spec is not None and name in self.__dict__:
            # A reassignment (``__init__`` sets each field once; __post_init__ checks those).
            value = _checked(spec[0], spec[1], value, f"{type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    def validate(self) -> None:
        """Cross-field checks; the default has none. Raise ``ConfigError(detail, key=name)``."""

    def prepare(self) -> None:
        """Run by :func:`validate_tree` before the groups under this one are validated.

        :class:`PolyRLConfig` imports the user modules of ``trainer.imports`` here, so the
        names they register are known when the registry-backed options are checked.
        """
