"""The native engine in-process: equality with HF, log-prob gap, seeds, batching, weights, sleep."""

from __future__ import annotations

import threading

import pytest
import torch

from polyrl.core.numerics import token_log_probs
from polyrl.core.rollout_api import (
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    SampleOutput,
    SamplingParams,
)
from polyrl.models.loader import load_causal_lm
from polyrl.models.tiny import build_tiny_model
from polyrl.rollout.native import NativeEngine, NativeEngineConfig

SMALL = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "kv_cache_tokens": 4096}


def run(engine: NativeEngine, requests: list[GenerateRequest], stream: bool = False, hook=None):
    """Submit requests and wait; return {request_id: [SampleOutput per sample]}."""
    outs = {r.request_id: [SampleOutput(i) for i in range(r.params.n)] for r in requests}
    left = [sum(r.params.n for r in requests)]
    done = threading.Event()
    errors: list[BaseException] = []

    def sink_for(rid: str):
        def sink(payload):
            if isinstance(payload, BaseException):
                errors.append(payload)
                done.set()
                return
            for d in payload:
                if hook is not None:
                    hook(rid, d)
                outs[rid][d.index].add(d)
                if d.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return sink

    for r in requests:
        engine.submit(r, sink_for(r.request_id), stream=stream)
    assert done.wait(120), "engine did not finish in time"
    assert not errors, errors
    return outs


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(16, 1000, (k,), generator=g).tolist() for k in lens]


def hf_greedy(model, prompt: list[int], n: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        **kw,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def other_dir(tiny_qwen2_seed1_dir):
    return tiny_qwen2_seed1_dir


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_causal_lm(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = NativeEngine(model_dir, NativeEngineConfig(**SMALL))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe"])
def test_greedy_equals_hf_generate(arch, tmp_path_factory):
    path = build_tiny_model(arch, tmp_path_factory.mktemp(arch) / "m", size="nano")
    model = load_causal_lm(path)
    eng = NativeEngine(path, NativeEngineConfig(**SMALL))
    eng.start()
    try:
        ps = prompts(4, seed=1)
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        reqs = [GenerateRequest(f"r{i}", tuple(p), params) for i, p in enumerate(ps)]
        outs = run(eng, reqs)
        for i, p in enumerate(ps):
            assert outs[f"r{i}"][0].output_ids == hf_greedy(model, p, 12), f"prompt {i}"
            assert outs[f"r{i}"][0].finish_reason == "length"
    finally:
        eng.shutdown()


def test_rollout_training_logprob_gap(engine, hf_model):
    """The gap between rollout log-probs and a teacher-forced training forward pass."""
    ps = prompts(6, seed=2)
    gaps = []
    for temperature in (1.0, 0.7):
        params = SamplingParams(
            max_new_tokens=16, temperature=temperature, seed=5, logprobs=True, ignore_eos=True
        )
        reqs = [GenerateRequest(f"g{temperature}-{i}", tuple(p), params) for i, p in enumerate(ps)]
        outs = run(engine, reqs)
        for i, p in enumerate(ps):
            sample = outs[f"g{temperature}-{i}"][0]
            full = torch.tensor([p + sample.output_ids])
            with torch.no_grad():
                logits = hf_model(full).logits[0, len(p) - 1 : -1]
            ref = token_log_probs(logits, torch.tensor(sample.output_ids), temperature)
            gaps.append((ref - torch.tensor(sample.logprobs)).abs().max().item())
    gap = max(gaps)
    print(f"rollout/training log-prob gap (max abs, fp32): {gap:.3e}")
    assert gap < 1e-4


def test_same_seed_same_tokens_whatever_is_batched(engine):
    ps = prompts(5, seed=3)
    params = SamplingParams(max_new_tokens=20, seed=1234, top_k=50, top_p=0.9, ignore_eos=True)
    alone = run(engine, [GenerateRequest("alone", tuple(ps[0]), params)])["alone"][0]
    crowd = [GenerateRequest("seeded", tuple(ps[0]), params)] + [
        GenerateRequest(f"other{i}", tuple(p), SamplingParams(max_new_tokens=30, n=2))
        for i, p in enumerate(ps[1:])
    ]
    together = run(engine, crowd, stream=True)["seeded"][0]
    assert together.output_ids == alone.output_ids
    other_seed = SamplingParams(max_new_tokens=20, seed=99, top_k=50, top_p=0.9, ignore_eos=True)
    different = run(engine, [GenerateRequest("d", tuple(ps[0]), other_seed)])["d"][0]
    assert different.output_ids != alone.output_ids
    # n samples of one seeded request differ from each other, and repeat exactly.
    multi = SamplingParams(max_new_tokens=10, seed=7, n=3, ignore_eos=True)
    a = run(engine, [GenerateRequest("m1", tuple(ps[1]), multi)])["m1"]
    b = run(engine, [GenerateRequest("m2", tuple(ps[1]), multi)])["m2"]
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert len({tuple(s.output_ids) for s in a}) == 3


@pytest.mark.parametrize("length", [7, 16, 37])
def test_forked_samples_equal_separate_requests(engine, length):
    # Samples after the first start from the first's prompt keys, values and logits (no
    # prefill of their own): each must give what a request of its own with its derived seed
    # gives, whether the prompt ends inside a block or on its edge. Log-probs agree to float
    # rounding only: BLAS may take another path for a one-row batch than for four rows.
    prompt = tuple(prompts(1, seed=20 + length, lo=length, hi=length + 1)[0])
    seed, n = 31, 4
    params = SamplingParams(max_new_tokens=12, seed=seed, n=n, logprobs=True, ignore_eos=True)
    steps_before = engine.stats().steps_total
    together = run(engine, [GenerateRequest(f"fork{length}", prompt, params)])[f"fork{length}"]
    # One step computes the prompt and the first token of every sample, then 11 decode steps.
    assert engine.stats().steps_total - steps_before == 12
    for i, sample in enumerate(together):
        own = SamplingParams(
            max_new_tokens=12,
            seed=(seed + 0x9E3779B97F4A7C15 * i) % 2**63,
            logprobs=True,
            ignore_eos=True,
        )
        rid = f"own{length}-{i}"
        alone = run(engine, [GenerateRequest(rid, prompt, own)])[rid][0]
        assert sample.output_ids == alone.output_ids, f"sample {i}"
        assert torch.allclose(
            torch.tensor(sample.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        ), f"sample {i}"
    assert len({tuple(s.output_ids) for s in together}) == n


def test_filters_restrict_the_draw(engine, hf_model):
    p = prompts(1, seed=4)[0]
    params = SamplingParams(max_new_tokens=12, top_k=3, seed=3, ignore_eos=True)
    out = run(engine, [GenerateRequest("k", tuple(p), params)])["k"][0].output_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([p + out])).logits[0, len(p) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(tok in top3[i].tolist() for i, tok in enumerate(out))
    # top_k=1 and a tiny top_p both collapse to greedy.
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    ref = run(engine, [GenerateRequest("g", tuple(p), greedy)])["g"][0].output_ids
    for i, kw in enumerate([{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}]):
        ps = SamplingParams(max_new_tokens=12, seed=i, ignore_eos=True, **kw)
        got = run(engine, [GenerateRequest(f"c{i}", tuple(p), ps)])[f"c{i}"][0].output_ids
        assert got == ref, kw


def test_repetition_penalty_matches_hf(engine, hf_model):
    p = prompts(1, seed=5)[0]
    params = SamplingParams(
        max_new_tokens=15, temperature=0, repetition_penalty=1.5, ignore_eos=True
    )
    out = run(engine, [GenerateRequest("rp", tuple(p), params)])["rp"][0].output_ids
    assert out == hf_greedy(hf_model, p, 15, repetition_penalty=1.5)


def test_top_logprobs_rank_the_distribution(engine, hf_model):
    p = prompts(1, seed=6)[0]
    params = SamplingParams(max_new_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    out = run(engine, [GenerateRequest("t", tuple(p), params)])["t"][0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([p + out.output_ids])).logits[0, len(p) - 1 : -1]
    lsm = torch.log_softmax(logits.float(), -1)
    for i, alts in enumerate(out.top_logprobs):
        assert [a for a, _ in alts] == lsm[i].topk(3).indices.tolist()
        assert alts[0][0] == out.output_ids[i]  # greedy picks the most likely
        assert abs(alts[0][1] - out.logprobs[i]) < 1e-6


def test_stop_conditions(engine, hf_model, model_dir):
    from polyrl.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    p = prompts(1, seed=7)[0]
    ref = hf_greedy(hf_model, p, 20)
    stop_tok = ref[5]
    params = SamplingParams(
        max_new_tokens=20, temperature=0, stop_token_ids=(stop_tok,), ignore_eos=True
    )
    out = run(engine, [GenerateRequest("st", tuple(p), params)])["st"][0]
    first = ref.index(stop_tok)
    assert out.output_ids == ref[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    text = tok.decode(ref, skip_special_tokens=True)
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_new_tokens=20, temperature=0, stop=(stop_str,), ignore_eos=True)
    out = run(engine, [GenerateRequest("ss", tuple(p), params)])["ss"][0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert stop_str in tok.decode(out.output_ids, skip_special_tokens=True)
    assert stop_str not in tok.decode(out.output_ids[:-1], skip_special_tokens=True)


def test_long_prompt_is_chunked_without_stalling_decodes(engine):
    steps: dict[str, list[int]] = {"short": [], "long": []}

    def hook(rid, delta):
        if delta.token_ids:
            steps[rid].append(engine.stats().steps_total)

    short = GenerateRequest(
        "short", (5, 6, 7), SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    )
    long = GenerateRequest(
        "long",
        tuple(prompts(1, seed=8, lo=600, hi=601)[0]),
        SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True),
    )
    run(engine, [short, long], stream=True, hook=hook)
    first_long = steps["long"][0]
    during = [s for s in steps["short"] if s <= first_long]
    # The 600-token prompt needs >= 10 steps of 63 prefill tokens; the short request got a
    # token in every one of them.
    assert len(during) >= 9
    assert during == list(range(during[0], during[0] + len(during)))


def test_prefix_cache_reuse_keeps_outputs(engine):
    base = prompts(1, seed=9, lo=70, hi=71)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    first = run(engine, [GenerateRequest("p1", tuple(base), params)])["p1"][0]
    assert first.cached_prompt_tokens == 0
    again = run(engine, [GenerateRequest("p2", tuple(base), params)])["p2"][0]
    assert again.cached_prompt_tokens == 64  # four full blocks of 16
    assert again.output_ids == first.output_ids


def test_preemption_under_a_tiny_kv_budget(model_dir, hf_model):
    eng = NativeEngine(
        model_dir,
        NativeEngineConfig(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_tokens=96),
    )
    eng.start()
    try:
        ps = prompts(4, seed=10, lo=20, hi=30)
        params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
        outs = run(eng, [GenerateRequest(f"q{i}", tuple(p), params) for i, p in enumerate(ps)])
        for i, p in enumerate(ps):
            assert outs[f"q{i}"][0].output_ids == hf_greedy(hf_model, p, 24)
        stats = eng.stats()
        assert stats.preemptions_total > 0
        assert stats.kv_cache_blocks_used == 0 and stats.running == stats.waiting == 0
    finally:
        eng.shutdown()


def test_seeded_samples_survive_preemption(model_dir, engine):
    # Each sample's stream position is request state: recomputing a preempted sequence resumes
    # its draws where they were, so a starved engine gives what a roomy one gives.
    ps = prompts(3, seed=11, lo=20, hi=30)
    params = SamplingParams(max_new_tokens=24, seed=5, n=2, ignore_eos=True)
    reqs = [GenerateRequest(f"s{i}", tuple(p), params) for i, p in enumerate(ps)]
    roomy = run(engine, reqs)
    eng = NativeEngine(
        model_dir, NativeEngineConfig(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_tokens=96)
    )
    eng.start()
    try:
        starved = run(eng, reqs)
        assert eng.stats().preemptions_total > 0
    finally:
        eng.shutdown()
    for r in reqs:
        assert [s.output_ids for s in starved[r.request_id]] == [
            s.output_ids for s in roomy[r.request_id]
        ]


def test_setup_runs_off_the_caller_thread_and_raises_in_it(engine, tmp_path):
    # The model is loaded in a thread that ends with the constructor (no OpenMP team of the
    # caller's outlives it), yet a failure still raises from the constructor.
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NativeEngine(tmp_path / "missing")
    # The engine thread runs with the intra-op thread count it was built with.
    assert engine._command(torch.get_num_threads).result() == engine._num_threads


def test_rejects_bad_requests_without_holding_anything(engine):
    vocab = engine.vocab_size
    with pytest.raises(InvalidRequestError, match="unknown token id"):
        engine.submit(GenerateRequest("b1", (1, vocab)), lambda p: None)
    with pytest.raises(InvalidRequestError, match="exceeds the context length"):
        params = SamplingParams(max_new_tokens=engine.max_model_len)
        engine.submit(GenerateRequest("b2", (1, 2), params), lambda p: None)
    too_long = tuple([5] * engine.max_model_len)
    with pytest.raises(InvalidRequestError, match="leaving no room"):
        engine.submit(GenerateRequest("b3", too_long), lambda p: None)
    s = engine.stats()
    assert s.running == s.waiting == 0 and s.kv_cache_blocks_used == 0


def test_load_weights_switches_atomically_and_versions(model_dir, other_dir):
    eng = NativeEngine(model_dir, NativeEngineConfig(**SMALL))
    eng.start()
    old_model, new_model = load_causal_lm(model_dir), load_causal_lm(other_dir)
    try:
        p = prompts(1, seed=11)[0]
        greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
        before = run(eng, [GenerateRequest("w0", tuple(p), greedy)])["w0"][0]
        assert before.weight_version == 0
        assert before.output_ids == hf_greedy(old_model, p, 10)

        # A long request streams while the switch happens: tokens up to the switch come from
        # the old weights, every later delta reports the new version.
        versions: list[tuple[int, list[int]]] = []
        long = GenerateRequest(
            "long", tuple(p), SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
        )
        done = threading.Event()

        def sink(payload):
            for d in payload:
                versions.append((d.weight_version, d.token_ids))
                if d.finish_reason:
                    done.set()

        eng.submit(long, sink, stream=True)
        while len(versions) < 3:
            done.wait(0.01)
        v = eng.load_weights(new_model.named_parameters())
        assert v == 1
        assert done.wait(60)
        seen = [ver for ver, _ in versions]
        assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 1
        old_part = [t for ver, toks in versions if ver == 0 for t in toks]
        assert old_part == hf_greedy(old_model, p, len(old_part))

        after = run(eng, [GenerateRequest("w1", tuple(p), greedy)])["w1"][0]
        assert after.weight_version == 1
        assert after.output_ids == hf_greedy(new_model, p, 10)
        assert after.output_ids != before.output_ids

        with pytest.raises(InvalidRequestError, match="not a parameter"):
            eng.load_weights([("model.nope.weight", torch.zeros(1))])
        name, param = next(iter(new_model.named_parameters()))
        with pytest.raises(InvalidRequestError, match="shape"):
            eng.load_weights([(name, torch.zeros(3, 3))])
        with pytest.raises(InvalidRequestError, match="missing"):
            eng.load_weights([(name, param)])
        assert eng.load_weights([(name, param)], version=7, partial=True) == 7
        assert eng.update_weights_from_dir(model_dir) == 8
        back = run(eng, [GenerateRequest("w2", tuple(p), greedy)])["w2"][0]
        assert back.output_ids == before.output_ids and back.weight_version == 8
    finally:
        eng.shutdown()


def test_sleep_and_wake_up(model_dir):
    eng = NativeEngine(model_dir, NativeEngineConfig(**SMALL))
    eng.start()
    try:
        p = prompts(1, seed=12)[0]
        greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
        ref = run(eng, [GenerateRequest("a", tuple(p), greedy)])["a"][0].output_ids
        kv = eng.stats().kv_cache_bytes
        assert kv > 0

        info = eng.sleep(1).result(10)
        assert info["kv_cache_bytes_released"] == kv and eng.stats().kv_cache_bytes == 0
        assert eng.stats().sleeping
        with pytest.raises(EngineUnavailableError, match="asleep"):
            eng.submit(GenerateRequest("z", tuple(p), greedy), lambda _: None)
        eng.wake_up().result(10)
        assert eng.stats().kv_cache_bytes == kv and not eng.stats().sleeping
        assert run(eng, [GenerateRequest("b", tuple(p), greedy)])["b"][0].output_ids == ref

        weights = eng.stats().weight_bytes
        info = eng.sleep(2).result(10)
        assert info["weight_bytes_released"] == weights and eng.stats().weight_bytes == 0
        eng.wake_up(["kv_cache"]).result(10)
        with pytest.raises(EngineUnavailableError, match="discarded"):
            eng.submit(GenerateRequest("y", tuple(p), greedy), lambda _: None)
        eng.update_weights_from_dir(model_dir)
        assert eng.stats().weight_bytes == weights
        assert run(eng, [GenerateRequest("c", tuple(p), greedy)])["c"][0].output_ids == ref
    finally:
        eng.shutdown()


def test_pause_abort_resume(engine):
    p = prompts(1, seed=13)[0]
    got: list[int] = []
    finished = threading.Event()
    final = {}

    def sink(payload):
        for d in payload:
            got.extend(d.token_ids)
            if d.finish_reason:
                final["reason"] = d.finish_reason
                finished.set()

    params = SamplingParams(max_new_tokens=2000, ignore_eos=True)
    engine.submit(GenerateRequest("pa", tuple(p), params), sink, stream=True)
    while len(got) < 3:
        finished.wait(0.01)
    engine.pause().result(10)
    frozen = len(got)
    finished.wait(0.3)
    assert len(got) == frozen and engine.stats().running == 1
    assert engine.abort(["pa"]).result(10) == 1
    assert finished.wait(10)
    assert final["reason"] == "abort" and 3 <= len(got) < 2000
    engine.resume().result(10)
    out = run(engine, [GenerateRequest("pb", (1, 2, 3), SamplingParams(max_new_tokens=3))])
    assert len(out["pb"][0].output_ids) <= 3


def test_prompt_logprobs_score_every_prompt_token(engine, hf_model):
    """Prompt log-probs equal a teacher-forced forward, chunked or prefix-cached alike."""
    # 150 tokens: three prefill chunks of SMALL's 64-token budget; asked twice, the second
    # time the prompt's blocks sit in the prefix cache and must be computed again anyway.
    p = prompts(1, seed=11, lo=150, hi=151)[0]
    params = SamplingParams(max_new_tokens=2, temperature=0.7, prompt_logprobs=3, n=2)
    outs = {}
    for rid in ("cold", "cached"):
        out = {}

        def keep(_rid, d, out=out):
            if d.prompt_logprobs is not None:
                out["lp"], out["top"] = d.prompt_logprobs, d.prompt_top_logprobs

        run(engine, [GenerateRequest(rid, tuple(p), params)], hook=keep)
        outs[rid] = out
    with torch.no_grad():
        logits = hf_model(torch.tensor([p])).logits[0, :-1].float() / 0.7
    ref = token_log_probs(logits, torch.tensor(p[1:]), 1.0)
    lsm = torch.log_softmax(logits, -1)
    for out in outs.values():
        assert out["lp"][0] is None and len(out["lp"]) == len(p)
        gap = (torch.tensor(out["lp"][1:]) - ref).abs().max().item()
        assert gap < 1e-5, gap
        assert out["top"][0] == []
        for i, alts in enumerate(out["top"][1:]):
            assert [a for a, _ in alts] == lsm[i].topk(3).indices.tolist()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=129)
