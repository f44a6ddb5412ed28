"""Weight transfer from a model engine to rollout servers: bucketed, versioned, atomic."""

from polyrl.weights.base import (
    BucketMeta,
    TensorMeta,
    Transport,
    WeightTransferError,
    create_transport,
    register_transport,
    registered_transports,
)
from polyrl.weights.receiver import LoadFnTarget, WeightReceiver, WeightTarget
from polyrl.weights.sender import SendStats, WeightSender
from polyrl.weights.staging import SafetensorsDirTarget

__all__ = [
    "BucketMeta",
    "LoadFnTarget",
    "SafetensorsDirTarget",
    "SendStats",
    "TensorMeta",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "WeightTarget",
    "WeightTransferError",
    "create_transport",
    "register_transport",
    "registered_transports",
]
