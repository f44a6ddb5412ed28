"""Backend-agnostic rollout pieces: sampling params, registry, KV blocks, scheduler, text."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    SampleDelta,
    SampleOutput,
    SamplingParams,
)
from polyrl.rollout.base import available_backends, create_backend, register_backend
from polyrl.rollout.native.kv_cache import BlockAllocator, NoFreeBlocksError
from polyrl.rollout.native.sampler import SamplingRow
from polyrl.rollout.native.scheduler import Scheduler, SeqStatus, Sequence

# ----------------------------------------------------------------------------- params


def test_sampling_params_defaults_and_round_trip():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.n == 1 and not p.greedy
    q = SamplingParams.from_dict(p.to_dict())
    assert q == p
    r = SamplingParams.from_dict({"stop": "END", "stop_token_ids": [3, 4], "temperature": 0})
    assert r.stop == ("END",) and r.stop_token_ids == (3, 4) and r.greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("max_new_tokens", 0),
        ("max_new_tokens", True),
        ("n", 0),
        ("n", 10_000),
        ("seed", -1),
        ("logprobs", 1),
        ("top_logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (-3,)),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_sampling_param_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value) and "expected" in str(info.value)
    assert info.value.status == 400


def test_unknown_sampling_param_suggests_the_close_name():
    with pytest.raises(InvalidRequestError, match="did you mean 'temperature'"):
        SamplingParams.from_dict({"tempreature": 0.5})
    with pytest.raises(InvalidRequestError, match="must be a JSON object"):
        SamplingParams.from_dict([1, 2])  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(
    temperature=st.floats(0, 5),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    n=st.integers(1, 16),
    max_new=st.one_of(st.none(), st.integers(1, 4096)),
)
def test_valid_sampling_params_survive_json(temperature, top_p, top_k, min_p, n, max_new):
    p = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        n=n,
        max_new_tokens=max_new,
    )
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_generate_request_checks_prompt():
    with pytest.raises(InvalidRequestError, match="at least one token"):
        GenerateRequest("r", ())
    with pytest.raises(InvalidRequestError, match="position 1"):
        GenerateRequest("r", (1, "x"))  # type: ignore[arg-type]


def test_sample_output_accumulates_deltas():
    out = SampleOutput(index=0)
    out.add(SampleDelta(0, [5, 6], [-1.0, -2.0], weight_version=3, first_weight_version=3))
    out.add(SampleDelta(0, [7], [-0.5], finish_reason="length", weight_version=4))
    assert out.output_ids == [5, 6, 7] and out.logprobs == [-1.0, -2.0, -0.5]
    assert out.finish_reason == "length"
    assert (out.first_weight_version, out.weight_version) == (3, 4)


# --------------------------------------------------------------------------- registry


def test_registry_lists_native_and_rejects_unknown():
    assert "native" in available_backends()
    with pytest.raises(ValueError, match="did you mean 'native'"):
        create_backend("nativ", "/nowhere")


def test_registry_refuses_a_second_factory_for_a_name():
    @register_backend("test-dummy")
    class Dummy:
        def __init__(self, model_dir, **options):
            self.model_dir = model_dir
            self.options = options

    assert create_backend("test-dummy", "/m", x=1).options == {"x": 1}
    with pytest.raises(ValueError, match="already registered"):
        register_backend("test-dummy")(type("Other", (), {}))


def test_native_backend_rejects_unknown_option():
    with pytest.raises(TypeError, match="unknown native backend option"):
        create_backend("native", "/m", max_num_sqes=3)


# -------------------------------------------------------------------------- KV blocks


def test_prefix_cache_matches_exact_full_blocks_only():
    alloc = BlockAllocator(8, 4)
    tokens = list(range(10))
    blocks = [alloc.allocate() for _ in range(3)]
    alloc.register(blocks[0], -1, tokens[0:4])
    alloc.register(blocks[1], blocks[0], tokens[4:8])
    alloc.free(blocks)
    assert alloc.num_cached == 2 and alloc.num_free == 8
    hit = alloc.match_prefix(tokens, max_blocks=2)
    assert hit == blocks[:2] and alloc.hit_tokens_total == 8
    # A different second block only reuses the first.
    alloc.free(hit)
    other = tokens[:4] + [99, 5, 6, 7]
    assert alloc.match_prefix(other, max_blocks=2) == blocks[:1]


def test_evicted_parent_invalidates_children():
    alloc = BlockAllocator(2, 2)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.register(a, -1, [1, 2])
    alloc.register(b, a, [3, 4])
    alloc.free([a, b])
    # Reclaim both blocks for other content, then re-register a with new tokens.
    x, y = alloc.allocate(), alloc.allocate()
    assert {x, y} == {a, b}
    alloc.register(a, -1, [1, 2])
    alloc.free([x, y])
    assert alloc.match_prefix([1, 2, 3, 4, 5], max_blocks=2) == [a]


def test_reset_prefix_cache_forgets_everything():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate()
    alloc.register(a, -1, [1, 2])
    alloc.free([a])
    alloc.reset_prefix_cache()
    assert alloc.match_prefix([1, 2, 3], max_blocks=1) == []
    assert alloc.num_free == 4 and alloc.num_cached == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "match"]), st.integers(0, 5))))
def test_block_accounting_invariants(ops):
    alloc = BlockAllocator(6, 2)
    held: list[list[int]] = []
    rng = random.Random(0)
    for op, k in ops:
        if op == "alloc":
            try:
                block = alloc.allocate()
            except NoFreeBlocksError:
                assert alloc.num_free == 0
                continue
            tokens = [k, k + 1]
            alloc.register(block, -1, tokens)
            held.append([block])
        elif op == "free" and held:
            alloc.free(held.pop(rng.randrange(len(held))))
        elif op == "match":
            got = alloc.match_prefix([k, k + 1, 0], max_blocks=1)
            if got:
                held.append(got)
        refs = sum(len(h) for h in held)
        assert alloc.num_used == len({b for h in held for b in h})
        assert refs >= alloc.num_used
        assert alloc.num_free + alloc.num_used == 6
    for h in held:
        alloc.free(h)
    assert alloc.num_free == 6


# -------------------------------------------------------------------------- scheduler


def _seq(i: int, prompt_len: int, max_new: int = 8, first: int = 0) -> Sequence:
    prompt = list(range(first, first + prompt_len))
    return Sequence(i, None, 0, prompt, SamplingParams(), max_new, SamplingRow())


def test_chunked_prefill_keeps_decoding_running():
    sched = Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    short = _seq(0, 3)
    sched.add(short)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.length) for c in plan] == [(0, 3)]
    for c in plan:
        sched.commit(c)
    short.tokens.append(7)  # sampled
    long = _seq(1, 30)
    sched.add(long)
    steps = 0
    while long.num_computed < 30:
        plan = sched.schedule()
        lengths = {c.seq.seq_id: c.length for c in plan}
        assert lengths[0] == 1, "the decoding sequence must get its token every step"
        assert sum(lengths.values()) <= 8
        for c in plan:
            sched.commit(c)
        short.tokens.append(7)
        steps += 1
    assert steps == 5  # 30 prompt tokens in chunks of 7


def test_preemption_frees_the_newest_and_requeues_it():
    sched = Scheduler(BlockAllocator(4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 7), _seq(1, 7, first=100)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert len(plan) == 2 and sched.allocator.num_free == 0
    for c in plan:
        sched.commit(c)
    a.tokens += [1, 2]  # a now needs a third block
    b.tokens += [1]
    plan = sched.schedule()
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and not b.blocks
    assert [c.seq for c in plan] == [a]
    assert sched.waiting[0] is b


def test_followers_wait_for_the_leader_prompt():
    sched = Scheduler(BlockAllocator(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    lead, follow = _seq(0, 9), _seq(1, 9)
    follow.leader = lead
    sched.add(lead)
    sched.add(follow)
    plan = sched.schedule()
    assert [c.seq for c in plan] == [lead]
    for c in plan:
        sched.commit(c)
    lead.tokens.append(3)
    plan = sched.schedule()
    chunks = {c.seq.seq_id: c for c in plan}
    assert chunks[1].start == 8  # two full prompt blocks came from the prefix cache
    assert follow.cached_prompt_tokens == 8


def _request(sched: Scheduler, prompt_len: int, n: int) -> list[Sequence]:
    """Add the ``n`` samples of one request: the first leads, the others wait for its prompt."""
    seqs = [_seq(i, prompt_len) for i in range(n)]
    for seq in seqs:
        if seq is not seqs[0]:
            seq.leader = seqs[0]
        sched.add(seq)
    return seqs


def _run_step(sched: Scheduler) -> None:
    for c in sched.schedule():
        sched.commit(c)


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_blocks_and_copies_the_partial_one(caching):
    alloc = BlockAllocator(8, 4, enable_prefix_caching=caching)
    sched = Scheduler(alloc, max_num_seqs=3, max_num_batched_tokens=64)
    lead, follow, _ = _request(sched, 9, 3)
    assert sched.fork(lead, follow) is None  # the leader has not computed its prompt yet
    _run_step(sched)
    src, dst = sched.fork(lead, follow)
    assert src == lead.blocks[2] and dst not in lead.blocks
    assert follow.blocks == [*lead.blocks[:2], dst]
    assert follow.status is SeqStatus.RUNNING and follow.num_computed == 9
    assert follow.cached_prompt_tokens == (8 if caching else 0) and follow.leader is None
    assert alloc.num_free == 8 - 4
    assert sched.fork(lead, follow) is None  # already running
    # The leader's shared blocks outlive it until the follower lets go of them.
    sched.remove(lead)
    assert alloc.num_used == 3
    sched.remove(follow)
    assert alloc.num_used == 0
    # A full sequence set leaves the third sample waiting for an ordinary prefill.
    sched2 = Scheduler(BlockAllocator(8, 4), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _request(sched2, 8, 2)
    _run_step(sched2)
    assert sched2.fork(a, b) is None and b.status is SeqStatus.WAITING and not b.blocks


def test_fork_of_a_block_aligned_prompt_copies_nothing():
    sched = Scheduler(BlockAllocator(8, 4), max_num_seqs=4, max_num_batched_tokens=64)
    lead, follow = _request(sched, 8, 2)
    _run_step(sched)
    assert sched.fork(lead, follow) == (-1, -1)
    assert follow.blocks == lead.blocks


# ------------------------------------------------------------------------------ text


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.models.tiny import resolve_tiny_spec, tiny_tokenizer

    return tiny_tokenizer(resolve_tiny_spec("qwen2", "nano"))


def test_text_assembler_holds_back_possible_stop_strings(tokenizer):
    from polyrl.rollout.openai_compat import TextAssembler

    ids = tokenizer("abc STOP tail").input_ids
    asm = TextAssembler(tokenizer, ["STOP"], skip_special_tokens=True)
    pieces = []
    for i, t in enumerate(ids):
        # The engine ends the sample on the token that completes the stop string.
        done = "STOP" in tokenizer.decode(ids[: i + 1])
        pieces.append(asm.push([t], finished=done, stop_reason="STOP" if done else None))
        assert "S" not in "".join(pieces[:-1] if done else pieces)
        if done:
            break
    assert "".join(pieces) == "abc "


def test_text_assembler_streams_everything_without_stop(tokenizer):
    from polyrl.rollout.openai_compat import TextAssembler

    text = "x = 12 + 30, done."
    ids = tokenizer(text).input_ids
    asm = TextAssembler(tokenizer, [], skip_special_tokens=True)
    pieces = [asm.push([t], finished=False) for t in ids]
    pieces.append(asm.push([], finished=True))
    assert "".join(pieces) == text


def test_cli_serve_rejects_bad_arguments(tmp_path, capsys):
    from polyrl.cli import main

    assert main(["serve", str(tmp_path), "--backend", "nope"]) == 2
    assert "unknown rollout backend 'nope'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
