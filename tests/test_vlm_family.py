"""The other vision-language families, SmolVLM and Qwen3-VL: tiny builders, processors, rules.

The engine, rollout and RL tests of SmolVLM (Qwen3-VL: engine and rollout) are the Qwen2-VL
ones parametrized over the family (tests/test_engine_vlm.py, test_rollout_vlm.py,
test_rl_vlm.py).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from polyrl.core.multimodal import MultiModalInputError, expand_placeholders
from polyrl.models.vision_family import (
    Qwen2VLFamily,
    Qwen3VLFamily,
    SmolVLMFamily,
    vision_family,
)


def _image(size, color=(200, 40, 10)):
    img = Image.new("RGB", size, color)
    px = img.load()
    for x in range(size[0]):
        px[x, 0] = (3 * x % 256, 0, 0)
    return img


def _user(n_images: int, text: str = "count"):
    parts = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_the_tiny_smolvlm_loads_with_the_auto_classes(tiny_smolvlm_dir):
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )

    model = AutoModelForImageTextToText.from_pretrained(tiny_smolvlm_dir)
    assert type(model).__name__ == "SmolVLMForConditionalGeneration"
    config = AutoConfig.from_pretrained(tiny_smolvlm_dir)
    tok = AutoTokenizer.from_pretrained(tiny_smolvlm_dir)
    assert tok.convert_tokens_to_ids("<image>") == config.image_token_id
    assert len(tok.encode("<fake_token_around_image><global-img><row_2_col_1>")) == 3
    image_processor = AutoImageProcessor.from_pretrained(tiny_smolvlm_dir)
    assert image_processor.max_image_size == {"longest_edge": 32}
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (32, 8)
    assert isinstance(vision_family(config), SmolVLMFamily)


def test_tile_size_is_a_smolvlm_option_only():
    from polyrl.models.tiny import resolve_tiny_spec

    spec = resolve_tiny_spec("smolvlm", tile_size=16, image_size=48)
    assert (spec["dims"]["tile_size"], spec["dims"]["patch_size"]) == (16, 8)
    assert "tile_size" not in resolve_tiny_spec("qwen2_vl")["dims"]
    with pytest.raises(ValueError, match="tile_size only applies"):
        resolve_tiny_spec("qwen2_vl", tile_size=16)
    with pytest.raises(ValueError, match="multiple of tile_size"):
        resolve_tiny_spec("smolvlm", image_size=40)


@pytest.mark.parametrize(("size", "layout"), [((56, 56), (2, 2)), ((60, 20), (1, 2))])
def test_smolvlm_expansion_equals_transformers_prompt_string(tiny_smolvlm_processor, size, layout):
    # transformers' own SmolVLMProcessor needs num2words and torchvision; its prompt-string
    # function and image processor do not, and are what it uses.
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    proc = tiny_smolvlm_processor
    ids, mm = proc.encode_messages(_user(1), images=[_image(size)])
    assert tuple(mm.tensors["image_rows_cols"][0].tolist()) == layout
    text = get_image_prompt_string(
        *layout,
        image_seq_len=4,
        fake_token_around_image="<fake_token_around_image>",
        image_token="<image>",
        global_image_token="<global-img>",
    )
    want = proc.tokenizer.apply_chat_template(
        _user(1), add_generation_prompt=True, return_dict=False
    )
    at = want.index(proc.token_ids["image"])
    want[at : at + 1] = proc.tokenizer.encode(text, add_special_tokens=False)
    assert ids == want
    # The image processor's own tiles, the whole image's tile last.
    stock = proc.image_processor(images=[[_image(size)]], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(mm.tensors["pixel_values"], stock[0])
    tiles = layout[0] * layout[1] + 1
    assert mm.token_counts == (tiles * 4,) and ids.count(proc.token_ids["image"]) == tiles * 4


def test_smolvlm_placeholders_count_per_token_and_expanded_ids_pass(tiny_smolvlm_processor):
    proc = tiny_smolvlm_processor
    imgs = [_image((56, 56)), _image((20, 20), (0, 90, 200))]
    # Adjacent placeholders (two image parts in a row) are two images.
    ids, mm = proc.encode_messages(_user(2), images=imgs)
    assert proc.media_order(ids) == ["image", "image"]
    assert expand_placeholders(ids, proc.token_ids, mm) == ids
    again, mm2 = proc.encode(ids, images=imgs)  # a rollout server receives expanded ids
    assert again == ids and mm2.digests == mm.digests
    with pytest.raises(MultiModalInputError, match="2 media placeholder.*1 image"):
        proc.encode_messages(_user(2), images=imgs[:1])
    with pytest.raises(MultiModalInputError, match="takes images only|images only"):
        proc.process_media(videos=[[imgs[0], imgs[0]]])


def test_smolvlm_pixel_bounds_map_to_the_longest_edge(tiny_smolvlm_dir):
    from polyrl.models.processor import VisionProcessor

    # image_max_pixels 32*32: the longest edge goes to 32, one tile, no split.
    small = VisionProcessor.from_pretrained(tiny_smolvlm_dir, max_pixels=32 * 32 + 5)
    _, mm = small.encode_messages(_user(1), images=[_image((80, 60))])
    assert mm.token_counts == (4,) and mm.tensors["pixel_values"].shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="image_min_pixels does not apply to smolvlm"):
        VisionProcessor.from_pretrained(tiny_smolvlm_dir, min_pixels=1024)
    with pytest.raises(ValueError, match="below one 32 x 32 tile"):
        VisionProcessor.from_pretrained(tiny_smolvlm_dir, max_pixels=500)


def test_families_name_their_tower_and_refuse_others(tiny_vl_dir, tiny_smolvlm_dir):
    from transformers import AutoConfig

    qwen = vision_family(AutoConfig.from_pretrained(tiny_vl_dir))
    smol = vision_family(AutoConfig.from_pretrained(tiny_smolvlm_dir))
    assert isinstance(qwen, Qwen2VLFamily) and qwen.mrope and not smol.mrope
    assert smol.in_tower("model.connector.modality_projection.proj")
    assert not smol.in_tower("model.text_model.layers.0.self_attn.q_proj")
    assert qwen.in_tower("model.visual.blocks.0.attn.qkv") and not qwen.in_tower("model.visualx")
    assert vision_family({"model_type": "llama"}) is None
    with pytest.raises(ValueError, match="'gemma3' is not supported; polyrl runs"):
        vision_family({"model_type": "gemma3", "vision_config": {}})


def test_qwen3_vl_reads_its_patches_and_deepstack_and_refuses_videos(tiny_qwen3_vl_processor):
    proc = tiny_qwen3_vl_processor
    family = proc.family
    assert isinstance(family, Qwen3VLFamily) and family.mrope
    # 16-pixel patches, two frames per temporal patch; one DeepStack layer in the tiny model.
    assert family.patch_dim == 3 * 2 * 16 * 16 and family.deepstack_layers == 1
    assert family.in_tower("model.visual.deepstack_merger_list.0.linear_fc1")
    ids, mm = proc.encode([5, proc.token_ids["image"], 6], images=[_image((64, 64))])
    # A 64 x 64 image: 4 x 4 patches, merged 2 x 2 into 4 image tokens.
    assert mm.tensors["image_grid_thw"].tolist() == [[1, 4, 4]] and len(ids) == 2 + 4
    with pytest.raises(MultiModalInputError, match="qwen3_vl videos are not supported"):
        proc.process_media(videos=[[_image((64, 64))] * 2])


def test_qwen3_vl_dummy_features_reach_every_vision_parameter(tiny_qwen3_vl_dir):
    # The FSDP engine's dummy vision runs (a rank without media) must use the DeepStack
    # mergers too, or their gradients' reduce-scatter would not match the other ranks'.
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_dir)
    family = vision_family(model.config)
    out = family.dummy_features(model, torch.device("cpu"))
    # One merge group: one merged row plus one DeepStack row, at the language model's width.
    assert out.shape == (2, model.config.text_config.hidden_size)
    out.square().sum().backward()
    no_grad = [n for n, p in model.model.visual.named_parameters() if p.grad is None]
    assert no_grad == [], no_grad


def test_truncation_that_cuts_a_smolvlm_marker_is_refused(tiny_smolvlm_processor):
    import io

    from polyrl.core.prompts import PromptTooLongError
    from polyrl.data.dataset import RLDataset

    proc = tiny_smolvlm_processor
    buf = io.BytesIO()
    _image((56, 56)).save(buf, format="PNG")
    rows = [
        {
            "data_source": "t",
            "prompt": [{"role": "user", "content": "<image>How many?"}],
            "reward_model": {"ground_truth": "1"},
            "images": [{"bytes": buf.getvalue()}],
        }
    ]
    ids = RLDataset(rows, proc.tokenizer, 256, processor=proc)[0]["input_ids"].tolist()
    # Keep the tokens after the first tile's first marker: every image token survives.
    first = ids.index(proc.tokenizer.convert_tokens_to_ids("<fake_token_around_image>"))
    with pytest.raises(PromptTooLongError, match="cut its image"):
        RLDataset(rows, proc.tokenizer, len(ids) - first - 1, processor=proc, truncation="left")
