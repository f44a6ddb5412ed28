"""FSDP2 backend of the model engine (``torch.distributed.fsdp.fully_shard``).

Each decoder layer is one FSDP unit and the root module (embeddings, final norm, heads) another.
Runs on CPU with gloo and on GPU with NCCL.

Gradient scaling.  FSDP normally *averages* gradients over ranks.  The engine instead sets the
divide factor to 1 (plain sums) and has loss functions divide by mini-batch-wide token/sequence
counts summed over all ranks before the micro-batch loop.  The gradient is then exactly that of
the whole mini-batch's loss, whatever the micro-batch split or number of ranks.

Checkpoints use ``torch.distributed.checkpoint`` (every rank writes its own shards) plus per-rank
RNG files and a small engine-state file; see :mod:`polyrl.model_engine.checkpoint` for the
atomic layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polyrl.core.batch import Batch
from polyrl.core.cpu import retain_freed_memory
from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine import checkpoint as ckpt
from polyrl.model_engine.attention import use_cpu_sdpa
from polyrl.model_engine.batching import (
    MicroBatchLayout,
    group_token_costs,
    min_micro_batches,
    plan_micro_batches,
    row_spans,
)
from polyrl.model_engine.config import (
    CheckpointConfig,
    EngineConfig,
    ModelSpec,
    OptimizerConfig,
    config_to_dict,
)
from polyrl.model_engine.distributed import (
    DistInfo,
    init_distributed,
    release_distributed,
    select_device,
)
from polyrl.model_engine.engine import (
    GLOBAL_SEQS_KEY,
    GLOBAL_TOKENS_KEY,
    ROW_GROUP_KEY,
    InferFn,
    LossFn,
    ModelOutput,
    TrainingEngine,
    compute_log_probs,
    register_engine,
)
from polyrl.model_engine.heads import (
    ValueModel,
    enable_activation_checkpointing,
    load_model,
    model_forward,
    no_split_module_classes,
)
from polyrl.model_engine.lora import (
    ADAPTER_NAME,
    LoraLayout,
    apply_lora,
    merge_lora_weight,
    save_peft_adapter,
)
from polyrl.model_engine.optim import apply_configured_schedule, build_optimizer, build_scheduler
from polyrl.model_engine.prefix import (
    PrefixSplit,
    plan_prefix_split,
    shared_prefix_forward,
    supports_shared_prefix,
)

__all__ = ["ADAPTER_DIR", "FSDP2Engine", "unwrapped_class_name"]

_STATE_FORMAT = "polyrl.fsdp2"
_STATE_VERSION = 1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Wrapper prefixes that must not leak into Hugging Face parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_MAX_SHARD_BYTES = 2 * 1024**3
#: Folder of an exported LoRA model directory holding the adapter alone (peft format).  Not the
#: directory itself: an adapter_config.json there would make transformers load it as an adapter.
ADAPTER_DIR = "adapter"


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _group_size(batch: Batch) -> int:
    size = batch.meta.get(ROW_GROUP_KEY, 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"batch.meta[{ROW_GROUP_KEY!r}] must be an int >= 1, got {size!r}")
    return size


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def unwrapped_class_name(module: torch.nn.Module) -> str:
    """Return the model's own class name, as Hugging Face writes it in ``architectures``.

    ``fully_shard`` swaps a module's class for a generated ``FSDP<Name>`` subclass of
    :class:`FSDPModule` and the original class; the first class in the MRO that is not an FSDP
    class is the original one.
    """
    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__


def _to_float(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().float().item())
    if isinstance(value, int | float | np.floating | np.integer) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what} must be a number or a 0-d tensor, got {type(value).__name__}")


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
        super().__init__(model, engine, optimizer, checkpoint)
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
        # LoRA: peft's wrapper (for disable_adapter) and where the adapters sit.
        self._peft: Any = None
        self._lora: LoraLayout | None = None

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
        world = self._dist.world_size
        fsdp_size = world if cfg.parallelism.fsdp_size == -1 else cfg.parallelism.fsdp_size
        if fsdp_size > world or world % fsdp_size:
            raise ValueError(
                f"ParallelismConfig.fsdp_size={fsdp_size} must divide the world size {world}"
            )
        if fsdp_size == world:
            self._mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
        else:
            self._mesh = init_device_mesh(
                device.type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "fsdp")
            )
        _seed_all(cfg.seed)
        model = load_model(self.model_spec, seed=cfg.seed)
        if self.model_spec.lora_rank:
            # Before sharding: peft swaps the targeted linear layers for LoRA layers in place.
            self._peft = apply_lora(model, self.model_spec)
            self._lora = LoraLayout(model, _clean_name)
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
        layer_classes = no_split_module_classes(model)
        for module in list(model.modules()):
            if layer_classes and isinstance(module, layer_classes):
                fully_shard(
                    module, mesh=self._mesh, reshard_after_forward=reshard, mp_policy=policy
                )
        fully_shard(model, mesh=self._mesh, reshard_after_forward=reshard, mp_policy=policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Sum (not average) gradients over ranks: losses are already normalised by
                # mini-batch-wide counts.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._model = model
        # Frozen (base) weights are left out: with LoRA only the adapters are optimised.
        self._optimizer = build_optimizer(model.parameters(), self.optimizer_config)
        self._scheduler = build_scheduler(self._optimizer, self.optimizer_config)

    def close(self) -> None:
        """Drop the model/optimizer; the last engine on a polyrl-created group destroys it."""
        self._model = None
        self._peft = None
        self._lora = None
        self._optimizer = None
        self._scheduler = None
        if self._dist is not None:
            release_distributed(self._dist)
        self._dist = None

    @property
    def rank(self) -> int:
        """Data-parallel rank of this process."""
        return self._require_init().rank

    @property
    def world_size(self) -> int:
        """Number of data-parallel ranks."""
        return self._require_init().world_size

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
    def _prepare(self, batch: Batch, need_loss_mask: bool) -> tuple[Batch, list[int]]:
        """Copy ``batch`` to the device, validated, with position ids and a cleaned loss mask."""
        if not isinstance(batch, Batch):
            raise TypeError(f"expected a polyrl.core.batch.Batch, got {type(batch).__name__}")
        required = ["input_ids", "attention_mask"] + (["loss_mask"] if need_loss_mask else [])
        missing = [k for k in required if k not in batch.tensor_keys]
        if missing:
            raise KeyError(
                f"batch is missing tensor column(s) {missing}; engine batches need "
                f"{required} (+ optional position_ids), got columns {batch.keys()}"
            )
        ids = batch["input_ids"]
        shape = tuple(ids.shape)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {shape}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got {ids.dtype}")
        for key in ("attention_mask", "position_ids", "loss_mask"):
            if key in batch.tensor_keys and tuple(batch[key].shape) != shape:
                raise ValueError(
                    f"{key} has shape {tuple(batch[key].shape)}, expected {shape} like input_ids"
                )
        tensors = {k: v.to(self._device) for k, v in batch.tensors.items()}
        am = tensors["attention_mask"]
        starts, lengths = row_spans(am)
        if "position_ids" not in tensors:
            tensors["position_ids"] = (am.long().cumsum(1) - 1).clamp(min=0)
        if need_loss_mask:
            lm = tensors["loss_mask"]
            keep = am.bool().clone()
            if shape[0]:
                keep[torch.arange(shape[0], device=am.device), starts] = False
            tensors["loss_mask"] = torch.where(
                keep, lm, torch.zeros((), dtype=lm.dtype, device=lm.device)
            )
        local = Batch(
            tensors=tensors, non_tensors=batch.non_tensors, meta=batch.meta, batch_size=shape[0]
        )
        return local, lengths.tolist()

    @property
    def _layout_mode(self) -> str:
        cfg = self.engine_config
        if not cfg.dynamic_batching:
            return "identity"
        return "pack" if cfg.pack_sequences else "trim"

    def _plan(self, lengths: list[int], group_size: int = 1) -> list[list[int]]:
        """Plan this rank's micro-batches; every rank gets the same count.

        ``group_size`` (``batch.meta[ROW_GROUP_KEY]``): runs of that many consecutive rows stay
        in one micro-batch.
        """
        cfg = self.engine_config
        budget = cfg.max_tokens_per_micro_batch
        kwargs = {
            "dynamic": cfg.dynamic_batching,
            "micro_batch_size": cfg.micro_batch_size,
            "max_tokens": budget,
            "packed": cfg.pack_sequences,
            "group_size": group_size,
        }
        # What must fit the budget at once: a row, or a whole group of rows.
        costs = (
            lengths
            if group_size == 1
            else group_token_costs(lengths, group_size, cfg.pack_sequences)
        )
        longest = max(costs, default=0)
        over = cfg.dynamic_batching and longest > budget
        k_local = 0 if over else min_micro_batches(lengths, **kwargs)
        # Agree on the count (and on any error) before anyone starts a collective forward.
        stats = torch.tensor([k_local, longest], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        k, global_longest = (int(x) for x in stats.tolist())
        if cfg.dynamic_batching and global_longest > budget:
            what = "a sequence" if group_size == 1 else f"a group of {group_size} rows"
            raise ValueError(
                f"{what} of {global_longest} tokens exceeds "
                f"max_tokens_per_micro_batch={budget}; raise the budget to at least the longest "
                "sequence" + ("" if group_size == 1 else " group (the rows that share a loss)")
            )
        return plan_micro_batches(lengths, max(k, 1), **kwargs)

    def _prefix_splits(
        self, local: Batch, plan: list[list[int]], enabled: bool
    ) -> tuple[list[PrefixSplit | None], list[bool]]:
        """Per micro-batch of ``plan``: this rank's prefix split (or None), and all ranks' say.

        Under FSDP every model call is a collective, so a micro-batch takes the two-call
        shared-prefix forward only if every rank with rows in it can; ranks without rows then run
        two dummy calls.
        """
        cfg = self.engine_config
        usable = (
            enabled
            and cfg.share_prefix
            and self.model_spec.kind == "causal_lm"
            # Hugging Face turns the KV cache off under activation checkpointing in training.
            and not cfg.gradient_checkpointing
            and supports_shared_prefix(self.model)
        )
        if not usable:  # the same on every rank: nothing to agree on
            return [None] * len(plan), [False] * len(plan)
        columns = [local[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")]
        splits: list[PrefixSplit | None] = [
            plan_prefix_split(*(c[rows] for c in columns)) if rows else None for rows in plan
        ]
        if self.world_size == 1:
            return splits, [split is not None for split in splits]
        # A rank without rows in a micro-batch does not stand in the others' way.
        ready = [s is not None or not rows for rows, s in zip(plan, splits, strict=True)]
        flags = torch.tensor(ready, dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        agreed = [bool(f) for f in flags.tolist()]
        return [split if ok else None for split, ok in zip(splits, agreed, strict=True)], agreed

    def _forward(self, mb: Batch, plan: PrefixSplit | None = None) -> ModelOutput:
        am = mb["attention_mask"]
        temperature = mb.meta.get("temperature", 1.0)
        chunk_size = self.engine_config.logprob_chunk_size
        if plan is not None:
            return shared_prefix_forward(
                self.model, plan, mb["input_ids"], am, mb["position_ids"], temperature, chunk_size
            )
        layout = MicroBatchLayout.build(am, self._layout_mode)
        ids = layout.to_compute(mb["input_ids"])
        pos = layout.to_compute(mb["position_ids"])
        layout.check_packable(pos)
        raw = model_forward(
            self.model, self.model_spec.kind, ids, layout.compute_attention_mask(am), pos
        )
        return ModelOutput(
            kind=self.model_spec.kind,
            raw=raw,
            layout=layout,
            compute_input_ids=ids,
            attention_mask=am,
            temperature=temperature,
            chunk_size=chunk_size,
        )

    def _dummy_pass(self, backward: bool, calls: int = 1) -> None:
        """Run one-token forwards (+ zero backward) to keep FSDP collectives matched.

        ``calls`` is the number of model calls the other ranks make for this micro-batch (two
        under the shared-prefix forward).
        """
        ids = torch.zeros(1, 1, dtype=torch.long, device=self._device)
        total = None
        for _ in range(calls):
            raw = model_forward(self.model, self.model_spec.kind, ids, None, ids).float().sum()
            total = raw if total is None else total + raw
        if backward and total is not None:
            (total * 0.0).backward()

    def _union_keys(self, keys: set[str]) -> list[str]:
        if self.world_size == 1:
            return sorted(keys)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(keys))
        return sorted(set().union(*gathered))

    # ------------------------------------------------------------------------------ training
    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, forward_only: bool = False
    ) -> dict[str, float]:
        """See :meth:`TrainingEngine.forward_backward`."""
        self._require_params("forward_backward")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        local, lengths = self._prepare(batch, need_loss_mask=True)
        nonzero = local["loss_mask"] != 0
        counts = torch.tensor(
            [int(nonzero.sum()), int(nonzero.any(dim=1).sum())], dtype=torch.float64
        )
        if self.world_size > 1:
            dist.all_reduce(counts)
        global_tokens, global_seqs = (float(x) for x in counts.tolist())
        plan = self._plan(lengths, _group_size(batch))
        splits, shared = self._prefix_splits(local, plan, enabled=True)

        loss_sum = 0.0
        compute_tokens = 0
        acc: dict[str, list[float]] = {}  # name -> [weighted sum, weight, plain sum, count]
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
                        self._dummy_pass(backward=not forward_only, calls=1 + shared[index])
                    continue
                mb = local[rows]
                mb.meta.update(
                    {
                        GLOBAL_TOKENS_KEY: global_tokens,
                        GLOBAL_SEQS_KEY: global_seqs,
                        "dp_size": self.world_size,
                    }
                )
                with grad_ctx:
                    output = self._forward(mb, splits[index])
                    result = loss_fn(output, mb)
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise TypeError(
                            f"loss_fn must return (loss, metrics), got {type(result).__name__}"
                        )
                    loss, metrics = result
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise TypeError("loss_fn's loss must be a scalar tensor")
                    if not forward_only:
                        if not loss.requires_grad:
                            raise ValueError(
                                "loss_fn returned a loss that does not depend on the model output "
                                "(requires_grad is False)"
                            )
                        loss.backward()
                loss_sum += float(loss.detach().float())
                compute_tokens += output.compute_tokens
                weight = float((mb["loss_mask"] != 0).sum())
                if not isinstance(metrics, Mapping):
                    raise TypeError(
                        f"loss_fn's metrics must be a mapping, got {type(metrics).__name__}"
                    )
                for name, value in metrics.items():
                    v = _to_float(value, f"metric {name!r}")
                    slot = acc.setdefault(str(name), [0.0, 0.0, 0.0, 0.0])
                    slot[0] += weight * v
                    slot[1] += weight
                    slot[2] += v
                    slot[3] += 1.0
        finally:
            if defer_sync:
                # Never leave FSDP skipping reductions if a loss function raised mid-way.
                self.model.set_requires_gradient_sync(True)

        names = self._union_keys(set(acc))
        flat = [loss_sum, float(compute_tokens)]
        for name in names:
            flat.extend(acc.get(name, [0.0, 0.0, 0.0, 0.0]))
        reduced = torch.tensor(flat, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(reduced)
        values = reduced.tolist()
        out: dict[str, float] = {
            "loss": values[0],
            "num_tokens": global_tokens,
            "num_seqs": global_seqs,
            "num_micro_batches": float(len(plan)),
            "compute_tokens": values[1],
        }
        for i, name in enumerate(names):
            wsum, wtot, psum, cnt = values[2 + 4 * i : 6 + 4 * i]
            if name in out:
                name = f"loss_fn/{name}"
            out[name] = wsum / wtot if wtot > 0 else (psum / cnt if cnt > 0 else float("nan"))
        return out

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
        if clip > 0:
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
        local, lengths = self._prepare(batch, need_loss_mask=share)
        plan = self._plan(lengths, _group_size(batch))
        splits, shared = self._prefix_splits(local, plan, enabled=share)
        pieces: list[dict[str, torch.Tensor]] = []
        order: list[int] = []
        with self.eval_mode(), torch.no_grad():
            for index, rows in enumerate(plan):
                if not rows:
                    self._dummy_pass(backward=False, calls=1 + shared[index])
                    continue
                mb = local[rows]
                result = fn(self._forward(mb, splits[index]), mb)
                if not isinstance(result, Mapping) or not result:
                    raise TypeError("infer fn must return a non-empty mapping of tensors")
                piece = {}
                for key, value in result.items():
                    if (
                        not isinstance(value, torch.Tensor)
                        or value.ndim == 0
                        or value.shape[0] != len(rows)
                    ):
                        raise ValueError(
                            f"infer fn output {key!r} must be a tensor with {len(rows)} rows"
                        )
                    piece[key] = value.detach()
                if pieces and set(piece) != set(pieces[0]):
                    raise ValueError("infer fn returned different keys for different micro-batches")
                pieces.append(piece)
                order.extend(rows)
        if not pieces:
            return Batch(batch_size=len(local))
        index = torch.tensor(order, dtype=torch.long, device=self._device)
        tensors = {}
        for key in pieces[0]:
            stacked = torch.cat([p[key] for p in pieces], dim=0)
            result_t = torch.empty_like(stacked)
            result_t[index] = stacked
            tensors[key] = result_t.to(out_device) if out_device is not None else result_t
        return Batch(tensors=tensors)

    def _set_training(self, mode: bool) -> bool:
        model = self.model
        previous = model.training
        model.train(mode)
        return previous

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
            super().adapter_disabled()  # raises: nothing to disable
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

    @staticmethod
    def _full(tensor: torch.Tensor) -> torch.Tensor:
        """Return the whole tensor behind a (maybe sharded) parameter; collective for DTensors."""
        if isinstance(tensor, DTensor):
            # On one rank the local shard is the whole tensor: skip the gather's copy.
            single = tensor.device_mesh.size() == 1
            tensor = tensor.to_local() if single else tensor.full_tensor()
        return tensor.detach()

    def named_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        merge_adapter: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`TrainingEngine.named_tensors`."""
        self._require_params("named_tensors")
        seen: set[int] = set()
        state = self.model.state_dict(keep_vars=True)
        lora = self._lora
        for raw, tensor in state.items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = _clean_name(raw)
            full: torch.Tensor | None = None
            if lora is not None:
                if lora.is_adapter(name):
                    continue
                base = lora.base_of(name)
                if base is not None:
                    layer, leaf = base
                    name = f"{layer}.{leaf}"
                    if merge_adapter and leaf == "weight":
                        # Every rank gathers W, A and B in this same order.
                        a_name, b_name = LoraLayout.adapter_names(raw[: -len(".base_layer.weight")])
                        full = merge_lora_weight(
                            self._full(tensor),
                            self._full(state[a_name]),
                            self._full(state[b_name]),
                            lora.scaling[layer],
                        )
            if full is None:
                full = self._full(tensor)
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            if device is not None:
                full = full.to(device)
            yield name, full

    def adapter_tensors(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full_tensor)`` of the LoRA A/B weights (engine names); collective.

        Names read ``<layer>.lora_A.default.weight``; nothing is yielded without an adapter.
        """
        self._require_params("adapter_tensors")
        lora = self._lora
        if lora is None:
            return
        for raw, tensor in self.model.state_dict(keep_vars=True).items():
            name = _clean_name(raw)
            if not lora.is_adapter(name):
                continue
            full = self._full(tensor)
            if dtype is not None:
                full = full.to(dtype)
            if device is not None:
                full = full.to(device)
            yield name, full

    def _broadcast_token(self) -> str:
        token = [uuid.uuid4().hex[:12]]
        if self.world_size > 1:
            dist.broadcast_object_list(token, src=0)
        return str(token[0])

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

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
        self._require_params("export_hf")
        directory = os.path.abspath(directory)
        is_main = self.rank == 0
        token = self._broadcast_token()
        parent = os.path.dirname(directory)
        tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{token}")
        if is_main:
            os.makedirs(tmp)
        dtype = dtype or resolve_dtype(self.model_spec.dtype)
        shards: list[list[str]] = []
        current: dict[str, torch.Tensor] = {}
        size = 0
        weight_map: dict[str, str] = {}
        total_bytes = 0

        def flush() -> None:
            nonlocal current, size
            if not current:
                return
            from safetensors.torch import save_file

            name = f"part-{len(shards):05d}.safetensors"
            save_file(current, os.path.join(tmp, name), metadata={"format": "pt"})
            shards.append(list(current))
            current, size = {}, 0

        try:
            for name, tensor in self.named_tensors(dtype=dtype, device="cpu"):
                if not is_main:
                    continue
                tensor = tensor.contiguous()
                nbytes = tensor.numel() * tensor.element_size()
                if current and size + nbytes > _MAX_SHARD_BYTES:
                    flush()
                current[name] = tensor
                size += nbytes
                total_bytes += nbytes
            adapter: dict[str, torch.Tensor] = {}
            if self._peft is not None and self.model_spec.lora_export_adapter:
                for name, tensor in self.adapter_tensors(dtype=dtype, device="cpu"):
                    if is_main:
                        adapter[name] = tensor.clone()
            if is_main:
                flush()
                self._finish_export(tmp, shards, weight_map, total_bytes, dtype, tokenizer)
                if adapter:
                    config = self._peft.peft_config[ADAPTER_NAME]
                    save_peft_adapter(os.path.join(tmp, ADAPTER_DIR), config, adapter)
                ckpt.publish_dir(tmp, directory)
        finally:
            if is_main and os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        return directory

    def _finish_export(
        self,
        tmp: str,
        shards: list[list[str]],
        weight_map: dict[str, str],
        total_bytes: int,
        dtype: torch.dtype,
        tokenizer: Any,
    ) -> None:
        n = len(shards)
        for i, names in enumerate(shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(tmp, f"part-{i:05d}.safetensors"), os.path.join(tmp, final))
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        model = self.model
        if isinstance(model, ValueModel):
            config = model.export_config()
        else:
            config = model.config.__class__.from_dict(model.config.to_dict())
            config.architectures = [unwrapped_class_name(model)]
        config.use_cache = True  # training turned the cache off; inference wants it back
        config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(tmp)
        src = self.model_spec.path
        if os.path.isfile(os.path.join(src, "generation_config.json")):
            shutil.copy2(os.path.join(src, "generation_config.json"), tmp)
        elif not isinstance(model, ValueModel):
            # Generation defaults (bos/eos/pad ids) from the config, as save_pretrained would.
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
            return
        if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
            raise TypeError(
                "export_hf: tokenizer must have save_pretrained() or be a directory path, got "
                f"{type(tokenizer).__name__}"
            )
        tok_dir = (
            os.fspath(tokenizer)
            if tokenizer is not None
            else (self.model_spec.tokenizer_path or src)
        )
        if tokenizer is not None and not os.path.isdir(tok_dir):
            raise FileNotFoundError(f"export_hf: tokenizer directory {tok_dir!r} does not exist")
        for name in _TOKENIZER_FILES:
            path = os.path.join(tok_dir, name)
            if os.path.isfile(path):
                shutil.copy2(path, tmp)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> str:
        """See :meth:`TrainingEngine.save_checkpoint`."""
        self._require_params("save_checkpoint")
        if self._optim_offloaded is not None:
            raise RuntimeError("save_checkpoint: optimizer state is offloaded; call reload() first")
        if extra_state is not None and not isinstance(extra_state, Mapping):
            raise TypeError(f"extra_state must be a mapping, got {type(extra_state).__name__}")
        root = os.path.abspath(directory)
        name = ckpt.step_dir_name(step)
        final = os.path.join(root, name)
        token = self._broadcast_token()
        tmp = ckpt.new_tmp_dir(root, name, token)
        is_main = self.rank == 0
        if is_main:
            os.makedirs(root, exist_ok=True)
            ckpt.remove_stale_tmp_dirs(root)
            os.makedirs(os.path.join(tmp, "rng"))
        self._barrier()
        with_optim = self.checkpoint_config.save_optimizer
        state = self._checkpoint_state(with_optim)
        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(tmp, "dcp"), sync_files=True))
        torch.save(self._rng_state(), os.path.join(tmp, "rng", f"rank_{self.rank}.pt"))
        if is_main:
            assert self._scheduler is not None
            engine_state = {
                "format": _STATE_FORMAT,
                "version": _STATE_VERSION,
                "step": step,
                "optimizer_steps": self._optimizer_steps,
                "scheduler": self._scheduler.state_dict(),
                "extra_state": dict(extra_state or {}),
                "world_size": self.world_size,
                "has_optimizer": with_optim,
                "model_kind": self.model_spec.kind,
                "lora": self._lora_signature(),
            }
            torch.save(engine_state, os.path.join(tmp, "engine_state.pt"))
            with open(os.path.join(tmp, "configs.json"), "w") as f:
                json.dump(
                    {
                        "model": config_to_dict(self.model_spec),
                        "engine": config_to_dict(self.engine_config),
                        "optimizer": config_to_dict(self.optimizer_config),
                        "checkpoint": config_to_dict(self.checkpoint_config),
                    },
                    f,
                    indent=1,
                    default=str,
                )
        self._barrier()  # every rank's shards and RNG file are on disk
        if is_main:
            ckpt.write_complete_marker(tmp, {"step": step, "world_size": self.world_size})
            ckpt.publish_dir(tmp, final)
            ckpt.atomic_write_text(os.path.join(root, ckpt.LATEST_FILE), name)
            ckpt.prune_checkpoints(root, self.checkpoint_config.max_to_keep)
        self._barrier()
        return final

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """See :meth:`TrainingEngine.load_checkpoint`."""
        self._require_params("load_checkpoint")
        if self._optim_offloaded is not None:
            raise RuntimeError("load_checkpoint: optimizer state is offloaded; call reload() first")
        resolved = ckpt.resolve_checkpoint(os.path.abspath(path))
        engine_state = ckpt.load_checkpoint_file(resolved, "engine_state.pt", "the engine state")
        if engine_state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{resolved!r} is not an FSDP2 engine checkpoint")
        if engine_state.get("model_kind") != self.model_spec.kind:
            raise ValueError(
                f"{resolved!r} holds a {engine_state.get('model_kind')!r} model, this engine "
                f"trains a {self.model_spec.kind!r} model"
            )
        self._check_lora_signature(engine_state.get("lora"), resolved)
        with_optim = bool(engine_state["has_optimizer"]) and self.checkpoint_config.load_optimizer
        reader = FileSystemReader(os.path.join(resolved, "dcp"))
        state = self._checkpoint_state(with_optim)
        # Every key of the template must be in the checkpoint (DCP loads strictly); with LoRA
        # the template holds the adapter only and the frozen base stays as loaded.
        dcp.load(state, storage_reader=reader)
        options = self._state_dict_options(loading=True)
        if with_optim:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
        else:
            set_model_state_dict(self.model, state["model"], options=options)
        assert self._scheduler is not None
        self._scheduler.load_state_dict(engine_state["scheduler"])
        changed = apply_configured_schedule(self._scheduler, self.optimizer_config)
        if changed and self.rank == 0:
            warnings.warn(
                f"resuming from {resolved}: the LR schedule follows this run's optimizer "
                f"settings, not the checkpoint's ({'; '.join(changed)})",
                stacklevel=2,
            )
        self._optimizer_steps = int(engine_state["optimizer_steps"])
        rng_file = os.path.join("rng", f"rank_{self.rank}.pt")
        if os.path.isfile(os.path.join(resolved, rng_file)):
            rng = ckpt.load_checkpoint_file(resolved, rng_file, "the RNG state")
            try:
                self._set_rng_state(rng)
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise ckpt.CorruptCheckpointError(
                    f"checkpoint {resolved!r} is corrupt: its file {rng_file!r} does not hold "
                    f"an RNG state ({type(exc).__name__}: {exc})"
                ) from exc
        self._barrier()
        return {
            "step": int(engine_state["step"]),
            "extra_state": engine_state["extra_state"],
            "path": resolved,
        }

    def _state_dict_options(self, loading: bool = False) -> StateDictOptions | None:
        if self._peft is None:
            return None
        # The frozen base weights come from ModelSpec.path; only the adapter is saved.
        return StateDictOptions(ignore_frozen_params=True, strict=not loading)

    def _checkpoint_state(self, with_optim: bool) -> dict[str, Any]:
        """Return the state DCP saves/loads: model (adapter only with LoRA) and optimizer."""
        options = self._state_dict_options()
        if with_optim:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
            state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model, options=options)}
        if self._lora is not None:
            # A frozen weight tied to another name (embeddings / LM head) survives
            # ignore_frozen_params under its second name: drop everything but the adapter.
            lora = self._lora
            state["model"] = {k: v for k, v in state["model"].items() if lora.is_adapter(k)}
        return state

    def _lora_signature(self) -> dict[str, Any] | None:
        """Return what a checkpoint's adapter must match to load: rank, scale, layers."""
        if self._lora is None:
            return None
        spec = self.model_spec
        return {
            "rank": spec.lora_rank,
            "alpha": float(spec.lora_alpha),
            "layers": sorted(self._lora.scaling),
        }

    def _check_lora_signature(self, saved: Any, path: str) -> None:
        mine = self._lora_signature()
        if saved == mine:
            return
        if saved is None:
            raise ValueError(
                f"{path!r} holds full model weights, this engine trains a LoRA adapter "
                f"(ModelSpec.lora_rank={self.model_spec.lora_rank}); set lora_rank=0 to resume it"
            )
        if mine is None:
            raise ValueError(
                f"{path!r} holds a LoRA adapter of rank {saved['rank']}, this engine trains every "
                f"weight; set ModelSpec.lora_rank={saved['rank']} (lora_alpha={saved['alpha']}, "
                "the same target_modules) to resume it"
            )
        raise ValueError(
            f"{path!r} holds a LoRA adapter (rank {saved['rank']}, alpha {saved['alpha']}, "
            f"{len(saved['layers'])} layers) unlike this engine's (rank {mine['rank']}, alpha "
            f"{mine['alpha']}, {len(mine['layers'])} layers); set ModelSpec.lora_rank, "
            "lora_alpha and target_modules as the run that saved it did"
        )

    def _rng_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if self._device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self._device)
        return state

    def _set_rng_state(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if self._device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self._device)

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
