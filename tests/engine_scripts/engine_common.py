"""Helpers shared by the model-engine tests and their multi-process scripts.

Tiny models come from :func:`polyrl.models.tiny.build_tiny_model` (random init, local tokenizer,
no network).  Reference numbers come from a plain single-process Hugging Face model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from polyrl.core.batch import Batch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def tiny_model(out_dir: str | os.PathLike[str], arch: str = "qwen2", **overrides) -> str:
    """A 2-layer, 32-wide tiny causal LM (tied embeddings unless overridden)."""
    from polyrl.models.tiny import build_tiny_model

    dims = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 64}
    dims.update(overrides)
    return str(build_tiny_model(arch, out_dir, size="nano", **dims))


def make_batch(
    n: int,
    max_len: int,
    vocab: int,
    seed: int = 0,
    min_len: int = 3,
    left_pad_rows: int = 0,
) -> Batch:
    """Variable-length rows: a prompt (no loss) then a response (loss), padded to ``max_len``.

    The first ``left_pad_rows`` rows are left-padded, the rest right-padded.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(n, max_len, dtype=torch.long)
    am = torch.zeros(n, max_len, dtype=torch.long)
    lm = torch.zeros(n, max_len, dtype=torch.float32)
    pos = torch.zeros(n, max_len, dtype=torch.long)
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length, (1,), generator=g))
        start = max_len - length if i < left_pad_rows else 0
        sl = slice(start, start + length)
        ids[i, sl] = torch.randint(1, vocab, (length,), generator=g)
        am[i, sl] = 1
        pos[i, sl] = torch.arange(length)
        lm[i, start + prompt : start + length] = 1.0
    return Batch(
        tensors={"input_ids": ids, "attention_mask": am, "position_ids": pos, "loss_mask": lm}
    )


def clean_loss_mask(batch: Batch) -> torch.Tensor:
    """The loss mask the engine uses: real tokens with a causal prediction only."""
    am = batch["attention_mask"].bool()
    lm = batch["loss_mask"] * am
    first = am.int().argmax(dim=1)
    lm = lm.clone()
    lm[torch.arange(len(batch)), first] = 0
    return lm


def reference_sft(model_dir: str, batch: Batch, dtype=torch.float32):
    """Plain HF + torch: SFT loss (token mean) and named gradients on the whole batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.train()
    ids, am, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = clean_loss_mask(batch)[:, 1:]
    loss = -(logp * mask).sum() / (mask != 0).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads, model


def reference_log_probs(model, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Token log-probs aligned like the engine's (0 on first tokens and padding)."""
    ids, am, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros(len(batch), 1), logp], dim=1)
    keep = am.bool().clone()
    keep[torch.arange(len(batch)), am.int().argmax(dim=1)] = False
    return torch.where(keep, out, torch.zeros(()))


def engine_grads(engine) -> dict[str, torch.Tensor]:
    """Full gradients of the engine's parameters (collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # An abort in a rank then prints every thread's Python stack in the test's log.
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]),
        }
    )
    return env


def exit_rank(code: int = 0) -> None:
    """End a rank script once its results are written, skipping interpreter teardown.

    The process group outlives ``destroy_process_group`` here (DTensor's sharding caches keep
    the device mesh alive), so its gloo threads are still running while Python finalises; a CI
    run once saw a rank abort in that teardown ("terminate called without an active exception",
    SIGABRT) after all of its work had finished.  Nothing is left to clean up at this point.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(script: str, args: list[str], world: int, timeout: float = 240.0) -> list[int]:
    """Run ``script`` as ``world`` ranks (env rendezvous on a free local port); return codes."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            env=script_env(rank, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    codes, logs = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            codes.append(p.returncode)
            logs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    launch.last_logs = logs  # type: ignore[attr-defined]
    return codes


def make_group_batch(
    prompts: int,
    n: int,
    prompt_width: int,
    response_width: int,
    vocab: int,
    seed: int = 0,
) -> Batch:
    """RL rollout layout: ``n`` responses per prompt, prompts left-padded into ``prompt_width``
    columns and responses right-padded into ``response_width`` (loss on response tokens).

    Prompt lengths vary from 1 to ``prompt_width``, response lengths from 1 to ``response_width``;
    rows of one prompt are consecutive.
    """
    g = torch.Generator().manual_seed(seed)
    width = prompt_width + response_width
    rows = prompts * n
    ids = torch.zeros(rows, width, dtype=torch.long)
    am = torch.zeros(rows, width, dtype=torch.long)
    lm = torch.zeros(rows, width, dtype=torch.float32)
    for p in range(prompts):
        plen = int(torch.randint(1, prompt_width + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab, (plen,), generator=g)
        for k in range(n):
            r = p * n + k
            rlen = int(torch.randint(1, response_width + 1, (1,), generator=g))
            ids[r, prompt_width - plen : prompt_width] = prompt
            ids[r, prompt_width : prompt_width + rlen] = torch.randint(
                1, vocab, (rlen,), generator=g
            )
            am[r, prompt_width - plen : prompt_width + rlen] = 1
            lm[r, prompt_width : prompt_width + rlen] = 1.0
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return Batch(
        tensors={"input_ids": ids, "attention_mask": am, "position_ids": pos, "loss_mask": lm}
    )
