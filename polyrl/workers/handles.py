"""Typed driver-side handles of the engine roles: the actor, reference, critic and PRM.

A :class:`~polyrl.controller.WorkerGroup` binds every registered method of its workers at run
time (:class:`~polyrl.controller.RoleView`), so an editor cannot follow a call such as
``actor.update_actor(...)`` to its code. These thin classes wrap one role's view with one
method per :class:`~polyrl.workers.engine.EngineWorker` method the trainer uses, with the
worker method's signature and the type the group's dispatch returns: a method dispatched
``DP_COMPUTE`` returns the ranks' outputs joined into one ``Batch`` (``None`` for rows given by
reference, whose outputs go back to the transfer queue), ``DP_COMPUTE_METRIC`` one metrics
dict, ``ONE_TO_ALL`` a list with one answer per rank. Each method's docstring names the worker
method it calls::

    group = WorkerGroup({"actor": actor_spec, "ref": ref_spec}, pool=pool)
    engines = EngineHandles.of({role: group.role(role) for role in group.roles})
    engines.actor.init_model()
    batch = batch.union(engines.actor.compute_log_prob(batch))
    metrics = engines.actor.update_actor(batch, ACTOR_LOSS, loss_kwargs)

Colocated roles (one process per rank) and separate groups look the same from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from polyrl.controller import RoleView
from polyrl.core.batch import Batch
from polyrl.workers.store import StoredRows

__all__ = [
    "ActorHandle",
    "CriticHandle",
    "EngineHandle",
    "EngineHandles",
    "PRMHandle",
    "ReferenceHandle",
]


class EngineHandle:
    """What every engine role serves: lifecycle, checkpoints, memory, weight digests.

    Args:
        view: the role's methods in its worker group (``group.role(name)``).
    """

    def __init__(self, view: RoleView) -> None:
        self.view = view

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.view.role!r} of {self.view.group.name!r})"

    @property
    def world_size(self) -> int:
        """Number of ranks of the role's group."""
        return self.view.world_size

    # ------------------------------------------------------------------ lifecycle
    def init_model(self) -> list[dict[str, Any]]:
        """Build the model on every rank: :meth:`EngineWorker.init_model` (one dict per rank)."""
        return self.view.init_model()

    def close_model(self) -> None:
        """Release the engine on every rank: :meth:`EngineWorker.close_model`."""
        self.view.close_model()

    def attach_transfer_queue(self, queue: Any) -> None:
        """Accept rows by reference: :meth:`EngineWorker.attach_transfer_queue`."""
        self.view.attach_transfer_queue(queue)

    # ------------------------------------------------------------------ checkpoints, weights
    def save_checkpoint(
        self, directory: str, step: int, extra_state: Mapping[str, Any] | None = None
    ) -> list[str]:
        """Write ``<directory>/global_step_<step>``: :meth:`EngineWorker.save_checkpoint`.

        Returns each rank's answer (the step directory's path).
        """
        return self.view.save_checkpoint(directory, step, extra_state)

    def load_checkpoint(self, path: str) -> list[dict[str, Any]]:
        """Restore a step directory: :meth:`EngineWorker.load_checkpoint` (one dict per rank)."""
        return self.view.load_checkpoint(path)

    def export_hf(self, directory: str, tokenizer: Any = None) -> list[str]:
        """Write a Hugging Face model directory: :meth:`EngineWorker.export_hf` (per rank)."""
        return self.view.export_hf(directory, tokenizer=tokenizer)

    def weight_digest(self, merge_adapter: bool = True) -> list[str]:
        """SHA-256 of the weights as each rank sees them: :meth:`EngineWorker.weight_digest`."""
        return self.view.weight_digest(merge_adapter=merge_adapter)

    def gather_weights(
        self,
        names: Sequence[str] | None = None,
        dtype: torch.dtype | None = None,
        merge_adapter: bool = True,
    ) -> list[dict[str, torch.Tensor] | None]:
        """Full tensors on rank 0 (``None`` elsewhere): :meth:`EngineWorker.gather_weights`."""
        return self.view.gather_weights(names=names, dtype=dtype, merge_adapter=merge_adapter)

    # ------------------------------------------------------------------ device memory
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimizer state to host memory: :meth:`EngineWorker.offload`."""
        self.view.offload(params=params, optimizer=optimizer)

    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """Bring offloaded state back to the device: :meth:`EngineWorker.reload`."""
        self.view.reload(params=params, optimizer=optimizer)

    def empty_cache(self) -> None:
        """Give the CUDA allocator's cached blocks back: :meth:`EngineWorker.empty_cache`."""
        self.view.empty_cache()


class ReferenceHandle(EngineHandle):
    """The reference model: log-probs the KL terms and PRIME measure against."""

    def compute_ref_log_prob(
        self, batch: Batch | StoredRows, share_prefix: bool = False
    ) -> Batch | None:
        """``ref_log_probs`` of the rows: :meth:`EngineWorker.compute_ref_log_prob`."""
        return self.view.compute_ref_log_prob(batch, share_prefix=share_prefix)


class ActorHandle(EngineHandle):
    """The policy: its log-probs, its update and the push of its weights to the replicas.

    With a LoRA adapter it is the reference too (:meth:`compute_ref_log_prob` reads the frozen
    base), so the trainer uses the actor's handle as its reference handle then.
    """

    def compute_log_prob(
        self, batch: Batch | StoredRows, with_entropy: bool = False, share_prefix: bool = False
    ) -> Batch | None:
        """``old_log_probs`` (and ``entropy``): :meth:`EngineWorker.compute_log_prob`."""
        return self.view.compute_log_prob(
            batch, with_entropy=with_entropy, share_prefix=share_prefix
        )

    def compute_ref_log_prob(
        self, batch: Batch | StoredRows, share_prefix: bool = False
    ) -> Batch | None:
        """Log-probs of the frozen base: :meth:`EngineWorker.compute_ref_log_prob`."""
        return self.view.compute_ref_log_prob(batch, share_prefix=share_prefix)

    def update_actor(
        self,
        batch: Batch | StoredRows,
        loss: str = "sft",
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train on the rows (metrics ``actor/*``): :meth:`EngineWorker.update_actor`."""
        return self.view.update_actor(
            batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler
        )

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
    ) -> list[dict[str, Any] | None]:
        """Push the weights to the replicas ``urls``: :meth:`EngineWorker.sync_weights`.

        Returns each rank's sender statistics (``None`` on a rank that sent nothing).
        """
        return self.view.sync_weights(
            transport=transport,
            urls=urls,
            bucket_mb=bucket_mb,
            checksum=checksum,
            version=version,
            mode=mode,
            inflight=inflight,
            transport_options=transport_options,
            dtype=dtype,
            senders=senders,
        )


class CriticHandle(EngineHandle):
    """The value model of PPO's GAE: its values and its update."""

    def compute_values(self, batch: Batch | StoredRows) -> Batch | None:
        """Per-token ``values``: :meth:`EngineWorker.compute_values`."""
        return self.view.compute_values(batch)

    def update_critic(
        self,
        batch: Batch | StoredRows,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train on the rows (metrics ``critic/*``): :meth:`EngineWorker.update_critic`."""
        return self.view.update_critic(
            batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler
        )


class PRMHandle(EngineHandle):
    """PRIME's implicit process reward model: its log-probs and its update."""

    def compute_prm_log_prob(
        self, batch: Batch | StoredRows, share_prefix: bool = False
    ) -> Batch | None:
        """``prm_log_probs`` of the rows: :meth:`EngineWorker.compute_prm_log_prob`."""
        return self.view.compute_prm_log_prob(batch, share_prefix=share_prefix)

    def update_prm(
        self,
        batch: Batch | StoredRows,
        loss: str,
        loss_kwargs: Mapping[str, Any] | None = None,
        num_mini_batches: int = 1,
        epochs: int = 1,
        step_scheduler: bool = True,
    ) -> dict[str, Any]:
        """Train on the rows (metrics ``prime/prm_*``): :meth:`EngineWorker.update_prm`."""
        return self.view.update_prm(
            batch, loss, loss_kwargs, num_mini_batches, epochs, step_scheduler
        )


#: The handle class of each role name of the trainer's worker groups.
_HANDLES: dict[str, type[EngineHandle]] = {
    "actor": ActorHandle,
    "ref": ReferenceHandle,
    "critic": CriticHandle,
    "prm": PRMHandle,
}


@dataclasses.dataclass(frozen=True)
class EngineHandles:
    """The engine roles a run started, each behind its typed handle.

    ``ref`` is ``None`` when no reference engine runs (no KL term, or LoRA, whose reference is
    the actor's base model), ``critic`` without GAE and ``prm`` without PRIME.
    """

    actor: ActorHandle
    ref: ReferenceHandle | None = None
    critic: CriticHandle | None = None
    prm: PRMHandle | None = None

    @classmethod
    def of(cls, views: Mapping[str, RoleView]) -> EngineHandles:
        """Wrap each role's view (``actor``, ``ref``, ``critic``, ``prm``) in its handle."""
        if "actor" not in views or set(views) - set(_HANDLES):
            raise ValueError(
                f"engine roles must include 'actor' and be among {sorted(_HANDLES)}, got "
                f"{sorted(views)}"
            )
        return cls(**{role: _HANDLES[role](view) for role, view in views.items()})

    def started(self) -> dict[str, EngineHandle]:
        """Every started role's handle by role name, the actor first."""
        roles = {"actor": self.actor, "ref": self.ref, "critic": self.critic, "prm": self.prm}
        return {role: handle for role, handle in roles.items() if handle is not None}
