"""The model engine: one interface for SFT/DPO/reward/actor/critic training, pluggable backends.

See :mod:`polyrl.model_engine.engine` for the interface and the batch column contract,
:mod:`polyrl.model_engine.fsdp2` for the FSDP2 backend, and
:mod:`polyrl.model_engine.losses` for the loss plug-in signature.
"""

from polyrl.model_engine.config import (
    CheckpointConfig,
    EngineConfig,
    MixedPrecisionConfig,
    ModelSpec,
    OptimizerConfig,
    ParallelismConfig,
)
from polyrl.model_engine.engine import (
    ModelOutput,
    TrainingEngine,
    available_engines,
    build_engine,
    compute_entropy,
    compute_log_probs,
    compute_log_probs_and_entropy,
    compute_values,
    register_engine,
)
from polyrl.model_engine.losses import global_counts, sft_loss

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "MixedPrecisionConfig",
    "ModelOutput",
    "ModelSpec",
    "OptimizerConfig",
    "ParallelismConfig",
    "TrainingEngine",
    "available_engines",
    "build_engine",
    "compute_entropy",
    "compute_log_probs",
    "compute_log_probs_and_entropy",
    "compute_values",
    "global_counts",
    "register_engine",
    "sft_loss",
]
