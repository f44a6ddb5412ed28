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
