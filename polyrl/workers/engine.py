"""Controller workers that host a model engine: the actor, critic, reference and PRM roles.

An :class:`EngineWorker` is a :class:`~polyrl.controller.Worker` holding one
:class:`~polyrl.model_engine.engine.TrainingEngine`.  A :class:`~polyrl.controller.WorkerGroup`
drives it from the driver; the engine joins the ``torch.distributed`` group the controller
already initialised (gloo on CPU, NCCL on GPUs), so every engine collective spans the group's
ranks::

    from polyrl.controller import ResourcePool, WorkerGroup, WorkerSpec
    from polyrl.workers.engine import EngineWorker

    spec = WorkerSpec(EngineWorker, kwargs={"role": "actor", "model": model_dir,
                                            "optimizer": {"lr": 1e-5}})
    actor = WorkerGroup(spec, pool=ResourcePool("actor", 2))
    actor.init_model()
    batch = batch.union(actor.compute_log_prob(batch))        # adds "old_log_probs"
    metrics = actor.update_actor(batch, "sft")                 # loss by registry name

Colocated roles share one process per rank, so their models share the device and the driver
calls role-prefixed methods::

    group = WorkerGroup({"actor": actor_spec, "ref": ref_spec}, pool=pool)
    group.actor_init_model(); group.ref_init_model()
    ref = group.ref_compute_ref_log_prob(batch)                # adds "ref_log_probs"

Loss functions travel by name (plus keyword arguments), never as closures: a name registered
with :func:`~polyrl.workers.losses.register_loss` in the worker process (``"sft"`` and the RL
losses are built in) or an import path ``"package.module:function"`` that the worker imports.
See :mod:`polyrl.workers.losses`.

Data-parallel calls (``compute_*``, ``update_*``, ``evaluate_loss``) split a Batch into one
contiguous shard per rank.  When its length does not divide the number of ranks the dispatcher
pads it with copies of the first rows, and an update would weigh those copies like real rows:
pad with :func:`pad_batch_for_dp` first (it adds rows with an all-zero loss mask) or pass a
batch whose length divides the world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from polyrl.controller import Dispatch, Worker, register
from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ENTROPY,
    LOSS_MASK,
    OLD_LOG_PROBS,
    PRM_LOG_PROBS,
    REF_LOG_PROBS,
    VALUES,
)
from polyrl.core.dtypes import resolve_dtype
from polyrl.model_engine.config import CheckpointConfig, EngineConfig, ModelSpec, OptimizerConfig
from polyrl.model_engine.engine import (
    TrainingEngine,
    build_engine,
    compute_log_probs,
    compute_log_probs_and_entropy,
    compute_values,
)
from polyrl.workers.losses import LOSSES, available_losses, register_loss, resolve_loss
from polyrl.workers.store import StoreClient, StoredRows
from polyrl.workers.weight_sync import WeightSync

__all__ = [
    "ENGINE_MESH",
    "ENTROPY_KEY",
    "LOSSES",
    "LOG_PROBS_KEY",
    "PRM_LOG_PROBS_KEY",
    "REF_LOG_PROBS_KEY",
    "ROLES",
    "VALUES_KEY",
    "EngineWorker",
    "available_losses",
    "pad_batch_for_dp",
    "register_loss",
    "resolve_loss",
]

#: Name of the worker mesh (``dp x sp x tp``) the data-parallel methods dispatch over.
ENGINE_MESH = "engine"

# The columns each inference method adds; the names live in :mod:`polyrl.core.columns`.
#: Column added by :meth:`EngineWorker.compute_log_prob` (the behaviour policy's log-probs).
LOG_PROBS_KEY = OLD_LOG_PROBS
#: Column added by :meth:`EngineWorker.compute_log_prob` with ``with_entropy=True``.
ENTROPY_KEY = ENTROPY
#: Column added by :meth:`EngineWorker.compute_ref_log_prob`.
REF_LOG_PROBS_KEY = REF_LOG_PROBS
#: Column added by :meth:`EngineWorker.compute_values`.
VALUES_KEY = VALUES
#: Column added by :meth:`EngineWorker.compute_prm_log_prob`.
PRM_LOG_PROBS_KEY = PRM_LOG_PROBS

#: Engine roles: what the hosted model is and which methods it serves. ``prm`` is PRIME's
#: implicit process reward model: a causal LM trained on outcome labels.
ROLES: tuple[str, ...] = ("actor", "critic", "reference", "prm")
_ROLE_ALIASES = {"ref": "reference"}
_MODEL_KIND = {
    "actor": "causal_lm",
    "reference": "causal_lm",
    "critic": "value",
    "prm": "causal_lm",
}
#: Where each trained role's update metrics go (``actor/pg_loss``, ``prime/prm_loss``, ...).
_METRIC_PREFIX = {"actor": "actor/", "critic": "critic/", "prm": "prime/prm_"}


# ------------------------------------------------------------------------------ helpers
def pad_batch_for_dp(
    batch: Batch, dp_size: int, zero_keys: Sequence[str] = (LOSS_MASK,)
) -> tuple[Batch, int]:
    """Pad ``batch`` to a multiple of ``dp_size`` with rows that carry no loss.

    The added rows copy the first rows with the ``zero_keys`` columns set to zero, so a
    token-weighted loss (and its token counts) ignores them.  Returns ``(padded, num_added)``;
    drop the last ``num_added`` rows of any per-row result.
    """
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if len(batch) == 0:
        raise ValueError("cannot pad an empty Batch for data parallelism")
    missing = [k for k in zero_keys if k not in batch.tensor_keys]
    if missing:
        raise KeyError(f"pad_batch_for_dp: zero_keys {missing} are not tensor columns of the batch")
    pad = (-len(batch)) % dp_size
    if pad == 0:
        return batch, 0
    index = torch.arange(pad) % len(batch)
    extra = batch[index.tolist()].clone()
    for key in zero_keys:
        extra[key] = torch.zeros_like(extra[key])
    return Batch.concat([batch, extra]), pad


def _canonical_role(role: str) -> str:
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise ValueError(f"EngineWorker role must be one of {list(ROLES)} (or 'ref'), got {role!r}")
    return role


def _model_spec(model: ModelSpec | Mapping[str, Any] | str, role: str) -> ModelSpec:
    kind = _MODEL_KIND[role]
    if isinstance(model, str):
        return ModelSpec(path=model, kind=kind)
    if isinstance(model, Mapping):
        return ModelSpec(**{"kind": kind, **dict(model)})
    if isinstance(model, ModelSpec):
        return model
    raise TypeError(
        f"model must be a ModelSpec, a dict of its fields or a model directory, got "
        f"{type(model).__name__}"
    )


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return None


# ------------------------------------------------------------------------------ the worker
class EngineWorker(Worker):
    """Hosts one training engine for the ``actor``, ``critic``, ``reference`` or ``prm`` role.

    Args:
        role: ``"actor"`` (causal LM, trained), ``"critic"`` (value model, trained),
            ``"reference"`` / ``"ref"`` (causal LM, inference only) or ``"prm"`` (PRIME's
            implicit process reward model: a causal LM, trained).
        model: a :class:`~polyrl.model_engine.ModelSpec`, a dict of its fields or a model directory;
            the model kind defaults to the role's (a value model for the critic).
        engine: :class:`~polyrl.model_engine.EngineConfig` (or dict).  ``device="auto"`` follows the
            device the controller gave this worker.
        optimizer: :class:`~polyrl.model_engine.OptimizerConfig` (or dict); unused by the reference.
        checkpoint: :class:`~polyrl.model_engine.CheckpointConfig` (or dict).

    Construction is cheap; :meth:`init_model` builds the engine (all ranks, collectively).
    """

    def __init__(
        self,
        role: str = "actor",
        model: ModelSpec | Mapping[str, Any] | str = "",
        engine: EngineConfig | Mapping[str, Any] | None = None,
        optimizer: OptimizerConfig | Mapping[str, Any] | None = None,
        checkpoint: CheckpointConfig | Mapping[str, Any] | None = None,
    ) -> None:
        self._engine_role = _canonical_role(role)
        spec = _model_spec(model, self._engine_role)
        expected = _MODEL_KIND[self._engine_role]
        if spec.kind != expected:
            raise ValueError(
                f"the {self._engine_role} role needs a {expected!r} model, got ModelSpec.kind="
                f"{spec.kind!r}"
            )
        self._model_spec = spec
        eng = engine if isinstance(engine, EngineConfig) else EngineConfig(**dict(engine or {}))
        if eng.device == "auto":
            # The controller decided whether this rank owns a GPU; the process group matches it.
            eng = dataclasses.replace(eng, device=self.device.type)
        self._engine_config = eng
        # Peers of one sequence/tensor-parallel group must get the same rows: the engine's mesh
        # is (dp_shard, sp, tp) row-major, as the controller lays ranks out.
        par = eng.parallelism
        model_parallel = par.tensor_parallel_size * par.ulysses_sequence_parallel_size
        if self.world_size % model_parallel == 0:  # else init_model names the keys
            shape = {
                "dp": self.world_size // model_parallel,
                "sp": par.ulysses_sequence_parallel_size,
                "tp": par.tensor_parallel_size,
            }
            self.register_mesh(ENGINE_MESH, shape)
        self._optimizer_config = optimizer
        self._checkpoint_config = checkpoint
        self._engine: TrainingEngine | None = None
        self._store: StoreClient | None = None
        # One sender for the run: its transport (buffers, a dist group) outlives each sync.
        self._weight_sync = WeightSync()

    # ------------------------------------------------------------------ plain (in-process) API
    @property
    def engine_role(self) -> str:
        """``"actor"``, ``"critic"``, ``"reference"`` or ``"prm"``."""
        return self._engine_role

    @property
    def engine(self) -> TrainingEngine:
        """The hosted engine (for colocated roles and the weight transfer engine)."""
        if self._engine is None:
            raise RuntimeError(
                f"{self._engine_role} worker (rank {self.rank}): the model is not built; call "
                "init_model() first"
            )
        return self._engine

    def named_tensors(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        merge_adapter: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` one at a time (collective over the group's ranks).

        For in-process consumers such as a colocated rollout's weight transfer engine; see
        :meth:`polyrl.model_engine.engine.TrainingEngine.named_tensors` (``merge_adapter``:
        LoRA weights merged, or the frozen base).
        """
        return self.engine.named_tensors(dtype=dtype, device=device, merge_adapter=merge_adapter)

    def _require_role(self, method: str, *roles: str) -> None:
        if self._engine_role not in roles:
            raise RuntimeError(
                f"{method} is not available on a {self._engine_role} worker; it needs the "
                f"{' or '.join(roles)} role"
            )

    # ------------------------------------------------------------------ lifecycle
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Build and shard the model (and optimizer) on every rank; returns where it lives."""
        if self._engine is None:
            self._engine = build_engine(
                self._model_spec,
                self._engine_config,
                self._optimizer_config,
                self._checkpoint_config,
            )
        engine = self._engine
        # The dispatcher hands rows out by the mesh registered in __init__; the engine sums
        # gradients and counts tokens over its own data-parallel group. A backend whose ranks
        # are laid out otherwise would train on wrong rows silently, so the two must agree.
        dp_rank, dp_size, _ = self.dispatch_info(ENGINE_MESH)
        if (engine.rank, engine.world_size) != (dp_rank, dp_size):
            raise RuntimeError(
                f"{self._engine_role} worker (rank {self.rank}): the engine's data-parallel rank/"
                f"size ({engine.rank}, {engine.world_size}) differ from the dispatch mesh's "
                f"({dp_rank}, {dp_size}); the engine must lay ranks out (dp, sp, tp), tp fastest"
            )
        return {
            "role": self._engine_role,
            "rank": engine.rank,
            "world_size": engine.world_size,
            "device": str(engine.device),
        }

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def close_model(self) -> None:
        """Release the engine and its weight sender (the controller's process group stays up)."""
        self._weight_sync.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ------------------------------------------------------------------ rows by reference
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def attach_transfer_queue(self, queue: Any) -> None:
        """Give this worker a transfer-queue client, so it accepts :class:`StoredRows`.

        After this, every ``compute_*`` and ``update_*`` method also takes a reference to rows
        in the queue where it takes a ``Batch``: it fetches its shard, computes, and (for the
        inference methods) puts the outputs back instead of returning them.
        """
        self._store = StoreClient(queue)

    def _rows(self, data: Batch | StoredRows) -> Batch:
        if not isinstance(data, StoredRows):
            return data
        if self._store is None:
            raise RuntimeError(
                f"{self._engine_role} worker (rank {self.rank}): given rows by reference but no "
                "transfer queue is attached; call attach_transfer_queue first"
            )
        return self._store.load(data)

    def _infer(self, data: Batch | StoredRows, compute: Callable[[Batch], Batch]) -> Batch | None:
        """Run ``compute`` on ``data``'s rows; outputs of referenced rows go back to the queue.

        Only the collect rank of each data-parallel group puts them: its tensor/sequence-
        parallel peers computed the same rows (the dispatch drops their results likewise).
        """
        out = compute(self._rows(data))
        if isinstance(data, StoredRows):
            assert self._store is not None
            if self.dispatch_info(ENGINE_MESH)[2]:
                self._store.put(data, out)
            return None
        return out

    # ------------------------------------------------------------------ inference
    @register(dispatch=Dispatch.DP_COMPUTE, mesh=ENGINE_MESH)
    def compute_log_prob(
        self, batch: Batch | StoredRows, with_entropy: bool = False, share_prefix: bool = False
    ) -> Batch | None:
        """Token log-probs of ``input_ids`` (``old_log_probs``; ``entropy`` on request).

        Honours ``batch.meta["temperature"]``.  Actor or reference role.  ``share_prefix``: the
        caller reads only positions where ``loss_mask`` is nonzero (see
        :meth:`~polyrl.model_engine.engine.TrainingEngine.infer_batch`).
        """
        self._require_role("compute_log_prob", "actor", "reference")
        fn = compute_log_probs_and_entropy if with_entropy else compute_log_probs

        def compute(rows: Batch) -> Batch:
            out = self.engine.infer_batch(rows, fn, share_prefix)
            tensors = {LOG_PROBS_KEY: out["log_probs"]}
            if with_entropy:
                tensors[ENTROPY_KEY] = out["entropy"]
            return Batch(tensors=tensors)

        return self._infer(batch, compute)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh=ENGINE_MESH)
    def compute_ref_log_prob(
        self, batch: Batch | StoredRows, share_prefix: bool = False
    ) -> Batch | None:
        """Token log-probs under the reference model (``ref_log_probs``).

        ``share_prefix`` as in :meth:`compute_log_prob`.  On an actor that trains a LoRA adapter
        the reference is the actor's own frozen base model (adapter disabled), so a LoRA run
        needs no reference engine.
        """
        self._require_role("compute_ref_log_prob", "reference", "actor")

        def compute(rows: Batch) -> Batch:
            engine = self.engine
            base = engine.adapter_disabled() if engine.has_adapter else contextlib.nullcontext()
            with base:
                out = engine.infer_batch(rows, compute_log_probs, share_prefix)
            return Batch(tensors={REF_LOG_PROBS_KEY: out["log_probs"]})

        return self._infer(batch, compute)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh=ENGINE_MESH)
    def compute_prm_log_prob(
        self, batch: Batch | StoredRows, share_prefix: bool = False
    ) -> Batch | None:
        """Token log-probs under the PRM (``prm_log_probs``); ``share_prefix`` as above."""
        self._require_role("compute_prm_log_prob", "prm")

        def compute(rows: Batch) -> Batch:
            out = self.engine.infer_batch(rows, compute_log_probs, share_prefix)
            return Batch(tensors={PRM_LOG_PROBS_KEY: out["log_probs"]})

        return self._infer(batch, compute)

    @register(dispatch=Dispatch.DP_COMPUTE, mesh=ENGINE_MESH)
    def compute_values(self, batch: Batch | StoredRows) -> Batch | None:
        """Per-token values of the critic (``values``)."""
        self._require_role("compute_values", "critic")

        def compute(rows: Batch) -> Batch:
            out = self.engine.infer_batch(rows, compute_values)
            return Batch(tensors={VALUES_KEY: out["values"]})

        return self._infer(batch, compute)

    # ------------------------------------------------------------------ training
    def _update(
        self,
        batch: Batch | StoredRows,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None,
        num_mini_batches: int,
        epochs: int,
        step_scheduler: bool,
    ) -> dict[str, Any]:
        batch = self._rows(batch)
        loss_fn = resolve_loss(loss, loss_kwargs)
        for name, value in (("num_mini_batches", num_mini_batches), ("epochs", epochs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if len(batch) < num_mini_batches:
            raise ValueError(
                f"this rank's shard has {len(batch)} rows, fewer than num_mini_batches="
                f"{num_mini_batches}"
            )
        engine = self.engine
        minis = batch.chunk(num_mini_batches) if num_mini_batches > 1 else [batch]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _ in range(epochs):
            for mini in minis:
                metrics = engine.train_batch(mini, loss_fn)
                for key, value in metrics.items():
                    number = _to_float(value)
                    # A skipped update reports a non-finite grad_norm; keep that visible, but
                    # never let it poison the other averages.
                    if number is None or (not math.isfinite(number) and key != "grad_norm"):
                        continue
                    sums[key] = sums.get(key, 0.0) + number
                    counts[key] = counts.get(key, 0) + 1
        prefix = _METRIC_PREFIX[self._engine_role]
        out: dict[str, Any] = {f"{prefix}{k}": sums[k] / counts[k] for k in sums}
        out[f"{prefix}num_updates"] = float(epochs * len(minis))
        if step_scheduler:
            out[f"{prefix}lr_next"] = engine.lr_scheduler_step()
        return out

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, mesh=ENGINE_MESH)
    def update_actor(
        self,
        batch: Batch | StoredRows,
        loss: str = "sft",
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train the actor on this rank's shard: ``epochs`` passes over ``num_mini_batches``.

        Each mini-batch is one optimizer step (:meth:`TrainingEngine.train_batch`); the LR
        schedule advances once per call when ``step_scheduler``.  ``loss`` is a registered name
        or ``"module:function"`` and ``loss_kwargs`` its keyword arguments.  Returns the step
        metrics averaged over the optimizer steps, prefixed ``actor/``.
        """
        self._require_role("update_actor", "actor")
        return self._update(batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, mesh=ENGINE_MESH)
    def update_critic(
        self,
        batch: Batch | StoredRows,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train the critic like :meth:`update_actor`; metrics are prefixed ``critic/``."""
        self._require_role("update_critic", "critic")
        return self._update(batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, mesh=ENGINE_MESH)
    def update_prm(
        self,
        batch: Batch | StoredRows,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train the PRM like :meth:`update_actor`; metrics are prefixed ``prime/prm_``."""
        self._require_role("update_prm", "prm")
        return self._update(batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler)

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC, mesh=ENGINE_MESH)
    def evaluate_loss(
        self, batch: Batch, loss: str = "sft", loss_kwargs: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Forward-only loss over this rank's shard (eval mode, no gradients, no update).

        Returns the engine's globally reduced metrics: ``loss`` (mean over the whole batch's
        loss tokens for token-mean losses) and ``num_tokens`` among them.
        """
        engine = self.engine
        with engine.eval_mode():
            metrics = engine.forward_backward(batch, resolve_loss(loss, loss_kwargs), True)
        return {k: v for k, v in metrics.items() if _to_float(v) is not None}

    # ------------------------------------------------------------------ weights to rollout
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sync_weights(
        self,
        transport: str,
        urls: Sequence[str],
        bucket_mb: float = 64.0,
        checksum: bool = False,
        version: int | None = None,
        mode: str = "staged",
        inflight: str = "keep",
        transport_options: dict[str, Any] | None = None,
        dtype: str | None = None,
        senders: Sequence[int] | None = None,
    ) -> dict[str, Any] | None:
        """Send this group's weights to the rollout replicas ``urls`` over ``transport``.

        Collective: every rank walks the weights; rank ``senders[i]`` sends to ``urls[i]``
        (default: rank 0 to all), casting to ``dtype`` (the replicas' dtype; ``None``: the
        engine's). The transport is kept for the next sync to the same replicas (see
        :class:`~polyrl.workers.weight_sync.WeightSync`). Returns each rank's statistics
        (``None`` on a rank that sent to no replica).
        """
        engine = self.engine
        return self._weight_sync.send(
            engine.named_tensors(),
            self.rank,
            transport,
            urls,
            senders=senders,
            device=engine.device,
            bucket_mb=bucket_mb,
            dtype=None if dtype is None else resolve_dtype(dtype, "sync_weights dtype"),
            checksum=checksum,
            version=version,
            transport_options=transport_options,
            mode=mode,
            inflight=inflight,
        )

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def empty_cache(self) -> None:
        """Give the CUDA allocator's cached blocks back, for replicas waking on this GPU."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ checkpoints and weights
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> str:
        """Atomically write ``<directory>/global_step_<step>``; returns its path."""
        return self.engine.save_checkpoint(directory, step, extra_state)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore a step directory (or the newest under a root); returns step + extra_state."""
        return self.engine.load_checkpoint(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, directory: str, tokenizer: Any = None) -> str:
        """Write a Hugging Face model directory (rank 0 writes; every rank gathers)."""
        return self.engine.export_hf(directory, tokenizer=tokenizer)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimizer state to CPU memory."""
        self.engine.offload(params=params, optimizer=optimizer)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded parameters and/or optimizer state back to the device."""
        self.engine.reload(params=params, optimizer=optimizer)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def weight_digest(self, merge_adapter: bool = True) -> str:
        """SHA-256 over every (name, full tensor) as this rank sees it; collective.

        Equal digests on all ranks show the replicas agree; comparing with another engine's
        digest checks two models hold the same weights bit for bit.  With a LoRA adapter the
        digest covers the merged weights, or with ``merge_adapter=False`` the frozen base.
        """
        digest = hashlib.sha256()
        for name, tensor in self.engine.named_tensors(device="cpu", merge_adapter=merge_adapter):
            digest.update(name.encode())
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def gather_weights(
        self,
        names: Sequence[str] | None = None,
        dtype: torch.dtype | None = None,
        merge_adapter: bool = True,
    ) -> dict[str, torch.Tensor] | None:
        """Full tensors (by Hugging Face name) on rank 0, ``None`` on the other ranks.

        Collective.  Meant for small models and tests; large models should stream
        :meth:`named_tensors` in-process instead.  ``merge_adapter`` as in :meth:`named_tensors`.
        """
        wanted = None if names is None else set(names)
        found: dict[str, torch.Tensor] = {}
        tensors = self.engine.named_tensors(dtype=dtype, device="cpu", merge_adapter=merge_adapter)
        for name, tensor in tensors:
            if wanted is None or name in wanted:
                found[name] = tensor.clone() if self.rank == 0 else tensor
        if wanted is not None and wanted - set(found):
            raise KeyError(f"gather_weights: unknown tensor names {sorted(wanted - set(found))}")
        return found if self.rank == 0 else None
