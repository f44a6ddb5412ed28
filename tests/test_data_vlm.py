"""Vision-language data: verl/TRL image rows, parquet with image bytes, the visual task."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from polyrl.core.columns import MULTI_MODAL
from polyrl.core.multimodal import MultiModalInputError
from polyrl.data.dataset import PromptTooLongError, RLDataset
from polyrl.data.io import read_rows, write_rows
from polyrl.data.media import expand_mask, media_messages
from polyrl.data.schema import RowValidationError
from polyrl.data.tasks import generate, write_task_splits


def _png(color=(255, 0, 0), size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _verl_row(text="<image>How many?", images=None, gt="3", **extra):
    return {
        "data_source": "visual_count",
        "prompt": [{"role": "user", "content": text}],
        "reward_model": {"ground_truth": gt},
        "images": images if images is not None else [{"bytes": _png()}],
        **extra,
    }


def _image_runs(ids, proc):
    image = proc.token_ids["image"]
    runs, prev = [], None
    for t in ids:
        if t == image:
            if prev != image:
                runs.append(0)
            runs[-1] += 1
        prev = t
    return runs


def test_verl_rows_with_bytes_and_placeholders(tiny_vl_processor):
    proc = tiny_vl_processor
    rows = [
        _verl_row(),
        _verl_row("Left <image> right <image> which?", [{"bytes": _png()}, _png((0, 0, 255))]),
    ]
    ds = RLDataset(rows, proc.tokenizer, 128, processor=proc)
    first, second = ds[0], ds[1]
    assert first["raw_prompt"][0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "How many?"},
    ]
    assert [p["type"] for p in second["raw_prompt"][0]["content"]] == [
        "text",
        "image",
        "text",
        "image",
        "text",
    ]
    assert _image_runs(first["input_ids"].tolist(), proc) == [4]
    assert _image_runs(second["input_ids"].tolist(), proc) == [4, 4]
    assert first[MULTI_MODAL].token_counts == (4,)
    assert second[MULTI_MODAL].kinds == ("image", "image")
    assert second[MULTI_MODAL].digests[0] != second[MULTI_MODAL].digests[1]
    batch = ds.collate([first, second])
    assert list(batch.non_tensors[MULTI_MODAL]) == [first[MULTI_MODAL], second[MULTI_MODAL]]


def test_verl_rows_with_relative_paths_read_from_the_data_folder(tmp_path, tiny_vl_processor):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png((0, 255, 0)))
    path = write_rows([_verl_row(images=[{"path": "imgs/a.png"}])], tmp_path / "train.parquet")
    ds = RLDataset(path, tiny_vl_processor.tokenizer, 128, processor=tiny_vl_processor)
    assert ds[0][MULTI_MODAL].token_counts == (4,)


def test_trl_rows_image_column_and_content_parts(tiny_vl_processor):
    proc = tiny_vl_processor
    parts = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    rows = [
        {"prompt": [{"role": "user", "content": parts}], "image": Image.new("RGB", (56, 56))},
        # No placeholder anywhere: the image goes in front of the user's text, as TRL does.
        {"prompt": "What colour?", "image": _png()},
        {"prompt": [{"role": "user", "content": "Hi"}], "images": [_png(), _png()]},
    ]
    ds = RLDataset(rows, proc.tokenizer, 128, processor=proc, require_reward_fields=False)
    assert ds[0]["raw_prompt"][0]["content"] == parts
    assert ds[1]["raw_prompt"][0]["content"] == parts
    assert ds[1]["input_ids"].tolist() == ds[0]["input_ids"].tolist()
    assert _image_runs(ds[2]["input_ids"].tolist(), proc) == [4, 4]
    # The images stay out of extra_info (what reward functions receive).
    assert "image" not in ds[1]["extra_info"] and "images" not in ds[2]["extra_info"]


def test_text_model_refuses_image_rows(tiny_qwen2_tokenizer):
    with pytest.raises(RowValidationError, match="row 0 has 1 image.*not a vision-language"):
        RLDataset([_verl_row()], tiny_qwen2_tokenizer, 64)


def test_parquet_round_trip_keeps_image_bytes(tmp_path):
    png = _png((1, 2, 3))
    rows = [
        _verl_row(images=[{"bytes": png, "path": "a.png"}, Image.new("RGB", (4, 4))]),
        {"data_source": "x", "prompt": "p", "reward_model": {"ground_truth": 1}},
        _verl_row(images=None, videos=[[png, {"bytes": png}]]),
    ]
    back = read_rows(write_rows(rows, tmp_path / "d.parquet"))
    assert back[0]["images"][0] == {"bytes": png, "path": "a.png"}
    assert Image.open(io.BytesIO(back[0]["images"][1]["bytes"])).size == (4, 4)
    assert "images" not in back[1] and "videos" not in back[1]
    assert back[2]["videos"] == [[{"bytes": png}, {"bytes": png}]]
    # verl's own layout: a native list<struct<bytes, path>> column.
    import pyarrow.parquet as pq

    assert str(pq.read_schema(tmp_path / "d.parquet").field("images").type) == (
        "list<element: struct<bytes: binary, path: string>>"
    )
    # JSON keeps them as base64 text, which the image decoder reads.
    json_back = read_rows(write_rows(rows[:1], tmp_path / "d.jsonl"))
    assert isinstance(json_back[0]["images"][0]["bytes"], str)


def test_pixel_bounds_change_the_number_of_image_tokens(tiny_vl_dir):
    from polyrl.models.processor import load_vision_processor

    row = _verl_row(images=[{"bytes": _png(size=(112, 112))}])
    counts = {}
    for side in (56, 112):
        proc = load_vision_processor(tiny_vl_dir, min_pixels=side * side, max_pixels=side * side)
        ds = RLDataset([row], proc.tokenizer, 128, processor=proc)
        counts[side] = ds[0][MULTI_MODAL].token_counts[0]
        assert _image_runs(ds[0]["input_ids"].tolist(), proc) == [counts[side]]
    assert (counts[56], counts[112]) == (4, 16)


def test_bad_image_fails_at_load_naming_the_row_or_is_filtered(tiny_vl_processor):
    proc = tiny_vl_processor
    rows = [_verl_row(), _verl_row(images=[{"bytes": b"not an image"}]), _verl_row()]
    with pytest.raises(MultiModalInputError, match=r"row 1: field 'images': image 0: not a read"):
        RLDataset(rows, proc.tokenizer, 128, processor=proc)
    ds = RLDataset(rows, proc.tokenizer, 128, processor=proc, truncation="filter")
    assert (len(ds), ds.num_bad_media, ds.bad_media_indices) == (2, 1, [1])
    # More images than placeholders is a load-time error too.
    with pytest.raises(MultiModalInputError, match="row 0"):
        RLDataset([_verl_row(images=[_png(), _png()])], proc.tokenizer, 128, processor=proc)


def test_truncation_never_cuts_an_image(tiny_vl_processor):
    proc = tiny_vl_processor
    rows = [_verl_row("<image>" + " word" * 40)]
    with pytest.raises(PromptTooLongError, match="would cut its image"):
        RLDataset(rows, proc.tokenizer, 20, processor=proc, truncation="left")
    ds = RLDataset(rows, proc.tokenizer, 20, processor=proc, truncation="filter")
    assert len(ds) == 0 and ds.num_filtered == 1
    # Cutting only text is fine: the image run is whole.
    ds = RLDataset(rows, proc.tokenizer, 20, processor=proc, truncation="right")
    assert len(ds[0]["input_ids"]) == 20 and _image_runs(ds[0]["input_ids"].tolist(), proc) == [4]


def test_n_copies_share_one_object(tiny_vl_processor):
    proc = tiny_vl_processor
    ds = RLDataset([_verl_row(), _verl_row()], proc.tokenizer, 128, processor=proc)
    assert ds[0][MULTI_MODAL] is ds[0][MULTI_MODAL]
    batch = ds.collate([ds[0], ds[1]]).repeat(4)
    column = batch.non_tensors[MULTI_MODAL]
    assert all(column[k] is column[0] for k in range(4))
    assert all(column[k] is column[4] for k in range(4, 8))


def test_media_messages_and_mask_expansion():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<video>a<image>"}]
    out = media_messages(msgs, 1, 1)
    assert out[1]["content"] == [
        {"type": "video"},
        {"type": "text", "text": "a"},
        {"type": "image"},
    ]
    assert msgs[1]["content"] == "<video>a<image>"  # not changed in place
    assert expand_mask([5, 9, 5, 8], [0, 0, 1, 1], {"image": 9, "video": 8}, [3, 2]) == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
    ]


def test_visual_task_is_deterministic_and_splits_are_disjoint(tmp_path):
    a = generate("visual_count", 20, 3, "train")
    assert a == generate("visual_count", 20, 3, "train")
    assert a[:5] == generate("visual_count", 5, 3, "train")
    assert a != generate("visual_count", 20, 4, "train")
    row = a[0]
    assert row["prompt"][0]["content"].startswith("<image>How many red shapes")
    img = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    assert img.size == (56, 56)
    assert row["reward_model"]["ground_truth"] in {"1", "2", "3", "4"}
    train, test = write_task_splits("visual_count", tmp_path, 60, 30, 0)
    train_rows, test_rows = read_rows(train), read_rows(test)
    assert (len(train_rows), len(test_rows)) == (60, 30)
    train_images = {r["images"][0]["bytes"] for r in train_rows}
    assert not train_images & {r["images"][0]["bytes"] for r in test_rows}
    with pytest.raises(ValueError, match="exceed"):
        generate("visual_count", 1, 0, grid=2, max_count=4)


def test_visual_task_loads_into_the_dataset(tmp_path, tiny_vl_processor):
    train, _ = write_task_splits("visual_count", tmp_path, 8, 4, 0)
    ds = RLDataset(train, tiny_vl_processor.tokenizer, 64, processor=tiny_vl_processor)
    assert len(ds) == 8 and all(ds[i][MULTI_MODAL].token_counts == (4,) for i in range(8))


def test_visual_count_reward_parses_answers():
    from polyrl.reward import get_scorer

    score = get_scorer("visual_count")
    assert score("3", "3") == 1.0
    assert score("There are 3 red shapes.", "3") == 1.0
    assert score("#### 4", "3") == 0.0
    assert score("three", "3") == 0.0
    assert score("", "3") == 0.0


def test_sft_chats_with_images(tiny_vl_processor):
    from polyrl.trainer.sft_data import SFTDataError, SFTDataset, chats_from_rows, collate_chats

    proc = tiny_vl_processor
    rows = generate("visual_count", 3, 0)
    chats = chats_from_rows(rows)
    assert chats[0]["images"] == rows[0]["images"]
    ds = SFTDataset(chats, proc.tokenizer, 64, processor=proc)
    item = ds[0]
    image = proc.token_ids["image"]
    assert _image_runs(item.input_ids, proc) == [4]
    assert all(m == 0 for t, m in zip(item.input_ids, item.loss_mask, strict=True) if t == image)
    learned = [t for t, m in zip(item.input_ids, item.loss_mask, strict=True) if m]
    assert proc.tokenizer.decode(learned).startswith(rows[0]["reward_model"]["ground_truth"])
    batch = collate_chats([ds[0], ds[1]], proc.tokenizer.pad_token_id)
    assert list(batch.non_tensors[MULTI_MODAL]) == [ds[0].multi_modal, ds[1].multi_modal]
    bad = [dict(rows[0], images=[{"bytes": b"junk"}]), rows[1]]
    with pytest.raises(SFTDataError, match="row 0: field 'images'"):
        SFTDataset(chats_from_rows(bad), proc.tokenizer, 64, processor=proc)
    ds = SFTDataset(chats_from_rows(bad), proc.tokenizer, 64, "filter", processor=proc)
    assert (len(ds), ds.num_bad_media) == (1, 1)
    with pytest.raises(SFTDataError, match="cut its image"):
        SFTDataset(chats, proc.tokenizer, 8, "right", processor=proc)
    with pytest.raises(SFTDataError, match="not a vision-language model"):
        SFTDataset(chats, proc.tokenizer, 64)


def test_image_options_in_config():
    from polyrl.config import ConfigError, load_config
    from polyrl.config.verl_compat import lookup

    cfg = load_config("grpo", ["data.image_min_pixels=3136", "data.image_max_pixels=12544"])
    assert (cfg.data.image_key, cfg.data.video_key) == ("images", "videos")
    assert (cfg.data.image_min_pixels, cfg.data.image_max_pixels) == (3136, 12544)
    with pytest.raises(ConfigError, match="image_min_pixels"):
        load_config("grpo", ["data.image_min_pixels=9000", "data.image_max_pixels=100"])
    assert lookup("data.image_key").polyrl == "data.image_key"
