"""A worker's access to the transfer queue: rows by reference instead of by value.

With the transfer queue on, the driver hands an engine worker group a :class:`StoredRows`
(a queue ``BatchMeta``, the step's :class:`StepLayout` and the fields to fetch) where it
would otherwise hand it a :class:`~polyrl.core.batch.Batch`. The group's dispatch cuts the
reference for its data-parallel ranks like a batch (``__dp_chunks__``); each rank's
:class:`StoreClient` fetches its rows straight from the storage units, rebuilds them in the
layout the driver-side batch has, and puts per-token outputs back. The driver moves only
references.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyrl.core.batch import Batch
from polyrl.core.columns import (
    MULTI_MODAL,
    PROMPT_IDS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
)
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.model_engine.engine import TEMPERATURE_KEY

__all__ = ["RAGGED_FIELDS", "StepLayout", "StoreClient", "StoredRows"]

#: Per-sample token fields the rollout side puts (each row its own 1-D array).
RAGGED_FIELDS = (PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS)


def _rows_of(batch: Batch, key: str) -> list[list[Any]]:
    """Return a ragged column as lists (the queue stacks it when all rows are as long)."""
    if key in batch.tensor_keys:
        return [row.tolist() for row in batch[key]]
    return [np.asarray(row).tolist() for row in batch.non_tensors[key]]


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How a step's samples are packed for the engines: the driver-side batch's widths.

    Args:
        width_prompt: the longest prompt of the step (prompts are left-padded to it).
        width_response: the longest response of the step (responses are right-padded to it).
        pad_id: the padding token id.
        rollout_log_probs: whether the samples carry the servers' log-probs.
        multi_modal: whether the samples carry media (the engines then fetch
            :data:`~polyrl.core.columns.MULTI_MODAL` with the tokens).
        temperature: the sampling temperature the engines compute the rows' log-probs at
            (``batch.meta[TEMPERATURE_KEY]`` of the rebuilt batch, as in the driver's).
    """

    width_prompt: int
    width_response: int
    pad_id: int
    rollout_log_probs: bool = True
    multi_modal: bool = False
    temperature: float = 1.0

    def rebuild(self, rows: Batch) -> Batch:
        """Pack fetched rows into the engine batch the driver would have built for them.

        Fixed-width tensor columns fetched with the rows (per-token outputs of earlier phases,
        per-row scalars) are carried over as they are; the per-row objects too; the batch's
        meta holds the layout's temperature.
        """
        batch = build_rollout_batch(
            _rows_of(rows, PROMPT_IDS),
            _rows_of(rows, RESPONSE_IDS),
            self.pad_id,
            _rows_of(rows, ROLLOUT_LOG_PROBS) if self.rollout_log_probs else None,
            _rows_of(rows, RESPONSE_MASK),
            width_prompt=self.width_prompt,
            width_response=self.width_response,
        )
        for key in rows.tensor_keys:
            if key not in RAGGED_FIELDS:
                batch[key] = rows[key]
        for key in rows.non_tensor_keys:
            if key not in RAGGED_FIELDS:
                batch.non_tensors[key] = rows.non_tensors[key]
        batch.meta[TEMPERATURE_KEY] = self.temperature
        return batch

    def fields(self, extra: Sequence[str] = ()) -> list[str]:
        """Return the queue fields :meth:`rebuild` needs, plus ``extra``."""
        base = [PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK]
        if self.rollout_log_probs:
            base.append(ROLLOUT_LOG_PROBS)
        if self.multi_modal:
            base.append(MULTI_MODAL)
        return base + [f for f in extra if f not in base]

    def load(self, queue: Any, meta: Any, extra: Sequence[str] = ()) -> Batch:
        """Fetch ``meta``'s rows (layout fields + ``extra``) from the queue and rebuild them."""
        return self.rebuild(queue.get_data(meta, fields=self.fields(extra)))


@dataclasses.dataclass(frozen=True)
class StoredRows:
    """A reference to rows in the transfer queue, passed where a ``Batch`` would be.

    Args:
        meta: the rows' ``BatchMeta`` (partition, sample ids, storage locations).
        layout: how to rebuild them into an engine batch.
        fields: queue fields to fetch besides the layout's token fields.
    """

    meta: Any
    layout: StepLayout
    fields: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.meta)

    def __dp_chunks__(self, n: int) -> list[StoredRows]:
        """Cut for ``n`` data-parallel ranks (the worker-group dispatch protocol)."""
        return [dataclasses.replace(self, meta=m) for m in self.meta.__dp_chunks__(n)]

    def with_fields(self, *fields: str) -> StoredRows:
        """Return the same reference with ``fields`` fetched too."""
        return dataclasses.replace(
            self, fields=self.fields + tuple(f for f in fields if f not in self.fields)
        )


class StoreClient:
    """Loads the rows of a :class:`StoredRows` and puts outputs back for them."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def load(self, rows: StoredRows) -> Batch:
        """Fetch and rebuild ``rows``.

        Raises:
            ValueError: the reference holds no rows (a rank was given nothing to do).
        """
        if len(rows) == 0:
            raise ValueError("a worker was given a reference to no rows")
        return rows.layout.load(self.queue, rows.meta, rows.fields)

    def put(self, rows: StoredRows, outputs: Batch) -> None:
        """Put ``outputs`` (one row per referenced row) into the rows' partition."""
        self.queue.put(outputs, rows.meta.partition, sample_ids=list(rows.meta.sample_ids))
