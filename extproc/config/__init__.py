"""Configuration: one YAML file, validated on load (pydantic), with environment overrides."""

from extproc.config.loader import ConfigError, default_config, load_config
from extproc.config.schema import (
    AdminConfig,
    Config,
    EndpointConfig,
    LimitsConfig,
    ListenConfig,
    ModelConfig,
    SchedulingConfig,
)

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "EndpointConfig",
    "LimitsConfig",
    "ListenConfig",
    "ModelConfig",
    "SchedulingConfig",
    "default_config",
    "load_config",
]
