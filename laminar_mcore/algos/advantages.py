"""Advantage estimators, one value per trajectory, in a small registry.

GRPO normalises each reward within its group (the trajectories sampled for one prompt):
``A_i = (r_i - b_i) / (std_g + eps)`` with ``b_i`` the group mean, or with ``leave_one_out`` the
mean of the *other* members (RLOO). A group of one has no baseline and gets advantage 0.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Sequence, Union

import torch

AdvantageFn = Callable[..., torch.Tensor]
_ESTIMATORS: Dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        return fn

    return wrap


def get_advantage_fn(name: str) -> AdvantageFn:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[name]


def _group_index(group_ids: Union[Sequence[Hashable], torch.Tensor]) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    index: Dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


@register_advantage("grpo")
def grpo_advantages(rewards, group_ids, *, std_normalize: bool = True,
                    leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages (float32, one per trajectory) from rewards and group ids."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    g = _group_index(group_ids)
    if r.numel() != g.numel():
        raise ValueError(f"{r.numel()} rewards but {g.numel()} group ids")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    n_groups = int(g.max()) + 1 if g.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, r)
    mean = total / count
    n = count[g]
    if leave_one_out:
        baseline = torch.where(n > 1, (total[g] - r) / (n - 1).clamp(min=1), r)
    else:
        baseline = mean[g]
    adv = r - baseline
    if std_normalize:
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, (r - mean[g]) ** 2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))  # unbiased, as torch.std
        adv = adv / (std[g] + eps)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    return adv.float()
