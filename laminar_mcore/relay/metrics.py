"""A relay's ``/metrics``: the books of its events and their Prometheus families.

``RelayBooks`` counts what happens where it happens -- a version completes (from the trainer:
published; from the upstream relay: received), a version is forwarded downstream, a pull is
leased, served and released, the master rebuilds its chain, a fault, a recovery -- as plain
counts and running histograms under one short lock of its own, so the data-plane threads pay
one increment and nothing grows with time. ``relay_families(server)`` adds, at scrape time, a
snapshot of the store (versions and bytes held, leases) taken under the store's lock. It never
reads weights, and takes the two locks one after the other, never the books' and then the
store's (a version's completion is booked under the store's lock). The names are documented
in docs/metrics.md.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Sequence

from prometheus_client.core import Metric

from ..metrics.prometheus import SECONDS_BUCKETS, Histogram, counter, gauge
from .store import StoredVersion

FAULTS = ("downstream_failed", "failure_reported", "relay_lost")  # + the store's version_failed
RECOVERIES = ("rechained", "promoted", "master_changed")
REBUILD_REASONS = ("register", "failure", "promotion")
BUCKET_OUTCOMES = ("full", "delta", "fallback", "resent")


class RelayBooks:
    """Counts of one relay's events since it started (see the module docstring)."""

    def __init__(self, formats: Sequence[str] = ()) -> None:
        """``formats``: the pull formats, counted from 0 before their first pull."""
        self._lock = threading.Lock()
        # source ("trainer": published, "upstream": received) -> versions, bytes
        self.versions: Dict[str, int] = {"trainer": 0, "upstream": 0}
        self.bytes: Dict[str, int] = {"trainer": 0, "upstream": 0}
        self.seconds = {"trainer": Histogram(SECONDS_BUCKETS),
                        "upstream": Histogram(SECONDS_BUCKETS)}
        self.forwarded = 0
        self.forwarded_bytes = 0
        self.forward_seconds = Histogram(SECONDS_BUCKETS)
        self.pulls: Dict[str, int] = dict.fromkeys(formats, 0)  # format -> leases granted
        self.pulled_bytes = 0
        self.pull_seconds = Histogram(SECONDS_BUCKETS)
        self.rebuilds: Dict[str, int] = dict.fromkeys(REBUILD_REASONS, 0)
        self.faults: Dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.recoveries: Dict[str, int] = dict.fromkeys(RECOVERIES, 0)
        # buckets received, by how: whole, as a delta rebuilt here, a delta that did not
        # rebuild, and sent again whole after one; and the bytes that crossed the wire
        self.buckets: Dict[str, int] = dict.fromkeys(BUCKET_OUTCOMES, 0)
        self.wire_bytes = 0

    def completed(self, sv: StoredVersion) -> None:
        """``sv`` became this relay's newest version (a store listener, under the store's lock)."""
        source = "trainer" if sv.owner == "trainer" else "upstream"
        with self._lock:  # counter and histogram together: a scrape sees both or neither
            self.versions[source] += 1
            self.bytes[source] += sv.nbytes
            self.seconds[source].observe(max((sv.finished or sv.started) - sv.started, 0.0))

    def forwarded_version(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.forwarded += 1
            self.forwarded_bytes += nbytes
            self.forward_seconds.observe(seconds)

    def bucket(self, outcome: str, full_bytes: int, wire_bytes: int) -> None:
        """A bucket received (from the trainer or upstream): ``outcome`` full, delta or
        fallback; ``wire_bytes`` what crossed the wire for it."""
        with self._lock:
            self.buckets[outcome] = self.buckets.get(outcome, 0) + 1
            self.wire_bytes += wire_bytes

    def _bump(self, table: Dict[str, int], key: str) -> None:
        with self._lock:
            table[key] = table.get(key, 0) + 1

    def leased(self, fmt: str) -> None:
        self._bump(self.pulls, fmt)

    def served(self, nbytes: int) -> None:
        with self._lock:
            self.pulled_bytes += nbytes

    def released(self, seconds: float) -> None:
        with self._lock:
            self.pull_seconds.observe(seconds)

    def rebuilt(self, reason: str) -> None:
        self._bump(self.rebuilds, reason)

    def fault(self, kind: str) -> None:
        self._bump(self.faults, kind)

    def recovery(self, kind: str) -> None:
        self._bump(self.recoveries, kind)

    def families(self, versions_failed: int = 0) -> List[Metric]:
        """``versions_failed``: the store's count of versions broken mid-way."""
        with self._lock:
            versions, nbytes = dict(self.versions), dict(self.bytes)
            forwarded, forwarded_bytes = self.forwarded, self.forwarded_bytes
            pulls, pulled_bytes = dict(self.pulls), self.pulled_bytes
            rebuilds = dict(self.rebuilds)
            faults = dict(self.faults, version_failed=versions_failed)
            recoveries = dict(self.recoveries)
            buckets, wire_bytes = dict(self.buckets), self.wire_bytes
            p = "laminar_relay_"
            hist = {
                "publish": self.seconds["trainer"].family(
                    p + "publish_seconds", "Seconds from a published version's first bucket "
                                           "to its last"),
                "receive": self.seconds["upstream"].family(
                    p + "receive_seconds", "Seconds from a received version's first bucket to "
                                           "its last"),
                "forward": self.forward_seconds.family(
                    p + "forward_seconds", "Seconds of one push to the downstream relay"),
                "pull": self.pull_seconds.family(
                    p + "pull_seconds", "Seconds from a pull's lease to its release")}
        return [
            counter(p + "versions_published", "Versions received complete from the trainer",
                    versions["trainer"]),
            counter(p + "published_bytes", "Bytes of the versions published by the trainer",
                    nbytes["trainer"]),
            hist["publish"],
            counter(p + "versions_received", "Versions received complete from the upstream "
                                             "relay", versions["upstream"]),
            counter(p + "received_bytes", "Bytes of the versions received from upstream",
                    nbytes["upstream"]),
            hist["receive"],
            counter(p + "buckets_received", "Buckets received, by how: full (whole), delta "
                    "(rebuilt here from a delta), fallback (a delta that did not rebuild), "
                    "resent (sent again whole after a fallback)",
                    None, labels=buckets, label="outcome"),
            counter(p + "wire_bytes", "Bytes received on the wire (a delta counts as sent)",
                    wire_bytes),
            counter(p + "versions_forwarded", "Versions pushed to the downstream relay",
                    forwarded),
            counter(p + "forwarded_bytes", "Bytes pushed to the downstream relay",
                    forwarded_bytes),
            hist["forward"],
            counter(p + "pulls", "Versions leased to pullers, by format", None,
                    labels=pulls, label="format"),
            counter(p + "pulled_bytes", "Bytes of buckets served to pullers", pulled_bytes),
            hist["pull"],
            counter(p + "chain_rebuilds", "Chains the master ordered anew, by reason", None,
                    labels=rebuilds, label="reason"),
            counter(p + "faults", "Faults seen, by kind", None, labels=faults, label="kind"),
            counter(p + "recoveries", "Recoveries made, by kind", None, labels=recoveries,
                    label="kind"),
        ]


def relay_families(server) -> Iterable[Metric]:
    """Every metric of ``server`` (a ``RelayServer``): its books and a snapshot of its store."""
    store = server.store
    with store.cond:
        held = [store.latest] if store.latest is not None else []
        held += [sv for sv in store.retired if sv.complete and sv.buckets]  # pinned: leases, pushes
        held_bytes = sum(sv.held_bytes for sv in held)
        arriving = list(store.receiving.values())
        buffers = (held_bytes + sum(sv.nbytes for sv in arriving + store.retired
                                    if not sv.complete)
                   + store.pooled_bytes)
        latest, leases = store.latest_version, len(store.leases)
        versions_failed = store.versions_failed
    p = "laminar_relay_"
    out = [
        gauge(p + "master", "1 on the master relay (the trainer publishes to it), else 0",
              1 if server.master else 0),
        gauge(p + "latest_version", "Newest complete version held (-1: none yet)", latest),
        gauge(p + "versions_held", "Complete versions held in host memory (the newest and "
                                   "older ones leases still pin)", len(held)),
        gauge(p + "held_bytes", "Bytes of the complete versions held", held_bytes),
        gauge(p + "versions_receiving", "Versions arriving now", len(arriving)),
        gauge(p + "host_memory_bytes", "Bytes of shared host memory the relay's buffers take "
                                       "(held, arriving, pooled for reuse)", buffers),
        gauge(p + "leases_active", "Pulls leased and not yet released", leases),
        gauge(p + "long_polls_waiting", "GET /latest long polls waiting for a newer version",
              server.long_polls),
        counter(p + "downstream_changes", "Times this relay's downstream relay changed",
                server.forwarder.downstream_changes),
    ]
    if server.master:
        with server.chain_lock:
            chained = len(server.relays)
        out.append(gauge(p + "chain_relays", "Relays in the master's chain, itself included",
                         chained + 1))
    return out + server.metrics.families(versions_failed)
