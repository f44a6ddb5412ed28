"""Tensor parallelism of dense decoder models, and log-probs over a vocabulary-sharded head.

Per decoder layer (Megatron's layout, built with torch's DTensor ``parallelize_module``):
query/key/value and gate/up projections are column-parallel (each rank computes some heads /
some of the MLP width, from the replicated hidden state) and the output / down projections
row-parallel (partial sums all-reduced back to a replicated hidden state).  Attention then runs
on the local heads only; Hugging Face's attention reshapes with ``-1`` heads, so no config edit
is needed.  The LM head is column-parallel over the vocabulary and its output stays sharded:
:func:`vocab_parallel_log_probs` computes log-softmax and entropy from max/sum all-reduces and
takes each target logit from the rank owning it, so full logits never exist on one rank.  With
tied embeddings the input embedding is sharded over the vocabulary the same way (row-parallel
lookup) and stays tied to the head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

__all__ = [
    "TP_FAMILIES",
    "VocabShard",
    "apply_tensor_parallel",
    "check_tp_family",
    "vocab_parallel_log_probs",
]

#: Model families (``config.model_type``) with a tensor-parallel plan.
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_LAYER_PLAN = {
    "self_attn.q_proj": "col",
    "self_attn.k_proj": "col",
    "self_attn.v_proj": "col",
    "self_attn.o_proj": "row",
    "mlp.gate_proj": "col",
    "mlp.up_proj": "col",
    "mlp.down_proj": "row",
}


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "backbone", model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_tp_family(model: nn.Module, tp: int) -> None:
    """Refuse a model family without a plan, or head counts that do not divide by ``tp``.

    Raises:
        ValueError: naming the family and the supported ones, or the head counts.
    """
    config = _text_config(model)
    family = getattr(config, "model_type", type(model).__name__)
    if family not in TP_FAMILIES:
        raise ValueError(
            f"tensor_parallel_size={tp}: no tensor-parallel plan for model family {family!r}; "
            f"supported: {', '.join(TP_FAMILIES)}"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the attention heads ({heads}) and key/value "
            f"heads ({kv_heads}) of {family!r}"
        )


class VocabShard:
    """Where this rank's slice of the vocabulary sits (DTensor's uneven ``Shard(0)`` split)."""

    def __init__(self, group: dist.ProcessGroup, local_size: int) -> None:
        self.group = group
        sizes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, int(local_size), group=group)
        self.offset = sum(sizes[: dist.get_rank(group)])
        self.local_size = int(local_size)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, causal_lm: bool) -> bool:
    """Parallelize ``model``'s decoder layers (and LM head of a causal LM) over ``tp_mesh``.

    Returns whether the LM head is vocabulary-parallel (its logits sharded on the last dim).
    """
    from polyrl.model_engine.heads import no_split_module_classes

    check_tp_family(model, tp_mesh.size())
    layer_classes = no_split_module_classes(model)
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for module in model.modules():
        if layer_classes and isinstance(module, layer_classes):
            plan = {name: styles[kind]() for name, kind in _LAYER_PLAN.items()}
            parallelize_module(module, tp_mesh, plan)
    if not causal_lm:
        # A value model's scalar head stays replicated.
        return False
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    # Vocabulary-sharded logits, left sharded: vocab_parallel_log_probs reduces them.
    parallelize_module(
        head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    )
    if tied:
        # The same Shard(0) split of the same matrix: a masked lookup per rank, partial rows
        # all-reduced. Sharded separately, then re-tied (both hold identical shards).
        parallelize_module(
            embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
        head.weight = embed.weight
    return True


class _VocabParallelLogProb(torch.autograd.Function):
    """Log-prob of each label and entropy from vocabulary-sharded logits ``(N, V/tp)``.

    Forward (``z = logits / T``): the row max and the sums of exponentials are all-reduced
    (MAX, then one SUM), the target logit comes from the owning rank (a masked gather in the same
    SUM).  Every rank then holds the same log-prob and entropy and computes the same loss, so the
    gradient with respect to its own logit slice needs no communication:
    ``(g * (onehot - p) - h * p * (z - E_p[z])) / T``.  Rows are processed ``chunk`` at a time
    in fp32, so the working set is ``chunk x V/tp`` floats whatever the logits' dtype; the
    backward recomputes the probabilities from the saved logits (already kept by autograd).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        shard: VocabShard,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group, n, width = shard.group, logits.shape[0], logits.shape[-1]
        local = labels - shard.offset
        owned = (local >= 0) & (local < width)
        index = torch.where(owned, local, torch.zeros_like(local))
        zmax = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            zmax[s : s + chunk] = logits[s : s + chunk].float().amax(dim=-1) / temperature
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        stats = torch.zeros(3 if with_entropy else 2, n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            z = logits[s : s + chunk].float() / temperature
            exp = torch.exp(z - zmax[s : s + chunk, None])
            stats[0, s : s + chunk] = exp.sum(dim=-1)
            picked = z.gather(-1, index[s : s + chunk, None]).squeeze(-1)
            stats[1, s : s + chunk] = torch.where(owned[s : s + chunk], picked, z.new_zeros(()))
            if with_entropy:
                stats[2, s : s + chunk] = (exp * z).sum(dim=-1)
        dist.all_reduce(stats, group=group)
        lse = zmax + torch.log(stats[0])
        logp = stats[1] - lse
        # E_p[z]; the entropy is lse - E_p[z].
        mean_z = stats[2] / stats[0] if with_entropy else lse
        ent = lse - mean_z
        ctx.save_for_backward(logits, lse, index, owned, mean_z)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_ent: torch.Tensor | None) -> Any:
        logits, lse, index, owned, mean_z = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        use_ent = ctx.with_entropy and grad_ent is not None
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            rows = slice(s, s + chunk)
            z = logits[rows].float() / t
            probs = torch.exp(z - lse[rows, None])
            g = -probs * grad_logp[rows, None]
            onehot = grad_logp[rows] * owned[rows].to(g.dtype)
            g.scatter_add_(-1, index[rows, None], onehot[:, None])
            if use_ent:
                g -= grad_ent[rows, None] * probs * (z - mean_z[rows, None])
            grad[rows] = (g / t).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[label]`` (and entropy) from this rank's vocabulary slice.

    Args:
        logits: ``(..., V/tp)`` local logits (any float dtype; computed in fp32 by chunks).
        labels: ``(...)`` global token ids.
        shard: this rank's vocabulary slice and the tensor-parallel group.
        temperature: sampling temperature (> 0).
        with_entropy: also return the entropy (else ``None``).
        chunk_size: rows per fp32 chunk.

    Collective over ``shard.group``; every rank returns the same fp32 values.
    """
    shape = labels.shape
    flat = logits.reshape(-1, logits.shape[-1])
    logp, ent = _VocabParallelLogProb.apply(
        flat,
        labels.reshape(-1),
        shard,
        float(temperature),
        max(1, int(chunk_size)),
        bool(with_entropy),
    )
    return logp.view(shape), (ent.view(shape) if with_entropy else None)
