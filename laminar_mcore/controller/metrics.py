"""The controller's ``GET /metrics``: its books as Prometheus metrics, read at scrape time.

Every name is documented in docs/metrics.md; the books are the controller's own (the rollout
manager's stats, the experience buffer, the fault records), so ``/metrics``, ``summary.json``
and the trace never disagree. Read-only: nothing here changes the run.
"""

from __future__ import annotations

from typing import Iterable, List
from urllib.parse import urlsplit

from prometheus_client.core import Metric

from ..metrics.prometheus import counter, gauge

PREFIX = "laminar_controller_"
# an engine's state, as the rollout manager sees it (first that applies)
ENGINE_STATES = ("evicted", "restarting", "unhealthy", "pulling", "paused", "draining",
                 "generating", "idle")


def engine_state(e) -> str:
    if e.evicted:
        return "evicted"
    if e.restarting:
        return "restarting"
    if not e.healthy:
        return "unhealthy"
    if e.pulling:
        return "pulling"
    if e.paused:
        return "paused"
    if e.draining:
        return "draining"
    return "generating" if e.in_flight else "idle"


def controller_metrics(ctrl) -> Iterable[Metric]:
    """The metric families of ``ctrl`` (a ``controller.server.Controller``) now."""
    p = PREFIX
    manager, buffer = ctrl.manager, ctrl.buffer
    engines = list(manager.engines) if manager else []
    s = manager.stats if manager else None
    out: List[Metric] = [
        counter(p + "trajectories_generated", "Trajectories whose generation ended, kept or "
                "not (generated = consumed + buffered + discarded)", s.generated if s else 0),
        counter(p + "trajectories_consumed", "Trajectories handed to the trainer",
                buffer.consumed),
        gauge(p + "trajectories_buffered", "Rewarded trajectories waiting in the experience "
              "buffer", buffer.buffered),
        gauge(p + "trajectories_in_flight", "Trajectories being generated (the partial "
              "response pool)", len(ctrl.partial)),
        counter(p + "trajectories_discarded", "Trajectories discarded, by reason",
                labels=dict(buffer.discarded), label="reason"),
        counter(p + "trajectories_mixed_versions", "Consumed trajectories whose tokens came "
                "from more than one weight version (only mode=areal makes them)",
                ctrl.mixed_version_consumed),
        ctrl.staleness.family(p + "staleness", "Staleness of consumed trajectories at "
                              "consumption (trainer version - generating version)"),
        gauge(p + "trainer_version", "The newest weight version the trainer reported",
              ctrl.trainer_version),
        gauge(p + "engines", "Engines in each state",
              labels={state: sum(1 for e in engines if engine_state(e) == state)
                      for state in ENGINE_STATES}, label="state"),
        gauge(p + "engine_version", "The weight version each engine holds",
              labels={e.name: e.version for e in engines}, label="engine"),
        gauge(p + "engine_in_flight", "Trajectories in flight on each engine",
              labels={e.name: len(e.in_flight) for e in engines}, label="engine"),
        counter(p + "engine_pulls", "Weight versions engines pulled from their relays",
                s.pulls if s else 0),
        counter(p + "engine_pull_retries", "Pulls that failed on the relay's side and were "
                "tried again", s.pull_retries if s else 0),
        counter(p + "repacks", "Trajectories moved off a long-tail engine (Laminar's repack)",
                s.repacked if s else 0),
        counter(p + "repack_rounds", "Repack rounds that moved at least one trajectory",
                s.repack_rounds if s else 0),
        counter(p + "trajectories_resumed", "Trajectories resumed on another engine of their "
                "version after a failure", s.resumed if s else 0),
        counter(p + "trajectories_interrupted", "mode=areal: requests aborted for a weight "
                "update and resubmitted", s.interrupted if s else 0),
        counter(p + "protocol_errors", "Engine streams that could not be read as "
                "SGLang's protocol (their trajectories discarded, the engines kept)",
                s.protocol_errors if s else 0),
        counter(p + "request_errors", "Requests a working engine refused (4xx: their "
                "trajectories discarded as request_error:<code>, the engines kept)",
                s.request_errors if s else 0),
        counter(p + "prompts_too_long", "Prompts filtered before they were sent: longer than "
                "the engines' context with the response budget", s.prompts_too_long if s else 0),
        counter(p + "engine_restarts", "Engines restarted by their node's supervisor",
                s.engine_restarts if s else 0),
        gauge(p + "engines_evicted", "Engines out of the run for good",
              len(s.evicted) if s else 0),
        counter(p + "relay_failovers", "Master relay promotions (failovers)",
                ctrl.relay_failovers),
        counter(p + "trainer_restarts", "Trainer restarts from a checkpoint",
                ctrl.trainer_restarts),
        counter(p + "reward_worker_restarts", "Reward workers replaced after dying or timing "
                "out", ctrl.reward.restarts),
    ]
    if s is not None:
        out.append(s.pull_seconds.family(p + "engine_pull_seconds", "Seconds of each completed "
                                         "engine pull (request to the new version applied)"))
    faults = {}
    for f in list(ctrl.faults):
        key = (str(f.get("kind")), str(f.get("what")))
        faults[key] = faults.get(key, 0) + 1
    out.append(_two_label_counter(
        p + "faults", "Fault and recovery events by kind (engine, relay, trainer, node) and "
        "event (what happened: down, restarted, serving, promoted, ...)", faults))
    return out


def scrape_targets(ctrl) -> List[dict]:
    """Prometheus HTTP service discovery (``http_sd_configs``): the controller and every relay
    it knows now (the master and each rollout node's; a restarted relay's new address)."""
    relays = ctrl.relay_urls()  # every stripe's (controller/masters.py)
    if ctrl.manager is not None:  # engines added by the local launcher, not as nodes
        relays += [u for e in ctrl.manager.engines for u in e.relay.url.split(",")]
    out = [{"targets": [urlsplit(ctrl.url).netloc], "labels": {"role": "controller"}}]
    hosts = sorted({urlsplit(u).netloc for u in relays if u})
    if hosts:
        out.append({"targets": hosts, "labels": {"role": "relay"}})
    return out


def _two_label_counter(name: str, doc: str, counts) -> Metric:
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=["kind", "event"])
    for (kind, event), n in sorted(counts.items()):
        family.add_metric([kind, event], n)
    return family
