"""Fixtures of the vLLM backend tests: the vLLM venv, tiny models, one shared vLLM server.

These tests need ``.venv-vllm`` (``make test-vllm`` creates it first through
``scripts/setup_vllm_venv.sh``); they are not part of ``make test``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

T = TypeVar("T")

# vLLM's CPU attention wants head sizes of 32 or more; the nano preset has 16-wide heads, so
# the test model is nano with 2 query heads and 1 KV head (head size 64 / 2 = 32).
TINY = {"size": "nano", "heads": 2, "kv_heads": 1}


class Loop:
    """One event loop for the whole session, run from the main thread.

    The backend's HTTP client and tasks belong to the loop they were made on, so every test
    runs its coroutine on this same loop.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 180.0) -> T:
        """Run ``coro`` to completion (failing after ``timeout`` seconds)."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        """Close the loop."""
        self.loop.close()


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """Return the vLLM virtual environment; fail clearly when it was never set up."""
    from polyrl.rollout.vllm_backend import default_vllm_venv, vllm_available

    venv = default_vllm_venv()
    if not vllm_available(venv):
        pytest.fail(
            f"no vLLM installation in {venv}: run `make test-vllm` (which runs "
            "scripts/setup_vllm_venv.sh first) or set POLYRL_VLLM_VENV",
            pytrace=False,
        )
    return venv


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build a tiny qwen2 (tied embeddings, head size 32) that vLLM's CPU kernels can run."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("models") / "v1", seed=0, **TINY)


@pytest.fixture(scope="session")
def model_dir_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the same architecture with other random weights (seed 1): an update."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("models") / "v2", seed=1, **TINY)


@pytest.fixture(scope="session")
def aio() -> Iterator[Loop]:
    """Provide the session's event loop."""
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def backend(vllm_venv: Path, model_dir: Path, aio: Loop) -> Iterator[Any]:
    """One started :class:`VLLMBackend` shared by the tests (starting one takes ~30-60 s)."""
    from polyrl.rollout.vllm_backend import VLLMBackend

    # --enable-scale-out: the text model serves the image route too, so its test can
    # compare it with /v1/completions (the backend adds the flag for vision models only).
    b = VLLMBackend(
        model_dir, vllm_venv=str(vllm_venv), dtype="float32", extra_args=("--enable-scale-out",)
    )
    aio.run(b.start(), timeout=900)
    try:
        yield b
    finally:
        aio.run(b.shutdown(), timeout=120)
