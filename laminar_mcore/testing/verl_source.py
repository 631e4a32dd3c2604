"""verl 0.9.1's own RL functions, loaded as the reference our ``laminar_mcore.algos`` must equal.

    python -m laminar_mcore.testing.verl_source   # fetch into the cache, print where

verl is never installed: ``fetch`` runs ``pip download --no-deps verl==0.9.1`` once and extracts
the two files the tests read (``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py``) under ``.venv``. ``core_algos`` imports omegaconf, ray-era
configs and ``verl.utils`` (tensordict, transformers, the device helpers), so ``load`` does not
import it: it parses the file with ``ast``, drops every ``import`` statement and executes the
remaining top-level definitions (the functions, the ``AdvantageEstimator`` enum, the registries
and their decorators, unchanged) in a fresh module whose globals hold only what they use:
torch, numpy, the typing names, verl's own ``masked_sum``/``masked_mean``/``masked_var``/
``masked_whiten`` (taken from ``torch_functional.py`` the same way, as ``verl_F``) and minimal
stand-ins for the config classes (``ActorConfig``/``AlgoConfig``: attribute namespaces with a
dict-style ``get``, see ``actor_config``/``algo_config``) and for the ``deprecated`` decorator.
Names only the functions we do not call need (``as_torch_index``, ``group_mean_std``) raise if
called.
"""

from __future__ import annotations

import ast
import os
import types
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Optional

from .wheel_source import default_cache, fetch_wheel_files

VERSION = "0.9.1"
CORE_ALGOS = "verl/trainer/ppo/core_algos.py"
TORCH_FUNCTIONAL = "verl/utils/torch_functional.py"
FILES = (CORE_ALGOS, TORCH_FUNCTIONAL)
# verl.utils.torch_functional helpers core_algos calls as verl_F.<name>
_VERL_F = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")


def cache_dir() -> str:
    return default_cache(f"verl-{VERSION}-source", "LAMINAR_VERL_SOURCE")


def fetch(timeout_s: float = 600) -> str:
    """The cache directory, downloading and extracting the wheel if it is not there yet.
    Raises ``RuntimeError`` saying why when it cannot be had."""
    return fetch_wheel_files("verl", VERSION, FILES, cache_dir(), timeout_s)


def read(relpath: str) -> str:
    with open(os.path.join(fetch(), relpath)) as f:
        return f.read()


class _Config(types.SimpleNamespace):
    """An attribute namespace that also answers ``config.get(key, default)`` (DictConfig-style),
    which is all verl's loss and estimator functions ask of their config objects."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class ActorConfig(_Config):
    """Stand-in for ``verl.workers.config.ActorConfig`` (the losses check ``isinstance``)."""


class AlgoConfig(_Config):
    """Stand-in for ``verl.trainer.config.AlgoConfig``."""


def actor_config(*, clip_ratio: float = 0.2, clip_ratio_low: Optional[float] = None,
                 clip_ratio_high: Optional[float] = None, clip_ratio_c: float = 3.0,
                 tau_pos: float = 1.0, tau_neg: float = 1.05, clip_cov_ratio: float = 0.0002,
                 clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                 kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1,
                 global_batch_info: Optional[dict] = None) -> ActorConfig:
    """The fields of verl's ActorConfig (and its ``policy_loss`` section) the losses read,
    with verl's defaults; ``global_batch_info`` is splatted into ``agg_loss``."""
    policy_loss = _Config(clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
                          clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio,
                          ppo_kl_coef=ppo_kl_coef)
    return ActorConfig(clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                       clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                       tau_pos=tau_pos, tau_neg=tau_neg, policy_loss=policy_loss,
                       global_batch_info=dict(global_batch_info or {}))


def algo_config(*, gamma: float = 1.0, norm_adv_by_std_in_grpo: bool = True) -> AlgoConfig:
    """The fields of verl's AlgoConfig the outcome estimators read."""
    return AlgoConfig(gamma=gamma, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


def _deprecated(*_args, **_kwargs) -> Callable[[Callable], Callable]:
    return lambda fn: fn


def _unavailable(name: str) -> Callable:
    def fn(*_args, **_kwargs):
        raise NotImplementedError(f"{name} is not loaded from verl (verl_source stubs it)")

    return fn


def _exec_definitions(source: str, filename: str, module: types.ModuleType,
                      keep: Optional[tuple] = None) -> None:
    """Execute ``source``'s top-level statements except imports (only the functions named in
    ``keep``, when given) in ``module``'s namespace."""
    tree = ast.parse(source, filename)
    body = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if keep is not None and not (isinstance(node, ast.FunctionDef) and node.name in keep):
            continue
        body.append(node)
    tree.body = body
    exec(compile(tree, filename, "exec"), module.__dict__)  # noqa: S102 - verl's own source


_MODULE: Optional[types.ModuleType] = None


def load() -> types.ModuleType:
    """verl's ``core_algos`` as a module (cached): ``agg_loss``, ``kl_penalty``,
    ``get_policy_loss_fn(name)``, ``get_adv_estimator_fn(name)`` and everything else it
    defines. Raises ``RuntimeError`` when the wheel cannot be had."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    import numpy as np
    import torch

    root = fetch()
    verl_f = types.ModuleType("verl_F")
    verl_f.torch = torch
    path = os.path.join(root, TORCH_FUNCTIONAL)
    with open(path) as f:
        _exec_definitions(f.read(), path, verl_f, keep=_VERL_F)
    missing = [n for n in _VERL_F if not hasattr(verl_f, n)]
    if missing:
        raise RuntimeError(f"verl {VERSION}'s torch_functional.py has no {missing}")

    module = types.ModuleType("laminar_verl_core_algos")
    module.__dict__.update(
        torch=torch, np=np, defaultdict=defaultdict, Enum=Enum, Any=Any, Callable=Callable,
        Optional=Optional, DictConfig=_Config, AlgoConfig=AlgoConfig, ActorConfig=ActorConfig,
        verl_F=verl_f, deprecated=_deprecated, as_torch_index=_unavailable("as_torch_index"),
        group_mean_std=_unavailable("group_mean_std"))
    path = os.path.join(root, CORE_ALGOS)
    with open(path) as f:
        _exec_definitions(f.read(), path, module)
    _MODULE = module
    return module


if __name__ == "__main__":
    print(fetch())
