"""The layer contract import-linter cannot see: module names in strings imported at run time.

import-linter (``make lint``, ``[tool.importlinter]`` in ``pyproject.toml``) follows ``import``
statements only. A package below the trainer that names the trainer (or the entry points) in a
string -- a loss sent as ``"polyrl.trainer...:fn"`` and imported by the worker, an
``importlib.import_module("polyrl.trainer...")`` -- would load the layer above it unseen. This
scans the source of every package below the trainer for string literals (f-strings included)
that start with such a module name, and checks that the workers refuse a loss import path into
polyrl. ``make lint`` runs this file too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The layers no package below them may name: the trainer and the entry points above it.
TOP = "polyrl.trainer"


def _layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = (c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [[p.strip() for p in layer.split("|")] for layer in contract["layers"]]


def _split(layers: list[list[str]]) -> tuple[list[str], list[str]]:
    """``(forbidden names: the trainer and above, packages below the trainer)``."""
    cut = next(i for i, layer in enumerate(layers) if TOP in layer)
    above = [p for layer in layers[: cut + 1] for p in layer]
    below = [p for layer in layers[cut + 1 :] for p in layer]
    return above, below


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Each string literal's line and text; an f-string counts by its literal start."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                found.append((node.lineno, head.value))
    return found


def names_upper_layer(text: str, forbidden: list[str]) -> bool:
    """Whether ``text`` starts with a ``forbidden`` module (``pkg``, ``pkg.x``, ``pkg:f``)."""
    text = text.strip()
    return any(text == name or text.startswith((f"{name}.", f"{name}:")) for name in forbidden)


def test_the_scan_sees_the_forms_that_import_at_run_time():
    forbidden, below = _split(_layers())
    assert "polyrl.trainer" in forbidden and "polyrl.cli" in forbidden
    assert {"polyrl.workers", "polyrl.controller", "polyrl.core", "polyrl.algo"} <= set(below)
    source = (
        "import importlib\n"
        'LOSS = "polyrl.trainer.rl_losses:actor_loss"\n'
        'importlib.import_module("polyrl.trainer.rl.loop")\n'
        'module = f"polyrl.cli.{name}"\n'
        'doc = "see polyrl.trainer.rl.loop for the step"\n'
    )
    hits = {line for line, s in _strings(ast.parse(source)) if names_upper_layer(s, forbidden)}
    assert hits == {2, 3, 4}


def test_no_package_below_the_trainer_names_it_in_a_string():
    forbidden, below = _split(_layers())
    offenders = []
    for package in below:
        base = ROOT / package.replace(".", "/")
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        assert files and all(f.exists() for f in files), f"{package} not found under {ROOT}"
        for path in files:
            for line, text in _strings(ast.parse(path.read_text(), filename=str(path))):
                if names_upper_layer(text, forbidden):
                    offenders.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not offenders, "strings naming a layer above the trainer's line:\n" + "\n".join(
        offenders
    )


def test_no_module_sends_an_import_path_into_the_trainer():
    """The old form of a loss, ``"polyrl.trainer.rl_losses:actor_loss"``, is written nowhere."""
    offenders = []
    for path in sorted((ROOT / "polyrl").rglob("*.py")):
        for line, text in _strings(ast.parse(path.read_text(), filename=str(path))):
            if names_upper_layer(text, [TOP]) and ":" in text.split()[0]:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not offenders, "run-time import paths into the trainer:\n" + "\n".join(offenders)


def test_the_workers_resolve_rl_losses_by_name_and_refuse_paths_into_polyrl():
    from polyrl.workers.losses import ACTOR_LOSS, CRITIC_LOSS, PRM_LOSS, resolve_loss
    from polyrl.workers.rl_losses import actor_loss, critic_loss, prm_loss

    assert resolve_loss(ACTOR_LOSS) is actor_loss
    assert resolve_loss(CRITIC_LOSS) is critic_loss
    assert resolve_loss(PRM_LOSS) is prm_loss
    with pytest.raises(ValueError, match="registered name, not import path"):
        resolve_loss("polyrl.trainer.rl_losses:actor_loss")
