"""Images and the ``vllm`` backend: the prompt dict vLLM takes, and refusals over HTTP.

Run with ``make test-vllm``. :func:`vllm_prompt` builds the ``TokensPrompt`` dict with
``multi_modal_data`` that vLLM's own engine takes; the last test feeds it to vLLM (offline
``LLM.generate`` in the vLLM venv) with a tiny Qwen2-VL. Over HTTP, vLLM's token-in
completions API carries no images, so the backend refuses image requests with 400 rather than
generating from bare placeholders.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from polyrl.core.rollout_api import GenerateRequest, InvalidRequestError, SamplingParams
from polyrl.rollout.vllm_backend import vllm_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build a tiny Qwen2-VL with 32-wide attention heads (vLLM's CPU kernels want >= 32)."""
    from polyrl.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("vl") / "qwen2-vl"
    return build_tiny_model("qwen2_vl", out, size="nano", heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def processor(vl_dir: Path) -> Any:
    """Return the tiny model's vision processor."""
    from polyrl.models.processor import load_vision_processor

    return load_vision_processor(vl_dir)


def _request(processor: Any, colors: list[tuple[int, int, int]]) -> GenerateRequest:
    msgs = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in colors), {"type": "text", "text": "hi"}],
        }
    ]
    images = [Image.new("RGB", (56, 56), c) for c in colors]
    ids, mm = processor.encode_messages(msgs, images=images)
    return GenerateRequest("vl", tuple(ids), SamplingParams(max_new_tokens=4), multi_modal=mm)


def test_vllm_prompt_collapses_placeholders_and_decodes_media(processor: Any) -> None:
    """One placeholder per item goes to vLLM, with the items as PIL images."""
    req = _request(processor, [(255, 0, 0), (0, 0, 255)])
    image_id = processor.token_ids["image"]
    prompt = vllm_prompt(req, processor.token_ids)
    assert prompt["prompt_token_ids"].count(image_id) == 2
    assert list(req.prompt_ids).count(image_id) == sum(req.multi_modal.token_counts)
    images = prompt["multi_modal_data"]["image"]
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 0, 255)]
    text = GenerateRequest("t", (1, 2, 3))
    assert vllm_prompt(text, processor.token_ids) == {"prompt_token_ids": [1, 2, 3]}


def test_backend_refuses_images_over_http(backend: Any, aio: Any, processor: Any) -> None:
    """Token ids alone would be generated from placeholders: the backend says 400 instead."""
    req = _request(processor, [(1, 2, 3)])
    with pytest.raises(InvalidRequestError, match="no images"):
        aio.run(backend.generate(req))


_OFFLINE = r"""
import base64, io, json, sys
from PIL import Image
from vllm import LLM, SamplingParams
spec = json.loads(sys.stdin.read())
data = {"image": [Image.open(io.BytesIO(base64.b64decode(b))) for b in spec["images"]]}
llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True,
          limit_mm_per_prompt={"image": 2})
prompt = {"prompt_token_ids": spec["ids"], "multi_modal_data": data}
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("RESULT", json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_vllm_generates_from_the_prompt_dict(vllm_venv: Path, vl_dir: Path, processor: Any) -> None:
    """The prompt dict goes through vLLM's own engine and generates."""
    import io

    req = _request(processor, [(200, 40, 0)])
    prompt = vllm_prompt(req, processor.token_ids)
    images = []
    for im in prompt["multi_modal_data"]["image"]:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        images.append(base64.b64encode(buf.getvalue()).decode())
    spec = {"model": str(vl_dir), "ids": prompt["prompt_token_ids"], "images": images}
    proc = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", _OFFLINE],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    tokens = json.loads(line.split(" ", 1)[1])
    assert len(tokens) == 4
