"""The spread the constants allow (``sim.report --sensitivity``): every cost constant (and
the workload's length constants) moved by -20% and +20%, one at a time, at fixed placements;
per headline ratio its lowest and highest value over those runs and the constant that moves it
most (``<ratio>_min``, ``<ratio>_max``, ``<ratio>_most_sensitive_to``).

The constants are module-level tables (``costs.EFFICIENCY``, ``LINKS``, ``PROTOCOL``,
``TRAINER``) read at call time, so a worker process applies an override for one run and
restores it after. Two settings are varied beside them (``SETTINGS``): every system's engine
TP at half and twice the paper's (``SETTING.engine_tp_scale``: 0.5, 2; clamped to 1..8 GPUs)
and AReaL's eta at AReaL's own published values (``SETTING.areal_eta``: 4 in its code, 8 for
math; the base is the paper's infinity).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Dict, Iterator, List, Optional

from . import costs
from .workload import Workload

TABLES = {"EFFICIENCY": costs.EFFICIENCY, "LINKS": costs.LINKS, "PROTOCOL": costs.PROTOCOL,
          "TRAINER": costs.TRAINER}
WORKLOAD_CONSTANTS = ("response_median", "sigma_sample", "max_response")
# settings, not constants: the values each is tried at (instead of -20% / +20%)
SETTINGS = {"engine_tp_scale": (0.5, 2.0), "areal_eta": (4, 8)}


def constants() -> List[str]:
    """``TABLE.key`` of every constant varied (``Workload.<field>`` for the lengths,
    ``SETTING.<name>`` for the settings)."""
    names = [f"{t}.{k}" for t, table in TABLES.items() for k in table]
    names += [f"Workload.{k}" for k in WORKLOAD_CONSTANTS]
    names += [f"SETTING.{k}" for k in SETTINGS]
    return names


def with_settings(spec: dict, overrides: Optional[Dict[str, float]]) -> dict:
    """A run spec with ``overrides``' settings applied: ``engine_tp`` (the paper's engine TP
    for the spec's system times ``SETTING.engine_tp_scale``, within 1..8) and ``eta``
    (AReaL's bound, ``SETTING.areal_eta``)."""
    spec = dict(spec)
    for name, value in (overrides or {}).items():
        table, key = name.split(".")
        if table != "SETTING":
            continue
        if key == "engine_tp_scale":
            spec["engine_tp"] = engine_tp(spec["model"], spec["mode"], value)
        elif key == "areal_eta":
            spec["eta"] = int(value)
    return spec


@contextlib.contextmanager
def applied(overrides: Optional[Dict[str, float]]) -> Iterator[None]:
    """Cost-table overrides (``TABLE.key`` -> value) for the duration of one run."""
    saved = []
    try:
        for name, value in (overrides or {}).items():
            table, key = name.split(".")
            if table in ("Workload", "SETTING"):
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


def engine_tp(model: str, mode: str, scale: float = 1.0) -> int:
    """The paper's engine TP for ``model`` and ``mode`` times ``scale``, within 1..8 GPUs."""
    return max(1, min(8, int(round(costs.paper_engine_tp(model, mode) * scale))))


def unread(override: Optional[Dict[str, float]], protocol: str, mode: str = "",
           model: str = "") -> bool:
    """Whether a run of ``protocol`` (and ``mode``, ``model``) reads none of ``override``'s
    constants (so that its result is the base run's): another protocol's constants, AReaL's
    eta in a run of another system, or an engine TP scale that the clamp to 1..8 GPUs turns
    back into the paper's (half of TP 1)."""
    other = set().union(*(v for k, v in PROTOCOL_READS.items() if k != protocol))
    if mode and costs.system_of(mode) != "areal":
        other.add("SETTING.areal_eta")
    scale = (override or {}).get("SETTING.engine_tp_scale")
    if model and mode and scale is not None and engine_tp(model, mode, scale) == \
            engine_tp(model, mode):
        other.add("SETTING.engine_tp_scale")
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
        if table == "SETTING":
            out += [{name: v} for v in SETTINGS[key]]
            continue
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
