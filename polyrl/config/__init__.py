"""Typed configuration: option groups, bundled presets, YAML files and ``key=value`` overrides.

>>> from polyrl.config import load_config
>>> cfg = load_config("demo", ["trainer.total_steps=3"])
>>> cfg.trainer.total_steps
3
"""

from polyrl.config.loader import (
    OptionInfo,
    apply_overrides,
    available_presets,
    describe,
    from_dict,
    load_config,
    parse_override,
    read_preset,
    save_config,
    to_dict,
    to_yaml,
)
from polyrl.config.schema import (
    ConfigError,
    ConfigGroup,
    DataConfig,
    ModelConfig,
    PolyRLConfig,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    option,
    option_help,
)

__all__ = [
    "ConfigError",
    "ConfigGroup",
    "DataConfig",
    "ModelConfig",
    "OptionInfo",
    "PolyRLConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "apply_overrides",
    "available_presets",
    "describe",
    "from_dict",
    "load_config",
    "option",
    "option_help",
    "parse_override",
    "read_preset",
    "save_config",
    "to_dict",
    "to_yaml",
]
