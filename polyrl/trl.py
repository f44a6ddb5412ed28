"""TRL's names, for scripts that change only their import line.

::

    from polyrl.trl import GRPOConfig, GRPOTrainer   # was: from trl import ...

The configs take TRL's fields and defaults (:mod:`polyrl.config.trl_compat`; the table is in
``docs/migrating_from_trl.md``); the trainers take ``args=``, ``processing_class=`` and
``peft_config=``. ``RewardTrainer`` is :class:`polyrl.RewardModelTrainer`.
"""

from polyrl.config.trl_compat import DPOConfig, GRPOConfig, RewardConfig, RLOOConfig
from polyrl.trainer.api import DPOTrainer, GRPOTrainer, RLOOTrainer
from polyrl.trainer.api import RewardModelTrainer as RewardTrainer

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
]
