"""A rollout machine killed at a virtual time (``--fail machine@T``), and its recovery as
Laminar's section 8.4 reports it: the training throughput's dip and the time to full recovery.

At T the machine's engines stop (their streams hang) and its relay leaves the chain (the next
alive relay takes its place; the first alive one is the master). After SGLang's health-check
timeout (``costs.FAILURE['detect_s']``) the controller declares the engines lost
(``RolloutManager.engine_lost``, production code): their trajectories resume from the partial
response pool on healthy engines of the same version. After ``restart_s`` more the machine is
back: its relay fetches the newest version from the master over the network, then its engines
are replaced (``RolloutManager.replace_engine``) and pull it. Full recovery is when every
replacement engine is back in service: healthy and holding its relay's newest version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..controller.manager import EngineHandle, RolloutManager
from .costs import FAILURE
from .engine import SimEngine, SimEngineClient
from .relays import RelayTier


def parse_fail(text: str) -> Tuple[int, float]:
    """``machine@T`` (rollout machine index, virtual seconds)."""
    try:
        machine, at = text.split("@")
        return int(machine), float(at)
    except ValueError:
        raise SystemExit(f"--fail {text!r}: expected machine@T, e.g. 3@600") from None


@dataclass
class FailureRecord:
    machine: int
    at_s: float
    detected_s: Optional[float] = None
    relay_back_s: Optional[float] = None
    recovered_s: Optional[float] = None  # every replacement engine back in service
    engines: List[str] = field(default_factory=list)

    def figures(self, marks: List[float], tokens: List[int], horizon_s: float) -> Dict[str, float]:
        """``fail_*`` keys: throughput per iteration before the failure and its lowest after
        (within ``horizon_s``), the dip, and the seconds to full recovery."""
        thr = [(marks[i], tokens[i] / max(marks[i] - marks[i - 1], 1e-9))
               for i in range(1, len(marks))]
        before = [t for at, t in thr if at <= self.at_s]
        after = [t for at, t in thr if self.at_s < at <= self.at_s + horizon_s]
        base = sum(before) / len(before) if before else None
        low = min(after) if after else None
        out = {"fail_machine": self.machine, "fail_at_s": self.at_s,
               "fail_tokens_per_s_before": None if base is None else round(base, 1),
               "fail_tokens_per_s_min_after": None if low is None else round(low, 1),
               "fail_dip": round(1 - low / base, 4) if before and after else None,
               "fail_detect_s": None if self.detected_s is None
               else round(self.detected_s - self.at_s, 2),
               "fail_recovery_s": None if self.recovered_s is None
               else round(self.recovered_s - self.at_s, 2)}
        later = [t for at, t in thr if at > (self.recovered_s or float("inf"))]
        out["fail_tokens_per_s_after_recovery"] = round(sum(later) / len(later), 1) \
            if later else None
        return out


async def fail_machine(manager: RolloutManager, tier: RelayTier, handles: List[EngineHandle],
                       make_engine: Callable[[str], SimEngine],
                       record: FailureRecord) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, record.at_s - loop.time()))
    record.engines = [h.name for h in handles]
    tier.kill(record.machine)
    for h in handles:
        h.client.engine.freeze()
    await asyncio.sleep(FAILURE["detect_s"])
    record.detected_s = loop.time()
    for h in handles:
        manager.engine_lost(h, "its machine failed (simulated)")
    await asyncio.sleep(FAILURE["restart_s"])
    await tier.rejoin(record.machine)
    record.relay_back_s = loop.time()
    for h in handles:
        manager.replace_engine(h, SimEngineClient(make_engine(h.name)))
    while not all(h.healthy and 0 < h.relay.version <= h.version for h in handles):
        await asyncio.sleep(0.1)
    record.recovered_s = loop.time()
