"""Every Python snippet in the README and docs/ parses, and every polyrl name it imports exists.

The snippets are not all run here (most start servers or train; the examples and the service
tests run the same calls), but a renamed or removed API must not survive in the docs.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    """``(page:line, code)`` of every fenced Python block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(REPO)}:{line}", source_of(match.group(1))))
    return found


def source_of(block: str) -> str:
    """The code of a block; of an interactive session, its input lines (not the output)."""
    lines = block.splitlines()
    if not any(x.startswith(">>> ") for x in lines):
        return block
    return "\n".join(x[4:] for x in lines if x.startswith((">>> ", "... ")))


SNIPPETS = snippets()


def test_the_docs_have_python_snippets():
    assert len(SNIPPETS) >= 20  # the pattern still finds them


@pytest.mark.parametrize("where, code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_parses_and_its_polyrl_imports_exist(where, code):
    tree = ast.parse(code, filename=where)  # a SyntaxError names the page and line
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "polyrl":
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            if missing:  # a submodule imported by name counts too
                missing = [
                    n for n in missing if importlib.util.find_spec(f"{node.module}.{n}") is None
                ]
            assert not missing, f"{where}: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "polyrl":
                    importlib.import_module(alias.name)
