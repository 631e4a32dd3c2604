"""Rollout modes: one policy object per mode, on one code base.

A mode says two things: whether engines move to a new version together (a global barrier:
nobody pulls until every engine is idle, and engines generate only with the trainer's current
weights) and AReaL's admission bound eta (how many versions a trajectory admitted now may lag
the trainer when it is consumed; None: unbounded). Laminar has no barrier and no bound;
``algo.max_staleness`` bounds it. A new mode is one entry here (and its name in the schema's
allowed values, which are read from this table).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional


@dataclass(frozen=True)
class ModePolicy:
    name: str
    barrier: bool  # engines pull together, only when all are idle, and follow the trainer
    bound: Optional[int]  # admission staleness bound eta; None: unbounded
    # Whether ``algo.max_staleness`` sets the bound (modes whose bound is their definition
    # ignore it).
    configurable_bound: bool = False


MODES: Dict[str, ModePolicy] = {
    "laminar": ModePolicy("laminar", barrier=False, bound=None, configurable_bound=True),
    "one_step": ModePolicy("one_step", barrier=True, bound=1),
    "sync": ModePolicy("sync", barrier=True, bound=0),
}


def policy_for(mode: str, max_staleness: Optional[int] = None) -> ModePolicy:
    """The policy of ``mode``, with ``algo.max_staleness`` applied where the mode takes it."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
    policy = MODES[mode]
    if policy.configurable_bound:
        policy = replace(policy, bound=max_staleness)
    return policy
