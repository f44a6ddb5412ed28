"""Megatron-Core backend of the model engine (``EngineConfig.backend='megatron'``).

Builds a Megatron-Core ``GPTModel`` from a Hugging Face checkpoint through polyrl's own converter
(:mod:`.convert`), split by tensor parallelism (TP) and, for mixture-of-experts models, expert
parallelism (EP); the remaining ranks are data-parallel replicas.  Everything the engine
contract shares with FSDP2 is reused: batch preparation, micro-batch planning,
:class:`~polyrl.model_engine.engine.ModelOutput` (log-probs, entropy, the loss functions),
:class:`~polyrl.model_engine.metrics.MetricsAccumulator`, the optimizer / LR schedule builders
and the checkpoint directory helpers.

Layout.  Micro-batches use the engine's ``trim`` layout (each row's tokens left-aligned, rows
trimmed to the longest): Megatron's RoPE numbers a row's positions 0, 1, ... and its attention
is causal, so right padding never touches a real token.  The model gathers the vocabulary-parallel
logits (``parallel_output=False``) and the padded vocabulary rows are dropped, so a loss sees
``(rows, width, vocab)`` logits exactly like FSDP2's.

Gradients and the optimizer.  Megatron's own DDP buffers and DistributedOptimizer allocate on
CUDA; this backend keeps plain parameters, a torch optimizer over each rank's shards and sums
gradients itself (like FSDP2, a sum, since losses divide by mini-batch-wide counts): dense
parameters over the data-parallel group, expert parameters over the expert-data-parallel group.
The gradient norm counts TP-replicated parameters once (see :meth:`MegatronEngine._grad_norm`).

Not yet supported: pipeline and context parallelism (sizes > 1 are refused), LoRA, value models,
the shared-prefix forward and sequence packing (``pack_sequences`` runs as ``trim``).  On CPU
the patches of :mod:`.cpu_patches` are applied first.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from polyrl.core.batch import Batch
from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine import checkpoint as ckpt
from polyrl.model_engine.batching import MicroBatchLayout, plan_rank_micro_batches
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
from polyrl.model_engine.fsdp2_checkpoint import rng_state, seed_all, set_rng_state
from polyrl.model_engine.heads import read_safetensors
from polyrl.model_engine.megatron import convert as cv
from polyrl.model_engine.metrics import MetricsAccumulator
from polyrl.model_engine.optim import apply_configured_schedule, build_optimizer, build_scheduler

__all__ = ["MegatronEngine"]

_STATE_FORMAT = "polyrl-megatron-engine"

#: ``TransformerConfig`` switches that turn Megatron's fusions off: they are CUDA kernels or
#: torch.compile'd functions; the plain paths run anywhere and are exact.
PLAIN_KERNELS: dict[str, bool] = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "masked_softmax_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}
#: Tokenizer / generation files copied next to an exported model.
_COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False
    return True


def _rope_theta(config: Any) -> float:
    """RoPE base of a ``transformers`` config; refuses scaled RoPE variants Megatron's GPT lacks."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, Mapping):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(
                f"RoPE type {kind!r} is not supported by the Megatron backend yet (only default)"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def _freeze_padding_row(model: torch.nn.Module, pad_id: Any, vocab_size: int) -> None:
    """Give the pad token's embedding row no gradient from input lookups, as HF does.

    Hugging Face builds its input embedding as ``nn.Embedding(..., padding_idx=pad_token_id)``:
    wherever the pad id is looked up (also as a real token) the row gets no gradient.
    Megatron's ``VocabParallelEmbedding`` has no padding index.  Without this the Megatron and
    FSDP2 engines differ in that row's gradient (and, tied, in the LM head's): measured on a
    GRPO step, grad norm 0.67940 vs 0.67868.  Detaching the looked-up vectors at pad positions
    keeps the forward and drops exactly that gradient (the output-layer use of a tied row still
    gets its gradient, as in HF).
    """
    if not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size:
        return
    embedding = model.embedding.word_embeddings

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
        ids = inputs[0]
        if not torch.is_grad_enabled() or ids.shape != output.shape[:2]:
            return None
        pad = (ids == pad_id).unsqueeze(-1)
        return torch.where(pad, output.detach(), output)

    embedding.register_forward_hook(hook)


@register_engine("megatron")
class MegatronEngine(TrainingEngine):
    """Model engine on Megatron-Core: tensor- and expert-parallel GPT, data-parallel replicas."""

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
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._dist: DistInfo | None = None
        self._device = torch.device("cpu")
        self._hf_config: Any = None
        self._layout: cv.GPTLayout | None = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._owns_parallel_state = False
        self._params_offloaded = False
        self._optim_offloaded = False
        self._optimizer_steps = 0
        self._autocast_dtype: torch.dtype | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Join/create the process group, build the Megatron model from the HF checkpoint."""
        if self._model is not None:
            return
        path = self.model_spec.path
        if not path or not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"ModelSpec.path {path!r} does not exist or has no config.json; expected a local "
                "Hugging Face model directory"
            )
        self._check_supported()
        from polyrl.model_engine.megatron import cpu_patches

        cpu_patches.check_version()
        device = select_device(self.engine_config.device, int(os.environ.get("LOCAL_RANK", "0")))
        if device.type == "cpu":
            cpu_patches.apply()
        elif not _te_available():
            cpu_patches.apply_without_te()
        self._dist = init_distributed(device)
        self._device = device
        try:
            self._build(device)
        except BaseException:
            self._model = None
            self.close()
            raise

    def _check_supported(self) -> None:
        spec, cfg = self.model_spec, self.engine_config
        if spec.kind != "causal_lm":
            raise ValueError("the Megatron backend trains causal LMs only (no value head)")
        if spec.lora_rank:
            raise ValueError("the Megatron backend has no LoRA support yet (lora_rank=0)")
        par = cfg.parallelism
        if par.pipeline_parallel_size != 1 or par.context_parallel_size != 1:
            raise ValueError(
                "the Megatron backend runs tensor and expert parallelism only: pipeline_parallel_"
                "size and context_parallel_size must be 1"
            )
        if cfg.gradient_checkpointing:
            raise ValueError("gradient_checkpointing is not wired to Megatron's recompute")

    def _build(self, device: torch.device) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from transformers import AutoConfig

        cfg = self.engine_config
        par = cfg.parallelism
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=par.tensor_parallel_size,
                pipeline_model_parallel_size=1,
                context_parallel_size=1,
                expert_model_parallel_size=par.expert_parallel_size,
                expert_tensor_parallel_size=par.expert_tensor_parallel_size,
            )
            self._owns_parallel_state = True
        seed_all(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        hf = AutoConfig.from_pretrained(
            self.model_spec.path, trust_remote_code=self.model_spec.trust_remote_code
        )
        use_te = cfg.megatron.transformer_impl == "transformer_engine" or (
            cfg.megatron.transformer_impl == "auto" and device.type == "cuda" and _te_available()
        )
        if use_te and device.type == "cpu":
            raise ValueError("transformer_impl='transformer_engine' needs a CUDA device")
        layout = cv.GPTLayout.from_hf_config(
            hf,
            tp=par.tensor_parallel_size,
            ep=par.expert_parallel_size,
            etp=par.expert_tensor_parallel_size,
            fused_norms=use_te,
            make_vocab_size_divisible_by=cfg.megatron.make_vocab_size_divisible_by,
        )
        stored = resolve_dtype(self.model_spec.dtype)
        compute = cfg.mixed_precision.compute_dtype(device.type, stored)
        # Parameters stay in the stored dtype (the optimizer's master copy); a lower compute
        # dtype runs the forward under autocast.
        self._autocast_dtype = compute if compute != stored else None
        config = self._transformer_config(hf, layout, stored)
        model = GPTModel(
            config=config,
            transformer_layer_spec=self._layer_spec(layout, use_te),
            vocab_size=layout.padded_vocab_size,
            max_sequence_length=int(getattr(hf, "max_position_embeddings", 4096)),
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf),
            share_embeddings_and_output_weights=layout.tie_word_embeddings,
            parallel_output=False,
        )
        self._load_hf_weights(model, layout)
        _freeze_padding_row(model, getattr(hf, "pad_token_id", None), layout.vocab_size)
        model.to(device)
        self._hf_config = hf
        self._layout = layout
        self._model = model
        self._params = dict(model.named_parameters())
        self._optimizer = build_optimizer(model.parameters(), self.optimizer_config)
        self._scheduler = build_scheduler(self._optimizer, self.optimizer_config)

    def _transformer_config(self, hf: Any, layout: cv.GPTLayout, dtype: torch.dtype) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        par = self.engine_config.parallelism
        moe: dict[str, Any] = {}
        if layout.num_experts:
            moe = {
                "num_moe_experts": layout.num_experts,
                "moe_ffn_hidden_size": layout.moe_ffn_hidden_size,
                "moe_router_topk": int(hf.num_experts_per_tok),
                # HF Qwen3-MoE: softmax over all experts, top-k, then renormalised when
                # norm_topk_prob; Megatron's non-pre-softmax top-k (softmax over the k chosen
                # logits) is that renormalised distribution.
                "moe_router_pre_softmax": not bool(getattr(hf, "norm_topk_prob", True)),
                "moe_router_load_balancing_type": "none",
                "moe_aux_loss_coeff": 0.0,
                "moe_router_dtype": "fp32",
                # The all-gather dispatcher is the one that runs without CUDA-only kernels.
                "moe_token_dispatcher_type": "allgather",
                "moe_grouped_gemm": False,
                "moe_layer_freq": [int(m) for m in layout.moe_layers],
            }
        return TransformerConfig(
            num_layers=layout.num_layers,
            hidden_size=layout.hidden_size,
            num_attention_heads=layout.num_attention_heads,
            num_query_groups=layout.num_key_value_heads,
            kv_channels=layout.head_dim,
            ffn_hidden_size=layout.ffn_hidden_size,
            tensor_model_parallel_size=par.tensor_parallel_size,
            expert_model_parallel_size=par.expert_parallel_size,
            expert_tensor_parallel_size=par.expert_tensor_parallel_size,
            sequence_parallel=False,
            use_cpu_initialization=True,
            perform_initialization=False,  # every weight is overwritten from the checkpoint
            params_dtype=dtype,
            normalization="RMSNorm",
            layernorm_epsilon=float(getattr(hf, "rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=layout.qkv_bias,
            qk_layernorm=layout.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **PLAIN_KERNELS,
            **moe,
        )

    @staticmethod
    def _layer_spec(layout: cv.GPTLayout, use_te: bool) -> Any:
        from megatron.core.models.gpt import gpt_layer_specs as specs

        experts = layout.num_experts or None
        if use_te:
            return specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=False, qk_layernorm=layout.qk_norm
            )
        return specs.get_gpt_layer_local_spec(
            num_experts=experts, qk_layernorm=layout.qk_norm, normalization="RMSNorm"
        )

    def _load_hf_weights(self, model: torch.nn.Module, layout: cv.GPTLayout) -> None:
        """Copy this rank's shards of the HF checkpoint into the model."""
        from megatron.core import parallel_state as ps

        state = read_safetensors(self.model_spec.path)
        tp_rank = ps.get_tensor_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        local = cv.shard_state(state, layout, tp_rank, ep_rank)
        del state
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(local))
        unexpected = sorted(set(local) - set(params))
        if missing or unexpected:
            raise RuntimeError(
                f"HF -> Megatron conversion does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                src = local[name]
                if tuple(src.shape) != tuple(param.shape):
                    raise RuntimeError(
                        f"{name}: converted shape {tuple(src.shape)} != model {tuple(param.shape)}"
                    )
                param.copy_(src.to(param.dtype))

    def close(self) -> None:
        """Drop the model/optimizer and the parallel state / process group this engine made."""
        self._model = None
        self._params = {}
        self._optimizer = None
        self._scheduler = None
        if self._owns_parallel_state:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            self._owns_parallel_state = False
        if self._dist is not None:
            release_distributed(self._dist)
        self._dist = None

    # ------------------------------------------------------------------------------ groups
    @staticmethod
    def _ps() -> Any:
        from megatron.core import parallel_state as ps

        return ps

    @property
    def rank(self) -> int:
        """Data-parallel rank of this process (ranks of one TP/EP replica share it)."""
        self._require_init()
        return int(self._ps().get_data_parallel_rank())

    @property
    def world_size(self) -> int:
        """Number of data-parallel replicas."""
        self._require_init()
        return int(self._ps().get_data_parallel_world_size())

    @property
    def _dp_group(self) -> Any:
        return self._ps().get_data_parallel_group()

    @property
    def global_rank(self) -> int:
        """Rank in the default process group."""
        return self._require_init().rank

    @property
    def device(self) -> torch.device:
        """Device the model computes on."""
        return self._device

    @property
    def model(self) -> torch.nn.Module:
        """The local Megatron ``GPTModel`` (this rank's TP/EP shards)."""
        self._require_init()
        assert self._model is not None
        return self._model

    @property
    def layout(self) -> cv.GPTLayout:
        """The converter layout of the model."""
        self._require_init()
        assert self._layout is not None
        return self._layout

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over this rank's shards."""
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

    # ------------------------------------------------------------------------------ forward
    def _plan(self, lengths: list[int], group_size: int = 1) -> list[list[int]]:
        """Plan this rank's micro-batches; every rank (all replicas) gets the same count."""
        cfg = self.engine_config
        return plan_rank_micro_batches(
            lengths,
            dist.get_world_size(),
            dynamic=cfg.dynamic_batching,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_micro_batch,
            packed=False,
            group_size=group_size,
        )

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``(rows, width, vocab)`` of right-padded rows ``ids``."""
        rows, width = ids.shape
        ids = self._pad_for_experts(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        ctx = (
            torch.autocast(self._device.type, dtype=self._autocast_dtype)
            if self._autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            logits = self.model(ids, positions, attention_mask=None)
        return logits[:rows, :width, : self.layout.vocab_size]

    def _pad_for_experts(self, ids: torch.Tensor) -> torch.Tensor:
        """Pad ``ids`` to the largest micro-batch shape of the ranks that exchange MoE tokens.

        Megatron's all-gather token dispatcher (``token_dispatcher.py``
        ``MoEAllGatherTokenDispatcher``) gathers the hidden states of the expert-TP x EP group
        with equal-size collectives; data-parallel replicas in that group hold micro-batches of
        different shapes.  Extra rows / columns are padding tokens whose logits are dropped; no
        token capacity is set, so they never displace a real token's expert.
        """
        if not self.layout.num_experts:
            return ids
        group = self._ps().get_expert_tensor_and_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return ids
        shape = torch.tensor(ids.shape, dtype=torch.long)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
        rows, width = (int(x) for x in shape.tolist())
        if (rows, width) == tuple(ids.shape):
            return ids
        padded = ids.new_zeros(rows, width)
        padded[: ids.shape[0], : ids.shape[1]] = ids
        return padded

    def _forward(self, mb: Batch) -> ModelOutput:
        am = mb["attention_mask"]
        layout = MicroBatchLayout.build(am, "trim")
        ids = layout.to_compute(mb["input_ids"])
        pos = layout.to_compute(mb["position_ids"])
        expected = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
        real = layout.compute_attention_mask(am).bool()
        if not torch.equal(pos[real], expected[real]):
            raise ValueError(
                "the Megatron backend numbers each row's positions 0, 1, ... (its RoPE takes no "
                "position_ids): rows with other position_ids are not supported"
            )
        return ModelOutput(
            kind="causal_lm",
            raw=self._logits(ids),
            layout=layout,
            compute_input_ids=ids,
            attention_mask=am,
            temperature=mb.meta.get(TEMPERATURE_KEY, 1.0),
            chunk_size=self.engine_config.logprob_chunk_size,
        )

    def _dummy_pass(self, backward: bool) -> None:
        """Run a one-token forward (+ zero backward) to match the other ranks' collectives."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self._device)
        total = self._logits(ids).float().sum()
        if backward:
            (total * 0.0).backward()

    # ------------------------------------------------------------------------------ training
    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, forward_only: bool = False
    ) -> dict[str, float]:
        """See :meth:`TrainingEngine.forward_backward` (gradients are summed in optimizer_step)."""
        self._require_params("forward_backward")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        local, lengths = prepare_batch(batch, self._device, need_loss_mask=True)
        dp, group = self.world_size, self._dp_group
        global_tokens, global_seqs = global_loss_counts(local["loss_mask"], dp, group)
        plan = self._plan(lengths, row_group_size(batch))
        meta = {GLOBAL_TOKENS_KEY: global_tokens, GLOBAL_SEQS_KEY: global_seqs, "dp_size": dp}
        metrics = MetricsAccumulator()
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        for rows in plan:
            if not rows:
                with grad_ctx:
                    self._dummy_pass(backward=not forward_only)
                continue
            mb = local[rows]
            mb.meta.update(meta)
            with grad_ctx:
                output = self._forward(mb)
                loss, mb_metrics = check_loss_result(loss_fn(output, mb), forward_only)
                if not forward_only:
                    loss.backward()
            weight = float((mb["loss_mask"] != 0).sum())
            metrics.add(loss, output.compute_tokens, weight, mb_metrics)
        counts = {
            "num_tokens": global_tokens,
            "num_seqs": global_seqs,
            "num_micro_batches": float(len(plan)),
        }
        return metrics.reduce(dp, counts, group)

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def _sync_grads(self) -> None:
        """Sum gradients over the replicas that hold the same parameter shard.

        Expert parameters are replicated over the expert-data-parallel group, the others over
        the data-parallel group.
        """
        ps = self._ps()
        dense_group = ps.get_data_parallel_group()
        expert_group = ps.get_expert_data_parallel_group()
        dense_size = dist.get_world_size(dense_group)
        expert_size = dist.get_world_size(expert_group)
        for name, param in self._params.items():
            if param.grad is None:
                continue
            expert = cv.expert_index(name) is not None
            group, size = (expert_group, expert_size) if expert else (dense_group, dense_size)
            if size > 1:
                dist.all_reduce(param.grad, group=group)

    def _grad_norm(self) -> float:
        """Global L2 norm of the (synced) gradients, each model element counted once.

        A TP-split parameter counts on every TP rank, a replicated
        one on TP rank 0 only; expert parameters likewise within their expert-TP group.  The
        squares are summed over the model-parallel ranks of one replica: the TP group for dense
        parameters, the expert-TP x EP group for expert ones.
        """
        ps = self._ps()
        tp_rank = ps.get_tensor_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        dense = torch.zeros((), dtype=torch.float64, device=self._device)
        expert = torch.zeros((), dtype=torch.float64, device=self._device)
        for name, param in self._params.items():
            if param.grad is None:
                continue
            # The converter's table, not Megatron's ``tensor_model_parallel`` attribute: that is
            # only set by the weight initialisers, which perform_initialization=False skips.
            is_expert = cv.expert_index(name) is not None
            split = cv.partition_kind(name) != "replicated"
            if not split and (etp_rank if is_expert else tp_rank) != 0:
                continue
            square = param.grad.detach().double().pow(2).sum()
            if is_expert:
                expert += square
            else:
                dense += square
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(dense, group=ps.get_tensor_model_parallel_group())
        if dist.get_world_size(ps.get_expert_tensor_and_model_parallel_group()) > 1:
            dist.all_reduce(expert, group=ps.get_expert_tensor_and_model_parallel_group())
        return math.sqrt(float(dense + expert))

    def optimizer_step(self) -> float:
        """See :meth:`TrainingEngine.optimizer_step`."""
        self._require_params("optimizer_step")
        if self._optim_offloaded:
            raise RuntimeError("optimizer_step: optimizer state is offloaded; call reload() first")
        params = [p for p in self._params.values() if p.grad is not None]
        if not params:
            raise RuntimeError("optimizer_step: no gradients; run forward_backward first")
        self._sync_grads()
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm):
            self.zero_grad()
            return grad_norm
        clip = float(self.engine_config.grad_clip)
        if clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule, with the model-parallel norm.
            coef = clip / (grad_norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
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
        """See :meth:`TrainingEngine.infer_batch` (``share_prefix`` runs the full forward)."""
        self._require_params("infer_batch")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        out_device = batch["input_ids"].device if "input_ids" in batch.tensor_keys else None
        local, lengths = prepare_batch(batch, self._device, need_loss_mask=False)
        plan = self._plan(lengths, row_group_size(batch))
        pieces: list[dict[str, torch.Tensor]] = []
        order: list[int] = []
        with self.eval_mode(), torch.no_grad():
            for rows in plan:
                if not rows:
                    self._dummy_pass(backward=False)
                    continue
                mb = local[rows]
                result = fn(self._forward(mb), mb)
                pieces.append(check_infer_result(result, len(rows), pieces[0] if pieces else None))
                order.extend(rows)
        return gather_rows(pieces, order, len(local), self._device, out_device)

    def train_batch(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """See :meth:`TrainingEngine.train_batch`."""
        return train_on_batch(self, batch, loss_fn)

    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in training mode; restores the old mode."""
        return module_mode(self.model, True)

    def eval_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in eval mode; restores the old mode."""
        return module_mode(self.model, False)

    def shard_batch(self, batch: Batch) -> Batch:
        """See :meth:`TrainingEngine.shard_batch` (by data-parallel rank)."""
        return shard_for_rank(batch, self.rank, self.world_size)

    # ------------------------------------------------------------------------------ adapters
    @property
    def has_adapter(self) -> bool:
        """Always False: no LoRA on this backend yet."""
        return False

    def adapter_disabled(self) -> contextlib.AbstractContextManager[None]:
        """Raise: no adapter (:func:`~polyrl.model_engine.engine.no_adapter_error`)."""
        raise no_adapter_error(self)

    # ------------------------------------------------------------------------------ weights
    def _full_tensor(self, name: str) -> torch.Tensor:
        """One full Megatron tensor (global expert index), gathered over TP / EP; collective."""
        ps = self._ps()
        layout = self.layout
        found = cv.expert_index(name)
        if found is None:
            local = self._params[name].detach()
            if layout.tp == 1 or cv.partition_kind(name) == "replicated":
                return local
            group = ps.get_tensor_model_parallel_group()
            shards = [torch.empty_like(local) for _ in range(layout.tp)]
            dist.all_gather(shards, local.contiguous(), group=group)
            return cv.gather(name, shards)
        if layout.etp != 1:
            raise ValueError("named_tensors with expert_tensor_parallel_size > 1")
        owner = found[1] // (layout.num_experts // layout.ep)
        local_name = cv.local_name(name, layout, owner)
        assert local_name is not None
        if layout.ep == 1:
            return self._params[local_name].detach()
        group = ps.get_expert_model_parallel_group()
        # Local names are rank-local indices: every EP rank holds a tensor of this name and
        # shape (its own expert of that index), which receives the owner's.
        buf = self._params[local_name].detach().clone()
        dist.broadcast(buf, src=dist.get_global_rank(group, owner), group=group)
        return buf

    def named_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        merge_adapter: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """See :meth:`TrainingEngine.named_tensors`: HF names, full tensors one at a time.

        Every rank of the job (all TP / EP / data-parallel ranks) must exhaust the iterator.
        """
        self._require_params("named_tensors")
        for name, tensor in cv.megatron_to_hf(self._full_tensor, self.layout):
            if dtype is not None or device is not None:
                tensor = tensor.to(device=device, dtype=dtype)
            yield name, tensor

    def export_hf(
        self, directory: str, tokenizer: Any = None, dtype: torch.dtype | None = None
    ) -> str:
        """See :meth:`TrainingEngine.export_hf` (one safetensors file per 4 GB, rank 0 writes)."""
        from safetensors.torch import save_file

        self._require_params("export_hf")
        directory = os.path.abspath(directory)
        is_main = self.global_rank == 0
        token = self._broadcast_token()
        tmp = os.path.join(
            os.path.dirname(directory), f".{os.path.basename(directory)}.tmp-{token}"
        )
        dtype = dtype or resolve_dtype(self.model_spec.dtype)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        limit = 4 << 30
        for name, tensor in self.named_tensors(dtype=dtype, device="cpu"):
            if not is_main:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.contiguous().clone()
            size += nbytes
        if is_main:
            try:
                os.makedirs(tmp)
                self._write_export(tmp, shards, dtype, tokenizer, save_file)
                ckpt.publish_dir(tmp, directory)
            finally:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        return directory

    def _write_export(
        self,
        tmp: str,
        shards: list[dict[str, torch.Tensor]],
        dtype: torch.dtype,
        tokenizer: Any,
        save_file: Any,
    ) -> None:
        n = len(shards)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        if n > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        config = self._hf_config.__class__.from_dict(self._hf_config.to_dict())
        config.use_cache = True
        config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        src = os.fspath(tokenizer) if isinstance(tokenizer, str | os.PathLike) else None
        for folder in (self.model_spec.path, self.model_spec.tokenizer_path, src):
            if not folder or not os.path.isdir(folder):
                continue
            for fname in _COPIED_FILES:
                path = os.path.join(folder, fname)
                if os.path.isfile(path):
                    shutil.copy2(path, tmp)

    # ------------------------------------------------------------------------------ checkpoints
    def _broadcast_token(self) -> str:
        token = [uuid.uuid4().hex[:12]]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(token, src=0)
        return str(token[0])

    def _barrier(self) -> None:
        if dist.get_world_size() > 1:
            dist.barrier()

    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> str:
        """See :meth:`TrainingEngine.save_checkpoint`: one file per rank with its shards."""
        from megatron.core import tensor_parallel

        self._require_params("save_checkpoint")
        if extra_state is not None and not isinstance(extra_state, Mapping):
            raise TypeError(f"extra_state must be a mapping, got {type(extra_state).__name__}")
        root = os.path.abspath(directory)
        name = ckpt.step_dir_name(step)
        final = os.path.join(root, name)
        tmp = ckpt.new_tmp_dir(root, name, self._broadcast_token())
        rank, world = self.global_rank, dist.get_world_size()
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            ckpt.remove_stale_tmp_dirs(root)
            os.makedirs(tmp)
        self._barrier()
        state = {
            "model": {k: v.detach().cpu() for k, v in self._params.items()},
            "optimizer": (
                self.optimizer.state_dict() if self.checkpoint_config.save_optimizer else None
            ),
            "rng": rng_state(self._device),
            "tp_rng": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
        torch.save(state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
        if rank == 0:
            assert self._scheduler is not None
            engine_state = {
                "format": _STATE_FORMAT,
                "step": step,
                "optimizer_steps": self._optimizer_steps,
                "scheduler": self._scheduler.state_dict(),
                "extra_state": dict(extra_state or {}),
                "world_size": world,
                "parallelism": config_to_dict(self.engine_config.parallelism),
            }
            torch.save(engine_state, os.path.join(tmp, "engine_state.pt"))
        self._barrier()
        if rank == 0:
            ckpt.write_complete_marker(tmp, {"step": step, "world_size": world})
            ckpt.publish_dir(tmp, final)
            ckpt.atomic_write_text(os.path.join(root, ckpt.LATEST_FILE), name)
            ckpt.prune_checkpoints(root, self.checkpoint_config.max_to_keep)
        self._barrier()
        return final

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """See :meth:`TrainingEngine.load_checkpoint` (same world size and parallel layout)."""
        from megatron.core import tensor_parallel

        self._require_params("load_checkpoint")
        resolved = ckpt.resolve_checkpoint(os.path.abspath(path))
        engine_state = ckpt.load_checkpoint_file(resolved, "engine_state.pt", "the engine state")
        if engine_state.get("format") != _STATE_FORMAT:
            raise ValueError(f"{resolved!r} is not a Megatron engine checkpoint")
        here = config_to_dict(self.engine_config.parallelism)
        if (
            engine_state["world_size"] != dist.get_world_size()
            or engine_state["parallelism"] != here
        ):
            raise ValueError(
                f"{resolved!r} was saved with world size {engine_state['world_size']} and "
                f"{engine_state['parallelism']}; this engine runs {dist.get_world_size()} ranks "
                f"with {here} (resharding is not supported yet)"
            )
        state = ckpt.load_checkpoint_file(
            resolved, f"rank_{self.global_rank:05d}.pt", "this rank's shards"
        )
        with torch.no_grad():
            for name, param in self._params.items():
                param.copy_(state["model"][name])
        if state["optimizer"] is not None and self.checkpoint_config.load_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        assert self._scheduler is not None
        self._scheduler.load_state_dict(engine_state["scheduler"])
        apply_configured_schedule(self._scheduler, self.optimizer_config)
        set_rng_state(state["rng"], self._device)
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tp_rng"])
        self._optimizer_steps = int(engine_state["optimizer_steps"])
        self._barrier()
        return {
            "step": int(engine_state["step"]),
            "extra_state": engine_state["extra_state"],
            "path": resolved,
        }

    # ------------------------------------------------------------------------------ offload
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """See :meth:`TrainingEngine.offload` (a no-op move on CPU; gradients are dropped)."""
        self._require_init()
        on_device = self._device.type != "cpu"
        if params and not self._params_offloaded:
            self.zero_grad()
            if on_device:
                self.model.to("cpu")
            self._params_offloaded = True
        if optimizer and not self._optim_offloaded:
            if on_device:
                self._move_optimizer("cpu")
            self._optim_offloaded = True
        if on_device:
            torch.cuda.empty_cache()

    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """See :meth:`TrainingEngine.reload`."""
        self._require_init()
        on_device = self._device.type != "cpu"
        if params and self._params_offloaded:
            if on_device:
                self.model.to(self._device)
            self._params_offloaded = False
        if optimizer and self._optim_offloaded:
            if on_device:
                self._move_optimizer(self._device)
            self._optim_offloaded = False

    def _move_optimizer(self, device: torch.device | str) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    state[key] = value.to(device)
