"""Typed configuration: option groups, bundled presets, YAML files and ``key=value`` overrides.

>>> from polyrl.config import load_config
>>> cfg = load_config("demo", ["trainer.total_steps=3"])
>>> cfg.trainer.total_steps
3
"""

from polyrl.config.loader import (
    ConfigNote,
    ConfigProblems,
    OptionInfo,
    apply_overrides,
    available_presets,
    describe,
    from_dict,
    load_config,
    parse_override,
    read_preset,
    response_cap,
    save_config,
    to_dict,
    to_yaml,
)
from polyrl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    ConfigGroup,
    CriticConfig,
    DataConfig,
    DPOConfig,
    ModelConfig,
    OptimConfig,
    PolyRLConfig,
    PrimeConfig,
    RayConfig,
    RewardConfig,
    RMConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
    TransferConfig,
    option,
    option_help,
)

#: The configuration of an RL run (``polyrl train``, :class:`polyrl.GRPOTrainer`): the same
#: dataclass as every other job's, whose ``algorithm``, ``actor`` and ``critic`` groups are the
#: RL-specific ones.
RLConfig = PolyRLConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "ConfigError",
    "ConfigGroup",
    "ConfigNote",
    "ConfigProblems",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "OptionInfo",
    "PolyRLConfig",
    "PrimeConfig",
    "RLConfig",
    "RMConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "TransferConfig",
    "apply_overrides",
    "available_presets",
    "describe",
    "from_dict",
    "load_config",
    "option",
    "option_help",
    "parse_override",
    "read_preset",
    "response_cap",
    "save_config",
    "to_dict",
    "to_yaml",
]
