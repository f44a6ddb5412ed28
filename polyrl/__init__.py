"""polyrl: composable RL post-training for LLMs.

The RL trainers and their config are importable from the top level (lazily, so that
``import polyrl`` stays light)::

    from polyrl import GRPOTrainer, PPOTrainer, RLConfig
    from polyrl import DPOTrainer, RewardModelTrainer   # preference pairs
"""

from typing import Any

__all__ = [
    "DPOTrainer",
    "GRPOTrainer",
    "PPOTrainer",
    "REINFORCEPlusPlusTrainer",
    "RLConfig",
    "RLOOTrainer",
    "ReMaxTrainer",
    "RewardModelTrainer",
]


def __getattr__(name: str) -> Any:
    if name == "RLConfig":
        from polyrl.config import RLConfig

        return RLConfig
    if name in __all__:
        from polyrl.trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'polyrl' has no attribute {name!r}")
