"""Data: the row schema, file readers/writers, prompt datasets, a resumable sampler and tasks.

Only the light modules (schema, io) load with the package; the rest is imported on first use,
so ``python -m polyrl.data.tasks`` neither pays for torch nor finds itself imported twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polyrl.data.io import read_rows, write_rows
from polyrl.data.schema import (
    RowValidationError,
    ground_truth_of,
    make_row,
    normalize_row,
    row_uid,
    validate_messages,
    validate_row,
    validate_rows,
)

if TYPE_CHECKING:
    from polyrl.data.dataset import (
        TRUNCATION_POLICIES,
        PromptTooLongError,
        RLDataset,
        collate_prompts,
    )
    from polyrl.data.preprocess_gsm8k import (
        convert_gsm8k_rows,
        extract_gsm8k_answer,
        sample_gsm8k_path,
        write_gsm8k_splits,
    )
    from polyrl.data.sampler import StatefulSampler
    from polyrl.data.tasks import TASKS, generate, get_task, register_task, write_task_splits

_LAZY = {
    "TRUNCATION_POLICIES": "dataset",
    "PromptTooLongError": "dataset",
    "RLDataset": "dataset",
    "collate_prompts": "dataset",
    "StatefulSampler": "sampler",
    "TASKS": "tasks",
    "generate": "tasks",
    "get_task": "tasks",
    "register_task": "tasks",
    "write_task_splits": "tasks",
    "convert_gsm8k_rows": "preprocess_gsm8k",
    "extract_gsm8k_answer": "preprocess_gsm8k",
    "sample_gsm8k_path": "preprocess_gsm8k",
    "write_gsm8k_splits": "preprocess_gsm8k",
}

__all__ = [
    "TASKS",
    "TRUNCATION_POLICIES",
    "PromptTooLongError",
    "RLDataset",
    "RowValidationError",
    "StatefulSampler",
    "collate_prompts",
    "convert_gsm8k_rows",
    "extract_gsm8k_answer",
    "generate",
    "get_task",
    "ground_truth_of",
    "make_row",
    "normalize_row",
    "read_rows",
    "register_task",
    "row_uid",
    "sample_gsm8k_path",
    "validate_messages",
    "validate_row",
    "validate_rows",
    "write_gsm8k_splits",
    "write_rows",
    "write_task_splits",
]


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polyrl.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"polyrl.data.{module}"), name)
