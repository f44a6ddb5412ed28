"""The backend-agnostic model-engine interface, its registry, outputs and loss plug-ins.

An engine owns one model (a causal LM or a value model), its optimizer and LR schedule, sharded
over the data-parallel ranks of ``torch.distributed``.  Trainers differ only in the data and the
loss function they hand to :meth:`TrainingEngine.train_batch`.  A backend (FSDP2, Megatron-Core)
implements the :class:`TrainingEngine` Protocol, registers with ``@register_engine(name)`` and is
built with :func:`build_engine`; the logic every backend shares (the batch contract, loss
normalisation counts, the loss and infer-function contracts, ``train_batch`` itself) is in free
functions here.

Batch column contract
---------------------
Engine inputs are :class:`polyrl.core.batch.Batch` objects with these tensor columns, all
``(B, T)``:

* ``input_ids`` (int): token ids; padding positions must still hold a valid id (e.g. pad id);
* ``attention_mask`` (0/1): 1 on real tokens.  Each row's ones must be one contiguous run
  (left, right or both-sided padding are fine) and every row needs at least one real token;
* ``position_ids`` (int, optional): positions of the tokens; derived from ``attention_mask``
  (0, 1, 2, ... over the real tokens) when absent;
* ``loss_mask`` (0/1 or float weights; needed by :meth:`~TrainingEngine.forward_backward` and
  :meth:`~TrainingEngine.train_batch`): tokens the loss covers.  Only tokens that have a causal
  prediction can be learned, so the engine zeroes it on padding and on each row's first real
  token before counting; loss functions see that cleaned mask.

A vision-language model (a Hugging Face image-text-to-text model such as Qwen2-VL) also reads the
object column ``multi_modal`` (:data:`polyrl.core.columns.MULTI_MODAL`): each row's
:class:`~polyrl.core.multimodal.MultiModalInputs`, or ``None`` for a text row; rows without the
column are text rows.  ``input_ids`` must hold each item's *expanded* placeholder run
(:func:`~polyrl.core.multimodal.expand_placeholders`) inside the row's real tokens, and
``position_ids`` stay the ordinary text positions: the engine computes the M-RoPE positions
itself (:mod:`polyrl.model_engine.vision`).  Rows holding the same inputs object (the samples of
a prompt) have its images encoded once per micro-batch.

Any other tensor / non-tensor columns (advantages, old log-probs, rewards, ...) travel with their
rows into the micro-batches.  ``batch.meta[ROW_GROUP_KEY]`` (default 1) keeps each run of that many
consecutive rows together, in order, in one micro-batch: a loss that reads several rows at once (a
DPO or reward-model pair: chosen row, then rejected row) sees all of them (each rank's share must
hold whole groups).  ``batch.meta[TEMPERATURE_KEY]`` (default 1) is the sampling
temperature applied to log-probs and entropies.

Each rank passes **its own share** of the mini-batch (the controller dispatches shares; a
standalone script can use :meth:`TrainingEngine.shard_batch`).  Loss normalisation counts are
summed over all ranks before the micro-batch loop, so results do not depend on the split.

Loss functions
--------------
A loss function (:data:`LossFn`) has the signature ``loss_fn(model_output, batch) -> (loss,
metrics)``; :func:`sft_loss` is the one defined here, the RL ones are in
:mod:`polyrl.workers.rl_losses`:

* ``model_output`` is a :class:`ModelOutput` for one micro-batch; its per-token tensors
  (``log_probs``, ``entropy``, ``values``) are ``(b, T)`` and aligned with the micro-batch's
  columns;
* ``batch`` is that micro-batch (a :class:`polyrl.core.batch.Batch` with the caller's columns,
  only the rows of this micro-batch, and ``loss_mask`` already restricted to tokens that have a
  prediction);
* ``loss`` is a scalar tensor: **this micro-batch's contribution** to the mini-batch loss.  The
  engine back-propagates each contribution and reports their sum over micro-batches and ranks as
  ``loss``.  To make that sum independent of how rows were split into micro-batches and ranks,
  normalise by the mini-batch-wide counts the engine puts in ``batch.meta``
  (:data:`GLOBAL_TOKENS_KEY`, :data:`GLOBAL_SEQS_KEY`): pass :func:`global_counts` to
  :func:`polyrl.core.numerics.agg_loss`;
* ``metrics`` maps names to floats / 0-d tensors describing this micro-batch; the engine
  averages each over micro-batches and ranks, weighted by the micro-batch's loss-token count.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from polyrl.core.batch import Batch
from polyrl.core.numerics import agg_loss, shifted_token_log_probs
from polyrl.core.registry import Registry
from polyrl.model_engine.batching import MicroBatchLayout, balance_batch_for_dp, row_spans
from polyrl.model_engine.config import CheckpointConfig, EngineConfig, ModelSpec, OptimizerConfig

__all__ = [
    "ENGINES",
    "GLOBAL_SEQS_KEY",
    "GLOBAL_TOKENS_KEY",
    "ROW_GROUP_KEY",
    "TEMPERATURE_KEY",
    "InferFn",
    "LossFn",
    "ModelOutput",
    "TrainingEngine",
    "as_config",
    "available_engines",
    "build_engine",
    "check_infer_result",
    "check_loss_result",
    "compute_entropy",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "compute_values",
    "global_counts",
    "gather_rows",
    "global_loss_counts",
    "module_mode",
    "no_adapter_error",
    "prepare_batch",
    "register_engine",
    "row_group_size",
    "sft_loss",
    "shard_for_rank",
    "train_on_batch",
]

InferFn = Callable[["ModelOutput", Batch], Mapping[str, torch.Tensor]]
LossFn = Callable[["ModelOutput", Batch], tuple[torch.Tensor, Mapping[str, Any]]]

#: ``batch.meta`` key: loss tokens (non-zero ``loss_mask``) in the whole mini-batch, all ranks.
GLOBAL_TOKENS_KEY = "global_token_count"
#: ``batch.meta`` key: rows with at least one loss token in the whole mini-batch, all ranks.
GLOBAL_SEQS_KEY = "global_seq_count"
#: ``batch.meta`` key set by the caller: runs of this many consecutive rows share a micro-batch.
ROW_GROUP_KEY = "row_group_size"
#: ``batch.meta`` key set by the caller: log-probs and entropies are of ``softmax(logits / it)``
#: (default 1), the distribution the rollout sampled from at that temperature.
TEMPERATURE_KEY = "temperature"


class ModelOutput:
    """What the model produced for one micro-batch, aligned with the micro-batch's columns.

    Per-token tensors are ``(b, T)`` fp32 with zeros on padding, and are computed lazily on first
    access (entropy costs an extra pass over the vocabulary, so it is only computed when read):

    * :attr:`log_probs` -- ``log p(input_ids[t] | tokens before t)`` at the sampling temperature;
      0 on each row's first real token (nothing predicts it);
    * :attr:`entropy` -- entropy of the distribution that predicted token ``t`` (same alignment);
    * :attr:`values` -- value-model output at each real token.

    :attr:`logits` gives the raw ``(R, W, V)`` logits in the engine's compute layout (padding
    removed or packed; see :attr:`layout`), for losses that need more than these.
    """

    def __init__(
        self,
        *,
        kind: str,
        raw: torch.Tensor,
        layout: MicroBatchLayout,
        compute_input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        compute_tokens: int | None = None,
    ) -> None:
        self.kind = kind
        self.layout = layout
        #: Positions the model ran on for this micro-batch, padding included.
        self.compute_tokens = (
            layout.compute_shape[0] * layout.compute_shape[1]
            if compute_tokens is None
            else int(compute_tokens)
        )
        self.temperature = float(temperature)
        self._raw = raw
        self._ids = compute_input_ids
        self._chunk = chunk_size
        valid = attention_mask.bool()
        self._valid = valid
        self._predicted = valid & ~layout.first_token_mask()
        self._cache: dict[str, torch.Tensor] = {}
        #: MoE models under grad: the mean over layers of the routers' load-balancing loss
        #: (:mod:`polyrl.model_engine.moe`), for losses that add it; ``None`` otherwise.
        self.router_aux_loss: torch.Tensor | None = None

    def _need(self, kind: str, what: str) -> None:
        if self.kind != kind:
            raise AttributeError(
                f"{what} is only available for a {kind!r} model, not {self.kind!r}"
            )

    @property
    def logits(self) -> torch.Tensor:
        """Raw logits ``(R, W, V)`` in the compute layout (causal LM only)."""
        self._need("causal_lm", "logits")
        return self._raw

    def _token_stats(self, with_entropy: bool) -> None:
        self._need("causal_lm", "log_probs/entropy")
        logp, ent = shifted_token_log_probs(
            self._raw, self._ids, self.temperature, self._chunk, with_entropy
        )
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        self._cache["log_probs"] = torch.where(self._predicted, self.layout.to_batch(logp), zero)
        if ent is not None:
            self._cache["entropy"] = torch.where(self._predicted, self.layout.to_batch(ent), zero)

    def log_probs_and_entropy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both, computed in one pass over the vocabulary."""
        if "entropy" not in self._cache:
            self._token_stats(with_entropy=True)
        return self._cache["log_probs"], self._cache["entropy"]

    @property
    def log_probs(self) -> torch.Tensor:
        """Token log-probs ``(b, T)``."""
        if "log_probs" not in self._cache:
            self._token_stats(with_entropy=False)
        return self._cache["log_probs"]

    @property
    def entropy(self) -> torch.Tensor:
        """Per-token entropy ``(b, T)``."""
        return self.log_probs_and_entropy()[1]

    def log_probs_of(self, candidates: torch.Tensor) -> torch.Tensor:
        """Log-probs ``(b, T, k)`` of ``k`` candidate tokens at each position (differentiable).

        ``out[:, t, j] = log p(candidates[:, t, j] | tokens before t)`` at the sampling
        temperature: the distribution :attr:`log_probs` reads token ``t`` from, at other tokens
        (e.g. a teacher's top-k there). 0 where nothing is predicted, as in :attr:`log_probs`.
        """
        self._need("causal_lm", "log_probs_of")
        b, t = self.layout.batch_shape
        if candidates.dim() != 3 or tuple(candidates.shape[:2]) != (b, t):
            raise ValueError(
                f"candidates must be (b, T, k) = ({b}, {t}, k), got {tuple(candidates.shape)}"
            )
        # Row positions are contiguous in the (b, T) layout: the logits at t - 1 predict t.
        prev = torch.zeros_like(candidates)
        prev[:, :-1] = candidates[:, 1:]
        ids = self.layout.to_compute(prev.to(self._raw.device))
        z = self._raw.float()
        if self.temperature != 1.0:
            z = z / self.temperature
        logp = z.gather(-1, ids) - torch.logsumexp(z, dim=-1, keepdim=True)
        out = torch.zeros_like(self.layout.to_batch(logp))
        out[:, 1:] = self.layout.to_batch(logp)[:, :-1]
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        return torch.where(self._predicted[..., None], out, zero)

    @property
    def values(self) -> torch.Tensor:
        """Per-token values ``(b, T)`` (value model only)."""
        self._need("value", "values")
        if "values" not in self._cache:
            zero = torch.zeros((), dtype=self._raw.dtype, device=self._raw.device)
            self._cache["values"] = torch.where(self._valid, self.layout.to_batch(self._raw), zero)
        return self._cache["values"]


def compute_log_probs(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function: ``{"log_probs": (b, T)}``."""
    return {"log_probs": output.log_probs}


def compute_entropy(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function: ``{"entropy": (b, T)}``."""
    return {"entropy": output.entropy}


def compute_log_probs_and_entropy(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function: ``{"log_probs", "entropy"}`` from one pass."""
    logp, ent = output.log_probs_and_entropy()
    return {"log_probs": logp, "entropy": ent}


def compute_values(output: ModelOutput, batch: Batch) -> dict[str, torch.Tensor]:
    """``infer_batch`` function: ``{"values": (b, T)}``."""
    return {"values": output.values}


def global_counts(batch: Batch) -> dict[str, Any]:
    """``num_tokens`` / ``num_seqs`` of the whole mini-batch, for :func:`agg_loss`'s keywords.

    They come from ``batch.meta`` (set by the engine); without them (``None``) the micro-batch
    is taken to be the whole mini-batch.
    """
    return {
        "num_tokens": batch.meta.get(GLOBAL_TOKENS_KEY),
        "num_seqs": batch.meta.get(GLOBAL_SEQS_KEY),
    }


def sft_loss(output: ModelOutput, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the ``loss_mask`` tokens, averaged over all mini-batch tokens.

    ``loss_mask`` may hold 0/1 or per-token weights.  Metric ``sft/nll``: this micro-batch's mean
    NLL per loss token (the engine's ``loss`` is the exact mini-batch mean).
    """
    if "loss_mask" not in batch:
        raise KeyError("sft_loss needs a 'loss_mask' column marking the tokens to learn")
    mask = batch["loss_mask"]
    nll = -output.log_probs
    loss = agg_loss(nll, mask, "token-mean", **global_counts(batch))
    local = agg_loss(nll.detach(), mask, "token-mean")
    return loss, {"sft/nll": float(local)}


class TrainingEngine(Protocol):
    """The engine interface: one model + optimizer, sharded over the data-parallel ranks.

    A backend implements these members; it need not inherit anything (declaring the Protocol as
    a base only has the type checker and ``abc`` check that every member is there).  The logic
    backends share lives in free functions of this module (:func:`prepare_batch`,
    :func:`check_loss_result`, :func:`train_on_batch`, :func:`module_mode`,
    :func:`shard_for_rank`, ...) and :class:`~polyrl.model_engine.metrics.MetricsAccumulator`.

    :func:`build_engine` constructs a backend as ``cls(model, engine, optimizer, checkpoint)``
    (the four configs, see :func:`as_config`), which only stores them; :meth:`initialize` joins
    (or creates) the ``torch.distributed`` process group, loads and shards the model and builds
    the optimizer, so a controller worker can construct the engine first and initialise it once
    its process group is up.  Every method that touches the model is collective: all ranks must
    call it, in the same order, each with its own share of the data.
    """

    #: The name the backend is registered under (set by :func:`register_engine`).
    backend_name: str
    model_spec: ModelSpec
    engine_config: EngineConfig
    optimizer_config: OptimizerConfig
    checkpoint_config: CheckpointConfig

    # ------------------------------------------------------------------------------ lifecycle
    @abc.abstractmethod
    def initialize(self) -> None:
        """Join/create the process group, load and shard the model, build optimizer + scheduler."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the model and, if the engine created it, the process group."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """Data-parallel rank of this process."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of data-parallel ranks."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device the model computes on."""

    # ------------------------------------------------------------------------------ training
    @abc.abstractmethod
    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, forward_only: bool = False
    ) -> dict[str, float]:
        """Run ``loss_fn`` over this rank's micro-batches and accumulate gradients.

        Gradients are added to any already present (call :meth:`zero_grad` first for a fresh
        step).  With ``forward_only`` nothing is back-propagated (e.g. validation loss).

        Returns metrics reduced over all ranks: ``loss`` (sum of the micro-batch contributions),
        the loss function's metrics (token-weighted means), ``num_tokens`` (global loss tokens),
        ``num_seqs`` and ``num_micro_batches``.
        """

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop accumulated gradients."""

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients (``EngineConfig.grad_clip``) and step the optimizer.

        Returns the global gradient norm before clipping.  A non-finite norm skips the update
        (gradients are dropped) so one bad batch cannot poison the weights.
        """

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule one step; returns the new learning rate."""

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """Current learning rate."""

    @abc.abstractmethod
    def train_batch(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this mini-batch: zero grad, forward/backward, clip, step.

        The LR schedule is not advanced (call :meth:`lr_scheduler_step` once per training step).
        Returns :meth:`forward_backward`'s metrics plus ``grad_norm``, ``lr`` and
        ``update_skipped`` (1.0 when a non-finite gradient norm skipped the step).
        :func:`train_on_batch` implements it from the other members.
        """

    @abc.abstractmethod
    def infer_batch(
        self, batch: Batch, fn: InferFn = compute_log_probs, share_prefix: bool = False
    ) -> Batch:
        """Forward without gradients (eval mode) and collect ``fn``'s per-row outputs.

        ``fn(model_output, micro_batch)`` returns a mapping of tensors with one leading entry per
        micro-batch row; the result Batch holds them for this rank's rows in input order, on the
        device of the input's ``input_ids``.  ``share_prefix``: the caller reads only positions
        where the batch's ``loss_mask`` is nonzero, so prompts shared by rows may run once
        (``EngineConfig.share_prefix``; earlier positions then read 0, see
        :mod:`polyrl.model_engine.prefix`).
        """

    # ------------------------------------------------------------------------------ modes
    @abc.abstractmethod
    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in training mode (dropout on); restores the old mode."""

    @abc.abstractmethod
    def eval_mode(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model is in eval mode; restores the old mode."""

    # ------------------------------------------------------------------------------ adapters
    @property
    @abc.abstractmethod
    def has_adapter(self) -> bool:
        """Whether the model trains a LoRA adapter on frozen base weights (``lora_rank > 0``)."""

    @abc.abstractmethod
    def adapter_disabled(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the model runs without its adapter: the frozen base model.

        The reference policy of a LoRA run is this (no second engine holds a copy).

        Raises:
            RuntimeError: the engine has no adapter (:func:`no_adapter_error`).
        """

    # ------------------------------------------------------------------------------ weights
    @abc.abstractmethod
    def named_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        merge_adapter: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one parameter/buffer at a time.

        Only one full tensor is gathered at a time, so the whole model is never materialised.
        Collective: every rank must exhaust the iterator.  Tied weights appear once (under the
        first name, as Hugging Face checkpoints store them).  Tensors may share memory with the
        live parameters; copy them if they must outlive the next optimizer step.

        With a LoRA adapter the names are still the base model's: an adapted layer's weight is
        ``W + scale * B @ A`` (the policy the engine trains; what rollout replicas and
        :meth:`export_hf` receive), or, with ``merge_adapter=False``, the frozen ``W``.  Adapter
        tensors themselves are not yielded.
        """

    @abc.abstractmethod
    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> str:
        """Atomically write ``<directory>/global_step_<step>``; returns its path.

        Holds the sharded model, optimizer (per :class:`CheckpointConfig`), LR scheduler, every
        rank's RNG states and the opaque ``extra_state`` (e.g. the data sampler).  With a LoRA
        adapter only the trainable (adapter) weights are saved: the base model is read from
        ``ModelSpec.path`` again on resume.
        """

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore from a step directory, or the newest complete one under a root directory.

        Returns ``{"step": int, "extra_state": dict, "path": str}``.
        """

    @abc.abstractmethod
    def export_hf(
        self, directory: str, tokenizer: Any = None, dtype: torch.dtype | None = None
    ) -> str:
        """Write a Hugging Face model directory (config, safetensors, tokenizer if any).

        With a LoRA adapter the weights are merged (:meth:`named_tensors`), so the directory is a
        plain model; ``ModelSpec.lora_export_adapter`` also writes the adapter alone (peft
        format) to its ``adapter`` folder.
        """

    @abc.abstractmethod
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimizer state to CPU memory (e.g. while rollout runs)."""

    @abc.abstractmethod
    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded parameters and/or optimizer state back to the compute device."""

    # ------------------------------------------------------------------------------ data
    @abc.abstractmethod
    def shard_batch(self, batch: Batch) -> Batch:
        """Return this rank's share of a full mini-batch, token counts balanced across ranks.

        For scripts where every rank holds the whole mini-batch; the number of rows must divide
        by :attr:`world_size` (:func:`shard_for_rank`).
        """


# ---------------------------------------------------------------------------------- shared logic
def check_infer_result(
    result: object, rows: int, first: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Check what an :data:`InferFn` returned for a micro-batch of ``rows`` rows; detach it.

    ``first``: the first micro-batch's checked result, whose keys every later one must have.

    Raises:
        TypeError: not a non-empty mapping.
        ValueError: a value that is not a tensor with ``rows`` rows, or keys unlike ``first``'s.
    """
    if not isinstance(result, Mapping) or not result:
        raise TypeError("infer fn must return a non-empty mapping of tensors")
    piece = {}
    for key, value in result.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != rows:
            raise ValueError(f"infer fn output {key!r} must be a tensor with {rows} rows")
        piece[key] = value.detach()
    if first is not None and set(piece) != set(first):
        raise ValueError("infer fn returned different keys for different micro-batches")
    return piece


def gather_rows(
    pieces: list[dict[str, torch.Tensor]],
    order: list[int],
    num_rows: int,
    compute_device: torch.device,
    device: torch.device | None,
) -> Batch:
    """Join per-micro-batch outputs (on ``compute_device``) into one Batch in input row order.

    ``order`` lists the input row of each output row, micro-batch after micro-batch; the result
    is moved to ``device`` unless it is None.  No pieces: an empty Batch of ``num_rows`` rows.
    """
    if not pieces:
        return Batch(batch_size=num_rows)
    index = torch.tensor(order, dtype=torch.long, device=compute_device)
    tensors = {}
    for key in pieces[0]:
        stacked = torch.cat([p[key] for p in pieces], dim=0)
        result = torch.empty_like(stacked)
        result[index] = stacked
        tensors[key] = result.to(device) if device is not None else result
    return Batch(tensors=tensors)


def train_on_batch(engine: TrainingEngine, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
    """:meth:`TrainingEngine.train_batch` from the engine's other members.

    In training mode: zero grad, forward/backward, read the LR, clip and step.
    """
    with engine.train_mode():
        engine.zero_grad()
        metrics = engine.forward_backward(batch, loss_fn)
        lr = engine.lr
        grad_norm = engine.optimizer_step()
    metrics["grad_norm"] = grad_norm
    metrics["lr"] = lr
    metrics["update_skipped"] = 0.0 if math.isfinite(grad_norm) else 1.0
    return metrics


@contextlib.contextmanager
def module_mode(module: torch.nn.Module, training: bool) -> Iterator[None]:
    """Context in which ``module`` is in training (or eval) mode; restores the old mode."""
    previous = module.training
    module.train(training)
    try:
        yield
    finally:
        module.train(previous)


def shard_for_rank(batch: Batch, rank: int, world_size: int) -> Batch:
    """Return ``rank``'s share of a full mini-batch, token counts balanced across ranks.

    The number of rows must divide by ``world_size``.
    """
    if world_size == 1:
        return batch
    balanced, _ = balance_batch_for_dp(batch, world_size)
    return balanced.chunk(world_size)[rank]


def no_adapter_error(engine: object) -> RuntimeError:
    """Return the error :meth:`TrainingEngine.adapter_disabled` raises without an adapter."""
    return RuntimeError(
        f"{type(engine).__name__} has no LoRA adapter to disable (ModelSpec.lora_rank is 0)"
    )


def row_group_size(batch: Batch) -> int:
    """``batch.meta[ROW_GROUP_KEY]`` (default 1), checked to be an int >= 1."""
    size = batch.meta.get(ROW_GROUP_KEY, 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"batch.meta[{ROW_GROUP_KEY!r}] must be an int >= 1, got {size!r}")
    return size


def prepare_batch(
    batch: Batch, device: torch.device, need_loss_mask: bool
) -> tuple[Batch, list[int]]:
    """Check ``batch`` against the column contract and copy it to ``device``.

    Adds ``position_ids`` when absent and zeroes ``loss_mask`` on padding and on each row's first
    real token (nothing predicts it).  Returns the prepared batch and each row's real-token count.
    """
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
    tensors = {k: v.to(device) for k, v in batch.tensors.items()}
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


def global_loss_counts(
    loss_mask: torch.Tensor, world_size: int, group: Any = None
) -> tuple[float, float]:
    """Loss tokens and rows with any, summed over all ranks (collective when ``world_size > 1``).

    What :data:`GLOBAL_TOKENS_KEY` / :data:`GLOBAL_SEQS_KEY` hold; ``loss_mask`` is this rank's
    cleaned mask (:func:`prepare_batch`).  ``group``: the data-parallel group of ``world_size``
    ranks (default: all ranks).
    """
    nonzero = loss_mask != 0
    counts = torch.tensor([int(nonzero.sum()), int(nonzero.any(dim=1).sum())], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(counts, group=group)
    tokens, seqs = (float(x) for x in counts.tolist())
    return tokens, seqs


def check_loss_result(result: object, forward_only: bool) -> tuple[torch.Tensor, Mapping[str, Any]]:
    """Check what a :data:`LossFn` returned against the loss contract; return ``(loss, metrics)``.

    Raises:
        TypeError: not a ``(loss, metrics)`` pair, a loss that is not a scalar tensor, or
            metrics that are not a mapping.
        ValueError: a loss to back-propagate (not ``forward_only``) that does not depend on the
            model output.
    """
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"loss_fn must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("loss_fn's loss must be a scalar tensor")
    if not forward_only and not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not depend on the model output "
            "(requires_grad is False)"
        )
    if not isinstance(metrics, Mapping):
        raise TypeError(f"loss_fn's metrics must be a mapping, got {type(metrics).__name__}")
    return loss, metrics


#: Training-engine backends by name; the built-in ones are imported on first use, so importing
#: the interface stays light.
ENGINES: Registry[type[TrainingEngine]] = Registry(
    "engine backend",
    lazy={"fsdp2": "polyrl.model_engine.fsdp2", "megatron": "polyrl.model_engine.megatron.engine"},
    base=TrainingEngine,
    name_attr="backend_name",
)
register_engine = ENGINES.register
available_engines = ENGINES.names


def as_config(value: Any, cls: type, what: str) -> Any:
    """Return ``value`` as a ``cls`` config: itself, ``cls(**value)`` or ``cls()`` for None."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    raise TypeError(f"{what} must be a {cls.__name__} or a dict, got {type(value).__name__}")


def build_engine(
    model: ModelSpec | Mapping[str, Any] | str,
    engine: EngineConfig | Mapping[str, Any] | None = None,
    optimizer: OptimizerConfig | Mapping[str, Any] | None = None,
    checkpoint: CheckpointConfig | Mapping[str, Any] | None = None,
    *,
    initialize: bool = True,
) -> TrainingEngine:
    """Construct the backend named by ``engine.backend`` (and initialise it by default).

    ``model`` may be a :class:`ModelSpec`, a dict of its fields, or just the model directory.
    """
    spec = ModelSpec(path=model) if isinstance(model, str) else as_config(model, ModelSpec, "model")
    eng_cfg = as_config(engine, EngineConfig, "engine")
    opt_cfg = as_config(optimizer, OptimizerConfig, "optimizer")
    ckpt_cfg = as_config(checkpoint, CheckpointConfig, "checkpoint")
    obj = ENGINES.get(eng_cfg.backend)(spec, eng_cfg, opt_cfg, ckpt_cfg)
    if initialize:
        obj.initialize()
    return obj
