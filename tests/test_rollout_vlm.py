"""Vision-language rollout: the native engine and the server serve a tiny Qwen2-VL."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from polyrl.core.numerics import token_log_probs
from polyrl.core.rollout_api import GenerateRequest, InvalidRequestError, SamplingParams
from polyrl.rollout.native import NativeEngine, NativeEngineConfig
from tests.test_rollout_engine import run

# A small step budget so image prompts are prefilled in several chunks that cut image runs.
# Blocks of 4 tokens so image runs (4 tokens here) straddle block edges.
BS = 4
SMALL = {"max_num_seqs": 8, "max_num_batched_tokens": 8, "kv_cache_tokens": 2048, "block_size": BS}


def _image(color: tuple[int, int, int], size: tuple[int, int] = (112, 84)) -> Image.Image:
    # A gradient, so that patches differ and the vision tower's output depends on the pixels.
    img = Image.new("RGB", size, color)
    px = img.load()
    for x in range(size[0]):
        for y in range(0, size[1], 7):
            px[x, y] = ((color[0] + 3 * x) % 256, (color[1] + 5 * y) % 256, color[2])
    return img


def _png_b64(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _prompt(proc, images, text="describe"):
    msgs = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}],
        }
    ]
    return proc.encode_messages(msgs, images=images)


@pytest.fixture(scope="module")
def vl_engine(tiny_vl_dir):
    eng = NativeEngine(tiny_vl_dir, NativeEngineConfig(**SMALL))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_vl(tiny_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()


def _hf_logprobs(model, proc, ids, mm, out_ids, temperature):
    x = torch.tensor([ids + out_ids])
    types = torch.zeros_like(x)
    types[x == proc.token_ids["image"]] = 1
    types[x == proc.token_ids["video"]] = 2
    with torch.no_grad():
        logits = model(input_ids=x, mm_token_type_ids=types, **mm.tensors).logits
    logits = logits[0, len(ids) - 1 : -1]
    return token_log_probs(logits, torch.tensor(out_ids), temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_image_logprobs_equal_the_hf_forward(vl_engine, hf_vl, tiny_vl_processor, temperature):
    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((200, 30, 10)), _image((0, 90, 250), (56, 112))])
    assert len(ids) > SMALL["max_num_batched_tokens"]  # prefill is chunked
    params = SamplingParams(
        max_new_tokens=6, temperature=temperature, n=2, seed=3, logprobs=True, ignore_eos=True
    )
    rid = f"par{temperature}"
    outs = run(vl_engine, [GenerateRequest(rid, tuple(ids), params, multi_modal=mm)])[rid]
    t = 1.0 if temperature == 0 else temperature
    for sample in outs:
        ref = _hf_logprobs(hf_vl, proc, ids, mm, sample.output_ids, t)
        gap = (ref - torch.tensor(sample.logprobs)).abs().max().item()
        assert gap < 1e-4, gap
    if temperature == 0:
        assert outs[0].output_ids == outs[1].output_ids


def test_different_images_same_ids_do_not_share_kv(vl_engine, tiny_vl_processor):
    proc = tiny_vl_processor
    ids_a, mm_a = _prompt(proc, [_image((250, 0, 0))], text="same text here")
    ids_b, mm_b = _prompt(proc, [_image((0, 0, 250))], text="same text here")
    assert ids_a == ids_b and mm_a.digests != mm_b.digests
    params = SamplingParams(max_new_tokens=5, temperature=0, logprobs=True, ignore_eos=True)
    a = run(vl_engine, [GenerateRequest("img-a", tuple(ids_a), params, multi_modal=mm_a)])
    b = run(vl_engine, [GenerateRequest("img-b", tuple(ids_b), params, multi_modal=mm_b)])
    sa, sb = a["img-a"][0], b["img-b"][0]
    # Only the blocks before the image may be shared (the chat template's system prompt).
    image_start = ids_a.index(proc.token_ids["image"])
    assert sb.cached_prompt_tokens <= image_start
    assert sa.logprobs != sb.logprobs
    # The same image again reuses the prompt's blocks (up to its last full block).
    again = run(vl_engine, [GenerateRequest("img-a2", tuple(ids_a), params, multi_modal=mm_a)])
    s2 = again["img-a2"][0]
    assert s2.cached_prompt_tokens >= (len(ids_a) - 1) // BS * BS > image_start
    assert s2.output_ids == sa.output_ids
    torch.testing.assert_close(
        torch.tensor(s2.logprobs), torch.tensor(sa.logprobs), atol=1e-5, rtol=0
    )


def test_samples_share_the_prompt_and_images_are_encoded_once(vl_engine, tiny_vl_processor):
    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((10, 160, 40)), _image((90, 10, 200), (84, 84))], "once")
    runner = vl_engine.runner
    calls = runner.vision_calls
    params = SamplingParams(max_new_tokens=4, n=3, seed=1, ignore_eos=True)
    outs = run(vl_engine, [GenerateRequest("once", tuple(ids), params, multi_modal=mm)])["once"]
    assert runner.vision_calls - calls == 2  # two images, one tower call each
    assert all(s.cached_prompt_tokens == (len(ids) // BS) * BS for s in outs[1:])
    run(vl_engine, [GenerateRequest("twice", tuple(ids), params, multi_modal=mm)])
    assert runner.vision_calls - calls == 2  # the repeated prompt hits the embedding cache
    assert len({tuple(s.output_ids) for s in outs}) > 1


def test_engine_refuses_mismatched_media(vl_engine, tiny_vl_processor):
    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((1, 2, 3))])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(InvalidRequestError):  # placeholders but no media
        vl_engine.submit(GenerateRequest("bad1", tuple(ids), params), lambda p: None)
    with pytest.raises(InvalidRequestError):  # one placeholder token, not the expanded run
        short = [t for i, t in enumerate(ids) if t != proc.token_ids["image"] or i == ids.index(t)]
        vl_engine.submit(GenerateRequest("bad2", tuple(short), params, multi_modal=mm), print)


def test_weight_update_covers_the_vision_tower(vl_engine, tiny_vl_processor):
    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((70, 70, 70))], "weights")
    params = SamplingParams(max_new_tokens=3, temperature=0, logprobs=True, ignore_eos=True)
    before = run(vl_engine, [GenerateRequest("w0", tuple(ids), params, multi_modal=mm)])["w0"][0]
    runner = vl_engine.runner
    assert len(runner.embedding_cache) > 0
    named = dict(runner.model.named_parameters())
    assert any(n.startswith("model.visual.") for n in named)
    # A full update where only the vision tower's weights differ.
    orig = {n: p.detach().clone() for n, p in named.items()}
    new = dict(orig)
    for n in new:
        if n.startswith("model.visual.merger"):
            new[n] = new[n] * 1.5 + 0.01
    version = vl_engine.load_weights(list(new.items()))
    assert len(runner.embedding_cache) == 0
    after = run(vl_engine, [GenerateRequest("w1", tuple(ids), params, multi_modal=mm)])["w1"][0]
    assert after.weight_version == version
    assert after.logprobs != before.logprobs
    vl_engine.load_weights(list(orig.items()))
