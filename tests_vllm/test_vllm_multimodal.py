"""Images and the ``vllm`` backend: the prompt vLLM takes, its token-in generate route over HTTP.

Run with ``make test-vllm``. :func:`vllm_prompt` builds the ``TokensPrompt`` dict with
``multi_modal_data`` that vLLM's own engine takes; over HTTP an image request goes to vLLM's
``/inference/v1/generate`` (token ids with one placeholder per image, the images as ``data:``
URLs), whose body :func:`vllm_generate_body` builds. The route and its stream are checked on
the text model against ``/v1/completions``; the tests with a tiny Qwen2-VL need vLLM to load
that family, which needs a CPU torchvision in the vLLM venv (``setup_vllm_venv.sh``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    collect_outputs,
)
from polyrl.rollout.vllm_backend import vllm_generate_body, vllm_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build a tiny Qwen2-VL with 32-wide attention heads (vLLM's CPU kernels want >= 32)."""
    from polyrl.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("vl") / "qwen2-vl"
    return build_tiny_model("qwen2_vl", out, size="nano", heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def vl_vllm(vllm_venv: Path) -> Path:
    """Return the vLLM venv; fail clearly when vLLM there cannot load Qwen2-VL."""
    probe = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", "import torchvision"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.fail(
            "vLLM's Qwen2-VL needs torchvision, and `import torchvision` fails in "
            f"{vllm_venv}: {probe.stderr.strip().splitlines()[-1:]}; install the CPU build "
            "that pairs with its torch (scripts/setup_vllm_venv.sh tries "
            "torchvision==0.28.0+cpu from PyTorch's CPU index)",
            pytrace=False,
        )
    return vllm_venv


@pytest.fixture(scope="module")
def vl_backend(vl_vllm: Path, vl_dir: Path, aio: Any) -> Any:
    """Start a ``vllm`` backend serving the tiny Qwen2-VL."""
    from polyrl.rollout.vllm_backend import VLLMBackend

    b = VLLMBackend(vl_dir, vllm_venv=str(vl_vllm), dtype="float32", max_model_len=512)
    aio.run(b.start(), timeout=900)
    try:
        yield b
    finally:
        aio.run(b.shutdown(), timeout=120)


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


async def _collect(backend: Any, req: GenerateRequest) -> Any:
    return await collect_outputs(req, await backend.generate(req))


def test_generate_body_sends_collapsed_ids_and_images_as_data_urls(processor: Any) -> None:
    """One placeholder per image, the PNG sources as data: URLs, vLLM's sampling params."""
    req = _request(processor, [(255, 0, 0), (0, 0, 255)])
    image_id = processor.token_ids["image"]
    body = vllm_generate_body(req, processor.token_ids, "vl", 4)
    assert body["token_ids"] == vllm_prompt(req, processor.token_ids)["prompt_token_ids"]
    assert body["token_ids"].count(image_id) == 2
    urls = [p["url"] for p in body["content_parts"]]
    assert [p["type"] for p in body["content_parts"]] == ["image_url", "image_url"]
    sent = [base64.b64decode(u.removeprefix("data:image/png;base64,")) for u in urls]
    assert sent == list(req.multi_modal.sources)
    assert body["sampling_params"]["max_tokens"] == 4 and body["stream"] is True
    assert body["return_token_ids"] is True
    video = dataclasses.replace(
        req.multi_modal, kinds=("image", "video"), sources=(req.multi_modal.sources[0], [b""])
    )
    with pytest.raises(InvalidRequestError, match="images only"):
        vllm_generate_body(
            dataclasses.replace(req, multi_modal=video), processor.token_ids, "vl", 4
        )


def test_a_text_model_refuses_images(backend: Any, aio: Any, processor: Any) -> None:
    """The text model's config names no image token: an image request is a 400."""
    req = _request(processor, [(1, 2, 3)])
    with pytest.raises(InvalidRequestError, match="not a vision-language model"):
        aio.run(backend.generate(req))


def test_generate_route_streams_what_completions_does(backend: Any, aio: Any) -> None:
    """The generate route (the image path) streams what ``/v1/completions`` does.

    The same greedy request gives the same tokens, log-probs and alternatives, and the route
    echoes the prompt ids (the backend checks vLLM's expansion of image placeholders by them).
    """
    import httpx

    from polyrl.rollout.vllm_backend import _Job

    params = SamplingParams(
        max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    req = GenerateRequest("route", (5, 9, 13, 2), params)
    want = aio.run(_collect(backend, req)).outputs[0]
    body = vllm_generate_body(req, {}, backend.info.model, 5)

    async def stream() -> tuple[list[int], list[float], list[Any], list[int]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[Any] = []
        prompt: list[int] = []
        url = backend.url + "/inference/v1/generate"
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", url, json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    prompt = chunk.get("prompt_token_ids", prompt)
                    for choice in chunk["choices"]:
                        tokens += choice["token_ids"] or []
                        values, top = _Job._logprobs_of(choice)
                        logprobs += values
                        tops += [_Job._top_k(t, 2) for t in top]
        return tokens, logprobs, tops, prompt

    tokens, logprobs, tops, prompt = aio.run(stream())
    assert prompt == list(req.prompt_ids)
    assert tokens == want.output_ids
    assert logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert [[t for t, _ in row] for row in tops] == [
        [t for t, _ in row] for row in want.top_logprobs
    ]


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


def test_vllm_generates_from_the_prompt_dict(vl_vllm: Path, vl_dir: Path, processor: Any) -> None:
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
        [str(vl_vllm / "bin" / "python"), "-c", _OFFLINE],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    tokens = json.loads(line.split(" ", 1)[1])
    assert len(tokens) == 4


@torch.inference_mode()
def _hf_logprobs(vl_dir: Path, req: GenerateRequest, new: list[int]) -> list[float]:
    """Log-probs (fp32, T=1) of ``new`` after ``req``'s prompt and images, by HF's forward."""
    from polyrl.models.loader import load_causal_lm

    model = load_causal_lm(vl_dir).eval()
    ids = torch.tensor([[*req.prompt_ids, *new]])
    logits = model(input_ids=ids, **req.multi_modal.tensors).logits[0].float()
    logits = logits[len(req.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()


def test_backend_generates_from_images_over_http(
    vl_backend: Any, vl_dir: Path, aio: Any, processor: Any
) -> None:
    """Image prompts over HTTP: vLLM's log-probs are HF's forward with the image.

    Another image changes them too (the images reach the model).
    """
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = []
    for color in [(200, 40, 0), (0, 40, 200)]:
        req = dataclasses.replace(_request(processor, [color]), params=params)
        out = aio.run(_collect(vl_backend, req)).outputs[0]
        assert len(out.output_ids) == 4
        assert out.logprobs == pytest.approx(_hf_logprobs(vl_dir, req, out.output_ids), abs=2e-3)
        outs.append(out)
    assert outs[0].logprobs != pytest.approx(outs[1].logprobs, abs=1e-6)
