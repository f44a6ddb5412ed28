"""docs/configuration.md is exactly what scripts/gen_config_doc.py generates from the schema."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_doc", REPO / "scripts/gen_config_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_current():
    gen = _generator()
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == gen.render(), "regenerate: python scripts/gen_config_doc.py"


def test_every_option_is_on_the_page():
    from polyrl.config import describe

    page = (REPO / "docs" / "configuration.md").read_text()
    missing = [row.key for row in describe() if f"| `{row.key}` |" not in page]
    assert not missing
