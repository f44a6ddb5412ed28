"""polyrl: composable RL post-training for LLMs.

The RL trainers and their config are importable from the top level (lazily, so that
``import polyrl`` stays light)::

    from polyrl import GRPOTrainer, PPOTrainer, RLConfig
    from polyrl import DPOTrainer, RewardModelTrainer   # preference pairs

TRL's config classes (``GRPOConfig``, ``RLOOConfig``, ``DPOConfig``, ``RewardConfig``) are here
too, for ``args=``; :mod:`polyrl.trl` holds them with the trainers under TRL's names.
"""

from typing import Any

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOTrainer",
    "REINFORCEPlusPlusTrainer",
    "RLConfig",
    "RLOOConfig",
    "RLOOTrainer",
    "ReMaxTrainer",
    "RewardConfig",
    "RewardModelTrainer",
]

_TRL_CONFIGS = ("DPOConfig", "GRPOConfig", "RLOOConfig", "RewardConfig")


def __getattr__(name: str) -> Any:
    if name == "RLConfig":
        from polyrl.config import RLConfig

        return RLConfig
    if name in _TRL_CONFIGS:
        from polyrl.config import trl_compat

        return getattr(trl_compat, name)
    if name in __all__:
        from polyrl.trainer import api

        return getattr(api, name)
    raise AttributeError(f"module 'polyrl' has no attribute {name!r}")
