"""Where a step's rows live between phases: with the driver, or in the transfer queue.

An RL step (:meth:`~polyrl.trainer.rl.loop.RLTrainer.step`) is written once, against this
small interface. A *reference* to the step's rows is what the generation phase returned:

* :class:`InlinePlane` -- the reference is the :class:`~polyrl.core.batch.Batch` itself; engine
  calls get it (padded to the data-parallel size) and their outputs are joined onto it.
* :class:`QueuePlane` -- the reference is a :class:`~polyrl.workers.store.StoredRows`; engine
  workers fetch their shard from the transfer queue and put their outputs back, so the driver
  moves only references.

Each method takes a worker-group method (``actor.compute_log_prob``, ``critic.update_critic``,
...) and the reference; the advantage phase is the same function in both
(:func:`~polyrl.trainer.rl.advantage.advantage_phase`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from polyrl.config import PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.trainer.rl.advantage import advantage_phase
from polyrl.trainer.rl.store_worker import StoreWorkers
from polyrl.workers.engine import pad_batch_for_dp
from polyrl.workers.store import StoredRows

__all__ = ["DataPlane", "InlinePlane", "QueuePlane"]


class DataPlane(Protocol):
    """What a step does with its rows, whatever holds them."""

    def infer(self, method: Callable[..., Any], rows: Any, output: str, **kwargs: Any) -> Any:
        """Run an inference ``method`` on ``rows``; return the rows with its ``output`` column.

        ``output`` is the column ``method`` adds (a name of :mod:`polyrl.core.columns`); no
        other column of its result joins the rows.
        """
        ...

    def advantages(
        self, rows: Any, kl_ctrl: Any, max_response_length: int
    ) -> tuple[Any, dict[str, float], Any]:
        """Run the advantage phase; return ``(rows, data metrics, KL controller)``."""
        ...

    def update(self, method: Callable[..., Any], rows: Any, **kwargs: Any) -> dict[str, float]:
        """Run an update ``method`` (``update_actor``/``update_critic``) on ``rows``."""
        ...

    def release(self, rows: Any) -> dict[str, float]:
        """Drop the step's rows; return the plane's own metrics."""
        ...


class InlinePlane:
    """The step's rows pass through the driver as a ``Batch``.

    Args:
        cfg: the run's configuration.
        world_size: the engines' data-parallel size (batches are padded to a multiple of it).
    """

    def __init__(self, cfg: PolyRLConfig, world_size: int) -> None:
        self.cfg = cfg
        self.world_size = world_size

    def infer(self, method: Callable[..., Any], rows: Batch, output: str, **kwargs: Any) -> Batch:
        """Call ``method`` on the padded batch and join its ``output`` column onto it.

        Only ``output`` joins the rows (its padding dropped), as :class:`QueuePlane` fetches
        only ``output`` back: whatever else ``method`` returns is not the step's.

        Raises:
            KeyError: ``method`` returned no ``output`` column.
        """
        padded, extra = pad_batch_for_dp(rows, self.world_size)
        out = method(padded, **kwargs).select(output)
        return rows.union(out[: len(rows)] if extra else out)

    def advantages(
        self, rows: Batch, kl_ctrl: Any, max_response_length: int
    ) -> tuple[Batch, dict[str, float], Any]:
        """Run the advantage phase here, on the batch."""
        _, metrics = advantage_phase(rows, self.cfg, kl_ctrl, max_response_length)
        return rows, metrics, kl_ctrl

    def update(self, method: Callable[..., Any], rows: Batch, **kwargs: Any) -> dict[str, float]:
        """Call ``method`` on the batch padded with zero-loss rows to the data-parallel size."""
        padded, _ = pad_batch_for_dp(rows, self.world_size)
        return method(padded, **kwargs)

    def release(self, rows: Batch) -> dict[str, float]:
        """Nothing to release: the batch goes when the step drops it."""
        return {}


class QueuePlane:
    """The step's rows stay in the transfer queue; workers get and put them by reference.

    Args:
        queue: the transfer queue client.
        workers: the rollout workers (worker 0 runs the advantage phase next to the rows).
    """

    def __init__(self, queue: Any, workers: StoreWorkers) -> None:
        self.queue = queue
        self.workers = workers

    def infer(
        self, method: Callable[..., Any], rows: StoredRows, output: str, **kwargs: Any
    ) -> StoredRows:
        """Have every rank compute on its stored rows and put ``output`` back."""
        method(StoredRows(rows.meta, rows.layout), **kwargs)
        return rows.with_fields(output)

    def advantages(
        self, rows: StoredRows, kl_ctrl: Any, max_response_length: int
    ) -> tuple[StoredRows, dict[str, float], Any]:
        """Run the advantage phase in rollout worker 0, on the stored rows."""
        return self.workers.call(
            0,
            "advantages",
            rows=rows,
            kl_ctrl=kl_ctrl,
            max_response_length=max_response_length,
        )

    def update(
        self, method: Callable[..., Any], rows: StoredRows, **kwargs: Any
    ) -> dict[str, float]:
        """Have every rank fetch its shard of the rows and update on it."""
        return method(rows, **kwargs)

    def release(self, rows: StoredRows) -> dict[str, float]:
        """Clear the step's partition; report the queue's size before and the rows moved."""
        metrics = {
            "transfer/storage_bytes": float(self.queue.storage_bytes()),
            "transfer/samples": float(len(rows)),
        }
        self.queue.clear(rows.meta.partition)
        return metrics
