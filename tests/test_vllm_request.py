"""What the ``vllm`` backend sends vLLM for an image prompt, built without vLLM.

vLLM's multi-modal processor expands each image's placeholder itself, so
:func:`~polyrl.rollout.vllm_backend.vllm_prompt` and
:func:`~polyrl.rollout.vllm_backend.vllm_generate_body` collapse polyrl's expanded prompt back
to one placeholder per image (a Qwen2-VL run of image tokens; a SmolVLM image's marker-wrapped
tile runs), and send the pixel bounds the prompt was processed with, so vLLM makes as many
image tokens as polyrl's processor did. The same builders against a real vLLM server:
``tests_vllm/test_vllm_multimodal.py`` (``make test-vllm``).
"""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest
from PIL import Image

from polyrl.core.rollout_api import GenerateRequest, InvalidRequestError, SamplingParams
from polyrl.rollout.vllm_backend import (
    VLLMBackend,
    vllm_generate_body,
    vllm_processor_kwargs,
    vllm_prompt,
)


def _user(n_images: int) -> list[dict]:
    parts = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "count"}]}]


def _request(processor, images, pixel_bounds=None) -> GenerateRequest:
    ids = _bare_prompt(processor, len(images))
    ids, mm = processor.encode(ids, images, pixel_bounds=pixel_bounds)
    return GenerateRequest("r", tuple(ids), SamplingParams(max_new_tokens=4), multi_modal=mm)


def _bare_prompt(processor, n_images: int) -> list[int]:
    """The chat template's ids: one bare placeholder per image, what vLLM is to be sent."""
    return processor.tokenizer.apply_chat_template(
        _user(n_images), add_generation_prompt=True, return_dict=False
    )


def test_smolvlm_prompts_collapse_each_tile_expansion_to_one_image_token(tiny_smolvlm_processor):
    proc = tiny_smolvlm_processor
    # A split image (2x2 tiles plus the global view) and an unsplit one, side by side.
    images = [Image.new("RGB", (56, 56), (200, 40, 10)), Image.new("RGB", (20, 20), (0, 90, 200))]
    req = _request(proc, images)
    assert req.multi_modal.expansions, "SmolVLM expands with marker tokens"
    prompt = vllm_prompt(req, proc.token_ids)
    assert prompt["prompt_token_ids"] == _bare_prompt(proc, 2)
    # vLLM writes each image's expansion in place of its <image>: that gives polyrl's prompt.
    image = proc.token_ids["image"]
    redone: list[int] = []
    items = iter(req.multi_modal.expansions)
    for tok in prompt["prompt_token_ids"]:
        redone.extend(next(items) if tok == image else (tok,))
    assert redone == list(req.prompt_ids)
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(56, 56), (20, 20)]
    body = vllm_generate_body(req, proc.token_ids, "smol", 4)
    assert body["token_ids"] == prompt["prompt_token_ids"]
    # The trainer's processor used the model's own sizes: no bounds to send.
    assert "mm_processor_kwargs" not in body and "mm_processor_kwargs" not in prompt
    # A prompt with one image's expansion cut short matches none of its items.
    cut = list(req.prompt_ids)
    del cut[cut.index(image)]
    with pytest.raises(InvalidRequestError, match="placeholder"):
        vllm_prompt(dataclasses.replace(req, prompt_ids=tuple(cut)), proc.token_ids)


def test_qwen2_vl_pixel_bounds_reach_vllm_and_a_mismatch_is_refused(tiny_vl_processor, tiny_vl_dir):
    proc = tiny_vl_processor
    images = [Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (112, 56), (0, 0, 255))]
    bounds = (28 * 28, 56 * 56)  # the 112x56 image shrinks to at most 56*56 pixels
    req = _request(proc, images, pixel_bounds=bounds)
    kwargs = {"min_pixels": 28 * 28, "max_pixels": 56 * 56}
    # The engine's prompt dict carries them per request.
    prompt = vllm_prompt(req, proc.token_ids)
    assert prompt["prompt_token_ids"] == _bare_prompt(proc, 2)
    assert prompt["mm_processor_kwargs"] == kwargs
    # The HTTP token-in route takes none per request: the server is started with them...
    backend = VLLMBackend(tiny_vl_dir, image_min_pixels=bounds[0], image_max_pixels=bounds[1])
    cmd = backend.command(1)
    assert json.loads(cmd[cmd.index("--mm-processor-kwargs") + 1]) == kwargs
    assert "--mm-processor-kwargs" not in VLLMBackend(tiny_vl_dir).command(1)
    body = vllm_generate_body(req, proc.token_ids, "vl", 4, backend.pixel_bounds)
    assert body["token_ids"] == prompt["prompt_token_ids"]
    sent = [
        base64.b64decode(p["url"].removeprefix("data:image/png;base64,"))
        for p in body["content_parts"]
    ]
    assert sent == list(req.multi_modal.sources)
    # ... and a prompt processed with other bounds would be expanded otherwise there: a 400.
    with pytest.raises(InvalidRequestError, match=r"pixel bounds .*\(784, 3136\).*\(None, None\)"):
        vllm_generate_body(req, proc.token_ids, "vl", 4)


def test_smolvlm_pixel_bounds_become_its_longest_edge(tiny_smolvlm_dir):
    config = json.loads((tiny_smolvlm_dir / "config.json").read_text())
    tile = config["vision_config"]["image_size"]
    assert vllm_processor_kwargs(config, (None, (2 * tile) ** 2)) == {
        "size": {"longest_edge": 2 * tile}
    }
    assert vllm_processor_kwargs(config, (None, None)) == {}
    with pytest.raises(ValueError, match="image_min_pixels does not apply to smolvlm"):
        vllm_processor_kwargs(config, (tile * tile, None))
