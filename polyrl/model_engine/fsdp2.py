"""FSDP2 backend of the model engine (``torch.distributed.fsdp.fully_shard``).

Each decoder layer is one FSDP unit and the root module (embeddings, final norm, heads) another.
Runs on CPU with gloo and on GPU with NCCL.

Gradient scaling.  FSDP normally *averages* gradients over ranks.  The engine instead sets the
divide factor to 1 (plain sums) and has loss functions divide by mini-batch-wide token/sequence
counts summed over all ranks before the micro-batch loop.  The gradient is then exactly that of
the whole mini-batch's loss, whatever the micro-batch split or number of ranks.

Tensor, Ulysses sequence and expert parallelism (``ParallelismConfig.tensor_parallel_size``,
``ulysses_sequence_parallel_size``, ``expert_parallel_size``) put all ranks on one
``(dp_shard, sp, tp)`` mesh (:mod:`polyrl.model_engine.parallel`): :attr:`FSDP2Engine.rank` and
:attr:`FSDP2Engine.world_size` are then the data-parallel ones (peers of one sp x tp group see
the same rows), FSDP shards over ``dp_shard x sp``, and row-level collectives (loss counts,
metrics) run over the data-parallel group.

The engine holds an :class:`~polyrl.model_engine.fsdp2_checkpoint.FSDP2Checkpointer` for
checkpoints and Hugging Face export, and reduces metrics with a
:class:`~polyrl.model_engine.metrics.MetricsAccumulator`; sharding and gathering whole tensors
are in :mod:`~polyrl.model_engine.fsdp2_sharding`.  The backend-agnostic steps (batch
preparation, micro-batch planning, the loss contract) are free functions of
:mod:`polyrl.model_engine.engine`, :mod:`~polyrl.model_engine.batching` and
:mod:`~polyrl.model_engine.prefix`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from polyrl.core.batch import Batch
from polyrl.core.columns import MULTI_MODAL, ROUTED_EXPERTS
from polyrl.core.cpu import retain_freed_memory
from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine.attention import use_cpu_sdpa
from polyrl.model_engine.batching import MicroBatchLayout, plan_rank_micro_batches
from polyrl.model_engine.config import CheckpointConfig, EngineConfig, ModelSpec, OptimizerConfig
from polyrl.model_engine.distributed import (
    DistInfo,
    init_distributed,
    release_distributed,
    select_device,
)
from polyrl.model_engine.engine import (
    GLOBAL_SEQS_KEY,
    GLOBAL_TOKENS_KEY,
    TEMPERATURE_KEY,
    InferFn,
    LossFn,
    ModelOutput,
    TrainingEngine,
    as_config,
    check_infer_result,
    check_loss_result,
    compute_log_probs,
    gather_rows,
    global_loss_counts,
    module_mode,
    no_adapter_error,
    prepare_batch,
    register_engine,
    row_group_size,
    shard_for_rank,
    train_on_batch,
)
from polyrl.model_engine.fsdp2_checkpoint import FSDP2Checkpointer, seed_all
from polyrl.model_engine.fsdp2_sharding import (
    adapter_full_tensors,
    build_mesh,
    clean_name,
    named_full_tensors,
    shard_model,
)
from polyrl.model_engine.heads import (
    enable_activation_checkpointing,
    load_model,
    model_forward,
)
from polyrl.model_engine.lora import LoraLayout, apply_lora
from polyrl.model_engine.metrics import MetricsAccumulator
from polyrl.model_engine.moe import RouterHooks
from polyrl.model_engine.optim import build_optimizer, build_scheduler
from polyrl.model_engine.parallel.expert import (
    ExpertParallel,
    apply_expert_parallel,
    expert_meshes,
)
from polyrl.model_engine.parallel.mesh import ParallelDims, ParallelMesh, build_parallel_mesh
from polyrl.model_engine.parallel.runtime import ParallelRuntime, clip_grad_norm, dp_group
from polyrl.model_engine.prefix import (
    PrefixSplit,
    agree_prefix_splits,
    shared_prefix_forward,
    supports_shared_prefix,
)
from polyrl.model_engine.vision import (
    MicroBatchMedia,
    column_vision_calls,
    dummy_vision_calls,
    encode_once,
    freeze_vision_tower,
    media_tensors,
    mrope_position_column,
    vision_calls,
    vision_info,
)
from polyrl.models.moe import moe_routers
from polyrl.models.vision_family import VisionFamily

__all__ = ["FSDP2Engine"]


@register_engine("fsdp2")
class FSDP2Engine(TrainingEngine):
    """Model engine sharding parameters, gradients and optimizer state with FSDP2."""

    def __init__(
        self,
        model: ModelSpec,
        engine: EngineConfig,
        optimizer: OptimizerConfig,
        checkpoint: CheckpointConfig,
    ) -> None:
        self.model_spec = as_config(model, ModelSpec, "model")
        self.engine_config = as_config(engine, EngineConfig, "engine")
        self.optimizer_config = as_config(optimizer, OptimizerConfig, "optimizer")
        self.checkpoint_config = as_config(checkpoint, CheckpointConfig, "checkpoint")
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._dist: DistInfo | None = None
        self._device = torch.device("cpu")
        self._mesh: DeviceMesh | None = None
        self._params_offloaded = False
        self._optim_offloaded: list[tuple[dict[str, Any], str]] | None = None
        self._optimizer_steps = 0
        self._shard_group_size = 1
        # Tensor/sequence parallelism (None: data parallelism only).
        self._pmesh: ParallelMesh | None = None
        self._parallel: ParallelRuntime | None = None
        # LoRA: peft's wrapper (for disable_adapter) and where the adapters sit.
        self._peft: Any = None
        self._lora: LoraLayout | None = None
        self._checkpointer: FSDP2Checkpointer | None = None
        # A vision-language model's family rules (None: a text model).
        self._vision: VisionFamily | None = None
        # MoE models: routing replay, router statistics and the load-balancing loss.
        self._moe: RouterHooks | None = None
        self._ep: ExpertParallel | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Join/create the process group, load + shard the model, build optimizer + scheduler."""
        if self._model is not None:
            return
        cfg = self.engine_config
        path = self.model_spec.path
        if not path or not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"ModelSpec.path {path!r} does not exist or has no config.json; expected a local "
                "Hugging Face model directory"
            )
        device = select_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
        if device.type == "cpu" and cfg.retain_freed_memory:
            retain_freed_memory()
        self._dist = init_distributed(device)
        self._device = device
        try:
            self._build(device)
        except BaseException:
            # Leave no half-built engine or orphaned process group behind.
            self._model = None
            self.close()
            raise

    def _build(self, device: torch.device) -> None:
        assert self._dist is not None
        cfg = self.engine_config
        split = {
            name: getattr(cfg.parallelism, name)
            for name in cfg.parallelism.MEGATRON_ONLY_FIELDS
            if getattr(cfg.parallelism, name) != 1
        }
        if split:
            raise ValueError(f"the fsdp2 backend has no {split}; they need backend='megatron'")
        world = self._dist.world_size
        par = cfg.parallelism
        dims = ParallelDims.from_config(
            world,
            par.tensor_parallel_size,
            par.ulysses_sequence_parallel_size,
            par.expert_parallel_size,
        )
        if dims.trivial:
            fsdp_size = world if par.fsdp_size == -1 else par.fsdp_size
            self._mesh = build_mesh(device, world, fsdp_size)
        else:
            if par.fsdp_size not in (-1, dims.dp_shard * dims.sp):
                raise ValueError(
                    "ParallelismConfig.fsdp_size (HSDP) cannot be combined with "
                    "tensor_parallel_size / ulysses_sequence_parallel_size / "
                    "expert_parallel_size > 1; leave it -1"
                )
            # The expert-parallel code takes its sub-mesh from parallel_mesh.expert_mesh().
            self._pmesh = build_parallel_mesh(device, dims)
            self._mesh = self._pmesh.fsdp_mesh
            fsdp_size = self._mesh.size()
        seed_all(cfg.seed)
        model = load_model(self.model_spec, seed=cfg.seed)
        self._vision = vision_info(model)
        if self.model_spec.freeze_vision_tower:
            # Before LoRA and sharding: frozen parameters stay out of the optimizer.
            freeze_vision_tower(model)
        if dims.tp > 1 or dims.sp > 1:
            if self.model_spec.lora_rank:
                raise ValueError("LoRA is not supported with tensor/sequence parallelism yet")
            if self._vision is not None:
                raise ValueError(
                    "tensor/sequence parallelism of vision-language models is not supported "
                    "yet; use tensor_parallel_size=1 and ulysses_sequence_parallel_size=1"
                )
            # Before FSDP: the TP plan turns weights into DTensors FSDP then shards over dp.
            self._parallel = ParallelRuntime(self._pmesh, model, self.model_spec.kind)
        self._moe = RouterHooks(model) if moe_routers(model) else None
        ep = cfg.parallelism.expert_parallel_size
        if ep > 1:
            if dims.tp > 1 or dims.sp > 1:
                raise ValueError(
                    "expert_parallel_size > 1 with tensor or sequence parallelism is not "
                    "supported yet; use expert parallelism with data parallelism only"
                )
            self._ep = apply_expert_parallel(model, *expert_meshes(device.type, world, ep))
        if self.model_spec.lora_rank:
            # Before sharding: peft swaps the targeted linear layers for LoRA layers in place.
            self._peft = apply_lora(model, self.model_spec)
            self._lora = LoraLayout(model, clean_name)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(model)
        stored = resolve_dtype(self.model_spec.dtype)
        mp = cfg.mixed_precision
        param_dtype = mp.compute_dtype(device.type, stored)
        # CPU flash attention is slow in bf16 (and at short rows): polyrl.model_engine.attention.
        use_cpu_sdpa(model, param_dtype, device)
        policy = MixedPrecisionPolicy(
            param_dtype=None if param_dtype == stored else param_dtype,
            reduce_dtype=resolve_dtype(mp.reduce_dtype),
        )
        self._shard_group_size = fsdp_size
        # With one rank per shard group "resharding" frees only a duplicate of parameters that
        # stay whole anyway, and costs a second gather in backward.
        reshard = cfg.parallelism.reshard_after_forward and fsdp_size > 1
        experts = set(self._ep.params) if self._ep is not None else set()
        shard_model(model, self._mesh, reshard, policy, ignored=experts)
        self._model = model
        # Frozen (base) weights are left out: with LoRA only the adapters are optimised.
        self._optimizer = build_optimizer(
            (p for p in model.parameters() if p not in experts), self.optimizer_config
        )
        if self._ep is not None:
            # Plain (not FSDP) tensors: their own group, so fused/foreach steps never mix them
            # with DTensors; in model order, the same on every rank.
            self._optimizer.add_param_group({"params": list(self._ep.params)})
        self._scheduler = build_scheduler(self._optimizer, self.optimizer_config)
        self._checkpointer = FSDP2Checkpointer(
            self, self._scheduler, self._lora, self._peft, self._ep
        )

    def close(self) -> None:
        """Drop the model/optimizer; the last engine on a polyrl-created group destroys it."""
        self._model = None
        self._parallel = None
        self._pmesh = None
        self._moe = None
        self._ep = None
        self._peft = None
        self._lora = None
        self._vision = None
        self._optimizer = None
        self._scheduler = None
        self._checkpointer = None
        if self._dist is not None:
            release_distributed(self._dist)
        self._dist = None

    @property
    def rank(self) -> int:
        """Data-parallel rank of this process (tensor/sequence-parallel peers share it)."""
        info = self._require_init()
        return info.rank if self._pmesh is None else self._pmesh.dp_rank

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks (world size / (tensor x sequence parallel sizes))."""
        info = self._require_init()
        return info.world_size if self._pmesh is None else self._pmesh.dims.dp_shard

    @property
    def process_rank(self) -> int:
        """Rank of this process among all of them (files, barriers)."""
        return self._require_init().rank

    @property
    def process_world_size(self) -> int:
        """Number of processes."""
        return self._require_init().world_size

    @property
    def parallel_mesh(self) -> ParallelMesh | None:
        """The ``(dp_shard, sp, tp)`` mesh under tensor/sequence parallelism, else ``None``."""
        self._require_init()
        return self._pmesh

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Sizes of the mesh axes (what a checkpoint must be resumed on)."""
        if self._pmesh is None:
            return {"dp_shard": self.process_world_size, "sp": 1, "tp": 1, "ep": 1}
        dims = self._pmesh.dims
        return {"dp_shard": dims.dp_shard, "sp": dims.sp, "tp": dims.tp, "ep": dims.ep}

    @property
    def device(self) -> torch.device:
        """Device the model computes on."""
        return self._device

    @property
    def model(self) -> torch.nn.Module:
        """The sharded module (parameters are DTensors)."""
        self._require_init()
        assert self._model is not None
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the sharded parameters."""
        self._require_init()
        assert self._optimizer is not None
        return self._optimizer

    @property
    def optimizer_steps(self) -> int:
        """Optimizer updates applied so far (restored by load_checkpoint)."""
        return self._optimizer_steps

    @property
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _require_init(self) -> DistInfo:
        if self._dist is None or self._model is None:
            raise RuntimeError("the engine is not initialised; call initialize() first")
        return self._dist

    def _require_params(self, what: str) -> None:
        self._require_init()
        if self._params_offloaded:
            raise RuntimeError(f"{what}: parameters are offloaded to CPU; call reload() first")

    # ------------------------------------------------------------------------------ batches
    @property
    def _layout_mode(self) -> str:
        cfg = self.engine_config
        if self._parallel is not None and self._parallel.layout_mode is not None:
            return self._parallel.layout_mode
        if not cfg.dynamic_batching:
            return "identity"
        return "pack" if cfg.pack_sequences else "trim"

    def _plan(self, lengths: list[int], group_size: int = 1) -> list[list[int]]:
        """Plan this rank's micro-batches; every rank gets the same count."""
        cfg = self.engine_config
        return plan_rank_micro_batches(
            lengths,
            self.world_size,
            dynamic=cfg.dynamic_batching,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_micro_batch,
            packed=cfg.pack_sequences,
            group_size=group_size,
        )

    def _prefix_splits(
        self, local: Batch, plan: list[list[int]], enabled: bool
    ) -> tuple[list[PrefixSplit | None], list[bool]]:
        """Per micro-batch of ``plan``: the split all ranks agreed on (or None), and their say.

        See :func:`~polyrl.model_engine.prefix.agree_prefix_splits`.
        """
        cfg = self.engine_config
        usable = (
            enabled
            and cfg.share_prefix
            and self.model_spec.kind == "causal_lm"
            # Hugging Face turns the KV cache off under activation checkpointing in training.
            and not cfg.gradient_checkpointing
            # The prefix forward knows no media inputs or M-RoPE positions.
            and self._vision is None
            # The prefix forward's KV cache is not split over tensor/sequence ranks.
            and self._parallel is None
            and supports_shared_prefix(self.model)
            # Replayed routes are laid out per token of the whole rows.
            and ROUTED_EXPERTS not in local.tensor_keys
        )
        if not usable:  # the same on every rank: nothing to agree on
            return [None] * len(plan), [False] * len(plan)
        columns = [local[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")]
        return agree_prefix_splits(columns, plan, self.world_size)

    def _media(self, mb: Batch) -> MicroBatchMedia | None:
        """Return the micro-batch's media tensors (a VLM with a ``multi_modal`` column), or None."""
        if self._vision is None or MULTI_MODAL not in mb.non_tensors:
            return None
        return media_tensors(mb.non_tensors[MULTI_MODAL], len(mb), self._device)

    def _vision_calls(self, local: Batch, plan: list[list[int]]) -> list[int]:
        """Per micro-batch of ``plan``: the most vision-tower runs any rank makes in it.

        FSDP gathers each vision block on every run, so ranks must run the tower equally often;
        a rank below the maximum makes up the difference on dummy inputs (collective).
        """
        if self._vision is None:
            return [0] * len(plan)
        column = local.non_tensors.get(MULTI_MODAL)
        counts = [
            column_vision_calls(column[rows]) if column is not None and rows else 0 for rows in plan
        ]
        if self.world_size > 1 and counts:
            agreed = torch.tensor(counts, dtype=torch.long, device=self._device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            counts = [int(x) for x in agreed.tolist()]
        return counts

    def _forward(
        self, mb: Batch, plan: PrefixSplit | None = None, vision_calls_needed: int = 0
    ) -> ModelOutput:
        am = mb["attention_mask"]
        temperature = mb.meta.get(TEMPERATURE_KEY, 1.0)
        chunk_size = self.engine_config.logprob_chunk_size
        if self._moe is not None:
            self._moe.begin()
        if plan is not None:
            return shared_prefix_forward(
                self.model, plan, mb["input_ids"], am, mb["position_ids"], temperature, chunk_size
            )
        layout = MicroBatchLayout.build(am, self._layout_mode)
        ids = layout.to_compute(mb["input_ids"])
        if self._parallel is not None:
            pos = layout.to_compute(mb["position_ids"])
            layout.check_packable(pos)
            return self._parallel.output(self.model, layout, ids, am, pos, temperature, chunk_size)
        media = self._media(mb)
        if self._vision is None or not self._vision.mrope:
            pos = layout.to_compute(mb["position_ids"])
            layout.check_packable(pos)
        else:
            # An M-RoPE VLM always gets (4, R, W) positions, text rows too: with 3-D (or 2-D)
            # positions Hugging Face's Qwen2-VL finds no packed-sequence boundaries.
            column = mb.non_tensors.get(MULTI_MODAL)
            per_token = mrope_position_column(
                mb["input_ids"], am, mb["position_ids"], column, self._vision
            )
            pos = layout.to_compute(per_token)
            layout.check_packable(pos[..., 0])
            pos = pos.permute(2, 0, 1)
        if self._moe is not None:
            routes = mb[ROUTED_EXPERTS] if ROUTED_EXPERTS in mb.tensor_keys else None
            self._moe.begin(
                None if routes is None else layout.to_compute(routes, fill=-1),
                layout.to_compute(am, fill=0),
            )
        tensors = None
        if media is not None and self._vision is not None:
            tensors = self._vision.forward_media(media.tensors)
        extra = vision_calls_needed - vision_calls(tensors)
        with dummy_vision_calls(self.model, self._vision, extra), encode_once(self.model, media):
            raw = model_forward(
                self.model,
                self.model_spec.kind,
                ids,
                layout.compute_attention_mask(am),
                pos,
                tensors,
            )
        output = ModelOutput(
            kind=self.model_spec.kind,
            raw=raw,
            layout=layout,
            compute_input_ids=ids,
            attention_mask=am,
            temperature=temperature,
            chunk_size=chunk_size,
        )
        if self._moe is not None:
            output.router_aux_loss = self._moe.aux_loss
        return output

    def _dummy_pass(self, backward: bool, calls: int = 1, vision_calls_needed: int = 0) -> None:
        """Run one-token forwards (+ zero backward) to keep FSDP collectives matched.

        ``calls`` is the number of model calls the other ranks make for this micro-batch (two
        under the shared-prefix forward); ``vision_calls_needed`` the most vision-tower runs
        another rank makes in it (a VLM).
        """
        ids = torch.zeros(1, 1, dtype=torch.long, device=self._device)
        if self._moe is not None:  # the dummy token is no routing statistic
            self._moe.begin(valid=torch.zeros(1, dtype=torch.bool))
        total = None
        for _ in range(calls):
            if self._parallel is not None:
                raw = self._parallel.dummy_forward(self.model, self._device)
            else:
                with dummy_vision_calls(self.model, self._vision, vision_calls_needed):
                    raw = model_forward(self.model, self.model_spec.kind, ids, None, ids)
                raw = raw.float().sum()
            total = raw if total is None else total + raw
        if backward and total is not None:
            (total * 0.0).backward()

    # ------------------------------------------------------------------------------ training
    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, forward_only: bool = False
    ) -> dict[str, float]:
        """See :meth:`TrainingEngine.forward_backward`."""
        self._require_params("forward_backward")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        local, lengths = prepare_batch(batch, self._device, need_loss_mask=True)
        group = dp_group(self._pmesh)
        global_tokens, global_seqs = global_loss_counts(local["loss_mask"], self.world_size, group)
        plan = self._plan(lengths, row_group_size(batch))
        splits, shared = self._prefix_splits(local, plan, enabled=True)
        needed = self._vision_calls(local, plan)
        meta = {
            GLOBAL_TOKENS_KEY: global_tokens,
            GLOBAL_SEQS_KEY: global_seqs,
            "dp_size": self.world_size,
        }

        metrics = MetricsAccumulator()
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        # With one rank per shard group, reducing gradients only copies them; let FSDP
        # accumulate unsharded gradients and reduce once, after the last micro-batch.
        defer_sync = not forward_only and self._shard_group_size == 1 and len(plan) > 1
        try:
            for index, rows in enumerate(plan):
                if defer_sync:
                    self.model.set_requires_gradient_sync(index == len(plan) - 1)
                if not rows:
                    with grad_ctx:
                        self._dummy_pass(
                            backward=not forward_only,
                            calls=1 + shared[index],
                            vision_calls_needed=needed[index],
                        )
                    continue
                mb = local[rows]
                mb.meta.update(meta)
                with grad_ctx:
                    output = self._forward(mb, splits[index], needed[index])
                    loss, mb_metrics = check_loss_result(loss_fn(output, mb), forward_only)
                    if not forward_only:
                        loss.backward()
                if self._moe is not None:
                    self._moe.end()
                weight = float((mb["loss_mask"] != 0).sum())
                metrics.add(loss, output.compute_tokens, weight, mb_metrics)
        finally:
            if defer_sync:
                # Never leave FSDP skipping reductions if a loss function raised mid-way.
                self.model.set_requires_gradient_sync(True)
        counts = {
            "num_tokens": global_tokens,
            "num_seqs": global_seqs,
            "num_micro_batches": float(len(plan)),
        }
        reduced = metrics.reduce(self.world_size, counts, group)
        if self._moe is not None:
            reduced.update(self._moe.take_metrics(self.world_size))
        return reduced

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """See :meth:`TrainingEngine.optimizer_step`."""
        self._require_params("optimizer_step")
        if self._optim_offloaded is not None:
            raise RuntimeError("optimizer_step: optimizer state is offloaded; call reload() first")
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            raise RuntimeError("optimizer_step: no gradients; run forward_backward first")
        clip = float(self.engine_config.grad_clip)
        if self._ep is not None:
            self._ep.reduce_grads()
            experts = set(self._ep.params)
            norm = self._ep.grad_norm(p.grad for p in params if p not in experts)
            if clip > 0 and float(norm) > clip:
                scale = clip / (float(norm) + 1e-6)
                for p in set(params) | experts:
                    p.grad.mul_(scale)
        elif self._parallel is not None:
            # Gradients live on different meshes (dp only / dp x tp).
            grad_norm = clip_grad_norm(params, clip)
            if not np.isfinite(grad_norm):
                self.zero_grad()
                return grad_norm
            self.optimizer.step()
            self._optimizer_steps += 1
            return grad_norm
        elif clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not np.isfinite(grad_norm):
            self.zero_grad()
            return grad_norm
        self.optimizer.step()
        self._optimizer_steps += 1
        return grad_norm

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule; returns the new learning rate."""
        self._require_init()
        assert self._scheduler is not None
        self._scheduler.step()
        return self.lr

    def infer_batch(
        self, batch: Batch, fn: InferFn = compute_log_probs, share_prefix: bool = False
    ) -> Batch:
        """See :meth:`TrainingEngine.infer_batch`."""
        self._require_params("infer_batch")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        out_device = batch["input_ids"].device if "input_ids" in batch.tensor_keys else None
        share = share_prefix and "loss_mask" in batch.tensor_keys
        local, lengths = prepare_batch(batch, self._device, need_loss_mask=share)
        plan = self._plan(lengths, row_group_size(batch))
        splits, shared = self._prefix_splits(local, plan, enabled=share)
        needed = self._vision_calls(local, plan)
        pieces: list[dict[str, torch.Tensor]] = []
        order: list[int] = []
        with self.eval_mode(), torch.no_grad():
            for index, rows in enumerate(plan):
                if not rows:
                    self._dummy_pass(
                        backward=False, calls=1 + shared[index], vision_calls_needed=needed[index]
                    )
                    continue
                mb = local[rows]
                result = fn(self._forward(mb, splits[index], needed[index]), mb)
                pieces.append(check_infer_result(result, len(rows), pieces[0] if pieces else None))
                order.extend(rows)
        if self._moe is not None:
            self._moe.end()
            self._moe.take_metrics()  # inference passes are no training statistic
        return gather_rows(pieces, order, len(local), self._device, out_device)

    def train_batch(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """See :meth:`TrainingEngine.train_batch`."""
        return train_on_batch(self, batch, loss_fn)

    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in training mode (dropout on); restores the old mode."""
        return module_mode(self.model, True)

    def eval_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in eval mode; restores the old mode."""
        return module_mode(self.model, False)

    def shard_batch(self, batch: Batch) -> Batch:
        """See :meth:`TrainingEngine.shard_batch`."""
        return shard_for_rank(batch, self.rank, self.world_size)

    # ------------------------------------------------------------------------------ weights
    @property
    def has_adapter(self) -> bool:
        """See :attr:`TrainingEngine.has_adapter`."""
        return self._peft is not None

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """See :meth:`TrainingEngine.adapter_disabled` (peft's ``disable_adapter``)."""
        self._require_init()
        if self._peft is None:
            raise no_adapter_error(self)
        # Only flags on the LoRA layers change, identically on every rank: no collective.
        # peft freezes the adapter's parameters on entry and unfreezes, on exit, the ones
        # registered then; a forward in between makes FSDP2 register its unsharded copies, so
        # the sharded parameters (the optimizer's, and what a checkpoint saves) would stay
        # frozen, and the next checkpoint would hold no adapter. Unfreeze those too.
        trainable = [p for group in self.optimizer.param_groups for p in group["params"]]
        try:
            with self._peft.disable_adapter():
                yield
        finally:
            for param in trainable:
                param.requires_grad_(True)

    def named_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        merge_adapter: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`TrainingEngine.named_tensors`."""
        self._require_params("named_tensors")
        named = named_full_tensors(self.model, self._lora, dtype, device, merge_adapter)
        yield from named if self._ep is None else self._ep.full_tensors(named)

    def adapter_tensors(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full_tensor)`` of the LoRA A/B weights (engine names); collective.

        Names read ``<layer>.lora_A.default.weight``; nothing is yielded without an adapter.
        """
        self._require_params("adapter_tensors")
        if self._lora is not None:
            yield from adapter_full_tensors(self.model, self._lora, dtype, device)

    def _checkpointer_ready(self, what: str) -> FSDP2Checkpointer:
        """Return the checkpointer once parameters (and, but to export, optimizer) are here."""
        self._require_params(what)
        if what != "export_hf" and self._optim_offloaded is not None:
            raise RuntimeError(f"{what}: optimizer state is offloaded; call reload() first")
        assert self._checkpointer is not None
        return self._checkpointer

    def export_hf(
        self, directory: str, tokenizer: Any = None, dtype: torch.dtype | None = None
    ) -> str:
        """See :meth:`TrainingEngine.export_hf`.

        ``tokenizer`` may be an object with ``save_pretrained`` or a directory whose tokenizer
        files are copied; ``None`` copies them from ``ModelSpec.tokenizer_path`` or the model
        directory when present.  ``dtype`` defaults to the stored parameter dtype.  With LoRA the
        weights are merged, and ``ModelSpec.lora_export_adapter`` adds the adapter alone (peft
        format) under ``adapter/``.
        """
        return self._checkpointer_ready("export_hf").export_hf(directory, tokenizer, dtype)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> str:
        """See :meth:`TrainingEngine.save_checkpoint`."""
        return self._checkpointer_ready("save_checkpoint").save(directory, step, extra_state)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """See :meth:`TrainingEngine.load_checkpoint`."""
        info = self._checkpointer_ready("load_checkpoint").load(path)
        self._optimizer_steps = info.pop("optimizer_steps")
        return info

    # ------------------------------------------------------------------------------ offload
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """See :meth:`TrainingEngine.offload`.  Gradients are dropped when parameters move."""
        self._require_init()
        on_device = self._device.type != "cpu"
        if params and not self._params_offloaded:
            self.zero_grad()
            if on_device:
                self.model.to("cpu")
            self._params_offloaded = True
        if optimizer and self._optim_offloaded is None:
            moved: list[tuple[dict[str, Any], str]] = []
            if on_device:
                for state in self.optimizer.state.values():
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.device == self._device:
                            state[key] = value.to("cpu", non_blocking=True)
                            moved.append((state, key))
            self._optim_offloaded = moved
        if on_device:
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()

    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """See :meth:`TrainingEngine.reload`."""
        self._require_init()
        on_device = self._device.type != "cpu"
        if params and self._params_offloaded:
            if on_device:
                self.model.to(self._device)
            self._params_offloaded = False
        if optimizer and self._optim_offloaded is not None:
            for state, key in self._optim_offloaded:
                state[key] = state[key].to(self._device, non_blocking=True)
            self._optim_offloaded = None
        if on_device:
            torch.cuda.synchronize(self._device)

    @property
    def offloaded(self) -> dict[str, bool]:
        """Which parts are currently offloaded."""
        return {"params": self._params_offloaded, "optimizer": self._optim_offloaded is not None}
