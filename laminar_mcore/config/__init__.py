"""Run configuration: dataclass schemas (registered with Hydra) and cross-section validation.

The schemas import without Hydra or OmegaConf (``bench.gpu`` runs on bare GPU machines that have
neither); ``register_configs``, ``validate_config`` and ``ConfigError`` load them on first use.
"""

from .schema import LaminarConfig

__all__ = ["LaminarConfig", "register_configs", "ConfigError", "validate_config", "typed",
           "as_dict"]


def __getattr__(name):
    if name == "register_configs":
        from .schema import register_configs

        return register_configs
    if name in ("ConfigError", "validate_config"):
        from . import validate

        return getattr(validate, name)
    if name in ("typed", "as_dict"):
        from . import sections as module

        return getattr(module, name)
    raise AttributeError(name)
