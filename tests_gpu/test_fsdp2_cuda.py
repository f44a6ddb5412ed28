"""FSDP2 model engine at world size 1 on CUDA (NCCL group) against a plain HF + AdamW loop.

Same initial weights (the tiny model's safetensors), same batch, same AdamW settings; the engine
trains with its default mixed precision on CUDA (bfloat16 compute, fp32 master weights and
gradient reduction) and once in plain fp32. The reference mirrors FSDP2's mixed precision:
fp32 master parameters, a bf16 copy of the *parameters* (buffers such as the rotary
frequencies stay fp32, as FSDP's policy casts parameters only) for forward and backward, and
the bf16 gradients cast to fp32 for the optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from polyrl.core.batch import Batch
from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss

STEPS = 4
LR = 1e-3
WEIGHT_DECAY = 0.01
VOCAB = 1000  # the tiny tokenizer has 1024 ids; stay inside them


def make_batch(rows: int = 6, width: int = 24, seed: int = 0) -> Batch:
    """Right-padded rows: a prompt (no loss) then a response (loss)."""
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


def reference_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Token-mean NLL of the loss-mask tokens (the engine's ``sft_loss``)."""
    ids, am, pos, lm = (
        batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")
    )
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = lm[:, 1:]
    return -(logp * mask).sum() / (mask != 0).sum()


def reference_losses(model_dir, batch: Batch, compute_dtype: torch.dtype) -> list[float]:
    """Losses of ``STEPS`` AdamW steps of the plain HF model, FSDP2-style mixed precision."""
    from transformers import AutoModelForCausalLM

    master = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).cuda()
    master.train()
    compute = master
    if compute_dtype != torch.float32:
        compute = copy.deepcopy(master)
        for p in compute.parameters():  # parameters only: buffers stay fp32, as under FSDP2
            p.data = p.data.to(compute_dtype)
    masters, shadows = list(master.parameters()), list(compute.parameters())
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        if compute is not master:
            compute.zero_grad(set_to_none=True)
            with torch.no_grad():
                for s, m in zip(shadows, masters, strict=True):
                    s.copy_(m)
        loss = reference_loss(compute, batch)
        loss.backward()
        if compute is not master:
            for s, m in zip(shadows, masters, strict=True):
                m.grad = s.grad.float()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def engine_losses(model_dir, batch: Batch, param_dtype: str) -> list[float]:
    """Losses of ``STEPS`` ``train_batch`` calls of the FSDP2 engine on CUDA."""
    engine = build_engine(
        str(model_dir),
        EngineConfig(
            device="cuda",
            dynamic_batching=False,  # one micro-batch with the batch's own padding, like the ref
            micro_batch_size=len(batch),
            grad_clip=0.0,  # no clipping: the reference does not clip either
            mixed_precision={"param_dtype": param_dtype},
        ),
        OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY),
    )
    try:
        assert engine.device.type == "cuda"
        assert next(engine.model.parameters()).device.type == "cuda"
        # The engine created the process group: NCCL must serve its CUDA tensors.
        assert "nccl" in str(dist.get_backend_config()).lower()
        probe = torch.ones(1, device=engine.device)
        dist.all_reduce(probe)
        torch.cuda.synchronize()
        assert probe.item() == 1.0
        return [engine.train_batch(batch, sft_loss)["loss"] for _ in range(STEPS)]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("param_dtype", "compute_dtype", "rel"),
    [("auto", torch.bfloat16, 1e-2), ("float32", torch.float32, 1e-4)],
    ids=["bf16-mixed", "fp32"],
)
def test_fsdp2_steps_on_cuda_match_a_plain_hf_adamw_loop(tiny_dir, param_dtype, compute_dtype, rel):
    batch = make_batch()
    got = engine_losses(tiny_dir, batch, param_dtype)
    want = reference_losses(tiny_dir, batch, compute_dtype)
    print(f"engine {got}\nplain HF {want}")
    assert got == pytest.approx(want, rel=rel)
    assert want[-1] < want[0] and got[-1] < got[0]  # both really trained
    assert not dist.is_initialized()  # the engine released the group it created
