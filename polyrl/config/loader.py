"""Build :class:`~polyrl.config.schema.PolyRLConfig` objects from presets, YAML and overrides.

Precedence, lowest first: the dataclass defaults, the preset (a bundled name such as ``demo``
or a YAML file holding only the keys it changes), then ``key.sub=value`` overrides in order.
Every step validates: unknown keys name the nearest valid key, wrong types name the expected
type, and each error says which file or override it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, Union

import yaml

from polyrl.config import verl_compat
from polyrl.config.schema import (
    ConfigError,
    PolyRLConfig,
    canonical_mapping,
    canonical_path,
    check_value,
    deferred_registry_checks,
    deferred_validation,
    resolved_type_hints,
    type_name,
    validate_tree,
)

__all__ = [
    "ConfigNote",
    "ConfigProblems",
    "OptionInfo",
    "apply_overrides",
    "available_presets",
    "describe",
    "from_dict",
    "inline_yaml",
    "load_config",
    "parse_override",
    "read_preset",
    "response_cap",
    "save_config",
    "to_dict",
    "to_yaml",
    "verl_config_overrides",
]

T = TypeVar("T")

_PRESET_SUFFIXES = (".yaml", ".yml")


class OptionInfo(NamedTuple):
    """One option as listed by :func:`describe`."""

    key: str
    """Dotted path, e.g. ``data.max_prompt_length``."""
    type: str
    """Readable type, e.g. ``int``, ``list[str]``, or ``{a,b}`` for a choice."""
    default: Any
    """Default value (or current value when :func:`describe` is given an instance)."""
    help: str
    """One-line description."""


@dataclasses.dataclass(frozen=True)
class _OverrideValue:
    """A command-line value: its raw text and its YAML reading, picked by the target type."""

    raw: str
    parsed: Any
    yaml_error: str | None = None


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML loader that rejects a key repeated in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Safe YAML dumper that double-quotes strings holding Unicode line breaks.

    PyYAML writes a string holding NEL (U+0085) as a plain scalar and reads the NEL back as a
    space; quoting those strings keeps ``load(dump(x)) == x``.
    """


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = '"' if any(c in data for c in ("\x85", "\u2028", "\u2029")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Short one-line reason for a YAML error, with its position when known."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        where = exc.problem_mark or exc.context_mark
        pos = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        context = f"{exc.context}: " if exc.context else ""
        return _one_line(f"{context}{exc.problem}{pos}")
    return _one_line(str(exc))


# ---------------------------------------------------------------------------------------------
# Presets


def _preset_dir() -> Any:
    return resources.files("polyrl.config") / "presets"


def available_presets() -> list[str]:
    """Names of the presets bundled with polyrl, sorted (e.g. ``['default', 'demo']``)."""
    names = []
    for entry in _preset_dir().iterdir():
        if entry.is_file() and entry.name.endswith(_PRESET_SUFFIXES):
            names.append(entry.name.rsplit(".", 1)[0])
    return sorted(names)


def _looks_like_path(preset: str) -> bool:
    return os.sep in preset or "/" in preset or preset.endswith(_PRESET_SUFFIXES)


def _parse_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {_yaml_problem(exc)}", source=source) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"expected a mapping of options at the top level, got {type(data).__name__}",
            source=source,
        )
    return data


def read_preset(preset: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """Read a preset into a nested dict of the keys it sets.

    Args:
        preset: A bundled preset name (see :func:`available_presets`) or a path to a YAML file.

    Returns:
        ``(data, source)`` where ``source`` describes the preset for error messages.

    Raises:
        ConfigError: the name is not bundled and no such file exists, or the YAML is invalid.
    """
    if not isinstance(preset, str | os.PathLike):
        raise ConfigError(
            f"preset must be a preset name or a path, got {type(preset).__name__} {preset!r}"
        )
    if isinstance(preset, str) and not _looks_like_path(preset):
        for suffix in _PRESET_SUFFIXES:
            entry = _preset_dir() / f"{preset}{suffix}"
            if entry.is_file():
                source = f"preset '{preset}'"
                return _parse_yaml(entry.read_text(encoding="utf-8"), source), source
        if not Path(preset).is_file():
            names = ", ".join(available_presets())
            raise ConfigError(
                f"unknown preset {preset!r}; available presets: {names} "
                "(or give the path of a YAML file)"
            )
    path = Path(preset)
    source = f"file '{path}'"
    if not path.is_file():
        names = ", ".join(available_presets())
        raise ConfigError(f"preset file not found: '{path}' (bundled presets: {names})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read preset: {_one_line(str(exc))}", source=source) from None
    return _parse_yaml(text, source), source


#: verl's own config names a ``defaults:`` list may hold: the trainer defaults verl layers the
#: file on (polyrl's options already have a default each) and Hydra's marker for the file itself.
_VERL_BASE_DEFAULTS = ("ppo_trainer", "_self_")


def _flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Return ``{a: {b: 1}}`` as ``[("a.b", 1)]`` (an empty mapping stays a value)."""
    out: list[tuple[str, Any]] = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, f"{key}."))
        else:
            out.append((key, value))
    return out


def verl_config_overrides(
    config_path: str | os.PathLike[str] | None, config_name: str
) -> tuple[list[str], list[str]]:
    """Read verl's ``--config-path DIR --config-name NAME`` file as overrides, plus notes.

    The file (``DIR/NAME.yaml``) is a Hydra config in verl's keys: its ``defaults:`` list may
    name verl's ``ppo_trainer`` (the options it leaves unset keep their defaults, as the
    command line's do), ``_self_``, or other files of ``DIR`` (read first, in order); its
    ``hydra:`` section only steers Hydra and is ignored with a note. Each key becomes a
    ``key=value`` override that goes through the verl key table like a command-line one; put
    the command line's overrides after these so they win, as in verl.

    Raises:
        ConfigError: no such file, invalid YAML, or a ``defaults:`` entry that is neither
            verl's trainer config nor a file of ``DIR``.
    """
    folder = Path(config_path) if config_path is not None else Path.cwd()
    notes: list[str] = []

    def read(name: str, seen: tuple[str, ...]) -> list[str]:
        stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
        path = folder / f"{stem}.yaml"
        source = f"verl config '{path}'"
        if not path.is_file():
            raise ConfigError(f"verl config not found: '{path}' (--config-path/--config-name)")
        if stem in seen:
            raise ConfigError(f"'defaults:' includes {stem!r} again", source=source)
        try:
            data = _parse_yaml(path.read_text(encoding="utf-8"), source)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read it: {_one_line(str(exc))}", source=source) from None
        out: list[str] = []
        defaults = data.pop("defaults", None) or []
        for item in defaults if isinstance(defaults, list) else [defaults]:
            if item in _VERL_BASE_DEFAULTS:
                continue
            if isinstance(item, str) and (folder / f"{item}.yaml").is_file():
                out.extend(read(item, (*seen, stem)))
                continue
            raise ConfigError(
                f"'defaults:' entry {item!r} is neither verl's ppo_trainer nor a file of {folder}",
                source=source,
            )
        if "hydra" in data:
            del data["hydra"]
            notes.append(f"{source}: its 'hydra:' section is ignored (it only steers Hydra)")
        for key, value in _flatten(data):
            text = value if isinstance(value, str) else inline_yaml(value)
            out.append(f"{key}={text}")
        return out

    return read(config_name, ()), notes


def inline_yaml(value: Any) -> str:
    """One-line YAML of ``value`` (an override's value: :func:`parse_override` reads it back)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
    return text.removesuffix("...").strip()


# ---------------------------------------------------------------------------------------------
# Schema walking


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every valid dotted path under ``cls``: groups, options and their aliases (``actor.lr``)."""
    keys: list[str] = [f"{prefix}{alias}" for alias in getattr(cls, "aliases", {})]
    hints = resolved_type_hints(cls)
    for f in _init_fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        sub = _strip_optional(hints[f.name])
        if _is_group(sub):
            keys.extend(_dotted_keys(sub, f"{path}."))
    return keys


def _unknown_key(path: str, root: type, source: str | None) -> ConfigError:
    candidates = _dotted_keys(root)
    parent, _, leaf = path.rpartition(".")
    if verl_compat.is_verl_only(path) or (
        verl_compat.is_verl_group(parent) and parent not in candidates
    ):
        # A near spelling of a verl key of the same group is a typo; anything else is a verl
        # option polyrl lacks. Never a guess across groups: it would mean something else.
        near = verl_compat.near_spellings(path)
        if near:
            return ConfigError(
                f"unknown verl key '{path}'; did you mean '{near[0]}'?", source=source
            )
        return ConfigError(
            f"verl option '{path}' has no polyrl equivalent; drop it, or see "
            "'polyrl config verl' (docs/migrating_from_verl.md) for the keys polyrl reads",
            source=source,
        )
    # In a known group, a near spelling of one of its options (or of a verl key spelt there);
    # else of a whole key (the group itself misspelt). Nothing further afield: a guess that
    # merely shares letters ('nogroup.x' -> 'rollout.n', 'actor.learning_rate' ->
    # 'actor.warmup_ratio') misleads, and so does another word ('data.gen_batch_size' is not
    # 'data.train_batch_size').
    siblings = {k.rpartition(".")[2]: k for k in candidates if k.rpartition(".")[0] == parent}
    if parent and siblings:
        near = difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)
        close = [siblings[n] for n in near if verl_compat.near_spelling(leaf, n)]
        close = close or verl_compat.near_spellings(path)
    else:
        close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.6)
    if close:
        hint = f"; did you mean '{close[0]}'?"
    elif parent and parent in candidates:
        hint = f"; '{parent}' has no option '{leaf}' ('polyrl config describe' lists them all)"
    else:
        hint = " ('polyrl config describe' lists every option)"
    return ConfigError(f"unknown key '{path}'{hint}", source=source)


def _wants_raw_text(tp: Any, value: _OverrideValue) -> bool:
    """Whether a command-line value for type ``tp`` is taken verbatim rather than as YAML."""
    if tp is str:
        return True
    if _is_union(tp) and _strip_optional(tp) is str:
        # 'null', '~' and '' still mean None for an optional string.
        return value.yaml_error is not None or value.parsed is not None
    return False


def _got(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _mismatch(tp: Any, value: Any, key: str, hint: str = "") -> ConfigError:
    return ConfigError(f"expected {type_name(tp)}, got {_got(value)}{hint}", key=key)


def _merge_free(current: Any, value: Any) -> Any:
    """Merge a value into a free-form (``Any``) option: mappings merge key by key."""
    if isinstance(value, _OverrideValue):
        if value.yaml_error is not None:
            # Free-form values have no type to say "this is text": keep the text as typed.
            return value.raw
        return value.parsed
    if isinstance(value, Mapping) and isinstance(current, dict):
        merged = dict(current)
        for k, v in value.items():
            merged[k] = _merge_free(merged.get(k), v)
        return merged
    if isinstance(value, Mapping):
        return {k: _merge_free(None, v) for k, v in value.items()}
    return value


def _convert(value: Any, tp: Any, key: str, current: Any, root: type, source: str | None) -> Any:
    """Convert a YAML / command-line value to type ``tp`` (merging into groups and dicts)."""
    if isinstance(value, _OverrideValue):
        if _wants_raw_text(tp, value):
            value = value.raw
        elif value.yaml_error is not None:
            raise ConfigError(f"cannot read the value as YAML: {value.yaml_error}", key=key)
        else:
            value = value.parsed
    if _is_group(tp):
        if value is None:
            return current
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"expected a mapping of {tp.__name__} options, got {_got(value)}", key=key
            )
        base = current if isinstance(current, tp) else tp()  # an optional group set to None
        return _apply(base, value, f"{key}.", root, source)
    if tp is Any:
        return _merge_free(current, value)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = _strip_optional(tp)
        if not _is_union(inner):
            # X | None: X's own error (e.g. an unknown key inside a group) is the useful one.
            return _convert(value, inner, key, current, root, source)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, current, root, source)
            except ConfigError:
                continue
        raise _mismatch(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is list:
        (elem,) = typing.get_args(tp) or (Any,)
        if isinstance(value, list | tuple):
            items = list(value)
        elif value is None:
            raise _mismatch(tp, value, key, hint=" (write [] for an empty list)")
        elif isinstance(value, Mapping):
            raise _mismatch(tp, value, key)
        elif isinstance(value, str) and value.strip().startswith("["):
            # verl's quoted list form: data.train_files="['a.parquet','b.parquet']".
            try:
                parsed = yaml.load(value, Loader=_UniqueKeyLoader)
            except yaml.YAMLError:
                parsed = None
            items = parsed if isinstance(parsed, list) else [value]
        else:
            items = [value]  # a lone scalar means a one-element list: loggers=console
        return [_convert(v, elem, f"{key}[{i}]", None, root, source) for i, v in enumerate(items)]
    if origin is dict:
        kt, vt = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, key)
        merged = dict(current) if isinstance(current, dict) else {}
        for k, v in value.items():
            check_value(k, kt, f"{key} (key {k!r})")
            merged[k] = _convert(v, vt, f"{key}.{k}", merged.get(k), root, source)
        return merged
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _mismatch(tp, value, key, hint=" (use true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _mismatch(tp, value, key)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads '1e-6' (no dot) as a string; accept anything float() accepts.
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise _mismatch(tp, value, key)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise _mismatch(tp, value, key, hint=" (quote the value to pass text)")
    return check_value(value, tp, key)


def _apply(obj: T, patch: Mapping[Any, Any], prefix: str, root: type, source: str | None) -> T:
    """Return a copy of group ``obj`` with ``patch`` (a nested mapping) applied and validated."""
    cls = type(obj)
    try:
        patch = canonical_mapping(cls, patch)  # flat aliases (actor.lr) nest (actor.optim.lr)
    except ConfigError as exc:
        raise exc.prefixed(prefix[:-1]).with_source(source) from None
    hints = resolved_type_hints(cls)
    names = {f.name for f in _init_fields(cls)}
    changes: dict[str, Any] = {}
    for name, value in patch.items():
        if not isinstance(name, str):
            raise ConfigError(
                f"option names must be strings, got {type(name).__name__} {name!r}"
                + (f" under '{prefix[:-1]}'" if prefix else ""),
                source=source,
            )
        path = f"{prefix}{name}"
        if name not in names:
            raise _unknown_key(path, root, source)
        current = changes.get(name, getattr(obj, name))
        try:
            changes[name] = _convert(value, hints[name], path, current, root, source)
        except ConfigError as exc:
            raise exc.with_source(source) from None
    try:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    except ConfigError as exc:
        # __post_init__ names keys relative to its own group.
        raise exc.prefixed(prefix[:-1]).with_source(source) from None


# ---------------------------------------------------------------------------------------------
# Public API


def from_dict(
    data: Mapping[str, Any], cls: type[T] = PolyRLConfig, *, source: str | None = None
) -> T:
    """Build a config of type ``cls`` from a nested mapping holding only the keys it changes.

    Raises:
        ConfigError: on an unknown key, a wrong type or an invalid value.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"expected a mapping of options, got {type(data).__name__}", source=source
        )
    return _apply(cls(), data, "", cls, source)


def parse_override(text: str) -> tuple[list[str], _OverrideValue]:
    """Split ``'key.sub=value'`` into its key path and value.

    The value is read as YAML (``3`` is an int, ``[a,b]`` a list, ``true`` a bool, ``null``
    None, ``1e-3`` a float), except that options of type ``str`` take the text after the first
    ``=`` verbatim (``name=007`` is ``'007'``, ``name=`` is ``''``). Invalid YAML is reported
    when the value is applied to an option that is not a string.

    Hydra's ``+key=value`` (add a key the defaults lack) and ``++key=value`` (add or
    override), common in verl launch lines, set the option like ``key=value``: every option
    exists in polyrl's schema, so there is nothing to add.

    Raises:
        ConfigError: when there is no ``=`` or the key is empty or malformed.
    """
    if not isinstance(text, str):
        raise ConfigError(f"override must be a string 'key=value', got {type(text).__name__}")
    key, sep, raw = text.partition("=")
    key = key.strip()
    if key.startswith("+"):
        key = key[2:] if key.startswith("++") else key[1:]
    if not sep:
        raise ConfigError(
            f"malformed override '{text}': expected key=value, e.g. trainer.total_steps=10"
        )
    parts = key.split(".")
    if not key or any(not p.isidentifier() for p in parts):
        raise ConfigError(
            f"malformed key '{key}' in override '{text}': expected dotted option names like "
            "data.max_prompt_length"
        )
    try:
        parsed = yaml.load(raw, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        return parts, _OverrideValue(raw, None, yaml_error=_yaml_problem(exc))
    return parts, _OverrideValue(raw, _hydra_flow_mapping(parsed))


def _hydra_flow_mapping(value: Any) -> Any:
    """Read Hydra's ``{name:value}`` (no space after the colon) as YAML's ``{name: value}``.

    YAML takes ``{enable_thinking:false}`` as one key, ``"enable_thinking:false"``, with no
    value; verl launch lines write mappings that way. An option name has no colon, so such a
    key is split at its first one and the rest read as the value.
    """
    if not isinstance(value, Mapping):
        return value
    out = {}
    for key, item in value.items():
        if isinstance(key, str) and ":" in key and item is None:
            name, _, text = key.partition(":")
            out[name.strip()] = yaml.safe_load(text)
        else:
            out[key] = _hydra_flow_mapping(item)
    return out


def _override_patch(parts: list[str], value: _OverrideValue, root: type, source: str) -> dict:
    """Nest ``value`` under ``parts`` after checking each step of the path exists."""
    cls: Any = root
    for i, part in enumerate(parts[:-1]):
        path = ".".join(parts[: i + 1])
        if dataclasses.is_dataclass(cls):
            hints = resolved_type_hints(cls)
            if part not in {f.name for f in _init_fields(cls)}:
                raise _unknown_key(".".join(parts), root, source)
            cls = _strip_optional(hints[part])
            if _is_group(cls):
                continue
            if typing.get_origin(cls) is dict:
                break  # the remaining parts are keys of a free-form mapping option
            raise ConfigError(
                f"'{path}' is an option of type {type_name(cls)}, not a group; "
                f"cannot set '{'.'.join(parts)}'",
                source=source,
            )
    patch: Any = value
    for part in reversed(parts):
        patch = {part: patch}
    return patch


class ConfigNote(UserWarning):
    """What the loader decided for the user: a preset value dropped, a verl key read or ignored.

    :func:`load_config` and :func:`apply_overrides` report these with :func:`warnings.warn`;
    ``polyrl`` prints each as one ``polyrl: note: ...`` line.
    """


def _is_schema_path(parts: list[str], root: type) -> bool:
    """Whether ``parts`` names a group or option of ``root`` (or a key inside a dict option)."""
    cls: Any = root
    for part in parts:
        if not _is_group(cls):
            return typing.get_origin(cls) is dict
        fields = {f.name: f for f in _init_fields(cls)}
        if part not in fields:
            return False
        cls = _strip_optional(resolved_type_hints(cls)[part])
    return True


def _flat_keys(parts: list[str], value: Any) -> list[str]:
    """Dotted keys an override sets: ``data={a: 1}`` sets ``data.a``."""
    parsed = value.parsed if isinstance(value, _OverrideValue) else value
    key = ".".join(parts)
    if isinstance(parsed, Mapping) and parsed:
        return [k for name, v in parsed.items() for k in _flat_keys([*parts, str(name)], v)]
    return [key]


def _same(a: Any, b: Any) -> bool:
    return a == b and type(a) is type(b) or (a is None and b is None)


@dataclasses.dataclass
class _Overrides:
    """Overrides read and translated (verl keys to polyrl ones), ready to apply."""

    patches: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    user_keys: set[str] = dataclasses.field(default_factory=set)
    """polyrl keys the user set, directly or through a verl alias."""
    verl_given: dict[str, Any] = dataclasses.field(default_factory=dict)
    derived: list[verl_compat.VerlKey] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    ignored: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """verl keys accepted without effect, by the reason."""
    verl_keys: list[str] = dataclasses.field(default_factory=list)
    """The line's keys that are verl's and not polyrl's: the line speaks verl."""
    errors: list[ConfigError] = dataclasses.field(default_factory=list)
    """Every problem found, reported together (:func:`_raise_all`)."""
    sources: list[str] = dataclasses.field(default_factory=list)
    """Each override's source, in line order (to report the problems in that order)."""


#: ``async`` is a Python keyword, so the group is ``async_rl``; overrides may say ``async.*``.
ASYNC_SPELLING, ASYNC_GROUP = "async", "async_rl"


def _read_overrides(overrides: Sequence[str], root: type) -> _Overrides:
    if isinstance(overrides, str):
        raise ConfigError("overrides must be a list of 'key=value' strings, not one string")
    out = _Overrides()
    for text in overrides:
        out.sources.append(f"override '{text}'")
        try:
            _read_override(text, root, out)
        except ConfigError as exc:
            out.errors.append(exc)
    for reason, keys in out.ignored.items():
        out.notes.append(f"verl option(s) {', '.join(keys)} ignored: {reason}")
    return out


def _read_override(text: str, root: type, out: _Overrides) -> None:
    parts, value = parse_override(text)
    if parts and parts[0] == ASYNC_SPELLING:
        parts = [ASYNC_GROUP, *parts[1:]]
    parts = canonical_path(root, parts)  # actor.lr is actor.optim.lr
    key, source = ".".join(parts), f"override '{text}'"
    schema = _is_schema_path(parts, root)
    entry = verl_compat.lookup(key)
    if entry is not None and schema and entry.polyrl != key:
        entry = None  # a polyrl key keeps its polyrl meaning
    if entry is None:
        out.patches.append((source, _override_patch(parts, value, root, source)))
        out.user_keys.update(_flat_keys(parts, value))
        return
    if not schema:
        out.verl_keys.append(key)
    given = value.raw if value.yaml_error is not None else value.parsed
    if entry.kind == "ignored":
        keys = out.ignored.setdefault(entry.note, [])
        if key not in keys:  # given by a verl base YAML and the line too
            keys.append(key)
    elif entry.kind == "off":
        if not any(given == v for v in entry.off):
            raise ConfigError(
                f"verl option {key}={given!r} has no polyrl equivalent: {entry.note}",
                source=source,
            )
    elif entry.kind == "derived":
        out.verl_given[key] = given
        if all(d.derive is not entry.derive for d in out.derived):
            out.derived.append(entry)
    else:
        converted: Any = value
        if entry.convert is not None:
            try:
                converted = entry.convert(given)
            except verl_compat.VerlValueError as exc:
                raise ConfigError(f"verl option {key}: {exc}", source=source) from None
            if converted is verl_compat.SKIP:
                return
            if _same(converted, given):
                converted = value  # unchanged: keep the raw text for string options
        target = canonical_path(root, entry.polyrl.split("."))
        out.patches.append((source, _override_patch(target, converted, root, source)))
        out.user_keys.add(entry.polyrl)


class ConfigProblems(ConfigError):
    """Several problems of one set of overrides, reported together, one per line.

    Attributes:
        problems: The problems, in the order of the overrides.
    """

    def __init__(self, problems: Sequence[ConfigError]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  {exc}" for exc in self.problems)
        super().__init__(f"{len(self.problems)} problems in the overrides:\n{lines}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.problems,))


def _raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise the line's problems as one error (a single one as it is)."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems(errors)


def _derive_of(verl_key: str) -> Any:
    entry = verl_compat.lookup(verl_key)
    return entry.derive if entry is not None else None


def _set(cfg: T, key: str, value: Any, source: str) -> T:
    root = type(cfg)
    return _apply(cfg, _override_patch(key.split("."), value, root, source), "", root, source)


def _finish(cfg: T, read: _Overrides) -> T:
    """Apply what depends on every override: verl's derived values, then the length rule."""
    for entry in read.derived:
        source = f"verl option {entry.verl}"
        try:
            values = entry.derive(read.verl_given, cfg) if entry.derive else {}
        except verl_compat.VerlValueError as exc:
            raise ConfigError(str(exc), key=entry.verl) from None
        for key, value in values.items():
            if key in read.user_keys and not entry.force:
                read.notes.append(f"{key} set explicitly; not derived from the verl options")
                continue
            cfg = _set(cfg, key, value, source)
            given = ", ".join(
                f"{k}={v}" for k, v in read.verl_given.items() if _derive_of(k) is entry.derive
            )
            read.notes.append(f"{key}={value} (from verl's {given}; {entry.note})")
            read.user_keys.add(key)
    # verl generates data.max_response_length tokens; polyrl caps a turn at
    # rollout.max_new_tokens too, so the one the user set wins. verl's multi-turn loop caps a
    # turn only by what is left of that budget, so a verl multi-turn line follows it too.
    rollout, data, agent = (getattr(cfg, n, None) for n in ("rollout", "data", "agent"))
    verl_multi_turn = bool(read.verl_given.get(f"{verl_compat.MULTI_TURN}.enable"))
    if (
        rollout is not None
        and data is not None
        and ("data.max_response_length" in read.user_keys or verl_multi_turn)
        and "rollout.max_new_tokens" not in read.user_keys
        and (verl_multi_turn or not getattr(agent, "enable", False))
        and rollout.max_new_tokens != data.max_response_length
    ):
        cfg = _set(cfg, "rollout.max_new_tokens", data.max_response_length, "data")
        why = ": a verl multi-turn turn may use all of" if verl_multi_turn else " follows the given"
        read.notes.append(
            f"rollout.max_new_tokens={data.max_response_length}{why} data.max_response_length "
            "(set rollout.max_new_tokens to cap it lower)"
        )
    trainer = getattr(cfg, "trainer", None)
    if (
        trainer is not None
        and {"trainer.total_steps", "trainer.total_epochs"} <= read.user_keys
        and trainer.total_steps
    ):
        read.notes.append(
            f"trainer.total_steps={trainer.total_steps} and trainer.total_epochs="
            f"{trainer.total_epochs} both given: total_steps wins"
        )
    return cfg


def _emit(notes: Sequence[str]) -> None:
    for note in notes:
        warnings.warn(note, ConfigNote, stacklevel=3)


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Return a copy of ``cfg`` with ``key.sub=value`` overrides applied in order.

    verl keys (``actor_rollout_ref.actor.optim.lr=1e-6``) are read as the polyrl options they
    mean (see :mod:`polyrl.config.verl_compat`). Notes on what was translated, ignored or
    derived are reported as :class:`ConfigNote` warnings.

    Raises:
        ConfigError: naming the bad override and key (see :func:`parse_override`).
    """
    read = _read_overrides(overrides, type(cfg))
    cfg = _apply_all(cfg, read)
    _emit(read.notes)
    return cfg


def _apply_all(cfg: T, read: _Overrides) -> T:
    """Apply the overrides in order, then the cross-field checks once (order-independent)."""
    root = type(cfg)
    errors = list(read.errors)
    with deferred_validation():
        for source, patch in read.patches:
            try:
                cfg = _apply(cfg, patch, "", root, source)
            except ConfigError as exc:
                errors.append(exc)
        order = {source: i for i, source in enumerate(read.sources)}
        _raise_all(sorted(errors, key=lambda exc: order.get(exc.source or "", len(order))))
        cfg = _finish(cfg, read)
    try:
        validate_tree(cfg)
    except ConfigError as exc:
        raise exc.with_source("the overrides" if read.patches else None) from None
    return cfg


def _drop_preset_keys(data: dict[str, Any], user: set[str], source: str) -> list[str]:
    """Drop the preset values that contradict what the user asked for; return notes.

    * the user's ``data.train_files`` replaces a preset's generated ``data.task``;
    * the user's ``trainer.total_epochs`` (without ``trainer.total_steps``) replaces a
      preset's ``trainer.total_steps``.
    """
    notes: list[str] = []

    def drop(group: str, name: str, because: str) -> None:
        section = data.get(group)
        if isinstance(section, dict) and section.get(name):
            notes.append(f"{source} sets {group}.{name}={section[name]}; dropped: {because} given")
            section = dict(section)
            del section[name]
            data[group] = section

    if "data.train_files" in user and "data.task" not in user:
        drop("data", "task", "data.train_files")
    if "trainer.total_epochs" in user and "trainer.total_steps" not in user:
        drop("trainer", "total_steps", "trainer.total_epochs")
    return notes


def response_cap(cfg: PolyRLConfig) -> int:
    """Return the most tokens one RL response may hold.

    With the agent loop that is a whole multi-turn trajectory (``data.max_response_length``);
    otherwise one turn (``rollout.max_new_tokens``, capped by ``data.max_response_length``).
    """
    data = cfg.data.max_response_length
    return data if cfg.agent.enable else min(cfg.rollout.max_new_tokens, data)


#: What an RL sequence's length follows: the actor's token budget must hold the longest one.
_LENGTH_KEYS = (
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.max_new_tokens",
    "agent.enable",
)
#: Mini-batch options a preset may set, each in prompts: it must divide ``data.train_batch_size``
#: and leave every training rank at least one row per mini-batch.
_MINI_BATCH_KEYS = ("actor.ppo_mini_batch_size", "prime.mini_batch_size")
#: The options a mini-batch size must fit.
_BATCH_SHAPE_KEYS = (
    "data.train_batch_size",
    "rollout.n",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
)


def _preset_value(data: Mapping[str, Any], key: str) -> Any:
    group, name = key.split(".")
    section = data.get(group)
    return section.get(name) if isinstance(section, Mapping) else None


def _option(cfg: Any, key: str) -> Any:
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _yield_preset_values(
    cfg: PolyRLConfig, data: Mapping[str, Any], user: set[str], source: str
) -> tuple[PolyRLConfig, list[str]]:
    """Let the preset's values that no longer fit what the user set yield to it; return notes.

    A preset's mini-batch size (``actor.ppo_mini_batch_size``, ``prime.mini_batch_size``) that
    does not fit the user's ``data.train_batch_size`` (or ``rollout.n`` / world size) becomes
    the nearest size that fits, the largest up to it or else the smallest above it: a divisor
    of the batch that leaves every rank a row per mini-batch (the whole batch for a batch
    smaller than the preset's mini-batch). A value the user set stays as given, and the
    trainer's check names it.
    """
    notes: list[str] = []
    given = [k for k in _BATCH_SHAPE_KEYS if k in user]
    if not given:
        return cfg, notes
    batch = cfg.data.train_batch_size
    rows_per_rank = batch * cfg.rollout.n // cfg.trainer.world_size

    def fits(size: int) -> bool:
        return batch % size == 0 and rows_per_rank >= batch // size

    for key in _MINI_BATCH_KEYS:
        preset = _preset_value(data, key)
        if key in user or not preset or fits(preset):
            continue
        # The largest size up to the preset's that fits, else the smallest above it.
        sizes = [*range(min(preset, batch), 0, -1), *range(preset + 1, batch + 1)]
        size = next((m for m in sizes if fits(m)), None)
        if size is None:
            continue  # nothing fits: the trainer's check says what to raise
        cfg = _set(cfg, key, size, source)
        settings = ", ".join(f"{k}={_option(cfg, k)}" for k in given)
        notes.append(
            f"{source} sets {key}={preset}, which does not fit the given {settings}; using "
            f"{size}, the nearest size that does (set {key} to choose)"
        )
    return cfg, notes


def _yield_token_budget(cfg: PolyRLConfig, user: set[str]) -> tuple[PolyRLConfig, list[str]]:
    """Raise an ``actor.max_tokens_per_micro_batch`` the user did not set to the longest sequence.

    When the user's lengths (:data:`_LENGTH_KEYS`) make a sequence longer than the budget the
    preset (or the default) gives, no micro-batch could hold it; the budget becomes the length
    of the longest sequence.
    """
    key = "actor.max_tokens_per_micro_batch"
    given = [k for k in _LENGTH_KEYS if k in user]
    longest = cfg.data.max_prompt_length + response_cap(cfg)
    budget = cfg.actor.max_tokens_per_micro_batch
    if key in user or not given or budget >= longest:
        return cfg, []
    settings = ", ".join(f"{k}={_option(cfg, k)}" for k in given)
    note = (
        f"{key}={budget}, which you did not set, is below the longest sequence of the given "
        f"{settings} ({longest} tokens); using {longest} (set {key} to choose)"
    )
    return _set(cfg, key, longest, "the given lengths"), [note]


def load_config(
    preset: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> PolyRLConfig:
    """Load the full polyrl config.

    What the user sets wins over the preset: an override replaces the preset's value of the
    same key, and

    * ``data.train_files`` drops the preset's ``data.task`` (train on the user's files);
    * ``trainer.total_epochs`` drops the preset's ``trainer.total_steps`` (whichever of the two
      the user sets decides the run length; given both, a non-zero ``total_steps`` wins and a
      note says so);
    * ``data.max_response_length`` also sets ``rollout.max_new_tokens`` unless that is given.
    * a preset's mini-batch size (``actor.ppo_mini_batch_size``, ``prime.mini_batch_size``)
      that does not fit the given ``data.train_batch_size`` (or ``rollout.n``, world size)
      becomes the nearest one that does;
    * an ``actor.max_tokens_per_micro_batch`` below the longest sequence the given lengths
      allow is raised to it.

    Each such decision is reported as a :class:`ConfigNote` warning.

    A line that speaks verl (a key of :data:`~polyrl.config.verl_compat.VERL_KEYS` that is not
    a polyrl option) on the default or a bundled RL preset runs on verl's defaults instead of
    the preset's (:func:`~polyrl.config.verl_compat.verl_base`: the preset keeps only the keys
    that name its algorithm), with one note saying so.

    Args:
        preset: Bundled preset name (``default``, ``demo``; see :func:`available_presets`) or a
            YAML file path. ``None`` means ``default``.
        overrides: ``key.sub=value`` strings applied after the preset, in order, e.g.
            ``["trainer.total_steps=5", "data.train_files=[a.parquet,b.parquet]"]``; verl keys
            are read as the polyrl options they mean (:mod:`polyrl.config.verl_compat`).

    Returns:
        A validated :class:`PolyRLConfig` instance.

    Raises:
        ConfigError: unknown preset, unknown key (naming a near spelling, if any), wrong type,
            invalid value or malformed override; every problem of the overrides in one error,
            one per line.
    """
    data, source = read_preset("default" if preset is None else preset)
    read = _read_overrides(overrides, PolyRLConfig)
    # verl's defaults are verl's RL trainer's: for the default preset and the bundled RL ones
    # (SFT/DPO/RM presets have no algorithm group), never for a preset file the user wrote.
    bundled = preset is None or (isinstance(preset, str) and not _looks_like_path(preset))
    speaks_verl = bool(read.verl_keys) and bundled and ("algorithm" in data or not data)
    if speaks_verl:
        # A verl line means what it means in verl: its unset options take verl's defaults,
        # not the demo preset's (a preset file the user wrote stays theirs).
        data, kept = verl_compat.verl_base(data)
        keeps = f"; {source} gives only {', '.join(kept)}" if kept else ""
        read.notes.insert(
            0,
            f"the line speaks verl ({read.verl_keys[0]}, ...): options it leaves unset take "
            f"verl's defaults (docs/migrating_from_verl.md lists where polyrl differs){keeps}",
        )
        source = "verl's defaults"
    notes = _drop_preset_keys(data, read.user_keys, source)
    with deferred_registry_checks():  # the preset may name what its trainer.imports register
        base = from_dict(data, PolyRLConfig, source=source)
    cfg = _apply_all(base, read)
    if speaks_verl and "trainer.output_dir" not in read.user_keys:
        out_dir = verl_compat.verl_output_dir(cfg.trainer.project_name, cfg.trainer.experiment_name)
        cfg = _set(cfg, "trainer.output_dir", out_dir, source)
    cfg, yielded = _yield_preset_values(cfg, data, read.user_keys, source)
    cfg, raised = _yield_token_budget(cfg, read.user_keys)
    _emit(notes + read.notes + yielded + raised)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config object (a deep copy)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict expects a config dataclass instance, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """YAML text of a config; :func:`load_config` on it gives back an equal object."""
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def save_config(cfg: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` as YAML to ``path`` (creating parent directories); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_yaml(cfg), encoding="utf-8")
    return out


def describe(cfg_class: Any = PolyRLConfig) -> list[OptionInfo]:
    """List every option under a config class (or instance): key, type, default, help.

    Groups are expanded, so only options appear, in declaration order. Given an instance, the
    ``default`` column holds that instance's values.
    """
    obj = cfg_class() if isinstance(cfg_class, type) else cfg_class
    if not dataclasses.is_dataclass(obj):
        raise TypeError(f"describe expects a config dataclass, got {cfg_class!r}")
    return _describe(obj, "")


def _describe(obj: Any, prefix: str) -> list[OptionInfo]:
    rows: list[OptionInfo] = []
    hints = resolved_type_hints(type(obj))
    for f in _init_fields(type(obj)):
        tp = hints[f.name]
        value = getattr(obj, f.name)
        if _is_group(tp):
            rows.extend(_describe(value, f"{prefix}{f.name}."))
            continue
        rows.append(
            OptionInfo(
                key=f"{prefix}{f.name}",
                type=type_name(
                    tp, f.metadata.get("choices"), open_choices="registry" in f.metadata
                ),
                default=value,
                help=str(f.metadata.get("help", "")),
            )
        )
    return rows
