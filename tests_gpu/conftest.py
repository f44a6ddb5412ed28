"""GPU checks of polyrl: run on a CUDA machine (``make test-gpu`` / scripts/gpu_check.sh).

Not collected by ``make test`` (pyproject's ``testpaths`` names ``tests`` only). Every test
here is skipped when CUDA is unavailable, and for that reason alone; nothing imported at
collection time imports Ray (the lent GPU machine has none: these tests use the ``local``
worker backend).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pytest_collection_modifyitems(config, items):
    """Mark every test of this folder ``skipif(no CUDA)`` (hooks see the whole session)."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(NEEDS_CUDA)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The nano Qwen2 tiny model (seed 0, fp32 weights, local tokenizer); read-only."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2-nano", size="nano")


@pytest.fixture(scope="session")
def tiny_dir_seed1(tmp_path_factory) -> Path:
    """The same architecture as ``tiny_dir`` with other weights (seed 1); read-only."""
    from polyrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model("qwen2", root / "qwen2-nano-seed1", size="nano", seed=1)


#: scripts/gpu_check.sh names a file here: each test's outcome is appended as it finishes, so
#: a device call cut off by its time limit still brings back what ran.
LIVE_REPORT = os.environ.get("POLYRL_GPU_LIVE_REPORT")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_runtest_logreport(report):
    """Append ``PASSED`` / ``FAILED`` / ``NOT RUN`` lines to the live report (never "passed"
    for a skip: a skipped GPU test is a test that did not run)."""
    if not LIVE_REPORT:
        return
    line = None
    if report.skipped and report.when in ("setup", "call"):
        line = f"- NOT RUN {report.nodeid}: {_skip_reason(report)}"
    elif report.failed:
        what = "FAILED" if report.when == "call" else f"ERROR ({report.when})"
        line = f"- {what} {report.nodeid} ({report.duration:.1f}s)"
    elif report.when == "call":
        line = f"- PASSED {report.nodeid} ({report.duration:.1f}s)"
    if line is not None:
        with open(LIVE_REPORT, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def pytest_collectreport(report):
    """A module skipped whole (vLLM, SGLang: not installed here) is reported as not run."""
    if LIVE_REPORT and report.skipped:
        with open(LIVE_REPORT, "a", encoding="utf-8") as f:
            f.write(f"- NOT RUN {report.nodeid} (whole module): {_skip_reason(report)}\n")
