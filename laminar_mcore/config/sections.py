"""The run config as the schema's dataclasses: what every role and component takes.

A composed Hydra config is validated (``validate_config``) and then turned into a
``LaminarConfig`` once; from there on each component takes its own typed section
(``cfg.rollout``, ``cfg.weight_sync``, ...), never a loose list of keywords.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Union

from .schema import LaminarConfig


def typed(cfg: Union[LaminarConfig, dict, "object"]) -> LaminarConfig:
    """``cfg`` (a DictConfig, a plain dict from ``as_dict`` or a LaminarConfig) as a
    ``LaminarConfig``; keys and types are checked against the schema."""
    if isinstance(cfg, LaminarConfig):
        return cfg
    from omegaconf import OmegaConf

    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LaminarConfig), cfg))


def as_dict(cfg: LaminarConfig) -> dict:
    """Plain data (for a process boundary); ``typed`` inverts it."""
    return asdict(cfg)
