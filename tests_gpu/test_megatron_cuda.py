"""Megatron-Core engine backend at world size 1 on CUDA (needs polyrl[megatron]).

The layer spec is TransformerEngine's when ``transformer_engine`` imports (``auto``), else the
local one (both are run when TE is there).  fp32 parameters and compute, TF32 off: per-token
log-probs against a plain HF forward, then the losses of 3 ``train_batch`` steps against the
FSDP2 engine's (no clipping, same AdamW).  Skipped when megatron-core is not installed (add it
with scripts/gpu_requirements.txt / `make gpu-wheels`).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs polyrl[megatron] (megatron-core 0.16.1)")

from polyrl.core.batch import Batch  # noqa: E402
from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss  # noqa: E402
from polyrl.model_engine.engine import compute_log_probs  # noqa: E402

VOCAB = 1000
STEPS = 3


def _te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def make_batch(rows: int = 6, width: int = 24, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, width, dtype=torch.long)
    am = torch.zeros(rows, width, dtype=torch.long)
    lm = torch.zeros(rows, width, dtype=torch.float32)
    for i in range(rows):
        length = int(torch.randint(width // 2, width + 1, (1,), generator=g))
        prompt = int(torch.randint(2, length // 2 + 1, (1,), generator=g))
        ids[i, :length] = torch.randint(1, VOCAB, (length,), generator=g)
        am[i, :length] = 1
        lm[i, prompt:length] = 1.0
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return Batch(
        tensors={"input_ids": ids, "attention_mask": am, "position_ids": pos, "loss_mask": lm}
    )


def hf_log_probs(model_dir, batch: Batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda()
    ids, am, pos = (batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids"))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = torch.zeros(ids.shape, device=ids.device)
    out[:, 1:] = logp * am[:, 1:] * am[:, :-1]
    return out.cpu()


def engine_cfg(backend: str, impl: str = "auto") -> EngineConfig:
    return EngineConfig(
        backend=backend,
        device="cuda",
        grad_clip=0.0,
        mixed_precision={"param_dtype": "float32"},
        megatron={"transformer_impl": impl},
    )


IMPLS = ["local"] + (["transformer_engine"] if _te() else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_megatron_matches_hf_and_fsdp2_on_cuda(tiny_dir, impl):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    batch = make_batch()
    ref = hf_log_probs(tiny_dir, batch)
    optim = OptimizerConfig(lr=1e-3, weight_decay=0.01)
    engine = build_engine(str(tiny_dir), engine_cfg("megatron", impl), optim)
    try:
        assert next(engine.model.parameters()).device.type == "cuda"
        got = engine.infer_batch(batch, compute_log_probs)["log_probs"].cpu()
        tol = 1e-5 if impl == "local" else 1e-4  # TE's fused kernels round differently
        assert float((got - ref).abs().max()) <= tol
        mine = [engine.train_batch(batch, sft_loss)["loss"] for _ in range(STEPS)]
        names = [n for n, _ in engine.named_tensors()]
        assert "model.embed_tokens.weight" in names
    finally:
        engine.close()
    fsdp = build_engine(str(tiny_dir), engine_cfg("fsdp2"), optim)
    try:
        theirs = [fsdp.train_batch(batch, sft_loss)["loss"] for _ in range(STEPS)]
    finally:
        fsdp.close()
    assert mine == pytest.approx(theirs, rel=1e-4)
