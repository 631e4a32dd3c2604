"""Advantage estimators, one value per trajectory, in a small registry (verl's names).

Every estimator has one signature::

    fn(rewards, group_ids, *, lengths=None, std_normalize=True, leave_one_out=False,
       eps=1e-6) -> torch.Tensor   # float32, one advantage per trajectory

``rewards``: one scalar (outcome) reward per trajectory; ``group_ids``: the prompt of each (the
trajectories of one prompt form its group); ``lengths``: each trajectory's number of loss
(response) tokens, which the token-weighted estimators need (``opo``, ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``). ``std_normalize`` and ``leave_one_out`` are GRPO's options:
an estimator without them accepts only their defaults and refuses the rest.

  grpo              (r_i - b_i) / (std_g + eps), b_i the group mean (leave_one_out: the mean of
                    the others); std_normalize=false is Dr. GRPO. A group of one gets 0.
  rloo              (n r_i - sum_g r) / (n - 1): the mean of the others as baseline (RLOO).
  reinforce_plus_plus            r_i whitened over all loss tokens of the batch (gamma = 1).
  reinforce_plus_plus_baseline   (r_i - mean_g) whitened over all loss tokens of the batch.
  opo               r_i - sum_g(len r) / sum_g(len): the length-weighted group baseline (OPO).
  gpg               alpha (r_i - mean_g), alpha = batch size / number of non-zero rewards.
  grpo_passk        the best sample of each group gets r_max - r_second (/ std with
                    std_normalize), every other sample 0 (Pass@k training).

Except ``grpo`` (whose groups of one get 0, as before), a group of one keeps verl's convention:
its baseline is 0. ``remax`` is refused (see ``spec.REFUSED_ADVANTAGES``).
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Optional, Sequence, Tuple, Union

import torch

from .spec import REFUSED_ADVANTAGES

AdvantageFn = Callable[..., torch.Tensor]
_ESTIMATORS: Dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        return fn

    return wrap


def advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as ``name`` (signature in the module docstring)."""
    if name in REFUSED_ADVANTAGES:
        raise ValueError(f"advantage estimator {name!r} is not supported: "
                         f"{REFUSED_ADVANTAGES[name]}")
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[name]


get_advantage_fn = advantage_fn  # the earlier name


def registered_advantages() -> Tuple[str, ...]:
    return tuple(_ESTIMATORS)


def _group_index(group_ids: Union[Sequence[Hashable], torch.Tensor]) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    index: Dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


class _Groups:
    """Rewards (float64), group index and per-group sums of one batch, checked."""

    def __init__(self, rewards, group_ids, lengths=None, *, need_lengths: bool = False):
        self.r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
        self.g = _group_index(group_ids)
        if self.r.numel() != self.g.numel():
            raise ValueError(f"{self.r.numel()} rewards but {self.g.numel()} group ids")
        if not torch.isfinite(self.r).all():
            raise ValueError("rewards must be finite")
        self.n_groups = int(self.g.max()) + 1 if self.g.numel() else 0
        self.lengths: Optional[torch.Tensor] = None
        if lengths is not None:
            self.lengths = torch.as_tensor(lengths, dtype=torch.float64).flatten()
            if self.lengths.numel() != self.r.numel() or (self.lengths < 0).any():
                raise ValueError(f"lengths: {self.lengths.numel()} non-negative token counts "
                                 f"needed, one per reward ({self.r.numel()})")
        elif need_lengths:
            raise ValueError("this estimator weights trajectories by their loss tokens: pass "
                             "lengths (each trajectory's number of response tokens)")
        self.count = self.sum(torch.ones_like(self.r))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-group sums of per-trajectory ``values``."""
        return torch.zeros(self.n_groups, dtype=torch.float64).index_add_(0, self.g, values)

    def mean_baseline(self) -> torch.Tensor:
        """Each trajectory's group mean; 0 for a group of one (verl's convention)."""
        n = self.count[self.g]
        return torch.where(n > 1, (self.sum(self.r) / self.count)[self.g], torch.zeros_like(n))


@register_advantage("grpo")
def grpo_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                    leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages (float32, one per trajectory) from rewards and group ids."""
    b = _Groups(rewards, group_ids, lengths)
    r, g, count = b.r, b.g, b.count
    total = b.sum(r)
    mean = total / count
    n = count[g]
    if leave_one_out:
        baseline = torch.where(n > 1, (total[g] - r) / (n - 1).clamp(min=1), r)
    else:
        baseline = mean[g]
    adv = r - baseline
    if std_normalize:
        std = torch.sqrt(b.sum((r - mean[g]) ** 2) / (count - 1).clamp(min=1))  # as torch.std
        adv = adv / (std[g] + eps)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    return adv.float()


def _grpo_options_only(name: str, std_normalize: bool, leave_one_out: bool,
                       std_ok: bool = False) -> None:
    if leave_one_out:
        raise ValueError(f"{name} takes no leave_one_out (GRPO's option; rloo is RLOO)")
    if not std_normalize and not std_ok:
        raise ValueError(f"{name} takes no std_normalize=false (GRPO's option)")


def _token_whiten(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` of per-trajectory ``values`` broadcast over each trajectory's
    ``lengths`` loss tokens: mean and (unbiased) variance over all the batch's tokens. A batch
    of at most one token cannot be whitened (verl raises): its advantages are 0."""
    n = lengths.sum()
    if n <= 1:
        return torch.zeros_like(values)
    mean = (values * lengths).sum() / (n + 1e-8)
    var = ((values - mean) ** 2 * lengths).sum() / (n + 1e-8) * (n / (n - 1))
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return torch.where(lengths > 0, out, torch.zeros_like(out))


@register_advantage("rloo")
def rloo_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                    leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): the mean of the group's other samples
    as baseline; a group of one keeps its reward."""
    _grpo_options_only("rloo", std_normalize, leave_one_out)
    b = _Groups(rewards, group_ids, lengths)
    n = b.count[b.g]
    adv = (b.r * n - b.sum(b.r)[b.g]) / (n - 1).clamp(min=1)
    return torch.where(n > 1, adv, b.r).float()


@register_advantage("reinforce_plus_plus")
def reinforce_pp_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                            leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262) for outcome rewards, gamma = 1: the reward whitened
    over every loss token of the batch (global batch normalisation, no group baseline)."""
    _grpo_options_only("reinforce_plus_plus", std_normalize, leave_one_out)
    b = _Groups(rewards, group_ids, lengths, need_lengths=True)
    return _token_whiten(b.r, b.lengths).float()


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantages(rewards, group_ids, *, lengths=None,
                                     std_normalize: bool = True, leave_one_out: bool = False,
                                     eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): the group mean subtracted, then whitened over
    every loss token of the batch."""
    _grpo_options_only("reinforce_plus_plus_baseline", std_normalize, leave_one_out)
    b = _Groups(rewards, group_ids, lengths, need_lengths=True)
    return _token_whiten(b.r - b.mean_baseline(), b.lengths).float()


@register_advantage("opo")
def opo_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                   leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """OPO (arXiv 2505.23585): the length-weighted mean reward of the group as baseline, the
    optimal baseline of an on-policy sequence-level gradient. A group whose samples have no
    loss token at all gets 0 (verl: NaN, on tokens that do not exist)."""
    _grpo_options_only("opo", std_normalize, leave_one_out)
    b = _Groups(rewards, group_ids, lengths, need_lengths=True)
    n, glen = b.count[b.g], b.sum(b.lengths)[b.g]
    adv = torch.where(n > 1, b.r - b.sum(b.lengths * b.r)[b.g] / glen, b.r)
    return torch.where((n > 1) & (glen == 0), torch.zeros_like(adv), adv).float()


@register_advantage("gpg")
def gpg_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                   leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GPG (arXiv 2504.02546): alpha (r_i - mean_g) with alpha = batch size / number of
    non-zero rewards, which rescales batches where few samples score."""
    _grpo_options_only("gpg", std_normalize, leave_one_out)
    b = _Groups(rewards, group_ids, lengths)
    alpha = b.r.numel() / max(int(torch.count_nonzero(b.r)), 1)
    return (alpha * (b.r - b.mean_baseline())).float()


@register_advantage("grpo_passk")
def grpo_passk_advantages(rewards, group_ids, *, lengths=None, std_normalize: bool = True,
                          leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k training (arXiv 2503.19595, as verl implements it): only each group's best
    sample gets an advantage, r_max - r_second (divided by the group's std + eps with
    std_normalize). Groups need at least two samples."""
    _grpo_options_only("grpo_passk", std_normalize, leave_one_out, std_ok=True)
    b = _Groups(rewards, group_ids, lengths)
    adv = torch.zeros_like(b.r)
    for k in range(b.n_groups):
        members = torch.nonzero(b.g == k).flatten()
        if members.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group {k} has "
                             f"{members.numel()}")
        group = b.r[members]
        top, top_idx = torch.topk(group, 2)  # verl's call: the same winner among ties
        value = top[0] - top[1]
        if std_normalize:
            value = value / (torch.std(group) + eps)
        adv[members[top_idx[0]]] = value
    return adv.float()
