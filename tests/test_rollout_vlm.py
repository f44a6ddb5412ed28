"""Vision-language rollout: the native engine and the server serve a tiny Qwen2-VL (and the
engine a tiny SmolVLM: 1-D positions, images as marker-wrapped tile runs)."""

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
STEP = 6
SMALL = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": STEP,
    "kv_cache_tokens": 2048,
    "block_size": BS,
}


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
def big_proc(tiny_vl_dir):
    """The tiny model's processor letting images fill up to 16 tokens (the default: 4)."""
    from polyrl.models.processor import VisionProcessor

    return VisionProcessor.from_pretrained(tiny_vl_dir, max_pixels=112 * 112)


def _hf_model(model_dir):
    """The Hugging Face model itself, in eval mode: what the parity tests compare with."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def _started_engine(model_dir):
    """A started native engine of ``model_dir``, shut down when the fixture ends."""
    eng = NativeEngine(model_dir, NativeEngineConfig(**SMALL))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def vl_engine(tiny_vl_dir):
    yield from _started_engine(tiny_vl_dir)


@pytest.fixture(scope="module")
def hf_vl(tiny_vl_dir):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()


@pytest.fixture(scope="module")
def smol_engine(tiny_smolvlm_dir):
    yield from _started_engine(tiny_smolvlm_dir)


@pytest.fixture(scope="module")
def hf_smol(tiny_smolvlm_dir):
    return _hf_model(tiny_smolvlm_dir)


@pytest.fixture(scope="module")
def q25_engine(tiny_qwen2_5_vl_dir):
    yield from _started_engine(tiny_qwen2_5_vl_dir)


@pytest.fixture(scope="module")
def hf_q25(tiny_qwen2_5_vl_dir):
    return _hf_model(tiny_qwen2_5_vl_dir)


@pytest.fixture(scope="module")
def big_q25_proc(tiny_qwen2_5_vl_dir):
    """Images of up to 16 tokens: several attention windows of Qwen2.5-VL's tower."""
    from polyrl.models.processor import VisionProcessor

    return VisionProcessor.from_pretrained(tiny_qwen2_5_vl_dir, max_pixels=112 * 112)


@pytest.fixture(scope="module")
def q3_engine(tiny_qwen3_vl_dir):
    yield from _started_engine(tiny_qwen3_vl_dir)


@pytest.fixture(scope="module")
def hf_q3(tiny_qwen3_vl_dir):
    return _hf_model(tiny_qwen3_vl_dir)


@pytest.fixture(scope="module")
def big_q3_proc(tiny_qwen3_vl_dir):
    """Images of up to 12 tokens: runs longer than a prefill chunk, DeepStack rows cut too."""
    from polyrl.models.processor import VisionProcessor

    return VisionProcessor.from_pretrained(tiny_qwen3_vl_dir, max_pixels=112 * 112)


#: Per family: the fixtures of (engine, HF model, processor) of the parity test.
PARITY = {
    "qwen2_vl": ("vl_engine", "hf_vl", "big_proc"),
    "qwen2_5_vl": ("q25_engine", "hf_q25", "big_q25_proc"),
    "qwen3_vl": ("q3_engine", "hf_q3", "big_q3_proc"),
    "smolvlm": ("smol_engine", "hf_smol", "tiny_smolvlm_processor"),
}


def _hf_logprobs(model, proc, ids, mm, out_ids, temperature):
    x = torch.tensor([ids + out_ids])
    if proc.model_type == "smolvlm":
        # The stock layout: one batch row of all the prompt's tiles.
        media = {"pixel_values": mm.tensors["pixel_values"].unsqueeze(0)}
    else:
        types = torch.zeros_like(x)
        types[x == proc.token_ids["image"]] = 1
        types[x == proc.token_ids.get("video", -1)] = 2
        media = {"mm_token_type_ids": types, **mm.tensors}
    with torch.no_grad():
        logits = model(input_ids=x, **media).logits
    logits = logits[0, len(ids) - 1 : -1]
    return token_log_probs(logits, torch.tensor(out_ids), temperature)


@pytest.mark.parametrize("family", sorted(PARITY))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_image_logprobs_equal_the_hf_forward(request, family, temperature):
    vl_engine, hf_vl, proc = (request.getfixturevalue(name) for name in PARITY[family])
    ids, mm = _prompt(proc, [_image((200, 30, 10)), _image((0, 90, 250), (56, 112))])
    # Prefill is chunked, and chunk edges cut through image runs.
    at = [i for i, t in enumerate(ids) if t == proc.token_ids["image"]]
    assert any(i % STEP == 0 and i - 1 in at for i in at), at
    params = SamplingParams(
        max_new_tokens=6, temperature=temperature, n=2, seed=3, logprobs=True, ignore_eos=True
    )
    rid = f"par{family}{temperature}"
    outs = run(vl_engine, [GenerateRequest(rid, tuple(ids), params, multi_modal=mm)])[rid]
    t = 1.0 if temperature == 0 else temperature
    for sample in outs:
        ref = _hf_logprobs(hf_vl, proc, ids, mm, sample.output_ids, t)
        gap = (ref - torch.tensor(sample.logprobs)).abs().max().item()
        assert gap < 1e-4, gap
    if temperature == 0:
        assert outs[0].output_ids == outs[1].output_ids


def test_video_and_image_logprobs_equal_the_hf_forward(vl_engine, hf_vl, big_proc):
    proc = big_proc
    frames = [_image((i * 60, 20, 200 - i * 40), (56, 56)) for i in range(4)]
    msgs = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"}],
        }
    ]
    ids, mm = proc.encode_messages(msgs, images=[_image((9, 99, 199))], videos=[frames])
    params = SamplingParams(max_new_tokens=5, seed=4, logprobs=True, ignore_eos=True)
    out = run(vl_engine, [GenerateRequest("vid", tuple(ids), params, multi_modal=mm)])["vid"][0]
    ref = _hf_logprobs(hf_vl, proc, ids, mm, out.output_ids, 1.0)
    assert (ref - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


def test_different_images_same_ids_do_not_share_kv(vl_engine, big_proc):
    proc = big_proc
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


def test_samples_share_the_prompt_and_images_are_encoded_once(vl_engine, big_proc):
    proc = big_proc
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


def test_preempted_image_prompts_recompute_the_same(vl_engine, big_proc, tiny_vl_dir):
    # A KV cache of 12 blocks cannot hold three of these prompts at once: sequences are
    # preempted and recomputed, and must keep their images and positions.
    proc = big_proc
    colors = [(250, 10, 10), (10, 250, 10), (10, 10, 250)]
    prompts = [_prompt(proc, [_image(c, (112, 112))], "p") for c in colors]
    params = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True, ignore_eos=True)
    reqs = [
        GenerateRequest(f"pre{i}", tuple(ids), params, multi_modal=mm)
        for i, (ids, mm) in enumerate(prompts)
    ]
    want = run(vl_engine, reqs)
    tight = NativeEngine(tiny_vl_dir, NativeEngineConfig(**{**SMALL, "kv_cache_tokens": 48}))
    tight.start()
    try:
        got = run(tight, reqs)
        assert tight.stats().preemptions_total > 0
    finally:
        tight.shutdown()
    for r in reqs:
        a, b = want[r.request_id][0], got[r.request_id][0]
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0
        )


def test_engine_refuses_mismatched_media(vl_engine, tiny_vl_processor):
    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((1, 2, 3))])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(InvalidRequestError):  # placeholders but no media
        vl_engine.submit(GenerateRequest("bad1", tuple(ids), params), lambda p: None)
    with pytest.raises(InvalidRequestError):  # one placeholder token, not the expanded run
        short = [t for i, t in enumerate(ids) if t != proc.token_ids["image"] or i == ids.index(t)]
        vl_engine.submit(GenerateRequest("bad2", tuple(short), params, multi_modal=mm), print)
    # Pixels the vision tower cannot take fail their own request only, before any step.
    import dataclasses
    import threading

    bad = dataclasses.replace(
        mm, tensors={**mm.tensors, "pixel_values": mm.tensors["pixel_values"][:, :7]}
    )
    got = []
    done = threading.Event()
    vl_engine.submit(
        GenerateRequest("bad3", tuple(ids), params, multi_modal=bad),
        lambda p: (got.append(p), done.set()),
    )
    assert done.wait(60) and isinstance(got[0], BaseException)
    ok = run(vl_engine, [GenerateRequest("ok3", tuple(ids), params, multi_modal=mm)])
    assert ok["ok3"][0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("family", "changed"),
    [("qwen2_vl", "model.visual.merger"), ("qwen3_vl", "model.visual.deepstack_merger_list")],
)
def test_weight_update_covers_the_vision_tower(request, family, changed):
    # Qwen3-VL: only the DeepStack mergers change; their features are cached with the image's.
    vl_engine = request.getfixturevalue({"qwen2_vl": "vl_engine", "qwen3_vl": "q3_engine"}[family])
    proc = request.getfixturevalue(
        {"qwen2_vl": "tiny_vl_processor", "qwen3_vl": "tiny_qwen3_vl_processor"}[family]
    )
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
        if n.startswith(changed):
            new[n] = new[n] * 1.5 + 0.01
    version = vl_engine.load_weights(list(new.items()))
    assert len(runner.embedding_cache) == 0
    calls = runner.vision_calls
    after = run(vl_engine, [GenerateRequest("w1", tuple(ids), params, multi_modal=mm)])["w1"][0]
    # One tower run gives the prompt's image embedding (and DeepStack rows) for every step.
    assert runner.vision_calls - calls == 1
    assert after.weight_version == version
    assert after.logprobs != before.logprobs
    vl_engine.load_weights(list(orig.items()))


def test_smolvlm_encodes_once_salts_the_prefix_cache_and_syncs_vision_weights(
    smol_engine, tiny_smolvlm_processor
):
    proc = tiny_smolvlm_processor
    runner = smol_engine.runner
    ids_a, mm_a = _prompt(proc, [_image((250, 0, 0)), _image((0, 250, 0), (30, 30))], "same")
    ids_b, mm_b = _prompt(proc, [_image((0, 0, 250)), _image((0, 250, 0), (30, 30))], "same")
    assert ids_a == ids_b and mm_a.digests != mm_b.digests
    # The first image is cut into 2 x 2 tiles plus the global view, each run after markers.
    assert mm_a.token_counts[0] == 5 * 4 and len(mm_a.expansions[0]) > 20
    params = SamplingParams(max_new_tokens=4, n=3, seed=1, logprobs=True, ignore_eos=True)
    calls = runner.vision_calls
    a = run(smol_engine, [GenerateRequest("sa", tuple(ids_a), params, multi_modal=mm_a)])["sa"]
    assert runner.vision_calls - calls == 2  # two images, n=3 samples: one tower call each
    assert all(s.cached_prompt_tokens == (len(ids_a) // BS) * BS for s in a[1:])
    b = run(smol_engine, [GenerateRequest("sb", tuple(ids_b), params, multi_modal=mm_b)])["sb"]
    assert runner.vision_calls - calls == 3  # only b's first image is new
    # Same ids, another first image: nothing after the text before it is shared.
    assert b[0].cached_prompt_tokens <= ids_a.index(proc.token_ids["image"])
    # A weight update of the connector alone reaches the image embeddings.
    named = dict(runner.model.named_parameters())
    orig = {n: p.detach().clone() for n, p in named.items()}
    new = {n: (v * 1.5 + 0.01 if n.startswith("model.connector.") else v) for n, v in orig.items()}
    one = SamplingParams(max_new_tokens=3, temperature=0, logprobs=True, ignore_eos=True)
    before = run(smol_engine, [GenerateRequest("w0", tuple(ids_a), one, multi_modal=mm_a)])
    smol_engine.load_weights(list(new.items()))
    assert len(runner.embedding_cache) == 0
    after = run(smol_engine, [GenerateRequest("w1", tuple(ids_a), one, multi_modal=mm_a)])
    assert after["w1"][0].logprobs != before["w0"][0].logprobs
    smol_engine.load_weights(list(orig.items()))


# ------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "inside").mkdir()
    _image((30, 200, 90)).save(root / "inside" / "a.png")
    _image((30, 200, 90)).save(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def vl_server(tiny_vl_dir, media_dir):
    from polyrl.rollout.launcher import ServerProcess
    from polyrl.rollout.options import ServerLimits

    limits = ServerLimits(allowed_media_dir=str(media_dir / "inside"), max_video_frames=16)
    options = {"num_threads": 1, **SMALL}
    proc = ServerProcess(tiny_vl_dir, options=options, limits=limits).start(timeout=180)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def vl_http(vl_server):
    import httpx

    with httpx.Client(base_url=vl_server.url, timeout=60) as client:
        yield client


def _one_placeholder_prompt(proc, n_images: int = 1) -> list[int]:
    msgs = [{"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), "hi"]}]
    msgs[0]["content"][-1] = {"type": "text", "text": "hi"}
    return proc.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)


def test_server_generate_with_images(vl_http, hf_vl, tiny_vl_processor):
    proc = tiny_vl_processor
    imgs = [_image((200, 100, 0)), _image((5, 5, 120), (84, 56))]
    ids = _one_placeholder_prompt(proc, 2)
    expanded, mm = proc.encode(ids, images=imgs)
    params = {"max_new_tokens": 4, "temperature": 1.0, "seed": 2, "n": 2, "logprobs": True}
    r = vl_http.post(
        "/generate",
        json={"input_ids": ids, "images": [_png_b64(i) for i in imgs], "sampling_params": params},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_ids"] == expanded
    for o in body["outputs"]:
        ref = _hf_logprobs(hf_vl, proc, expanded, mm, o["output_ids"], 1.0)
        assert (ref - torch.tensor(o["logprobs"])).abs().max().item() < 1e-4
    # Expanded runs are accepted as they are; a path inside the allowed directory too.
    r = vl_http.post(
        "/generate",
        json={
            "input_ids": expanded,
            "images": [{"path": "a.png"}, _png_b64(imgs[1])],
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt_ids"] == expanded


def test_client_sends_multi_modal_inputs(vl_server, tiny_vl_processor):
    import asyncio

    from polyrl.rollout.client import RolloutClient

    proc = tiny_vl_processor
    ids, mm = _prompt(proc, [_image((40, 40, 40))], "client")

    async def go():
        async with RolloutClient([vl_server.url]) as client:
            params = SamplingParams(max_new_tokens=3, temperature=0, logprobs=True)
            a = await client.generate(ids, params, multi_modal=mm)
            other = proc.encode(ids, images=[_image((240, 240, 10))])[1]
            b = await client.generate(ids, params, multi_modal=other)
            return a, b

    a, b = asyncio.run(go())
    assert a.prompt_ids == ids
    assert a.outputs[0].logprobs != b.outputs[0].logprobs


def test_client_sends_the_pixel_bounds_the_trainer_processed_with(
    vl_server, big_proc, tiny_vl_processor
):
    """A data processor with non-default ``image_max_pixels`` (16 tokens an image, the model's
    own: 4): the server, sent the bounds, expands the prompt as the trainer did."""
    import asyncio

    from polyrl.rollout.client import RolloutClient

    one = _one_placeholder_prompt(big_proc)
    ids, mm = big_proc.encode(one, images=[_image((30, 90, 150))])
    assert mm.pixel_bounds == (None, 112 * 112)
    assert mm.media_payload()["mm_processor_kwargs"] == {"max_pixels": 112 * 112}
    default_ids = tiny_vl_processor.encode(one, images=[_image((30, 90, 150))])[0]
    assert len(ids) > len(default_ids)  # the bounds matter for this image

    async def go():
        async with RolloutClient([vl_server.url]) as client:
            params = SamplingParams(max_new_tokens=2, temperature=0)
            return await client.generate(ids, params, multi_modal=mm)

    assert asyncio.run(go()).prompt_ids == ids


def test_server_chat_with_image_parts(vl_http):
    url = "data:image/png;base64," + _png_b64(_image((100, 0, 100)))
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is it"},
            ],
        }
    ]
    r = vl_http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 10
    msgs[0]["content"][0]["image_url"]["url"] = "https://example.com/cat.png"
    r = vl_http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
    assert r.status_code == 400, r.text
    assert "remote" in r.json()["error"]["message"]


def _huge_png_header() -> bytes:
    # A PNG whose header says 20000 x 20000 (its pixel data is a stub): refusing it must not
    # decode it.
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def test_hostile_media_get_4xx_and_the_server_stays_up(vl_http, tiny_vl_processor, media_dir):
    proc = tiny_vl_processor
    one = _one_placeholder_prompt(proc, 1)
    two = _one_placeholder_prompt(proc, 2)
    good = _png_b64(_image((9, 9, 9)))
    tiny_frame = _png_b64(Image.new("RGB", (28, 28)))
    video_id = proc.token_ids["video"]
    cases = {
        "corrupt bytes": {"input_ids": one, "images": [base64.b64encode(b"\x89PNGnope").decode()]},
        "not base64": {"input_ids": one, "images": ["!!!not an image!!!"]},
        "20000x20000": {
            "input_ids": one,
            "images": [base64.b64encode(_huge_png_header()).decode()],
        },
        "more images than placeholders": {"input_ids": one, "images": [good, good]},
        "fewer images than placeholders": {"input_ids": two, "images": [good]},
        "placeholders, no images": {"input_ids": two},
        "path outside the allowed dir": {
            "input_ids": one,
            "images": [{"path": str(media_dir / "outside.png")}],
        },
        "path escaping the allowed dir": {"input_ids": one, "images": [{"path": "../outside.png"}]},
        "remote url": {"input_ids": one, "images": ["https://example.com/a.png"]},
        "10000-frame video": {
            "input_ids": [video_id if t == proc.token_ids["image"] else t for t in one],
            "videos": [[tiny_frame] * 10000],
        },
        "images for several prompts": {"input_ids": [one, one], "images": [good]},
        "images not a list": {"input_ids": one, "images": good},
        "upscaling pixel bounds": {
            "input_ids": one,
            "images": [good],
            "mm_processor_kwargs": {"min_pixels": 10**12},
        },
        "unknown processor kwargs": {
            "input_ids": one,
            "images": [good],
            "mm_processor_kwargs": {"do_resize": False},
        },
    }
    expect = {
        "corrupt bytes": "not a readable image",
        "not base64": "not valid base64",
        "20000x20000": "more than the limit",
        "more images than placeholders": "but 2 image(s)",
        "fewer images than placeholders": "2 media placeholder(s)",
        "placeholders, no images": "no images or videos were given",
        "path outside the allowed dir": "outside the allowed media directory",
        "path escaping the allowed dir": "outside the allowed media directory",
        "remote url": "remote URLs are not fetched",
        "10000-frame video": "10000 frames, more than the limit of 16",
        "images for several prompts": "single prompt",
        "images not a list": "images",
        "upscaling pixel bounds": "mm_processor_kwargs",
        "unknown processor kwargs": "mm_processor_kwargs",
    }
    for name, body in cases.items():
        body = {**body, "sampling_params": {"max_new_tokens": 2}}
        r = vl_http.post("/generate", json=body)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        assert expect[name] in r.text, (name, r.text[:300])
        assert vl_http.get("/health").status_code == 200, name
    r = vl_http.post(
        "/generate",
        json={"input_ids": one, "images": [good], "sampling_params": {"max_new_tokens": 2}},
    )
    assert r.status_code == 200, r.text
    # Text alone still works on a vision model.
    r = vl_http.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"n": 2, "max_new_tokens": 3}}
    )
    assert r.status_code == 200, r.text


def test_text_model_refuses_images(agent_server, tiny_vl_processor):
    import httpx

    good = _png_b64(_image((9, 9, 9)))
    with httpx.Client(base_url=agent_server.url, timeout=60) as http:
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "images": [good]})
        assert r.status_code == 400, r.text
        assert "no images" in r.json()["error"]["message"]
        url = "data:image/png;base64," + good
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 400, r.text
        r = http.post(
            "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        )
        assert r.status_code == 200, r.text


def test_server_weight_update_reaches_the_vision_tower(vl_http, tiny_vl_processor, tmp_path):
    # Last in the module: it leaves the server on other weights. Only the vision tower's
    # weights differ in the new directory, so a changed output can only come from it (and
    # from the embedding cache having been dropped).
    from safetensors.torch import load_file, save_file

    from polyrl.models.tiny import build_tiny_model

    src = build_tiny_model("qwen2_vl", tmp_path / "seed0", seed=0)
    other = build_tiny_model("qwen2_vl", tmp_path / "seed1", seed=1)
    (shard,) = sorted(src.glob("*.safetensors"))
    (shard1,) = sorted(other.glob("*.safetensors"))
    mixed = load_file(shard)
    theirs = load_file(shard1)
    visual = [k for k in mixed if ".visual." in k or k.startswith("visual.")]
    assert visual
    for k in visual:
        mixed[k] = theirs[k]
    save_file(mixed, shard, metadata={"format": "pt"})
    ids = _one_placeholder_prompt(tiny_vl_processor, 1)
    body = {
        "input_ids": ids,
        "images": [_png_b64(_image((80, 160, 240)))],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "logprobs": True},
    }
    before = vl_http.post("/generate", json=body).json()["outputs"][0]["logprobs"]
    r = vl_http.post("/update_weights", json={"path": str(src), "version": 7})
    assert r.status_code == 200, r.text
    after = vl_http.post("/generate", json=body).json()["outputs"][0]
    assert after["weight_version"] == 7
    assert after["logprobs"] != before
