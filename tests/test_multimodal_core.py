"""Images as inputs: decoding with limits, placeholder expansion, M-RoPE positions, the tiny VLM."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from polyrl.core.multimodal import (
    MediaLimits,
    MultiModalInputError,
    decode_image,
    decode_video,
    expand_placeholders,
    image_digest,
    mrope_positions,
)


def _png(size=(28, 28), color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_decode_image_accepts_every_documented_form(tmp_path):
    data = _png()
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [
        data,
        {"bytes": data},
        {"path": str(tmp_path / "a.png")},
        {"path": "a.png"},
        b64,
        "data:image/png;base64," + b64,
        {"image_url": {"url": "data:image/png;base64," + b64}},
        Image.open(io.BytesIO(data)),
    ]
    digests = {image_digest(decode_image(f, allowed_dir=tmp_path)) for f in forms}
    assert len(digests) == 1


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        (b"\x89PNG\r\n\x1a\nnot really", "not a readable image"),
        ("https://example.com/cat.png", "remote URLs are not fetched"),
        ("data:image/png,xyz", "data: URL must look like"),
        ("@@@@", "not valid base64"),
        ({"nothing": 1}, "needs 'bytes' or 'path'"),
        (3.5, "is not an image"),
    ],
)
def test_decode_image_refuses_bad_input_by_name(item, needle):
    with pytest.raises(MultiModalInputError, match=needle) as err:
        decode_image(item, what="row 7: images[0]")
    assert "row 7: images[0]" in str(err.value)


def test_huge_image_is_refused_from_its_header_without_decoding_it():
    # A 20000 x 20000 PNG of one colour compresses to a few hundred KiB; refusing it must not
    # allocate its 1.2 GB of pixels, so the check reads the header only.
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    with pytest.raises(MultiModalInputError, match="more than the limit of"):
        decode_image(buf.getvalue())
    # Below Pillow's own guard, the header check names the size.
    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, format="PNG")
    with pytest.raises(MultiModalInputError, match="5000 x 5000 pixels"):
        decode_image(buf.getvalue())


def test_paths_must_lie_in_the_allowed_directory(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(_png())
    inner = tmp_path / "media"
    inner.mkdir()
    with pytest.raises(MultiModalInputError, match="outside the allowed media directory"):
        decode_image({"path": "../outside.png"}, allowed_dir=inner)
    with pytest.raises(MultiModalInputError, match="paths are not accepted"):
        decode_image({"path": str(outside)})


def test_videos_are_frame_lists_with_a_frame_limit():
    frames = [_png(color=(i, 0, 0)) for i in range(3)]
    assert len(decode_video(frames)) == 3
    with pytest.raises(MultiModalInputError, match="more than the limit of 2"):
        decode_video(frames, limits=MediaLimits(max_video_frames=2))
    with pytest.raises(MultiModalInputError, match="list of frames"):
        decode_video(_png())


def test_processor_expands_placeholders_and_checks_their_number(tiny_vl_processor):
    proc = tiny_vl_processor
    img = Image.new("RGB", (56, 56), (0, 0, 255))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    ids, mm = proc.encode_messages(msgs, images=[img])
    assert mm is not None and mm.kinds == ("image",)
    assert ids.count(proc.token_ids["image"]) == mm.token_counts[0] == 4
    # Already-expanded ids pass unchanged; more or fewer images than placeholders are refused.
    assert expand_placeholders(ids, proc.token_ids, mm) == ids
    with pytest.raises(MultiModalInputError, match="1 media placeholder.*2 image"):
        proc.encode_messages(msgs, images=[img, img])
    with pytest.raises(MultiModalInputError, match="1 media placeholder.*0 image"):
        proc.encode_messages(msgs, images=[])


def test_mrope_positions_equal_the_hf_models_own(tiny_vl_dir, tiny_vl_processor):
    from transformers import AutoModelForImageTextToText

    proc = tiny_vl_processor
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir).eval()
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "video"},
                {"type": "image"},
            ],
        }
    ]
    frames = [Image.new("RGB", (56, 56), (i * 50, 0, 0)) for i in range(3)]
    ids, mm = proc.encode_messages(
        msgs,
        images=[Image.new("RGB", (56, 56)), Image.new("RGB", (112, 56))],
        videos=[frames],
    )
    x = torch.tensor([ids])
    types = torch.zeros_like(x)
    types[x == proc.token_ids["image"]] = 1
    types[x == proc.token_ids["video"]] = 2
    want, want_delta = model.model.get_rope_index(
        x, types, image_grid_thw=mm.grids("image"), video_grid_thw=mm.grids("video")
    )
    got, delta = mrope_positions(ids, mm, proc.token_ids, proc.merge_size)
    assert torch.equal(got, want[:, 0])
    assert delta == int(want_delta)
    # Packed positions (text row first) give the model's own logits.
    with torch.no_grad():
        ref = model(input_ids=x, mm_token_type_ids=types, **mm.tensors).logits
        packed = torch.cat([torch.arange(len(ids)).view(1, 1, -1), got.view(3, 1, -1)])
        out = model(input_ids=x, position_ids=packed, **mm.tensors).logits
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_tiny_vl_model_loads_with_the_auto_classes(tiny_vl_dir):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from polyrl.models.loader import load_causal_lm

    model = load_causal_lm(tiny_vl_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    tok = AutoTokenizer.from_pretrained(tiny_vl_dir)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    assert AutoImageProcessor.from_pretrained(tiny_vl_dir).patch_size == 14


def test_sources_round_trip_through_the_media_payload(tiny_vl_processor):
    import pickle

    img = Image.new("RGB", (56, 56), (10, 200, 30))
    ids, mm = tiny_vl_processor.encode(
        [tiny_vl_processor.token_ids["image"], 5],
        images=[{"bytes": _png(size=(56, 56), color=(10, 200, 30))}],
    )
    payload = mm.media_payload()
    again = tiny_vl_processor.process_media(images=payload["images"])
    assert again.digests == mm.digests
    torch.testing.assert_close(again.tensors["pixel_values"], mm.tensors["pixel_values"])
    assert image_digest(img) == mm.digests[0]
    # n copies of one prompt's inputs pickle as one.
    one = len(pickle.dumps([mm]))
    assert len(pickle.dumps([mm] * 8)) < one + 100
