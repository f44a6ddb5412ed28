"""The native engine's fast paths: the C decode-attention kernel and the packed fast forward.

Each fast path is checked against the path it replaces (torch paged attention, the HF module
forward), which the rest of the engine tests check against HF ``generate``.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyrl.core.rollout_api import GenerateRequest, SampleOutput, SamplingParams
from polyrl.models.loader import load_causal_lm
from polyrl.models.tiny import build_tiny_model
from polyrl.rollout.native import NativeEngine, NativeEngineConfig, cpu_kernels
from polyrl.rollout.native.attention import StepMetadata, paged_attention
from polyrl.rollout.native.fast_forward import _rope, build_fast_forward
from polyrl.rollout.native.kv_cache import PagedKVCache

SMALL = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "kv_cache_tokens": 4096}


def run(engine: NativeEngine, requests: list[GenerateRequest]) -> dict[str, list[SampleOutput]]:
    """Submit requests, wait for every sample; return {request_id: [SampleOutput]}."""
    outs = {r.request_id: [SampleOutput(i) for i in range(r.params.n)] for r in requests}
    left = [sum(r.params.n for r in requests)]
    done = threading.Event()
    errors: list[BaseException] = []

    def sink(rid: str):
        def take(payload):
            if isinstance(payload, BaseException):
                errors.append(payload)
                done.set()
                return
            for d in payload:
                outs[rid][d.index].add(d)
                if d.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return take

    for r in requests:
        engine.submit(r, sink(r.request_id), stream=False)
    assert done.wait(120), "engine did not finish in time"
    assert not errors, errors
    return outs


def prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(16, 250, (k,), generator=g).tolist() for k in lens]


# Skips only without a C compiler; fails where one exists and the kernels did not build.
needs_kernels = pytest.mark.usefixtures("native_kernels")


def _reference(q, k_cache, v_cache, table, lens, scale, window):
    """Plain attention of each sequence's query over its gathered keys."""
    bs = k_cache.shape[1]
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        rows = torch.cat([k_cache[blk] for blk in table[b, : -(-n // bs)].tolist()])[:n]
        vals = torch.cat([v_cache[blk] for blk in table[b, : -(-n // bs)].tolist()])[:n]
        start = max(0, n - window) if window else 0
        k = rows[start:].transpose(0, 1)  # (kv_heads, n, dim)
        v = vals[start:].transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
        w = torch.softmax((q[b, :, None, :] @ k.transpose(1, 2))[:, 0] * scale, dim=-1)
        outs.append((w[:, None, :] @ v)[:, 0])
    return torch.stack(outs)


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "window"),
    [(6, 2, 32, 16, None), (4, 4, 24, 8, None), (8, 2, 64, 16, 20), (2, 1, 128, 16, None)],
)
def test_decode_kernel_matches_plain_attention(heads, kv_heads, dim, block_size, window):
    g = torch.Generator().manual_seed(heads * dim)
    num_blocks, b = 64, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    # Lengths below, at and across block boundaries; blocks scattered over the pool.
    lens = torch.tensor([1, block_size - 1, block_size, block_size + 1, 3 * block_size, 45, 61])
    width = -(-int(lens.max()) // block_size)
    table = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width)
    q = torch.randn(b, heads, dim, generator=g)
    scale = dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, window)
    want = _reference(q, k_cache, v_cache, table, lens, scale, window)
    assert got.shape == (b, heads, dim)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_kernels
def test_decode_kernel_rejects_wrong_layouts():
    k_cache = torch.zeros(4, 16, 2, 32)
    table = torch.zeros(1, 1, dtype=torch.long)
    lens = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="float32 CPU tensors"):
        cpu_kernels.paged_decode_attention(
            torch.zeros(1, 4, 32, dtype=torch.float64), k_cache, k_cache, table, lens, 1.0
        )
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.paged_decode_attention(
            torch.zeros(1, 4, 32), k_cache, k_cache, table.int(), lens, 1.0
        )


@needs_kernels
def test_rope_and_store_matches_torch_rope_and_writes_slots():
    g = torch.Generator().manual_seed(1)
    t, heads, kv_heads, dim = 9, 6, 2, 32
    q = torch.randn(t, heads, dim, generator=g)
    k = torch.randn(t, kv_heads, dim, generator=g)
    v = torch.randn(t, kv_heads, dim, generator=g)
    angles = torch.randn(t, dim // 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.zeros(4, 4, kv_heads, dim)
    v_cache = torch.zeros(4, 4, kv_heads, dim)
    slots = torch.tensor([3, 0, 15, 7, 8, 1, 2, 9, 4])
    want_q, want_k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    cpu_kernels.rope_and_store(q, k, v, cos, sin, slots, k_cache, v_cache)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, dim)[slots], want_k, atol=1e-6, rtol=0)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot outside"):
        cpu_kernels.rope_and_store(q, k, v, cos, sin, slots + 8, k_cache, v_cache)
    assert torch.equal(k_cache, before)  # nothing written


@needs_kernels
def test_add_rms_norm_matches_the_hf_norm():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 48, generator=g)
    delta = torch.randn(5, 48, generator=g)
    weight = torch.randn(48, generator=g)
    total = h + delta
    want = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = cpu_kernels.add_rms_norm(h, delta, weight, 1e-6)
    assert torch.equal(h, total)  # the residual add happened in place
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(h, None, weight, 1e-6), want)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_kernels.add_rms_norm(h.t(), None, weight, 1e-6)


@needs_kernels
def test_silu_mul_matches_torch_over_the_whole_range():
    g = torch.Generator().manual_seed(3)
    # 8-wide vector body and scalar tail; values out to where exp over- and underflows.
    gate = torch.cat([torch.randn(1001, generator=g) * 6, torch.tensor([-200.0, -90.0, 90.0])])
    up = torch.randn(gate.shape, generator=g)
    got = cpu_kernels.silu_mul(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=2e-6)
    assert torch.isfinite(got).all()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_kernels.silu_mul(gate, up[:-1])


@needs_kernels
def test_decode_kernel_refuses_blocks_outside_the_cache():
    k_cache = torch.zeros(4, 16, 2, 32)
    q = torch.zeros(1, 4, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.paged_decode_attention(
            q, k_cache, k_cache, torch.tensor([[1, 4]]), torch.tensor([20]), 1.0
        )


def test_kernels_can_be_switched_off(monkeypatch):
    was = cpu_kernels.available()
    monkeypatch.setenv("POLYRL_NATIVE_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_why", None)
    assert not cpu_kernels.available()
    assert "POLYRL_NATIVE_KERNELS" in cpu_kernels.unavailable_reason()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.paged_decode_attention(
            torch.zeros(1, 2, 8),
            torch.zeros(1, 4, 2, 8),
            torch.zeros(1, 4, 2, 8),
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
        )
    monkeypatch.undo()
    assert cpu_kernels.available() == was


@needs_kernels
def test_paged_attention_kernel_and_torch_paths_agree():
    """A mixed step (decode tokens, a fresh prefill, a continued prefill) through both paths."""
    g = torch.Generator().manual_seed(0)
    layers, blocks, bs, kvh, heads, dim = 1, 32, 4, 2, 6, 16
    cache = PagedKVCache(layers, blocks, bs, kvh, dim, torch.float32, torch.device("cpu"))
    cache.k(0).copy_(torch.randn(cache.k(0).shape, generator=g))
    cache.v(0).copy_(torch.randn(cache.v(0).shape, generator=g))
    dec_lens = [3, 6, 9]  # decode tokens at positions 2, 5, 8
    dec_table = torch.tensor([[0, 0, 0], [1, 2, 0], [3, 4, 5]])
    slots = [0 * bs + 2, 2 * bs + 1, 5 * bs + 0]
    fresh_len = 5  # a new sequence in blocks 6, 7
    slots += [6 * bs + i for i in range(4)] + [7 * bs]
    t = len(slots)
    q = torch.randn(t, heads, dim, generator=g)
    k = torch.randn(t, kvh, dim, generator=g)
    v = torch.randn(t, kvh, dim, generator=g)
    outs = []
    for use_kernel in (False, True):
        meta = StepMetadata(
            cache,
            torch.tensor(slots),
            dec_table,
            torch.tensor(dec_lens),
            dec_lens,
            [(3, fresh_len)],
            None,
            use_kernel=use_kernel,
        )
        outs.append(paged_attention(0, q, k, v, meta, dim**-0.5, None))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_fast_forward_matches_the_hf_forward(arch, tmp_path_factory):
    """Same tokens and log-probs with the engine's forward as with the HF module forward."""
    path = build_tiny_model(arch, tmp_path_factory.mktemp(arch) / "m", size="nano")
    ps = prompts(5, seed=11, lo=3, hi=40)
    params = SamplingParams(max_new_tokens=10, seed=3, logprobs=True, ignore_eos=True)
    results = []
    for fast in (True, False):
        eng = NativeEngine(path, NativeEngineConfig(fast_forward=fast, **SMALL))
        assert (eng.runner.fast is not None) == fast
        eng.start()
        try:
            reqs = [GenerateRequest(f"{arch}{i}", tuple(p), params) for i, p in enumerate(ps)]
            results.append(run(eng, reqs))
        finally:
            eng.shutdown()
    for rid, samples in results[0].items():
        other = results[1][rid][0]
        assert samples[0].output_ids == other.output_ids, rid
        gap = max(abs(a - b) for a, b in zip(samples[0].logprobs, other.logprobs, strict=True))
        assert gap < 1e-5, (rid, gap)


def test_fast_forward_declines_models_it_does_not_reproduce(tiny_qwen2_dir):
    model = load_causal_lm(tiny_qwen2_dir)
    assert build_fast_forward(model) is not None
    model.model.layers[1].input_layernorm = nn.LayerNorm(model.config.hidden_size)
    assert build_fast_forward(model) is None
    model = load_causal_lm(tiny_qwen2_dir)
    model.config.model_type = "gpt_neox"
    assert build_fast_forward(model) is None


def _packed_prefill(model: nn.Module, fast) -> tuple[torch.Tensor, list[list[int]]]:
    """One packed prefill of two prompts; the last tokens' logits, and the prompts."""
    cfg = model.config
    kvh = cfg.num_key_value_heads
    dim = cfg.hidden_size // cfg.num_attention_heads
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 16, kvh, dim, torch.float32, torch.device("cpu"))
    a, b = prompts(2, seed=12, lo=5, hi=20)
    ids = torch.tensor(a + b)
    pos = torch.tensor(list(range(len(a))) + list(range(len(b))))
    slots = torch.tensor(list(range(len(a))) + [64 + i for i in range(len(b))])
    meta = StepMetadata(cache, slots, None, None, [], [(0, len(a)), (len(a), len(b))], None)
    return fast(ids, pos, torch.tensor([len(a) - 1, len(a) + len(b) - 1]), meta), [a, b]


def test_fast_forward_logits_equal_hf_logits(tiny_qwen2_dir):
    """One packed prefill of two sequences: logits of the last tokens equal the HF model's."""
    model = load_causal_lm(tiny_qwen2_dir)
    fast = build_fast_forward(model)
    assert fast is not None
    logits, (a, b) = _packed_prefill(model, fast)
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in (a, b)])
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert F.cosine_similarity(logits, want).min() > 0.9999


def test_bf16_matmuls_stay_close_and_follow_weight_changes(tiny_qwen2_dir):
    """bf16 projections over fp32 weights: near the fp32 logits, refreshed on invalidate()."""
    model = load_causal_lm(tiny_qwen2_dir)
    fast32, fast16 = build_fast_forward(model), build_fast_forward(model, torch.bfloat16)
    assert fast32 is not None and fast16 is not None and fast16.matmul_dtype == torch.bfloat16
    want, _ = _packed_prefill(model, fast32)
    got, _ = _packed_prefill(model, fast16)
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)  # the bf16 path really ran
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert F.cosine_similarity(got, want).min() > 0.999
    with torch.no_grad():  # new projection weights, written in place as an in-place update does
        for layer in model.model.layers:
            for proj in (*layer.self_attn.children(), *layer.mlp.children()):
                if isinstance(proj, nn.Linear):
                    proj.weight.data.mul_(1.25)
    stale, _ = _packed_prefill(model, fast16)
    assert torch.equal(stale, got)  # the copies were made before the change
    fast16.invalidate()
    fresh, _ = _packed_prefill(model, fast16)
    rebuilt, _ = _packed_prefill(model, build_fast_forward(model, torch.bfloat16))
    assert torch.equal(fresh, rebuilt) and not torch.allclose(fresh, got, atol=0.05)


def test_engine_bf16_matmuls_follow_every_kind_of_weight_update(
    tiny_qwen2_dir, tiny_qwen2_seed1_dir
):
    """load_weights and a streamed in-place update both refresh the bf16 weight copies."""
    with pytest.raises(ValueError, match="matmul_dtype"):
        NativeEngineConfig(matmul_dtype="int8")
    config = NativeEngineConfig(matmul_dtype="bfloat16", **SMALL)
    ps = prompts(3, seed=21, lo=4, hi=30)
    params = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True, ignore_eos=True)

    def greedy(eng: NativeEngine, tag: str) -> list[tuple[list[int], list[float]]]:
        reqs = [GenerateRequest(f"{tag}{i}", tuple(p), params) for i, p in enumerate(ps)]
        outs = run(eng, reqs)
        return [(outs[r.request_id][0].output_ids, outs[r.request_id][0].logprobs) for r in reqs]

    expected = {}
    for name, path in (("a", tiny_qwen2_dir), ("b", tiny_qwen2_seed1_dir)):
        fresh = NativeEngine(path, config)
        fresh.start()
        try:
            expected[name] = greedy(fresh, name)
        finally:
            fresh.shutdown()
    assert expected["a"] != expected["b"]
    weights = {
        name: dict(load_causal_lm(path).named_parameters())
        for name, path in (("a", tiny_qwen2_dir), ("b", tiny_qwen2_seed1_dir))
    }
    eng = NativeEngine(tiny_qwen2_dir, config)
    assert eng.runner.fast is not None and eng.runner.fast.matmul_dtype == torch.bfloat16
    eng.start()
    try:
        assert greedy(eng, "a0") == expected["a"]
        eng.load_weights(weights["b"].items())
        assert greedy(eng, "b1") == expected["b"]
        eng.begin_weight_update("t1", mode="inplace", inflight="pause")
        names = list(weights["a"])
        for name in names:
            eng.weight_destination("t1", name).copy_(weights["a"][name].detach())
        eng.commit_weight_update("t1", names)
        assert greedy(eng, "a2") == expected["a"]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fast_forward_rope_table_equals_the_rotary_module(arch, tmp_path_factory):
    """Table rows are bit for bit the module's cos/sin, across table growth and batch sizes."""
    path = build_tiny_model(arch, tmp_path_factory.mktemp(arch) / "m", size="nano")
    model = load_causal_lm(path)
    fast = build_fast_forward(model)
    assert fast is not None and fast._rope_static
    h = torch.randn(3, model.config.hidden_size)
    g = torch.Generator().manual_seed(5)
    # Positions past the first table size (1024) make it grow.
    batches = [torch.randint(0, top, (n,), generator=g) for n, top in [(1, 10), (37, 600)]]
    batches += [torch.randint(0, 3000, (300,), generator=g), torch.tensor([17, 4500, 0])]
    for pos in batches:
        cos, sin = model.model.rotary_emb(h.unsqueeze(0), pos.unsqueeze(0))
        got_cos, got_sin = fast._cos_sin(h, pos)
        assert torch.equal(got_cos, cos[0]) and torch.equal(got_sin, sin[0]), pos
    assert fast._rope_table is not None and fast._rope_table[0].shape[0] == 8192
