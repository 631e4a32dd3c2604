"""Run configuration: dataclass schemas (registered with Hydra) and cross-section validation."""

from .schema import LaminarConfig, register_configs
from .validate import ConfigError, validate_config

__all__ = ["LaminarConfig", "register_configs", "ConfigError", "validate_config"]
