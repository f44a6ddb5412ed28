"""What the trainer asks of a reward scorer: the :class:`Scorer` Protocol.

Every kind of scorer the trainer builds implements it: the rule-based
:class:`~polyrl.reward.manager.RewardManager`, the weighted
:class:`~polyrl.reward.functions.RewardFunctionsManager`, and in the trainer the reward model
and judge mix (``MixedRewards``) and the shared, serialised wrapper (``SerialRewards``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from polyrl.core.batch import Batch
    from polyrl.reward.manager import RewardResult

__all__ = ["ReplicaEndpoints", "Scorer"]


class ReplicaEndpoints(Protocol):
    """Where the policy's rollout replicas answer (a rollout client is one)."""

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs."""
        ...

    #: The bearer token the replicas expect (``None``: none).
    api_key: str | None


class Scorer(Protocol):
    """Scores the rows of a rollout batch.

    The batch always carries the non-tensor columns ``response_text``, ``data_source``,
    ``ground_truth`` and ``extra_info``; the two flags ask for more.
    """

    #: Put ``source_row`` (each row's dataset record) and ``completion_ids`` (the response
    #: token ids) on the batch: batched, TRL-style reward functions read them.
    wants_rows: bool
    #: Put ``raw_prompt`` (the prompt as the dataset gave it) on the batch: a reward model or
    #: a judge reads it.
    wants_prompts: bool

    def attach_rollout(self, client: ReplicaEndpoints) -> None:
        """Learn where the policy's replicas are (a judge asks them); a no-op for most."""
        ...

    def score(self, batch: Batch) -> RewardResult:
        """Score every row of ``batch``."""
        ...

    def close(self) -> None:
        """Release the scorer's processes, threads and clients."""
        ...
