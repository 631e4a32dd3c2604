"""Rollout modes: one policy object per mode, on one code base.

A mode says three things: whether engines move to a new version together (a global barrier:
nobody pulls until every engine is idle, and engines generate only with the trainer's current
weights), AReaL's admission bound eta (how many versions a trajectory admitted now may lag
the trainer when it is consumed; None: unbounded), and what an engine does with the
trajectories it is generating when its relay has a newer version: finish them first, so each
trajectory comes from one version (Laminar), or interrupt them (AReaL's interruptible
generation: pause with abort, take the new weights, resubmit each request with the tokens it
has, so one trajectory may span versions and every token records its own). Laminar has no
barrier and no bound; ``algo.max_staleness`` bounds the staleness it trains on (a guarantee:
admission keeps it, a discard at consumption enforces it), and is AReaL's eta, which gates
submission (an interrupted trajectory's tokens may span versions). A new mode is one entry here
(and its name in the schema's allowed values, which are read from this table).
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
    # AReaL: on a new version, abort in-flight requests, pull, resubmit them with their prefix.
    interrupt: bool = False
    # Laminar: the bound is on the staleness trained on (each trajectory comes from one
    # version): engines lagging the bound pull before new work, and what is older than the
    # bound at consumption is discarded ("stale"). AReaL's eta gates submission only.
    bounds_consumption: bool = False


MODES: Dict[str, ModePolicy] = {
    "laminar": ModePolicy("laminar", barrier=False, bound=None, configurable_bound=True,
                          bounds_consumption=True),
    "one_step": ModePolicy("one_step", barrier=True, bound=1),
    "sync": ModePolicy("sync", barrier=True, bound=0),
    "areal": ModePolicy("areal", barrier=False, bound=None, configurable_bound=True,
                        interrupt=True),
}


def policy_for(mode: str, max_staleness: Optional[int] = None) -> ModePolicy:
    """The policy of ``mode``, with ``algo.max_staleness`` applied where the mode takes it."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
    policy = MODES[mode]
    if policy.configurable_bound:
        policy = replace(policy, bound=max_staleness)
    return policy
