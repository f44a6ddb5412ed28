"""Shared pytest fixtures: a real local Ray cluster and per-test temp dirs."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter

import pytest

# Keep Ray quiet and small on a 2-core CI box; never reach for the dashboard or usage stats.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """Order the test files heaviest first: those with the most ``slow`` tests, then the most tests.

    ``make test`` hands whole files to two workers in collection order (``--dist loadfile
    --no-loadscope-reorder``). xdist's own order (most tests first) left the files of one or
    two long end-to-end tests for last, where one worker ran them while the other sat idle;
    ending on files of quick tests lets both workers finish together. The order inside a file
    is kept (a stable sort on a key that is the same for all of a file's tests). Serial runs keep
    pytest's order.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for item in items:
        tests[file_of(item)] += 1
        slow[file_of(item)] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: (-slow[file_of(item)], -tests[file_of(item)], file_of(item)))


@pytest.fixture
def loop():
    """An event loop running in a thread of its own (for code that runs coroutines on it)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


@pytest.fixture(scope="session")
def ray_session():
    """A real single-node Ray cluster shared by the whole test session.

    Started with 4 logical CPUs (the machine has 2 cores) so tests can place a few actors.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=True,
            object_store_memory=1 << 30,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
    from polyrl.transfer.segments import sweep_segments

    # Ray kills its workers without their exit handlers: remove the transfer segments they
    # kept in /dev/shm (RAM) once they are gone.
    sweep_segments(wait_s=5.0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A nano qwen2 tiny model (seed 0), built once per session; treat it as read-only."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2-nano", size="nano")


@pytest.fixture(scope="session")
def tiny_qwen2_seed1_dir(tmp_path_factory):
    """The same architecture as ``tiny_qwen2_dir`` with other weights (seed 1); read-only."""
    from polyrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model("qwen2", root / "qwen2-nano-seed1", size="nano", seed=1)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A nano qwen2_vl tiny vision-language model (seed 0), built once per session; read-only."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("tiny") / "qwen2-vl-nano")


@pytest.fixture(scope="session")
def tiny_vl_processor(tiny_vl_dir):
    """The :class:`~polyrl.models.processor.VisionProcessor` of ``tiny_vl_dir``."""
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(tiny_vl_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory):
    """A nano qwen2_5_vl tiny vision-language model (seed 0), built once per session; read-only."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2.5-vl-nano")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_processor(tiny_qwen2_5_vl_dir):
    """The :class:`~polyrl.models.processor.VisionProcessor` of ``tiny_qwen2_5_vl_dir``."""
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(tiny_qwen2_5_vl_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory):
    """A qwen3_vl tiny vision-language model (seed 0), built once per session; read-only.

    Nano with 2 decoder layers; 16-pixel patches, images resized to about 64 x 64 (2 x 2
    tokens); DeepStack features of the first vision block added after the first decoder layer.
    """
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny") / "qwen3-vl", layers=2)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_processor(tiny_qwen3_vl_dir):
    """The :class:`~polyrl.models.processor.VisionProcessor` of ``tiny_qwen3_vl_dir``."""
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(tiny_qwen3_vl_dir)


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory):
    """A nano smolvlm tiny vision-language model (seed 0), built once per session; read-only.

    SigLIP tiles of 32 pixels, 4 tokens each; an image's longest edge is resized to 64, so it
    fills up to 2 x 2 tiles plus the global view.
    """
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("smolvlm", tmp_path_factory.mktemp("tiny") / "smolvlm-nano")


@pytest.fixture(scope="session")
def tiny_smolvlm_processor(tiny_smolvlm_dir):
    """The :class:`~polyrl.models.processor.VisionProcessor` of ``tiny_smolvlm_dir``."""
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(tiny_smolvlm_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_tokenizer(tiny_qwen2_dir):
    """The tokenizer of ``tiny_qwen2_dir``."""
    from polyrl.models.loader import load_tokenizer

    return load_tokenizer(tiny_qwen2_dir)


@pytest.fixture(scope="session")
def agent_server(tiny_qwen2_dir):
    """One small native rollout server on the tiny qwen2 model, shared by the agent tests."""
    from polyrl.rollout.launcher import ServerProcess

    options = {
        "num_threads": 1,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "kv_cache_tokens": 8192,
        "max_model_len": 2048,
    }
    proc = ServerProcess(tiny_qwen2_dir, options=options).start(timeout=180)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def engines():
    """``engines(*args, **kwargs)`` builds a model engine that is closed after the test."""
    from polyrl.model_engine import build_engine

    made = []

    def make(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


@pytest.fixture
def native_kernels():
    """The native engine's C kernels, built: skip where no C compiler exists, else fail.

    The engine falls back to torch when the kernels do not build, so a test that skipped on
    ``not available()`` would hide a source that no longer compiles: only a machine without a
    compiler may skip.
    """
    from polyrl.rollout.native import cpu_kernels

    if cpu_kernels.available():
        return
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler here, so no native kernels (the torch path is tested instead)")
    pytest.fail(
        f"a C compiler exists but the native kernels are unavailable: "
        f"{cpu_kernels.unavailable_reason()}"
    )
