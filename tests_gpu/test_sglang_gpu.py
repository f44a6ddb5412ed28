"""The ``sglang`` rollout backend against a real SGLang server on a CUDA GPU.

Skipped (with the reason) unless this process sees a CUDA GPU and the SGLang venv
(``scripts/setup_sglang_venv.sh``, or ``$POLYRL_SGLANG_VENV``) imports ``sglang``. Run with
``pytest tests_gpu/test_sglang_gpu.py``. One server is launched for the whole test: greedy
generation is checked against the Hugging Face model's log-probs, then the weights are
replaced from disk and the output follows the new ones.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest

from polyrl.core.rollout_api import GenerateRequest, SamplingParams, collect_outputs
from polyrl.rollout.sglang_backend import SGLangBackend, default_sglang_venv, sglang_available

# qwen2 "micro" with 3 query heads and 1 KV head: head size 64, which every SGLang GPU
# attention backend takes.
TINY = {"size": "micro", "heads": 3, "kv_heads": 1}
PROMPT = (272, 86, 440, 691, 511)
NEW_TOKENS = 12
# Log-prob agreement with the fp32 HF model, for a bfloat16 server.
LOGPROB_TOL = 0.1


@functools.lru_cache(maxsize=1)
def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: SGLang's PyPI build ships CUDA kernels only"
    venv = default_sglang_venv()
    if not sglang_available(venv):
        return f"no SGLang in {venv}: run scripts/setup_sglang_venv.sh or set POLYRL_SGLANG_VENV"
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sglang"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if probe.returncode != 0:
        return f"'import sglang' fails in {venv}: {probe.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="module", autouse=True)
def _needs_sglang_and_gpu() -> None:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)


def _build(root: Path, seed: int) -> Path:
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", root / f"seed{seed}", seed=seed, **TINY)


def _hf_logprobs(model_dir: Path, prompt: tuple[int, ...], output: list[int]) -> Any:
    """Teacher-forced fp32 log-softmax of the HF model at each output position (CPU)."""
    import torch

    from polyrl.models.loader import load_causal_lm

    model = load_causal_lm(str(model_dir)).eval()
    ids = torch.tensor([list(prompt) + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def _check_greedy(model_dir: Path, output: list[int], logprobs: list[float]) -> None:
    """Each token is (within bf16 noise) the HF argmax, with the HF log-prob."""
    table = _hf_logprobs(model_dir, PROMPT, output)
    for pos, (tok, lp) in enumerate(zip(output, logprobs, strict=True)):
        row = table[pos]
        assert float(row[tok]) >= float(row.max()) - LOGPROB_TOL, (pos, tok)
        assert abs(float(row[tok]) - lp) < LOGPROB_TOL, (pos, tok, lp, float(row[tok]))


async def _greedy(backend: SGLangBackend, rid: str) -> tuple[list[int], list[float], int]:
    params = SamplingParams(
        temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
    )
    request = GenerateRequest(rid, PROMPT, params)
    out = await collect_outputs(request, await backend.generate(request))
    (sample,) = out.outputs
    assert sample.finish_reason == "length"
    assert sample.logprobs is not None
    return sample.output_ids, sample.logprobs, sample.weight_version


def test_greedy_generation_and_weight_update(tmp_path: Path) -> None:
    """Greedy tokens and log-probs match HF; abort keeps partials; a disk update takes over."""
    v1 = _build(tmp_path, seed=0)
    v2 = _build(tmp_path, seed=1)

    async def go() -> None:
        backend = SGLangBackend(
            v1,
            dtype="bfloat16",
            gpu_memory_utilization=0.3,
            max_model_len=256,
            log_path=str(tmp_path / "sglang.log"),
        )
        await backend.start()
        try:
            assert backend.info.backend == "sglang"
            ids, lps, version = await _greedy(backend, "g1")
            assert len(ids) == NEW_TOKENS and version == 0
            _check_greedy(v1, ids, lps)
            again, _, _ = await _greedy(backend, "g2")
            assert again == ids  # greedy is deterministic

            # Streaming with n=2 and an abort part-way keeps the tokens generated so far.
            params = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True, n=2)
            stream = await backend.generate(GenerateRequest("ab", PROMPT, params))
            seen = 0
            aborted = False
            finish: list[str] = []
            async for delta in stream:
                seen += len(delta.token_ids)
                if delta.finish_reason:
                    finish.append(delta.finish_reason)
                if seen >= 4 and not aborted:
                    aborted = True
                    assert await backend.abort(["ab"]) == 1
            # A sample may just have finished on its own (200 tokens) before the abort landed.
            assert len(finish) == 2 and "abort" in finish and 4 <= seen < 400

            assert await backend.update_weights(str(v2)) == 1
            new_ids, new_lps, new_version = await _greedy(backend, "g3")
            assert new_version == 1
            _check_greedy(v2, new_ids, new_lps)
            assert new_ids != ids  # other random weights, other tokens
            stats = backend.stats()
            assert stats.weight_version == 1
            assert stats.generated_tokens_total >= 3 * NEW_TOKENS
        finally:
            await backend.shutdown()
        assert backend.process is None or backend.process.poll() is not None

    asyncio.run(asyncio.wait_for(go(), 1200))
