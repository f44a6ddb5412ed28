"""The FSDP2 model engine on vision-language models (tiny random Qwen2-VL and SmolVLM, fp32, CPU).

Log-probs of image prompts equal the HF model's own forward in every layout and at world size
2; the vision tower can be frozen; LoRA adapts the language model only; weights, exports and
checkpoints carry the vision tower. Tests taking ``family`` run for both families (SmolVLM in
fewer layouts: its path differs from Qwen2-VL's in media tensors and positions, not layouts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine_scripts"))

from engine_common import launch  # noqa: E402
from vlm_common import hf_media, reference_log_probs, vlm_batch  # noqa: E402

from polyrl.core.columns import MULTI_MODAL  # noqa: E402
from polyrl.model_engine import EngineConfig, OptimizerConfig, sft_loss  # noqa: E402
from polyrl.model_engine.engine import compute_log_probs  # noqa: E402

LAYOUTS = {
    "padded": {"dynamic_batching": False, "micro_batch_size": 4},
    "rows": {"dynamic_batching": False, "micro_batch_size": 1},
    "trimmed": {"dynamic_batching": True, "max_tokens_per_micro_batch": 4096},
    "packed": {
        "dynamic_batching": True,
        "pack_sequences": True,
        "max_tokens_per_micro_batch": 4096,
    },
}


#: Per family: (model directory fixture, processor fixture, the tower's parameter prefixes).
FAMILIES = {
    "qwen2_vl": ("tiny_vl_dir", "tiny_vl_processor", ("model.visual.",)),
    "qwen2_5_vl": ("tiny_qwen2_5_vl_dir", "tiny_qwen2_5_vl_processor", ("model.visual.",)),
    "qwen3_vl": ("tiny_qwen3_vl_dir", "tiny_qwen3_vl_processor", ("model.visual.",)),
    "smolvlm": (
        "tiny_smolvlm_dir",
        "tiny_smolvlm_processor",
        ("model.vision_model.", "model.connector."),
    ),
}


@pytest.fixture(scope="module", params=["qwen2_vl", "smolvlm"])
def family(request):
    # Qwen2.5-VL shares Qwen2-VL's engine path: only the log-prob parity runs it. Qwen3-VL
    # (DeepStack) runs in the parity, freezing, LoRA and export tests (WITH_QWEN3_VL).
    return request.param


#: The module's families plus Qwen3-VL, for the tests whose path differs for DeepStack.
WITH_QWEN3_VL = pytest.mark.parametrize(
    "family", ["qwen2_vl", "smolvlm", "qwen3_vl"], indirect=True, scope="module"
)


@pytest.fixture(scope="module")
def vl_dir(request, family):
    return request.getfixturevalue(FAMILIES[family][0])


@pytest.fixture(scope="module")
def vl_processor(request, family):
    return request.getfixturevalue(FAMILIES[family][1])


def _in_tower(family, name):
    return name.startswith(FAMILIES[family][2])


@pytest.fixture(scope="module")
def hf_model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir).eval()


@pytest.fixture(scope="module")
def batch(vl_processor):
    return vlm_batch(vl_processor)


@pytest.fixture(scope="module")
def reference(hf_model, vl_processor, batch):
    return reference_log_probs(hf_model, vl_processor, batch)


def _engine(engines, path, **engine_kwargs):
    return engines(
        str(path),
        EngineConfig(device="cpu", grad_clip=1e9, **engine_kwargs),
        OptimizerConfig(lr=1e-2),
    )


def _vlm_spec(path, **kwargs):
    from polyrl.model_engine import ModelSpec

    return ModelSpec(path=str(path), **kwargs)


@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen2_vl", layout) for layout in sorted(LAYOUTS)]
    + [("smolvlm", "padded"), ("smolvlm", "packed"), ("qwen2_5_vl", "packed")]
    # Qwen3-VL: padded repeats row 0's image and DeepStack features for row 3 (encode_once).
    + [("qwen3_vl", "padded"), ("qwen3_vl", "packed")],
    indirect=["family"],
)
def test_log_probs_with_images_equal_the_hf_models_own(engines, vl_dir, batch, reference, layout):
    engine = _engine(engines, vl_dir, **LAYOUTS[layout])
    out = engine.infer_batch(batch, compute_log_probs)["log_probs"]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_the_samples_of_a_prompt_encode_its_images_once(engines, family, vl_dir, batch, reference):
    engine = _engine(engines, vl_dir, **LAYOUTS["padded"])  # one micro-batch of 4 rows
    patches = []
    # Rows (Qwen2-VL: patches; SmolVLM: tiles) of pixels the vision encoder sees per call.
    tower = engine.model.model.visual if family == "qwen2_vl" else engine.model.model.vision_model
    hook = tower.register_forward_pre_hook(
        lambda module, args, kwargs: patches.append(
            (args or [kwargs.get("pixel_values")])[0].shape[0]
        ),
        with_kwargs=True,
    )
    try:
        out = engine.infer_batch(batch, compute_log_probs)["log_probs"]
    finally:
        hook.remove()
    # Rows 0 and 3 hold one inputs object: its image goes through the tower once.
    mm = batch[MULTI_MODAL]
    assert mm[0] is mm[3]
    assert patches == [
        mm[0].tensors["pixel_values"].shape[0] + mm[1].tensors["pixel_values"].shape[0]
    ]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_the_image_is_in_context(engines, vl_dir, vl_processor, batch, reference):
    # Another image of the same size (same tokens) changes the response's log-probs.
    _, other = vl_processor.encode(
        [vl_processor.token_ids["image"]], images=[Image.new("RGB", (56, 56), (0, 255, 0))]
    )
    changed = batch[[0, 1, 2, 3]]
    changed.non_tensors[MULTI_MODAL] = changed[MULTI_MODAL].copy()
    changed.non_tensors[MULTI_MODAL][0] = other
    engine = _engine(engines, vl_dir, **LAYOUTS["packed"])
    out = engine.infer_batch(changed, compute_log_probs)["log_probs"]
    mask = batch["loss_mask"].bool()
    assert (out[0] - reference[0])[mask[0]].abs().max() > 1e-4
    torch.testing.assert_close(out[1:], reference[1:], atol=1e-5, rtol=0)


#: Per family: the cases vlm_rank.py runs, and the top-level modules (under ``model.``) of
#: the language model and of the vision tower.
WORLD_2 = {
    "qwen2_vl": ("rows,packed,frozen_rows", ["language_model"], ["visual"]),
    # SmolVLM: the rows layout meets the dummy vision calls; packing and freezing at world
    # size 2 are family-independent (freezing SmolVLM's tower: the world-size-1 test).
    "smolvlm": ("rows", ["text_model"], ["connector", "vision_model"]),
}


def test_fsdp_world_size_2_matches_the_hf_model_and_one_rank(
    engines, family, vl_dir, batch, tmp_path
):
    cases, lm, tower = WORLD_2[family]
    out = tmp_path / "vlm.json"
    codes = launch("vlm_rank.py", [str(vl_dir), str(out), cases], world=2)
    assert codes == [0, 0], "\n".join(launch.last_logs)
    results = json.loads(out.read_text())
    single = _engine(engines, vl_dir, **LAYOUTS["rows"]).train_batch(batch, sft_loss)
    for name in ("rows", "packed"):
        if name not in results:
            continue
        got = results[name]
        assert got["logp_diff"] <= 1e-5, (name, got)
        # Summed gradients over ranks: the same step as one process on the whole batch.
        assert got["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5), name
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-5), name
        assert got["moved"] == sorted(lm + tower), got  # lm_head is tied
    assert sorted(results) == sorted(cases.split(","))
    frozen = results.get("frozen_rows")
    if frozen is not None:
        assert frozen["logp_diff"] <= 1e-5 and not set(tower) & set(frozen["moved"]), frozen
        assert set(lm) <= set(frozen["moved"]), frozen


def _full(engine):
    return {k: v.clone() for k, v in engine.named_tensors()}


@WITH_QWEN3_VL
def test_freeze_vision_tower_trains_the_language_model_only(engines, family, vl_dir, batch):
    engine = engines(
        _vlm_spec(vl_dir, freeze_vision_tower=True),
        EngineConfig(device="cpu", **LAYOUTS["packed"]),
        OptimizerConfig(lr=1e-2),
    )
    from torch.distributed.fsdp import FSDPModule

    # The vision tower is sharded unit by unit, like the decoder layers.
    inner = engine.model.model
    if family != "smolvlm":
        blocks, projection = inner.visual.blocks, inner.visual.merger
    else:
        blocks, projection = inner.vision_model.encoder.layers, inner.connector
    assert all(isinstance(b, FSDPModule) for b in blocks)
    assert isinstance(projection, FSDPModule)
    if family == "qwen3_vl":
        assert all(isinstance(m, FSDPModule) for m in inner.visual.deepstack_merger_list)
    optimised = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    tower = [p for n, p in engine.model.named_parameters() if _in_tower(family, n)]
    assert tower and not any(id(p) in optimised or p.requires_grad for p in tower)
    before = _full(engine)
    engine.train_batch(batch, sft_loss)
    after = _full(engine)
    for name, value in before.items():
        moved = not torch.equal(value, after[name])
        assert moved != _in_tower(family, name), name


def test_freeze_vision_tower_is_refused_for_a_text_model(engines, tiny_qwen2_dir):
    with pytest.raises(ValueError, match="no vision tower"):
        engines(_vlm_spec(tiny_qwen2_dir, freeze_vision_tower=True), EngineConfig(device="cpu"))


@pytest.mark.parametrize("family", ["qwen2_vl"], indirect=True)
def test_a_value_model_on_a_vlm_sees_the_images(engines, tiny_vl_dir, tiny_vl_processor, batch):
    from transformers import AutoModel

    from polyrl.model_engine.engine import compute_values

    engine = engines(
        _vlm_spec(tiny_vl_dir, kind="value"),
        EngineConfig(device="cpu", **LAYOUTS["packed"]),
        OptimizerConfig(lr=1e-2),
    )
    values = engine.infer_batch(batch, compute_values)["values"]
    head = dict(engine.named_tensors())
    assert any(n.startswith("model.visual.") for n in head)
    backbone = AutoModel.from_pretrained(tiny_vl_dir).eval()
    ids, am = batch["input_ids"], batch["attention_mask"].bool()
    image = tiny_vl_processor.token_ids["image"]
    for row in range(len(batch)):
        x = ids[row, am[row]].view(1, -1)
        mm = batch[MULTI_MODAL][row]
        media = {} if mm is None else {"mm_token_type_ids": (x == image).long(), **mm.tensors}
        with torch.no_grad():
            hidden = backbone(input_ids=x, **media).last_hidden_state[0]
        want = hidden @ head["score.weight"].view(-1) + head["score.bias"]
        torch.testing.assert_close(values[row, am[row]], want, atol=1e-5, rtol=0)
    assert engine.train_batch(batch, _value_loss)["grad_norm"] > 0


def _value_loss(output, mb):
    from polyrl.core.numerics import agg_loss

    loss = agg_loss(output.values.square(), mb["loss_mask"], "token-mean")
    return loss, {}


@WITH_QWEN3_VL
def test_lora_adapts_the_language_model_only(engines, family, vl_dir, hf_model, batch, reference):
    pytest.importorskip("peft")
    engine = engines(
        _vlm_spec(vl_dir, lora_rank=4),
        EngineConfig(device="cpu", **LAYOUTS["packed"]),
        OptimizerConfig(lr=1e-2),
    )
    lm = "model.text_model." if family == "smolvlm" else "model.language_model."
    layers = list(engine._lora.scaling)
    assert layers and all(n.startswith(lm) for n in layers)
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and n.startswith(lm) for n in trainable)
    # B starts at zero: the adapted model is the base model, images included.
    out = engine.infer_batch(batch, compute_log_probs)["log_probs"]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    engine.train_batch(batch, sft_loss)
    names = {n for n, _ in engine.named_tensors()}
    assert names == {n for n, _ in hf_model.named_parameters()}


@WITH_QWEN3_VL
def test_named_tensors_export_and_checkpoint_keep_the_vision_tower(
    engines, family, vl_dir, vl_processor, hf_model, batch, tmp_path
):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    engine = _engine(engines, vl_dir, **LAYOUTS["packed"])
    engine.train_batch(batch, sft_loss)
    weights = _full(engine)
    assert set(weights) == {n for n, _ in hf_model.named_parameters()}
    assert any(_in_tower(family, n) for n in weights)

    export = engine.export_hf(str(tmp_path / "export"))
    files = ["preprocessor_config.json", "tokenizer_config.json", "chat_template.jinja"]
    if family == "smolvlm":
        files.append("processor_config.json")  # SmolVLMProcessor's image_seq_len
    for name in files:
        assert (Path(export) / name).is_file(), name
    loaded = AutoModelForImageTextToText.from_pretrained(export).eval()
    AutoTokenizer.from_pretrained(export)
    image_processor = AutoImageProcessor.from_pretrained(export)
    assert image_processor.to_dict() == vl_processor.image_processor.to_dict()
    for name, value in loaded.named_parameters():
        torch.testing.assert_close(value, weights[name], atol=0, rtol=0)
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].view(1, -1)
    mm = batch[MULTI_MODAL][0]
    with torch.no_grad():
        got = loaded(input_ids=ids, **hf_media(vl_processor, ids, mm)).logits
    # Packed layout: the engine's raw logits cover the row's real tokens only, like ``got``.
    ref = engine.infer_batch(batch[[0]], lambda out, mb: {"logits": out.logits.clone()})
    torch.testing.assert_close(got, ref["logits"], atol=1e-5, rtol=0)

    path = engine.save_checkpoint(str(tmp_path / "ckpt"), step=1)
    engine.train_batch(batch, sft_loss)
    after_two = _full(engine)
    resumed = _engine(engines, vl_dir, **LAYOUTS["packed"])
    assert resumed.load_checkpoint(path)["step"] == 1
    for name, value in _full(resumed).items():
        assert torch.equal(value, weights[name]), name
    resumed.train_batch(batch, sft_loss)
    for name, value in _full(resumed).items():
        assert torch.equal(value, after_two[name]), name
