"""The one registry type: polyrl.core.registry.Registry."""

from __future__ import annotations

import sys
import types

import pytest

from polyrl.core.registry import Registry, UnknownNameError


def scorer(x: float) -> float:
    return x


def other(x: float) -> float:
    return -x


def test_register_get_names_and_mapping_access():
    reg: Registry = Registry("widget")
    assert reg.register("a", "alias")(scorer) is scorer
    reg.add("b", other)
    assert reg.get("a") is reg["alias"] is scorer and reg.get("b") is other
    assert reg.names() == ["a", "alias", "b"] == list(reg) and len(reg) == 3
    assert "a" in reg and "c" not in reg
    assert reg.items() == [("a", scorer), ("alias", scorer), ("b", other)]
    reg.remove("alias")
    reg.remove("never-registered")
    assert reg.names() == ["a", "b"]


def test_duplicate_is_refused_unless_same_entry_or_overwrite():
    reg: Registry = Registry("widget")
    reg.add("a", scorer)
    reg.add("a", scorer)  # the same object again is fine
    with pytest.raises(ValueError, match=r"widget 'a' is already registered.*overwrite=True"):
        reg.add("a", other)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", lambda x: x)
    reg.add("a", other, overwrite=True)
    assert reg.get("a") is other


def test_the_same_definition_imported_again_replaces_silently():
    reg: Registry = Registry("widget")
    reg.add("a", scorer)
    again = types.FunctionType(scorer.__code__, {}, "scorer")
    again.__qualname__, again.__module__ = scorer.__qualname__, scorer.__module__
    reg.add("a", again)
    assert reg.get("a") is again


def test_several_names_are_registered_all_or_none():
    reg: Registry = Registry("widget")
    reg.add("taken", other)
    with pytest.raises(ValueError, match="'taken' is already registered"):
        reg.register("free", "taken")(scorer)
    assert "free" not in reg
    with pytest.raises(ValueError, match="at least one widget name"):
        reg.register()
    with pytest.raises(ValueError, match="non-empty strings"):
        reg.register("ok", " ")


def test_unknown_name_suggests_the_closest_and_lists_known():
    reg: Registry = Registry("widget", hint="or give an import path")
    reg.add("gamma", scorer)
    reg.add("delta", other)
    with pytest.raises(UnknownNameError) as info:
        reg.get("gamna")
    message = str(info.value)
    assert message == (
        "unknown widget 'gamna'; did you mean 'gamma'? (known: delta, gamma); "
        "or give an import path"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(KeyError, match=r"unknown widget 'zzz' \(known: delta, gamma\)"):
        reg["zzz"]
    with pytest.raises(ValueError, match=r"unknown widget \['x'\]"):
        reg.get(["x"])  # type: ignore[arg-type]
    empty: Registry = Registry("thing")
    assert empty.unknown_message("x") == "unknown thing 'x' (known: none)"


def test_lazy_entries_import_their_module_on_first_get(tmp_path, monkeypatch):
    host = types.ModuleType("polyrl_test_registry_host")
    host.REG = Registry("widget", lazy={"lazy": "polyrl_test_lazy_widget"})
    monkeypatch.setitem(sys.modules, host.__name__, host)
    (tmp_path / "polyrl_test_lazy_widget.py").write_text(
        "import polyrl_test_registry_host as host\n"
        "@host.REG.register('lazy')\n"
        "def widget():\n"
        "    return 'built'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "polyrl_test_lazy_widget", raising=False)
    assert host.REG.names() == ["lazy"] and "lazy" in host.REG
    assert "polyrl_test_lazy_widget" not in sys.modules  # listing does not import
    assert host.REG.get("lazy")() == "built"
    assert "polyrl_test_lazy_widget" in sys.modules


def test_base_class_and_name_attribute():
    class Base:
        name = ""

    reg: Registry = Registry("plug-in", base=Base, name_attr="name")

    @reg.register("mine")
    class Mine(Base):
        pass

    assert Mine.name == "mine" and reg.get("mine") is Mine
    with pytest.raises(TypeError, match="plug-in 'bad' must be a Base subclass"):
        reg.register("bad")(object)
    with pytest.raises(TypeError, match="must be a Base subclass"):
        reg.add("instance", Mine())
    assert reg.names() == ["mine"]


def test_protocol_base_takes_classes_with_all_its_members():
    from typing import Protocol

    class Shape(Protocol):
        def area(self) -> float: ...

        @property
        def sides(self) -> int: ...

    reg: Registry = Registry("shape", base=Shape)

    @reg.register("square")
    class Square:  # no inheritance: the members are enough
        sides = 4

        def area(self) -> float:
            return 1.0

    assert reg.get("square") is Square

    class Blob:
        def area(self) -> float:
            return 0.0

    with pytest.raises(TypeError, match=r"Shape subclass or have all its members.*missing: sides"):
        reg.register("blob")(Blob)
    with pytest.raises(TypeError, match="must be a Shape subclass"):
        reg.add("instance", Square())
    assert reg.names() == ["square"]
