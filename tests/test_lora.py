"""LoRA (``model.lora_rank``): merged weights, adapter-only checkpoints, SFT and GRPO with LoRA.

The world-size-2 checks (FSDP2 sharding of a LoRA model, its gradients, merged weights and the
adapter checkpoint) run in tests/engine_scripts/equivalence.py, in the launch that
tests/test_model_engine.py makes anyway.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from test_rl_trainer import _e2e_overrides
from torch import nn

from polyrl.config import ConfigError, load_config
from polyrl.model_engine import ModelSpec
from polyrl.model_engine import checkpoint as ckpt
from polyrl.model_engine.lora import merge_lora_weight, peft_adapter_key, resolve_target_modules

BODY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------ pure parts
def test_merged_weight_is_w_plus_scale_times_b_a():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # (out 2, in 3)
    a = torch.tensor([[1.0, 0.0, -1.0]])  # (r 1, in 3)
    b = torch.tensor([[2.0], [0.5]])  # (out 2, r 1)
    # B @ A = [[2, 0, -2], [0.5, 0, -0.5]]; times 3, plus W:
    assert merge_lora_weight(w, a, b, 3.0).tolist() == [[7.0, 2.0, -3.0], [5.5, 5.0, 4.5]]
    assert w.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # a new tensor; W is untouched
    half = merge_lora_weight(w.bfloat16(), a.bfloat16(), b.bfloat16(), 3.0)
    assert half.dtype == torch.bfloat16 and half.float().tolist()[0] == [7.0, 2.0, -3.0]
    with pytest.raises(ValueError, match="do not chain"):
        merge_lora_weight(w, a, b.T, 1.0)
    with pytest.raises(ValueError, match="the weight"):
        merge_lora_weight(w.T, a, b, 1.0)
    assert (
        peft_adapter_key("model.layers.0.self_attn.q_proj.lora_A.default.weight")
        == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleDict({"q_proj": nn.Linear(2, 2), "up_proj": nn.Linear(2, 2)})
        self.lm_head = nn.Linear(2, 5)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_target_modules_resolve_against_the_model_and_bad_settings_are_named():
    toy = _Toy()
    assert resolve_target_modules(toy, ["all-linear"]) == ["q_proj", "up_proj"]  # no LM head
    assert resolve_target_modules(toy, ["block.q_proj", "lm_head"]) == ["block.q_proj", "lm_head"]
    with pytest.raises(ValueError, match="'o_proj' names no linear layer.*q_proj"):
        resolve_target_modules(toy, ["o_proj"])
    assert ModelSpec(path="m", target_modules="q_proj").target_modules == ["q_proj"]
    for bad, match in (
        ({"lora_rank": -1}, "lora_rank must be an int >= 0"),
        ({"lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
        ({"target_modules": ["all-linear", "q_proj"]}, "stands alone"),
        ({"lora_rank": 4, "kind": "value"}, "LoRA is for causal LMs"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelSpec(path="m", **bad)
    cfg = load_config("demo", ["model.lora_rank=8", "model.target_modules=q_proj"])
    assert cfg.model.lora_rank == 8 and cfg.model.target_modules == ["q_proj"]
    with pytest.raises(ConfigError, match="model.target_modules"):
        load_config("demo", ["model.target_modules=[all-linear,q_proj]"])
    with pytest.raises(ConfigError, match="model.lora_rank"):
        load_config("demo", ["model.lora_rank=-2"])
    from polyrl.trainer.preference import run_preference

    with pytest.raises(ConfigError, match="model.lora_rank.*trains every weight"):
        run_preference(load_config("rm_demo", ["model.lora_rank=4"]), "rm")


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    """The nano qwen2 with its own LM head (not tied to the embeddings), so LoRA may adapt it."""
    from polyrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("lora")
    return build_tiny_model("qwen2", root / "nano-untied", size="nano", tie_embeddings=False)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's load
def test_sft_with_lora_learns_saves_the_adapter_and_exports_merged_weights(tmp_path, untied_dir):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from polyrl.model_engine.export import export_checkpoint
    from polyrl.model_engine.heads import read_safetensors
    from polyrl.trainer.sft import run_sft

    out = tmp_path / "sft"
    cfg = load_config(
        "sft_demo",
        [
            f"trainer.output_dir={out}",
            f"model.path={untied_dir}",
            "model.lora_rank=8",
            "model.lora_alpha=16",
            "sft.lr=0.01",
            "data.num_train=64",
            "data.num_val=16",
            "trainer.total_steps=6",
            "trainer.test_freq=6",
            "trainer.save_freq=6",
            "trainer.loggers=[jsonl]",
        ],
    )
    summary = run_sft(cfg)
    assert summary["last_val_loss"] < summary["first_val_loss"] - 0.2, summary

    # The checkpoint holds the adapter (and its optimizer state), none of the frozen weights.
    dcp = FileSystemReader(str(out / "checkpoints" / "global_step_6" / "dcp"))
    keys = [k for k in dcp.read_metadata().state_dict_metadata if k.startswith("model.")]
    assert len(keys) == 2 * 4 * len(BODY)  # A and B of 7 projections in 4 layers
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in keys), keys

    # The export is a plain model whose adapted weights are W + (alpha / r) B @ A, every other
    # tensor the base model's, bit for bit; the adapter alone sits beside it in peft format.
    hf = out / "hf_model"
    merged, base = read_safetensors(str(hf)), read_safetensors(str(untied_dir))
    adapter = load_file(hf / "adapter" / "adapter_model.safetensors")
    assert sorted(merged) == sorted(base) and len(adapter) == len(keys)
    adapted = 0
    for name, w in base.items():
        layer = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{layer}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[name], w), name
            continue
        b = adapter[f"base_model.model.{layer}.lora_B.weight"]
        assert b.abs().max() > 0, name  # trained
        torch.testing.assert_close(merged[name], w + 2.0 * b @ a, rtol=0, atol=1e-6)
        adapted += 1
    assert adapted == 4 * len(BODY)
    config = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == sorted(BODY)

    # `polyrl export` of the checkpoint rebuilds the adapter on the base model (a resume) and
    # writes the same merged weights.
    again = export_checkpoint(out / "checkpoints", tmp_path / "exported")
    assert again.step == 6
    exported = read_safetensors(again.directory)
    assert all(torch.equal(exported[k], merged[k]) for k in merged)

    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(untied_dir), hf / "adapter"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, with_adapter(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_dpo_with_lora_uses_the_base_model_as_its_reference(tmp_path, untied_dir):
    from polyrl.trainer.preference import run_preference

    out = tmp_path / "dpo"
    cfg = load_config(
        "dpo_demo",
        [
            f"trainer.output_dir={out}",
            f"model.path={untied_dir}",
            "model.lora_rank=8",
            "model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
            "dpo.lr=0.01",
            "data.num_train=128",
            "data.num_val=32",
            "trainer.total_steps=6",
            "trainer.test_freq=3",
            "trainer.save_freq=3",
            "trainer.loggers=[jsonl]",
        ],
    )
    summary = run_preference(cfg, "dpo")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val/loss" in r]
    # Before the first update the adapter is zero (B = 0): the policy is the base model, which
    # is the reference, so every implicit reward is exactly 0.
    assert val[0]["step"] == 0 and val[0]["val/rewards/margins"] == 0.0
    assert val[0]["val/rewards/chosen"] == 0.0 == val[0]["val/rewards/rejected"]
    assert val[-1]["val/rewards/accuracies"] > 0.8, [r["val/rewards/accuracies"] for r in val]
    # The export is the merged model; the adapter sits beside it.
    assert (Path(summary["hf_model"]) / "adapter" / "adapter_config.json").is_file()

    # Killed while saving step 6, the run resumes from the adapter-only checkpoint of step 3
    # (adapter, its optimizer state, the sampler) and repeats steps 4-6 as they went.
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("hf_model"))
    (again / "checkpoints" / "global_step_6" / ckpt.COMPLETE_MARKER).unlink()
    resumed = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(again), resume_mode="auto")
    )
    assert run_preference(resumed, "dpo")["resumed_from"].endswith("global_step_3")
    after = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in after] == [r["step"] for r in records]
    for old, new in zip(records, after, strict=True):
        for key in ("train/loss", "train/grad_norm", "val/loss"):
            if key in old:
                assert new[key] == pytest.approx(old[key], rel=1e-5, abs=1e-6), (old["step"], key)


@pytest.mark.slow
def test_lora_grpo_raises_the_reward_on_frozen_base_weights(tmp_path, untied_dir):
    from polyrl.core.batch import Batch
    from polyrl.model_engine import EngineConfig, build_engine
    from polyrl.trainer.rl import RLTrainer

    steps = 4
    cfg = load_config(
        "demo",
        # The RL trainer tests' small run (dense short-text reward), with LoRA.
        _e2e_overrides(
            tmp_path,
            "grpo",
            "trainer.worker_backend=local",
            f"trainer.total_steps={steps}",
            "trainer.export_hf=false",
            "rollout.n=8",
            "reward.num_workers=0",
            "actor.lr=0.03",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
            # A KL term needs reference log-probs: the actor computes them without its adapter.
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.001",
            "model.lora_rank=8",
            f"model.target_modules=[{','.join(BODY)},lm_head]",
        ),
    )
    trainer = RLTrainer(cfg, model_dir=untied_dir)
    try:
        trainer.setup()
        assert trainer.ref is trainer.actor  # no reference engine: a role of the actor
        base = trainer.actor.weight_digest(merge_adapter=False)
        start = trainer.actor.weight_digest()
        scores = [trainer.step(step)["critic/score/mean"] for step in range(1, steps + 1)]
        assert trainer.actor.weight_digest(merge_adapter=False) == base  # frozen, bit for bit
        assert trainer.actor.weight_digest() != start  # the served (merged) policy moved
        ids = torch.randint(5, 500, (3, 10), generator=torch.Generator().manual_seed(1))
        rows = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        ref = trainer.ref.compute_ref_log_prob(rows)["ref_log_probs"]
        actor = trainer.actor.compute_log_prob(rows)["old_log_probs"]
        # Its checkpoint holds the adapter, though the reference passes froze and unfroze it.
        trainer.actor.save_checkpoint(str(tmp_path / "ckpt"), steps)
    finally:
        trainer.close()
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / f"global_step_{steps}" / "dcp"))
    keys = [k for k in saved.read_metadata().state_dict_metadata if k.startswith("model.")]
    assert len(keys) == 2 * (4 * len(BODY) + 1), keys  # A and B of 7 projections x 4, lm_head
    # The replicas served the merged LoRA policy: the reward rose over the run.
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.05, scores
    plain = build_engine(str(untied_dir), EngineConfig(device="cpu"))
    try:
        base_logp = plain.infer_batch(rows)["log_probs"]
    finally:
        plain.close()
    assert torch.equal(ref, base_logp)  # the reference is the base model, exactly
    assert not torch.allclose(actor, base_logp, atol=1e-3)
