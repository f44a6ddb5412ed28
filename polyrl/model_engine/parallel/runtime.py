"""Running a micro-batch under sequence and tensor parallelism, and reading its outputs.

:class:`ParallelRuntime` is what the FSDP2 engine holds once the mesh has a sequence- or
tensor-parallel axis: it applies the plans to the model before sharding, runs each forward
(slicing a packed row across the sequence-parallel ranks) and wraps the result in a
:class:`ParallelModelOutput`, whose per-token log-probs, entropy and values are whole rows on
every rank (gathered along the sequence, reduced over the vocabulary shards) so loss functions
see what they see without parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyrl.core.numerics import token_log_probs_and_entropy
from polyrl.model_engine.batching import MicroBatchLayout
from polyrl.model_engine.engine import ModelOutput
from polyrl.model_engine.heads import model_forward
from polyrl.model_engine.parallel.mesh import ParallelMesh
from polyrl.model_engine.parallel.tensor import (
    VocabShard,
    apply_tensor_parallel,
    vocab_parallel_log_probs,
)
from polyrl.model_engine.parallel.ulysses import enable_ulysses, gather_sequence, ulysses_context

__all__ = ["ParallelModelOutput", "ParallelRuntime"]


class ParallelModelOutput(ModelOutput):
    """A :class:`ModelOutput` whose raw output is this rank's shard (sequence and/or vocab).

    ``raw`` holds the positions ``[rank * L, (rank + 1) * L)`` of the padded packed row (all
    positions without sequence parallelism) and, for a causal LM under tensor parallelism,
    this rank's vocabulary slice.  :attr:`logits` is refused: whole logits are never built.
    """

    def __init__(self, runtime: ParallelRuntime, padded_ids: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._runtime = runtime
        self._padded_ids = padded_ids

    @property
    def logits(self) -> torch.Tensor:
        """Refused: under tensor/sequence parallelism each rank holds a shard of the logits."""
        raise ValueError(
            "ModelOutput.logits is not available under tensor_parallel_size > 1 or "
            "ulysses_sequence_parallel_size > 1 (each rank holds a shard of them); use "
            "log_probs / entropy"
        )

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        """Gather a per-position ``(R, L)`` tensor along the sequence; trim the padding."""
        full = gather_sequence(local, self._runtime.sp_group)
        return full[:, : self._ids.shape[1]]

    def _token_stats(self, with_entropy: bool) -> None:
        self._need("causal_lm", "log_probs/entropy")
        rt = self._runtime
        ids = self._padded_ids
        # Position t scores the next token; the last (padded) position gets a dummy label.
        labels = torch.zeros_like(ids)
        labels[:, :-1] = ids[:, 1:]
        width = self._raw.shape[1]
        start = rt.sp_rank * width
        labels = labels[:, start : start + width]
        if rt.vocab is not None:
            logp, ent = vocab_parallel_log_probs(
                self._raw, labels, rt.vocab, self.temperature, with_entropy, self._chunk
            )
        else:
            logp, ent = token_log_probs_and_entropy(
                self._raw, labels, self.temperature, self._chunk, with_entropy
            )
        zero = torch.zeros((), dtype=torch.float32, device=logp.device)
        for name, value in (("log_probs", logp), ("entropy", ent)):
            if value is None:
                continue
            whole = self._whole(value)
            shifted = torch.cat([whole.new_zeros(whole.shape[0], 1), whole[:, :-1]], dim=1)
            self._cache[name] = torch.where(self._predicted, self.layout.to_batch(shifted), zero)

    @property
    def values(self) -> torch.Tensor:
        """Per-token values ``(b, T)`` (value model only), gathered along the sequence."""
        self._need("value", "values")
        if "values" not in self._cache:
            whole = self._whole(self._raw)
            zero = torch.zeros((), dtype=whole.dtype, device=whole.device)
            self._cache["values"] = torch.where(self._valid, self.layout.to_batch(whole), zero)
        return self._cache["values"]


class ParallelRuntime:
    """Sequence/tensor-parallel forward of one engine (built once, before FSDP sharding)."""

    def __init__(self, pmesh: ParallelMesh, model: nn.Module, kind: str) -> None:
        self.pmesh = pmesh
        dims = pmesh.dims
        self.kind = kind
        self.sp = dims.sp
        self.sp_group = pmesh.group("sp") if dims.sp > 1 else None
        self.sp_rank = pmesh.sp_rank if dims.sp > 1 else 0
        self.vocab: VocabShard | None = None
        if dims.tp > 1:
            if apply_tensor_parallel(model, pmesh.tp_mesh, causal_lm=kind == "causal_lm"):
                weight = model.get_output_embeddings().weight
                self.vocab = VocabShard(pmesh.group("tp"), weight.to_local().shape[0])
        self.inner = enable_ulysses(model, dims.sp, dims.tp) if dims.sp > 1 else ""

    @property
    def layout_mode(self) -> str | None:
        """Sequence parallelism slices one packed row: it forces the ``pack`` layout."""
        return "pack" if self.sp > 1 else None

    def run(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model; return ``(raw shard, padded ids)``.

        Under sequence parallelism ``ids`` must be one packed row; it is padded to a multiple
        of the group size (the padding positions count up from 0, a sequence of their own that
        no real token attends to) and this rank runs its contiguous slice.
        """
        if self.sp_group is None:
            return model_forward(model, self.kind, ids, attention_mask, position_ids), ids
        if ids.shape[0] != 1:
            raise ValueError(
                f"ulysses sequence parallelism runs one packed row, got {ids.shape[0]} rows"
            )
        real = ids.shape[1]
        pad = -real % self.sp
        if pad:
            ids = F.pad(ids, (0, pad))
            tail = torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)
            position_ids = torch.cat([position_ids, tail[None]], dim=1)
        width = ids.shape[1] // self.sp
        part = slice(self.sp_rank * width, (self.sp_rank + 1) * width)
        with ulysses_context(self.sp_group, position_ids, self.inner, real):
            raw = model_forward(model, self.kind, ids[:, part], None, position_ids[:, part])
        return raw, ids

    def output(
        self,
        model: nn.Module,
        layout: MicroBatchLayout,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> ParallelModelOutput:
        """Run the model on compute-layout ``ids`` and wrap the result."""
        raw, padded = self.run(
            model, ids, layout.compute_attention_mask(attention_mask), position_ids
        )
        return ParallelModelOutput(
            self,
            padded,
            kind=self.kind,
            raw=raw,
            layout=layout,
            compute_input_ids=ids,
            attention_mask=attention_mask,
            temperature=temperature,
            chunk_size=chunk_size,
        )

    def dummy_forward(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        """Run a forward on ``sp`` padding tokens (one per rank); return its float sum.

        Keeps collectives matched on ranks without rows in a micro-batch.
        """
        ids = torch.zeros(1, self.sp, dtype=torch.long, device=device)
        pos = torch.arange(self.sp, device=device)[None]
        raw, _ = self.run(model, ids, None, pos)
        return raw.float().sum()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Total gradient norm over parameters sharded on different meshes; clip when ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails across
    DTensors of different meshes (FSDP-only vs FSDP x TP); here each (mesh, placements) group
    is reduced to a full scalar separately.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total_sq = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += float(norm) ** 2
    total = total_sq**0.5
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return total


def dp_group(pmesh: ParallelMesh | None) -> dist.ProcessGroup | None:
    """Return the data-parallel group for row-level collectives (``None``: all ranks)."""
    return None if pmesh is None else pmesh.group("dp_shard")
