"""The spread the constants allow (``sim.report --sensitivity``): every cost constant (and
the workload's length constants) moved by -20% and +20%, one at a time, at fixed placements;
per headline ratio its lowest and highest value over those runs and the constant that moves it
most (``<ratio>_min``, ``<ratio>_max``, ``<ratio>_most_sensitive_to``).

The constants are module-level tables (``costs.EFFICIENCY``, ``LINKS``, ``PROTOCOL``) read at
call time, so a worker process applies an override for one run and restores it after.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Dict, Iterator, List, Optional

from . import costs
from .workload import Workload

TABLES = {"EFFICIENCY": costs.EFFICIENCY, "LINKS": costs.LINKS, "PROTOCOL": costs.PROTOCOL}
WORKLOAD_CONSTANTS = ("response_median", "sigma_sample", "max_response")


def constants() -> List[str]:
    """``TABLE.key`` of every constant varied (``Workload.<field>`` for the lengths)."""
    names = [f"{t}.{k}" for t, table in TABLES.items() for k in table]
    names += [f"Workload.{k}" for k in WORKLOAD_CONSTANTS]
    return names


@contextlib.contextmanager
def applied(overrides: Optional[Dict[str, float]]) -> Iterator[None]:
    """Cost-table overrides (``TABLE.key`` -> value) for the duration of one run."""
    saved = []
    try:
        for name, value in (overrides or {}).items():
            table, key = name.split(".")
            if table == "Workload":
                continue
            saved.append((TABLES[table], key, TABLES[table][key]))
            TABLES[table][key] = value
        yield
    finally:
        for table, key, value in reversed(saved):
            table[key] = value


# The weight-protocol constants each protocol reads (``relays.RelayTier``); every other
# constant (efficiencies, the workload) is read by every run. A run whose protocol reads none
# of a variant's constants is the base run: ``--sensitivity`` reuses it instead of re-running.
PROTOCOL_READS = {
    "laminar": {f"LINKS.{k}" for k in ("publish_bytes_s", "chain_bytes_s", "chain_start_s",
                                       "pull_bytes_s", "pull_fixed_s")},
    "broadcast": {f"PROTOCOL.{k}" for k in costs.PROTOCOL},
    "colocated": {"LINKS.colocated_sync_fixed_s"},
}


def unread(override: Optional[Dict[str, float]], protocol: str) -> bool:
    """Whether a run of ``protocol`` reads none of ``override``'s constants (so that its
    result is the base run's)."""
    other = set().union(*(v for k, v in PROTOCOL_READS.items() if k != protocol))
    return bool(override) and all(name in other for name in override)


def workload_with(workload: Workload, overrides: Optional[Dict[str, float]]) -> Workload:
    fields = {}
    for name, value in (overrides or {}).items():
        table, key = name.split(".")
        if table == "Workload":
            fields[key] = type(getattr(workload, key))(value)
    return replace(workload, **fields) if fields else workload


def variants(factor: float = 0.2, names: Optional[List[str]] = None) -> List[Dict[str, float]]:
    """One override per constant (``names``: a subset of ``constants()``) and direction:
    value x (1 - factor), value x (1 + factor)."""
    unknown = sorted(set(names or ()) - set(constants()))
    if unknown:
        raise SystemExit(f"--constants {','.join(unknown)}: not a constant the sensitivity "
                         f"varies; choose from {', '.join(constants())}")
    out = []
    base = Workload()
    for name in names or constants():
        table, key = name.split(".")
        value = getattr(base, key) if table == "Workload" else TABLES[table][key]
        for f in (1 - factor, 1 + factor):
            out.append({name: value * f})
    return out


def spread(base: Dict[str, float], runs: List[tuple]) -> Dict[str, object]:
    """``runs``: (override, {ratio: value}). Per ratio: base, min, max, the constant whose
    ±20% moves it most, and each constant's two values."""
    out: Dict[str, object] = {}
    for ratio, b in base.items():
        values = [(name, v[ratio]) for o, v in runs if ratio in v for name in o]
        if not values:
            continue
        out[f"{ratio}_base"] = round(b, 3)
        out[f"{ratio}_min"] = round(min(v for _, v in values), 3)
        out[f"{ratio}_max"] = round(max(v for _, v in values), 3)
        swing: Dict[str, float] = {}
        for name, v in values:
            swing[name] = max(swing.get(name, 0.0), abs(v - b))
        out[f"{ratio}_most_sensitive_to"] = max(swing, key=swing.get)
        for o, v in runs:
            for name, value in o.items():
                if ratio in v:
                    out[f"{ratio}@{name}={value:.4g}"] = round(v[ratio], 3)
    return out
