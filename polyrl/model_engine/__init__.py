"""The model engine: one interface for SFT/DPO/reward/actor/critic training, pluggable backends.

See :mod:`polyrl.model_engine.engine` for the interface, the batch column contract and the loss
plug-in signature, and :mod:`polyrl.model_engine.fsdp2` for the FSDP2 backend.
"""

from polyrl.model_engine.config import (
    CheckpointConfig,
    EngineConfig,
    MegatronConfig,
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
    global_counts,
    register_engine,
    sft_loss,
)

__all__ = [
    "CheckpointConfig",
    "EngineConfig",
    "MegatronConfig",
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
