"""Every Python snippet in the README and docs/ parses, and every polyrl name it imports exists.

The snippets are not all run here (most start servers or train; the examples and the service
tests run the same calls), but a renamed or removed API must not survive in the docs. The
quick start's are run: its shell lines and its Python script, as a new user would, with only
what the page says the reader changes (paths, step counts, the rows) made small.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
QUICKSTART = REPO / "docs" / "quickstart.md"


def blocks(text: str, language: str) -> list[re.Match[str]]:
    """The fenced ``language`` blocks of a page (group 1: the code)."""
    return list(re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M))


def snippets() -> list[tuple[str, str]]:
    """``(page:line, code)`` of every fenced Python block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in blocks(text, "python"):
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


def shell_lines(block: str) -> list[list[str]]:
    """The commands of a shell block, continuation lines joined, comments dropped."""
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]


def quickstart_block(language: str, index: int) -> str:
    return blocks(QUICKSTART.read_text(), language)[index].group(1)


def test_the_quickstarts_demo_lines_are_valid(capsys):
    from polyrl.cli import main

    first = shell_lines(quickstart_block("bash", 0))
    assert first[0] == ["polyrl", "config", "presets"]
    assert main(first[0][1:]) == 0
    assert "grpo" in capsys.readouterr().out.split()
    # The preset runs themselves are the demo's (trained by the trainer tests); here each line
    # must resolve to a config as written.
    for words in first[1:]:
        assert words[:2] == ["polyrl", "train"], words
        assert main(["config", "show", *words[2:]]) == 0, words


@pytest.fixture(scope="module")
def answers_at_once(tiny_qwen2_dir, tmp_path_factory) -> Path:
    """A copy of the tiny model whose every response is the end-of-text token.

    It stands in for the reader's instruct model, which ends its answers; a random tiny model
    would fill the page's 256-token responses and make the run minutes long.
    """
    import torch
    import transformers

    from polyrl.models.loader import load_tokenizer

    dst = tmp_path_factory.mktemp("model") / "answers-at-once"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    tokenizer = load_tokenizer(tiny_qwen2_dir)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the token's embedding ...
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        first = model.model.layers[0].self_attn  # ... plus one constant direction (v's bias)
        first.v_proj.weight.zero_()
        first.v_proj.bias.fill_(1.0)
        first.o_proj.weight[0, 0] = 100.0
        head = model.get_output_embeddings().weight  # which only the end token reads
        head[eos].zero_()
        head[eos, 0] = 50.0
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


@pytest.mark.slow
def test_the_quickstarts_own_data_lines_train_on_gsm8k_shaped_data(
    tmp_path, monkeypatch, capsys, answers_at_once, ray_session
):
    # Ray started first, in another working directory than the run's: the engine actors then
    # write the export under the run's output directory only if the driver made it absolute.
    from polyrl.cli import main
    from polyrl.data import preprocess_gsm8k
    from polyrl.data.io import read_rows, write_rows

    model = answers_at_once
    raw = read_rows(preprocess_gsm8k.sample_gsm8k_path())  # GSM8K's question / answer rows
    (tmp_path / "gsm8k").mkdir()
    write_rows(raw * 2, tmp_path / "gsm8k" / "train.parquet")  # a batch of 32 needs 32 rows
    write_rows(raw[:4], tmp_path / "gsm8k" / "test.parquet")
    monkeypatch.chdir(tmp_path)
    convert, train = shell_lines(quickstart_block("bash", 1))
    assert convert[:3] == ["python", "-m", "polyrl.data.preprocess_gsm8k"]
    assert preprocess_gsm8k.main(convert[3:]) == 0
    assert train[:3] == ["polyrl", "train", "grpo"]
    assert "model.path=/models/Qwen2.5-0.5B-Instruct" in train
    line = [f"model.path={model}" if w.startswith("model.path=") else w for w in train[1:]]
    # The presets' 64-token prompt limit is why the page sets one: without it, one line
    # naming the option, before training.
    short = [w for w in line if not w.startswith("data.max_prompt_length=")]
    assert main([*short, "trainer.total_steps=1"]) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("polyrl: error:")]
    assert len(errors) == 1 and "raise data.max_prompt_length" in errors[0], err
    assert "Traceback" not in err
    assert not Path("outputs/grpo/hf_model").exists()
    assert main([*line, "trainer.total_steps=1"]) == 0  # the page: total_steps sets the length
    assert "[rl] done: steps=1" in capsys.readouterr().out
    assert Path("outputs/grpo/hf_model/config.json").is_file()


@pytest.mark.slow
def test_the_quickstarts_python_script_runs(tmp_path, answers_at_once):
    code = quickstart_block("python", 0)
    for doc, run in (
        ('model="path/to/hf_model"', f"model={str(answers_at_once)!r}"),
        ("trainer.total_steps=20", "trainer.total_steps=1"),
        ("]  # ... more rows", "] * 32"),  # a batch of 32 needs 32 rows
    ):
        assert doc in code, doc
        code = code.replace(doc, run)
    (tmp_path / "train.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "outputs" / "grpo" / "rl_summary.json").is_file()
