"""The model engine with the FSDP2 backend: equivalence, checkpoints, export, value model.

World-size-1 engines run in the test process (the engine creates a one-process gloo group);
world-size-2 checks run real processes through tests/engine_scripts/ with an env rendezvous.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine_scripts"))

from engine_common import (  # noqa: E402
    HERE,
    clean_loss_mask,
    engine_grads,
    launch,
    make_batch,
    reference_log_probs,
    reference_sft,
    script_env,
    tiny_model,
)

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.core.numerics import agg_loss  # noqa: E402
from polyrl.model_engine import (  # noqa: E402
    CheckpointConfig,
    EngineConfig,
    ModelSpec,
    OptimizerConfig,
    TrainingEngine,
    available_engines,
    build_engine,
    compute_entropy,
    compute_log_probs,
    compute_values,
    global_counts,
    register_engine,
    sft_loss,
)
from polyrl.model_engine import attention as cpu_attention  # noqa: E402
from polyrl.model_engine import checkpoint as ckpt  # noqa: E402
from polyrl.model_engine.engine import ENGINES  # noqa: E402
from polyrl.model_engine.heads import read_safetensors  # noqa: E402
from polyrl.model_engine.metrics import MetricsAccumulator  # noqa: E402
from polyrl.model_engine.optim import LRSchedule  # noqa: E402

VOCAB = 1000  # the tiny models' tokenizer has 1024 ids; stay inside it


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", tie_embeddings=False)


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------ configs
def test_configs_validate_with_clear_errors():
    with pytest.raises(ValueError, match="ModelSpec.kind"):
        ModelSpec(path="x", kind="reward")
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        EngineConfig(max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="fsdp_size"):
        EngineConfig(parallelism={"fsdp_size": 0})
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(scheduler="cosine")
    with pytest.raises(ValueError, match="betas"):
        OptimizerConfig(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelSpec(path="x", dtype="float8")
    cfg = EngineConfig(parallelism={"fsdp_size": 2}, mixed_precision={"param_dtype": "bf16"})
    assert cfg.parallelism.fsdp_size == 2 and cfg.mixed_precision.param_dtype == "bf16"
    import dataclasses

    for cls in (ModelSpec, EngineConfig, OptimizerConfig, CheckpointConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} lacks help"


def test_lr_schedule_shapes():
    warm_cos = LRSchedule("cosine", warmup=2, total=10, min_ratio=0.1)
    assert warm_cos(0) == pytest.approx(1 / 3) and warm_cos(1) == pytest.approx(2 / 3)
    assert warm_cos(2) == pytest.approx(1.0) and warm_cos(10) == pytest.approx(0.1)
    assert LRSchedule("linear", 0, 4, 0.0)(2) == pytest.approx(0.5)
    assert LRSchedule("constant", 0, 0, 0.0)(100) == 1.0


def test_registry_builds_backends_by_name(tmp_path):
    assert "fsdp2" in available_engines()
    with pytest.raises(ValueError, match="unknown engine backend 'nope'"):
        build_engine(ModelSpec(path=str(tmp_path)), EngineConfig(backend="nope"))
    with pytest.raises(TypeError, match="TrainingEngine subclass"):
        register_engine("bad")(object)

    @register_engine("test-null")
    class NullEngine(TrainingEngine):  # a backend only needs the abstract methods
        pass

    assert "test-null" in available_engines()
    with pytest.raises(TypeError, match="abstract"):
        build_engine(str(tmp_path), EngineConfig(backend="test-null"), initialize=False)


def test_metrics_accumulator_weights_by_loss_tokens_and_keeps_key_order():
    acc = MetricsAccumulator()
    acc.add(torch.tensor(0.5), 10, 3.0, {"m": 1.0, "loss": torch.tensor(7.0), "z": 2})
    acc.add(torch.tensor(0.25), 6, 1.0, {"m": 5.0, "loss": 3.0})
    out = acc.reduce(1, {"num_tokens": 4.0, "num_micro_batches": 2.0})
    assert list(out) == ["loss", "num_tokens", "num_micro_batches", "compute_tokens"] + [
        "loss_fn/loss",
        "m",
        "z",
    ]
    assert out["loss"] == 0.75 and out["compute_tokens"] == 16.0
    assert out["m"] == (3 * 1.0 + 1 * 5.0) / 4 and out["loss_fn/loss"] == (21 + 3) / 4
    assert out["z"] == 2.0
    # Without loss tokens a metric is the plain mean over the micro-batches reporting it.
    empty = MetricsAccumulator()
    empty.add(torch.tensor(0.0), 1, 0.0, {"m": 1.0})
    empty.add(torch.tensor(0.0), 1, 0.0, {"m": 3.0})
    assert empty.reduce(1, {})["m"] == 2.0
    with pytest.raises(ValueError, match="metric 'v' must be a scalar"):
        empty.add(torch.tensor(0.0), 1, 1.0, {"v": torch.ones(2)})


def test_engine_protocol_is_all_a_backend_implements(tmp_path):
    members = [name for name in vars(TrainingEngine) if not name.startswith("_")]
    assert {"train_batch", "shard_batch", "eval_mode", "has_adapter"} <= set(members)
    attrs = {name: (lambda self, *a, **k: None) for name in members}
    standalone = type("StandaloneEngine", (), attrs)  # implements it without inheriting
    try:
        register_engine("test-standalone")(standalone)
        assert "test-standalone" in available_engines()
        partial = type("PartialEngine", (), {k: v for k, v in attrs.items() if k != "lr"})
        with pytest.raises(TypeError, match=r"missing: lr"):
            register_engine("test-partial")(partial)
    finally:
        ENGINES.remove("test-standalone")


def test_missing_model_dir_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_engine(str(tmp_path / "absent"))


# ------------------------------------------------------------------------------------ equivalence
MODES = {
    "padded": dict(dynamic_batching=False, micro_batch_size=3),
    "dynamic_trim": dict(max_tokens_per_micro_batch=40),
    "dynamic_pack": dict(max_tokens_per_micro_batch=40, pack_sequences=True),
    "dynamic_trim_grad_ckpt": dict(max_tokens_per_micro_batch=64, gradient_checkpointing=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_train_batch_matches_plain_hf_world_size_1(tiny_dir, engines, mode):
    batch = make_batch(7, 16, VOCAB, seed=1, left_pad_rows=2)
    ref_loss, ref_grads, ref_model = reference_sft(tiny_dir, batch)
    engine = engines(tiny_dir, EngineConfig(grad_clip=1e9, **MODES[mode]), OptimizerConfig(lr=1e-3))
    ref_model.eval()
    logp = engine.infer_batch(batch, compute_log_probs)["log_probs"]
    torch.testing.assert_close(logp, reference_log_probs(ref_model, batch), atol=1e-5, rtol=0)

    metrics = engine.train_batch(batch, sft_loss)
    assert abs(metrics["loss"] - ref_loss) < 1e-5
    assert _max_diff(engine_grads(engine), ref_grads) < 1e-5
    assert metrics["num_tokens"] == float((clean_loss_mask(batch) != 0).sum())
    assert metrics["sft/nll"] == pytest.approx(ref_loss, abs=1e-5)
    expected_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values()))
    assert metrics["grad_norm"] == pytest.approx(float(expected_norm), rel=1e-5)
    if mode.startswith("dynamic"):
        assert metrics["compute_tokens"] < len(batch) * 16  # padding was removed


def test_micro_batch_split_does_not_change_loss_or_step(tiny_dir, engines):
    batch = make_batch(10, 20, VOCAB, seed=5)
    results = []
    for cfg in (
        EngineConfig(dynamic_batching=False, micro_batch_size=10),
        EngineConfig(dynamic_batching=False, micro_batch_size=1),
        EngineConfig(max_tokens_per_micro_batch=20),
    ):
        engine = engines(tiny_dir, cfg, OptimizerConfig(lr=1e-2))
        first = engine.train_batch(batch, sft_loss)
        second = engine.train_batch(batch, sft_loss)
        results.append((first["loss"], second["loss"], first["num_micro_batches"]))
        engine.close()
    assert results[1][2] == 10 and results[0][2] == 1 and results[2][2] > 1
    for loss1, loss2, _ in results[1:]:
        assert loss1 == pytest.approx(results[0][0], abs=1e-5)
        assert loss2 == pytest.approx(results[0][1], abs=1e-5)
    assert results[0][1] < results[0][0]  # the step itself lowered the loss


@pytest.mark.slow
def test_train_batch_matches_plain_hf_world_size_2(tiny_dir, tmp_path):
    out = tmp_path / "eq.json"
    codes = launch("equivalence.py", [tiny_dir, str(out)], world=2)
    assert codes == [0, 0], "\n".join(launch.last_logs)
    results = json.loads(out.read_text())
    assert set(results) == {
        "padded_mbs2",
        "padded_mbs1",
        "dynamic_trim",
        "dynamic_pack",
        "dynamic_trim_gc_hsdp",
        "shared_prefix",
        "shared_prefix_dummies",
        "lora",
    }
    lora = results.pop("lora")
    for name, r in results.items():
        assert r["grad_names_match"], name
        assert r["loss_diff"] < 1e-5, (name, r)
        assert r["grad_diff"] < 1e-5, (name, r)
        assert r["logp_diff"] < 1e-5, (name, r)
    assert results["padded_mbs1"]["num_micro_batches"] == 6  # rank 1 ran 3 dummy passes
    assert results["shared_prefix_dummies"]["num_micro_batches"] == 9  # rank 1: 6 dummy passes
    # LoRA sharded over two ranks: B = 0 leaves the model's function and the reference's
    # gradients decide the adapter's; merged weights, frozen base and the adapter checkpoint.
    assert lora["loss_diff"] < 1e-5 and lora["logp_diff"] < 1e-5, lora
    assert lora["base_logp_diff"] < 1e-5, lora  # trained adapter disabled: the plain model
    assert lora["num_layers"] == 2 * 7  # q, k, v, o, gate, up, down in both layers
    assert lora["grad_b_diff"] < 1e-5 and lora["grad_a_max"] == 0.0, lora
    assert lora["b_trained"] > 0 and lora["merge_diff"] < 1e-6, lora
    assert lora["base_is_the_model"] and lora["restored_equal"], lora
    keys = lora["checkpoint_model_keys"]
    assert len(keys) == 2 * 14 and all(".lora_A." in k or ".lora_B." in k for k in keys), keys


def test_temperature_and_entropy_inference(tiny_dir, engines):
    batch = make_batch(5, 12, VOCAB, seed=7, left_pad_rows=1)
    batch.meta["temperature"] = 0.7
    engine = engines(tiny_dir, EngineConfig(max_tokens_per_micro_batch=24))
    out = engine.infer_batch(
        batch, lambda o, b: {**compute_log_probs(o, b), **compute_entropy(o, b)}
    )
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(
        out["log_probs"], reference_log_probs(ref, batch, temperature=0.7), atol=1e-5, rtol=0
    )
    with torch.no_grad():
        logits = ref(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    logp_all = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    am = batch["attention_mask"].bool()
    keep = am[:, 1:] & am[:, :-1]
    torch.testing.assert_close(out["entropy"][:, 1:][keep], ent[keep], atol=1e-5, rtol=0)
    assert torch.all(out["entropy"][~am] == 0)


def test_loss_aggregation_modes_are_split_invariant(tiny_dir, engines):
    batch = make_batch(6, 12, VOCAB, seed=11)

    def seq_loss(output, mb):
        loss = agg_loss(
            -output.log_probs, mb["loss_mask"], "seq-mean-token-mean", **global_counts(mb)
        )
        return loss, {}

    whole = engines(tiny_dir, EngineConfig(dynamic_batching=False, micro_batch_size=6))
    split = engines(tiny_dir, EngineConfig(dynamic_batching=False, micro_batch_size=1))
    a = whole.forward_backward(batch, seq_loss, forward_only=True)["loss"]
    b = split.forward_backward(batch, seq_loss, forward_only=True)["loss"]
    # Different splits share prefixes differently: fp32 summation order, ~1 ulp at 7.0.
    assert a == pytest.approx(b, rel=1e-6)
    mask = clean_loss_mask(batch)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    nll = -reference_log_probs(ref, batch)
    per_row = (nll * mask).sum(1) / mask.sum(1)
    assert a == pytest.approx(float(per_row.mean()), abs=1e-5)


def test_bad_batches_and_loss_functions_are_rejected(tiny_dir, engines):
    engine = engines(tiny_dir, EngineConfig(max_tokens_per_micro_batch=16))
    batch = make_batch(3, 12, VOCAB, seed=2)
    with pytest.raises(KeyError, match="loss_mask"):
        engine.train_batch(
            Batch(tensors={k: batch[k] for k in ("input_ids", "attention_mask")}), sft_loss
        )
    holes = batch.clone()
    holes["attention_mask"][0, :] = torch.tensor([1, 0] * 6)
    with pytest.raises(ValueError, match="contiguous"):
        engine.infer_batch(holes)
    long = make_batch(2, 30, VOCAB, seed=3, min_len=20)
    with pytest.raises(ValueError, match="exceeds max_tokens_per_micro_batch=16"):
        engine.infer_batch(long)
    with pytest.raises(TypeError, match=r"\(loss, metrics\)"):
        engine.forward_backward(batch, lambda o, b: o.log_probs.sum())
    with pytest.raises(ValueError, match="requires_grad"):
        engine.forward_backward(batch, lambda o, b: (torch.tensor(1.0), {}))
    with pytest.raises(AttributeError, match="only available for a 'value' model"):
        engine.infer_batch(batch, compute_values)
    bad_shape = Batch(
        tensors={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"][:, :5]}
    )
    with pytest.raises(ValueError, match="attention_mask has shape"):
        engine.infer_batch(bad_shape)


def test_extra_columns_follow_their_rows_into_micro_batches(tiny_dir, engines):
    batch = make_batch(9, 14, VOCAB, seed=13, left_pad_rows=3)
    batch["row_id"] = torch.arange(9)
    batch["uid"] = [f"row-{i}" for i in range(9)]
    seen: list[int] = []

    def checking_loss(output, mb):
        assert list(mb["uid"]) == [f"row-{int(i)}" for i in mb["row_id"]]
        lengths = mb["attention_mask"].sum(1)
        assert torch.equal(lengths, batch["attention_mask"][mb["row_id"]].sum(1))
        assert output.log_probs.shape == mb["input_ids"].shape
        seen.extend(int(i) for i in mb["row_id"])
        return sft_loss(output, mb)

    engine = engines(tiny_dir, EngineConfig(max_tokens_per_micro_batch=28))
    metrics = engine.train_batch(batch, checking_loss)
    assert sorted(seen) == list(range(9)) and metrics["num_micro_batches"] > 1
    assert seen != list(range(9))  # dynamic batching regrouped rows by length


def test_non_finite_gradients_skip_the_update(tiny_dir, engines):
    batch = make_batch(3, 10, VOCAB, seed=14)
    engine = engines(tiny_dir, optimizer=OptimizerConfig(lr=1e-2))
    before = {n: t.clone() for n, t in engine.named_tensors()}

    def nan_loss(output, mb):
        loss, metrics = sft_loss(output, mb)
        return loss * float("nan"), metrics

    metrics = engine.train_batch(batch, nan_loss)
    assert metrics["update_skipped"] == 1.0 and engine.optimizer_steps == 0
    for name, tensor in engine.named_tensors():
        assert torch.equal(tensor, before[name]), name
    assert engine.train_batch(batch, sft_loss)["update_skipped"] == 0.0
    assert engine.optimizer_steps == 1


def test_position_ids_are_derived_when_absent(tiny_dir, engines):
    batch = make_batch(4, 10, VOCAB, seed=4, left_pad_rows=2)
    engine = engines(tiny_dir, EngineConfig(max_tokens_per_micro_batch=20))
    with_pos = engine.infer_batch(batch)["log_probs"]
    without = engine.infer_batch(batch.drop("position_ids"))["log_probs"]
    torch.testing.assert_close(with_pos, without, atol=0, rtol=0)


def test_mixed_precision_bf16_on_cpu_trains(tiny_dir, engines):
    batch = make_batch(4, 12, VOCAB, seed=9)
    ref_loss, _, _ = reference_sft(tiny_dir, batch)
    engine = engines(
        tiny_dir,
        EngineConfig(mixed_precision={"param_dtype": "bfloat16"}),
        OptimizerConfig(lr=1e-2),
    )
    # CPU flash attention is slow in bf16: the engine switches to its own CPU attention.
    assert engine.model.config._attn_implementation == cpu_attention.CPU_SDPA
    first = engine.train_batch(batch, sft_loss)
    assert first["loss"] == pytest.approx(ref_loss, abs=0.05)  # bf16 compute, fp32 master
    assert next(engine.model.parameters()).dtype == torch.float32
    second = engine.train_batch(batch, sft_loss)
    assert second["loss"] < first["loss"]
    fp32_engine = engines(tiny_dir)
    assert fp32_engine.model.config._attn_implementation == "sdpa"


def _attention_inputs(dtype, mask_kind, q_len=7, k_len=7, seed=0):
    """(module, q, k, v, mask) for 4 query heads over 2 key/value heads, rows 0 left-padded."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, q_len, 8, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(3, 2, k_len, 8, generator=gen).to(dtype).requires_grad_() for _ in "kv")
    visible = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    mask = visible.expand(3, 1, q_len, k_len).clone()
    mask[0, :, :, :2] = False  # row 0: two padding keys, so its first query sees nothing
    if mask_kind == "none":
        mask = None
    elif mask_kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return module, q, k, v, mask


# HF passes no mask only when keys and queries line up (q_len == k_len).
@pytest.mark.parametrize(
    ("mask_kind", "k_len"), [("none", 7), ("bool", 7), ("bool", 10), ("float", 7), ("float", 10)]
)
def test_grouped_math_attention_equals_sdpa(mask_kind, k_len):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v, mask = _attention_inputs(torch.float32, mask_kind, k_len=k_len)
    got = cpu_attention._grouped_math_attention(q, k, v, mask, 0.3, True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    # Row 0's fully masked query attends uniformly here (SDPA: zeros); no real token reads it.
    real = torch.ones(3, 7, dtype=torch.bool)
    if mask is not None:
        real[0, : max(0, 2 - (k_len - 7))] = False
    torch.testing.assert_close(got[real], want[real], atol=2e-6, rtol=1e-5)
    assert torch.isfinite(got).all()
    grads = torch.autograd.grad(got[real].square().sum(), (q, k, v))
    wants = torch.autograd.grad(want[real].square().sum(), (q, k, v))
    for g, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_cpu_sdpa_picks_math_or_fp32_flash_by_size(monkeypatch):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cpu_attention.register_cpu_sdpa()
    cpu_sdpa = AttentionInterface()[cpu_attention.CPU_SDPA]
    module, q, k, v, mask = _attention_inputs(torch.bfloat16, "bool", k_len=9)
    want, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), mask, scaling=0.3)
    # Small scores: the bf16 math path, equal to fp32 SDPA up to bf16 rounding on real rows.
    out, _ = cpu_sdpa(module, q, k, v, mask, scaling=0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:, 2:].float(), want[:, 2:], atol=3e-2, rtol=3e-2)
    assert not torch.equal(out, want.bfloat16())  # bf16 scores: not the fp32 kernel's bits
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
    # Above the size limit: exactly SDPA on fp32 inputs, cast back.
    monkeypatch.setattr(cpu_attention, "MATH_MAX_SCORES", 3 * 4 * 7 * 9 - 1)
    out, _ = cpu_sdpa(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(out, want.bfloat16(), atol=0, rtol=0)
    fp32 = torch.randn(2, 4, 5, 8)  # other dtypes: plain sdpa
    torch.testing.assert_close(
        cpu_sdpa(module, fp32, fp32, fp32, None)[0],
        sdpa_attention_forward(module, fp32, fp32, fp32, None)[0],
        atol=0,
        rtol=0,
    )


# ------------------------------------------------------------------------------------ checkpoints
@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tiny_dir, tmp_path):
    full, part1, part2 = (tmp_path / f"{n}.json" for n in ("full", "part1", "part2"))
    root = tmp_path / "ckpt"
    assert launch("ckpt_run.py", [tiny_dir, str(tmp_path / "unused"), str(full), "5"], 2) == [0, 0]
    codes = launch(
        "ckpt_run.py", [tiny_dir, str(root), str(part1), "5", "--save-and-die-at", "3"], 2
    )
    assert codes == [-signal.SIGKILL] * 2, "\n".join(launch.last_logs)
    assert ckpt.find_latest_checkpoint(str(root)) == str(root / "global_step_3")
    codes = launch("ckpt_run.py", [tiny_dir, str(root), str(part2), "5", "--resume"], 2)
    assert codes == [0, 0], "\n".join(launch.last_logs)
    uninterrupted = json.loads(full.read_text())
    resumed = {**json.loads(part1.read_text()), **json.loads(part2.read_text())}
    assert sorted(resumed) == ["1", "2", "3", "4", "5"]
    # Exact equality: same weights, optimizer moments, LR schedule, RNG (dropout) and data.
    assert resumed == uninterrupted


@pytest.mark.slow
def test_kill_during_save_never_leaves_a_partial_checkpoint(tiny_dir, tmp_path, engines):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ckpt_crash.py"), tiny_dir, str(root)],
        env={
            k: v
            for k, v in script_env(0, 1, 0).items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.strip() == "saving 3":
                proc.send_signal(signal.SIGKILL)  # lands while step 3 is being written
                break
            assert line, "".join(lines)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    names = sorted(n for n in os.listdir(root) if n.startswith("global_step_"))
    assert names[:2] == ["global_step_1", "global_step_2"]
    for name in names:
        assert ckpt.is_complete_checkpoint(str(root / name)), name
    latest = ckpt.find_latest_checkpoint(str(root))
    assert latest is not None and Path(latest).name in ("global_step_2", "global_step_3")
    engine = engines(tiny_dir)
    info = engine.load_checkpoint(str(root))
    assert info["path"] == latest and info["extra_state"] == {"step": info["step"]}
    engine.save_checkpoint(str(root), 10)  # a later save clears leftovers of the crashed one
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def test_checkpoint_layout_rotation_and_errors(tiny_dir, tmp_path, engines):
    root = tmp_path / "ckpt"
    engine = engines(tiny_dir, checkpoint=CheckpointConfig(max_to_keep=2))
    batch = make_batch(3, 10, VOCAB, seed=1)
    for step in (1, 2, 3):
        engine.train_batch(batch, sft_loss)
        path = engine.save_checkpoint(str(root), step, extra_state={"epoch": 0, "cursor": step})
        assert path == str(root / f"global_step_{step}")
    assert [s for s, _ in ckpt.list_checkpoints(str(root))] == [2, 3]
    assert (root / "latest").read_text() == "global_step_3"
    expected = engine.infer_batch(batch)["log_probs"]

    fresh = engines(tiny_dir)
    info = fresh.load_checkpoint(str(root))
    assert info["step"] == 3 and info["extra_state"] == {"epoch": 0, "cursor": 3}
    assert fresh.optimizer_steps == 3
    torch.testing.assert_close(fresh.infer_batch(batch)["log_probs"], expected, atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        fresh.load_checkpoint(str(tmp_path))
    (root / "global_step_3" / ckpt.COMPLETE_MARKER).unlink()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        fresh.load_checkpoint(str(root / "global_step_3"))
    assert ckpt.find_latest_checkpoint(str(root)) == str(root / "global_step_2")
    with pytest.raises(ValueError, match="step must be"):
        engine.save_checkpoint(str(root), -1)


def test_resume_follows_the_configured_lr_schedule(tiny_dir, tmp_path, engines):
    """A run resumed with a longer total_steps decays over the new total, from the saved step."""
    root = tmp_path / "ckpt"
    short = OptimizerConfig(lr=1e-2, scheduler="linear", total_steps=4)
    engine = engines(tiny_dir, optimizer=short)
    batch = make_batch(3, 10, VOCAB, seed=1)
    for _ in range(3):
        engine.train_batch(batch, sft_loss)
        engine.lr_scheduler_step()
    engine.save_checkpoint(str(root), 3)
    assert engine.lr == pytest.approx(1e-2 * (1 - 3 / 4))

    same = engines(tiny_dir, optimizer=short)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unchanged schedule resumes silently
        same.load_checkpoint(str(root))
    assert same.lr == pytest.approx(1e-2 * (1 - 3 / 4))

    longer_cfg = OptimizerConfig(lr=1e-2, scheduler="linear", total_steps=8)
    longer = engines(tiny_dir, optimizer=longer_cfg)
    with pytest.warns(UserWarning, match=r"total: 4 -> 8"):
        longer.load_checkpoint(str(root))
    assert longer.lr == pytest.approx(1e-2 * (1 - 3 / 8))
    longer.train_batch(batch, sft_loss)
    longer.lr_scheduler_step()
    assert longer.lr == pytest.approx(1e-2 * (1 - 4 / 8))


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("which", ["tied_qwen2", "untied_llama"])
def test_export_hf_loads_with_transformers_and_gives_engine_logits(
    which, tiny_dir, untied_llama_dir, tmp_path, engines
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_dir if which == "tied_qwen2" else untied_llama_dir
    engine = engines(src, EngineConfig(dynamic_batching=False), OptimizerConfig(lr=1e-2))
    batch = make_batch(4, 12, VOCAB, seed=6, left_pad_rows=1)
    engine.train_batch(batch, sft_loss)  # export trained weights, not the initial ones
    out = engine.export_hf(str(tmp_path / "export"))

    engine_logits = engine.infer_batch(batch, lambda o, b: {"logits": o.logits})["logits"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    am = batch["attention_mask"].bool()
    torch.testing.assert_close(hf_logits[am], engine_logits[am], atol=1e-5, rtol=1e-5)
    assert hf.config.use_cache is True
    # fully_shard swaps the class for FSDP<Name>: the export names the model's own class.
    source = json.loads((Path(src) / "config.json").read_text())
    assert type(engine.model).__name__.startswith("FSDP")
    exported_config = json.loads(Path(out, "config.json").read_text())
    assert exported_config["architectures"] == source["architectures"]
    assert os.path.isfile(os.path.join(out, "generation_config.json"))

    names = set(read_safetensors(out))
    exported = dict(engine.named_tensors())
    assert names == set(exported) == set(read_safetensors(src))
    assert ("lm_head.weight" in names) == (which == "untied_llama")
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hello")["input_ids"] == AutoTokenizer.from_pretrained(src)("hello")["input_ids"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp dir left
    engine.train_batch(batch, sft_loss)
    assert engine.export_hf(out) == out  # replacing an existing export is atomic too
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not torch.equal(again.model.norm.weight, hf.model.norm.weight)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_named_tensors_stream_full_tensors_with_hf_names(tiny_dir, engines):
    engine = engines(tiny_dir)
    original = read_safetensors(tiny_dir)
    stream = engine.named_tensors(dtype=torch.bfloat16)
    first_name, first = next(stream)
    assert first_name in original and first.dtype == torch.bfloat16
    seen = {first_name: first, **dict(stream)}
    assert set(seen) == set(original)
    for name, tensor in seen.items():
        torch.testing.assert_close(tensor, original[name].to(torch.bfloat16), atol=0, rtol=0)


# ------------------------------------------------------------------------------------ value model
def test_value_model_one_value_per_token_trains_and_exports(untied_llama_dir, tmp_path, engines):
    from transformers import AutoModelForTokenClassification

    from polyrl.model_engine.heads import ValueModel

    spec = ModelSpec(path=untied_llama_dir, kind="value")
    cfg = EngineConfig(max_tokens_per_micro_batch=24, grad_clip=1e9)  # compare unclipped grads
    engine = engines(spec, cfg, OptimizerConfig(lr=1e-3))
    batch = make_batch(5, 12, VOCAB, seed=8, left_pad_rows=2)
    values = engine.infer_batch(batch, compute_values)["values"]
    am = batch["attention_mask"].bool()
    assert values.shape == (5, 12) and values.dtype == torch.float32
    assert torch.all(values[~am] == 0) and torch.all(values[am] != 0)

    batch["returns"] = torch.linspace(-1, 1, 12).expand(5, 12).contiguous()

    def value_loss(output, mb):
        err = (output.values - mb["returns"]) ** 2
        return agg_loss(err, mb["loss_mask"], **global_counts(mb)), {}

    # Plain, unsharded reference: same backbone, same seeded head, whole batch at once.
    ref = ValueModel.from_pretrained(spec, seed=0)
    ref_values = ref(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    torch.testing.assert_close(ref_values[am], values[am], atol=1e-5, rtol=0)
    mask = clean_loss_mask(batch)
    ref_loss = (((ref_values - batch["returns"]) ** 2) * mask).sum() / (mask != 0).sum()
    ref_loss.backward()
    first = engine.train_batch(batch, value_loss)
    assert first["loss"] == pytest.approx(float(ref_loss.detach()), abs=1e-5)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert _max_diff(engine_grads(engine), ref_grads) < 1e-5
    assert ref_grads["score.weight"].abs().sum() > 0
    losses = [engine.train_batch(batch, value_loss)["loss"] for _ in range(3)]
    assert losses[-1] < first["loss"]

    out = engine.export_hf(str(tmp_path / "critic"))
    trained = engine.infer_batch(batch, compute_values)["values"]
    hf = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_values = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.squeeze(-1)
    torch.testing.assert_close(hf_values[am], trained[am], atol=1e-5, rtol=1e-5)
    reloaded = engines(ModelSpec(path=out, kind="value"))
    again = reloaded.infer_batch(batch, compute_values)["values"]
    torch.testing.assert_close(again, trained, atol=1e-6, rtol=0)
    with pytest.raises(AttributeError, match="only available for a 'causal_lm' model"):
        reloaded.infer_batch(batch, compute_log_probs)


# ------------------------------------------------------------------------------------ offload
def test_offload_and_reload_keep_training_exact(tiny_dir, engines):
    batch = make_batch(4, 10, VOCAB, seed=12)
    plain = engines(tiny_dir, optimizer=OptimizerConfig(lr=1e-2))
    moved = engines(tiny_dir, optimizer=OptimizerConfig(lr=1e-2))
    for engine in (plain, moved):
        engine.train_batch(batch, sft_loss)
    moved.offload()
    assert moved.offloaded == {"params": True, "optimizer": True}
    with pytest.raises(RuntimeError, match="reload"):
        moved.train_batch(batch, sft_loss)
    with pytest.raises(RuntimeError, match="reload"):
        list(moved.named_tensors())
    moved.reload(optimizer=False)
    moved.forward_backward(batch, sft_loss)
    with pytest.raises(RuntimeError, match="optimizer state is offloaded"):
        moved.optimizer_step()
    moved.reload()
    assert moved.offloaded == {"params": False, "optimizer": False}
    a = plain.train_batch(batch, sft_loss)
    b = moved.train_batch(batch, sft_loss)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_engines_share_a_process_group_until_the_last_closes(tiny_dir):
    import torch.distributed as dist

    assert not dist.is_initialized()
    batch = make_batch(3, 10, VOCAB, seed=1)
    actor = build_engine(tiny_dir)
    ref = build_engine(tiny_dir)  # e.g. actor and reference policy in one worker
    actor.close()
    assert dist.is_initialized()
    ref.infer_batch(batch)  # still usable
    ref.close()
    ref.close()  # idempotent
    assert not dist.is_initialized()
