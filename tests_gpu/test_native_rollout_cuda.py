"""The native rollout engine on CUDA: greedy tokens equal Hugging Face ``generate``."""

from __future__ import annotations

import torch
from gpu_common import run_engine

from polyrl.core.rollout_api import GenerateRequest, SamplingParams
from polyrl.models.loader import load_causal_lm
from polyrl.rollout.native import NativeEngine, NativeEngineConfig

NEW_TOKENS = 16


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    """``n`` random prompts of 3..40 token ids (inside the tiny tokenizer's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(16, 1000, (k,), generator=g).tolist() for k in lens]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """``NEW_TOKENS`` greedy tokens of ``model.generate`` for one prompt."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def test_native_engine_greedy_equals_hf_generate_on_cuda(tiny_dir):
    ps = prompts(6)
    model = load_causal_lm(tiny_dir, "float32", "cuda")
    want = [hf_greedy(model, p) for p in ps]
    del model
    config = NativeEngineConfig(
        device="cuda",
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        kv_cache_tokens=4096,
    )
    engine = NativeEngine(tiny_dir, config)
    engine.start()
    try:
        assert engine.runner.device.type == "cuda"
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        # Submitted together: prefill and decode of several sequences share steps.
        reqs = [GenerateRequest(f"r{i}", tuple(p), params) for i, p in enumerate(ps)]
        got = run_engine(engine, reqs)
    finally:
        engine.shutdown()
    for i in range(len(ps)):
        assert got[f"r{i}"] == want[i], f"prompt {i}"
