"""Weight transports: how a leased version's buckets reach an engine. One module per transport.

Every transport follows the relay's per-bucket protocol (``/pull`` leases a version, ``/bucket``
serves one bucket at a time, at most two outstanding, ``/release`` ends the lease) and has two
halves behind one small interface:

* a relay-side ``Exporter`` (``check`` a lease's request, ``serve`` one bucket in the
  transport's format, ``free`` the buckets an engine has applied, ``release`` a lease);
* an engine-side ``Puller`` (``pull`` the newest version into an engine between trajectories).

An engine's ``PullSpec`` names its transport; ``make_puller(spec)`` and ``make_exporter(name,
relay_cfg)`` find the module through ``TRANSPORTS``. A new transport is one module defining
``Exporter``, ``Puller``, ``enabled(relay_cfg)`` (whether a relay starts its exporter at
start-up rather than on the first request) and ``spec_for(rollout_cfg, weight_sync, devices)``
(an engine's ``PullSpec`` when ``weight_sync.engine_transport`` names it), plus one line in
``TRANSPORTS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import Exporter, Puller, TransportUnavailable

# transport name (the /pull "format") -> module of this package
TRANSPORTS: Dict[str, str] = {
    "shm": "shm",  # shared-memory handles: CPU engines on the relay's machine
    "sglang_cuda_ipc": "cuda_ipc",  # SGLang's CUDA IPC payloads: GPU engines on its machine
    "mooncake": "mooncake",  # Mooncake transfer-engine reads: engines on other machines
}


@dataclass(frozen=True)
class PullSpec:
    """How an engine takes weights from its relay: ``fmt`` names the transport; ``devices``
    are the engine's GPUs, one per TP rank, in rank order (CUDA IPC); ``options`` are the
    transport's own settings as (key, value) pairs (e.g. Mooncake's protocol)."""

    fmt: str = "shm"
    devices: Tuple[str, ...] = ()
    options: Tuple[Tuple[str, Any], ...] = ()

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)


def transport_module(name: str):
    if name not in TRANSPORTS:
        raise ValueError(f"LMC-E102: format {name!r} is not one of {', '.join(TRANSPORTS)}")
    return importlib.import_module(f"{__name__}.{TRANSPORTS[name]}")


def make_puller(spec: PullSpec) -> Puller:
    return transport_module(spec.fmt).Puller(spec)


def make_exporter(name: str, relay_cfg) -> Exporter:
    """The relay-side half of transport ``name``; ``TransportUnavailable`` when this relay
    cannot serve it (the message says how to enable it)."""
    return transport_module(name).Exporter(relay_cfg)


def enabled_at_start(relay_cfg) -> List[str]:
    """Transports a relay with ``relay_cfg`` starts with (the others start on first use)."""
    return [name for name in TRANSPORTS if transport_module(name).enabled(relay_cfg)]


async def pull_latest_into_engine(relay, engine, current_version: int, *,
                                  spec: PullSpec = PullSpec()) -> Optional[int]:
    """Apply the relay's newest version to ``engine`` (an ``SGLangClient``) if it is newer than
    ``current_version``, through the transport ``spec`` names; returns the new version, or None
    when there is nothing newer. A one-off pull: engines of a run keep their ``Puller``."""
    puller = make_puller(spec)
    try:
        return await puller.pull(relay, engine, current_version)
    finally:
        puller.close()


__all__: Sequence[str] = ["TRANSPORTS", "PullSpec", "Exporter", "Puller", "TransportUnavailable",
                          "make_puller", "make_exporter", "enabled_at_start",
                          "pull_latest_into_engine", "transport_module"]
