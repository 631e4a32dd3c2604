"""A rollout node: this machine's relay and engines.

``run(cfg, client)`` is the rollout role of a multi-node run (``job=rollout``): a
``NodeSupervisor`` (rollout/supervisor.py, which the single-machine launcher uses too) asks the
controller whether it hosts the master relay, starts its relay and engines, registers them and
restarts what dies; the role stops when the run is done or its controller is gone. With ``rollout.relay=remote`` the node
runs no relay: its engines read every version from the master relay through Mooncake, by a
pull agent in this process (rollout/pull_agent.py).
"""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.error
from typing import Optional

from ..config.budgets import join_timeout_s
from ..config.gpu_map import GpuMapError, NodeGpus, machine_gpu_map
from ..config.schema import LaminarConfig
from ..netutil import engine_api_key
from .launcher import engine_process


def start_engines(cfg: LaminarConfig, model_path: str, logs: str, procs: list,
                  name: str = "master", api_key: Optional[str] = None,
                  gpus: Optional[NodeGpus] = None) -> list:
    """``rollout.num_engines`` engines of this node (appended to ``procs`` as they start);
    ``gpus``: this node's GPU map (each engine's ``CUDA_VISIBLE_DEVICES``), None: no GPUs."""
    engines = []
    for i in range(cfg.rollout.num_engines):
        engine = engine_process(cfg, model_path, os.path.join(logs, f"engine-{name}-{i}.log"), i,
                                api_key=api_key, visible=gpus.engines[i] if gpus else None)
        procs.append(engine.start())
        engines.append(engine)
    return engines


class NodeError(RuntimeError):
    pass


def run(cfg: LaminarConfig, client) -> None:
    """The rollout role; ``client`` is a ``ControllerClient`` (the launcher makes it)."""
    name = f"{socket.gethostname()}-{os.getpid()}"
    logs = os.path.join(cfg.output_dir, cfg.run_name, "logs", name)

    def log(msg: str) -> None:
        print(f"[rollout {name}] {msg}", flush=True)

    try:  # this node's GPUs for its engines and relay (config/gpu_map.py); None: no GPUs
        gmap = machine_gpu_map(cfg, "rollout")
    except GpuMapError as exc:
        raise NodeError(str(exc)) from None
    gpus = gmap.node(0) if gmap is not None else None
    if gmap is not None:
        log(f"GPU map ({gmap.source}): {gmap.describe()}")
    client.wait_for("the controller", client.health, lambda a: a.get("ok"),
                    join_timeout_s(cfg))
    procs: list = []
    agent = None
    supervisor = None
    held: list = []  # the supervisor as soon as it exists (stopped below)
    previous = signal.signal(signal.SIGTERM, _leave_signal)
    try:
        try:
            if cfg.rollout.relay == "remote":
                agent = _run_remote_node(cfg, client, name, logs, procs, log, gpus)
                _watch(cfg, client, procs, log)
            else:
                supervisor = _run_relay_node(cfg, client, name, logs, log, held, gpus)
                _watch(cfg, client, [], log)
        except Leave:
            if supervisor is None and held:
                supervisor = held[0]
                log("SIGTERM before this node registered: stopping")
            elif supervisor is not None:
                _leave(cfg, client, [e.url for e in supervisor.engines], log)
            else:
                _leave(cfg, client, [p.url for p in procs] if agent is not None else [], log)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if agent is not None:
            agent.stop()
        if supervisor is None and held:  # it failed before registering (or the controller
            supervisor = held[0]         # was gone): what it started stops with it
        if supervisor is not None:
            supervisor.stop()
        for p in reversed(procs):
            p.stop()


class Leave(BaseException):
    """SIGTERM: this node leaves the run gracefully (not an Exception: nothing swallows it)."""


def _leave_signal(signum, frame):
    raise Leave()


def _leave(cfg, client, engine_urls, log) -> None:
    """Ask the controller to retire this node's engines (their trajectories finish, or are
    handed back, within ``cluster.shutdown_grace_s``: controller/elastic.py), then stop."""
    if not engine_urls:
        log("SIGTERM before this node registered: stopping")
        return
    log(f"SIGTERM: leaving the run ({len(engine_urls)} engines; their trajectories finish or "
        f"are handed back within cluster.shutdown_grace_s={cfg.cluster.shutdown_grace_s:g})")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM stops at once
    try:
        ended = client.leave(engine_urls, cfg.cluster.shutdown_grace_s)
        log(f"left the run: {ended.get('finished', 0)} trajectories finished here, "
            f"{ended.get('handed_back', 0)} handed back, {ended.get('discarded', 0)} discarded")
    except (OSError, RuntimeError) as exc:  # ControllerError is a RuntimeError
        log(f"could not leave gracefully ({exc}); stopping")


def _run_relay_node(cfg, client, name, logs, log, held: list, gpus=None):
    """A relay and engines under a ``NodeSupervisor``: what dies is restarted."""
    from .supervisor import NodeSupervisor

    info = client.wait_for("the model path", client.cluster, lambda a: a.get("model_path"),
                           join_timeout_s(cfg))
    supervisor = NodeSupervisor(cfg, client, info["model_path"], logs, name, log=log, gpus=gpus)
    held.append(supervisor)
    started = time.time()
    supervisor.start()
    took = time.time() - started
    supervisor.register()
    supervisor.watch()
    relays = ", ".join(f"{'master ' if m else ''}relay {r.url}"  # (one per stripe)
                       for r, m in zip(supervisor.relays, supervisor.masters))
    log(f"registered: {relays}, "
        f"{len(supervisor.engines)} {cfg.rollout.backend} engines (supervised; started in "
        f"{took:.1f} s)")
    return supervisor


def _run_remote_node(cfg, client, name, logs, procs, log, gpus=None):
    """Engines only; versions come from the master relay through the pull agent."""
    from .launcher import engine_pull_spec
    from .pull_agent import PullAgent

    info = client.wait_for("the master relay", client.cluster,
                           lambda a: a.get("master_relay"), join_timeout_s(cfg))
    relay_url = info["master_relay"]["url"]
    started = time.time()
    engines = start_engines(cfg, info["model_path"], logs, procs, name,
                            api_key=engine_api_key(client.token), gpus=gpus)
    took = time.time() - started
    agent = PullAgent(relay_url, [e.url for e in engines],
                      [engine_pull_spec(cfg.rollout, i, cfg.weight_sync, info["model_path"])
                       for i in range(len(engines))], client.token, host=cfg.rollout.host)
    agent.start()
    client.register(relay_url, [e.url for e in engines], pull_agent=agent.url)
    log(f"registered: no relay here, {len(engines)} {cfg.rollout.backend} engines pulling from "
        f"{relay_url} through Mooncake (pull agent {agent.url}; started in {took:.1f} s)")
    return agent


def _refused(exc: BaseException) -> bool:
    """Whether the controller's host answered that nothing listens (the controller ended),
    rather than not answering at all (a network that is down, maybe for a while)."""
    return isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)


def _watch(cfg, client, procs, log) -> None:
    """Until the run is done (or the controller gone): every process of the node must live.

    A controller whose port refuses connections has ended: the node stops after
    ``cluster.shutdown_grace_s``. One that does not answer at all may be behind a link that is
    down (this host's or its own): the node keeps its relay and engines for
    ``cluster.join_timeout_s`` (at least the grace) and goes on serving when the controller
    answers again -- a network outage does not end a rollout host."""
    unreachable_since = None
    while True:
        for p in procs:
            if p.proc.poll() is not None:
                raise NodeError(f"LMC-E604: {p.command[2]} exited with {p.proc.returncode}; see "
                                f"{p.log_path}")
        try:
            if client.health().get("done"):
                log("the run is done; stopping")
                return
            if unreachable_since is not None:
                log(f"the controller answers again after {time.time() - unreachable_since:.0f} s")
            unreachable_since = None
        except (urllib.error.URLError, OSError) as exc:
            if unreachable_since is None:
                log(f"the controller does not answer ({exc}); waiting for it")
            unreachable_since = unreachable_since or time.time()
            refused = _refused(exc)
            patience = cfg.cluster.shutdown_grace_s if refused else max(
                cfg.cluster.shutdown_grace_s, join_timeout_s(cfg))
            if time.time() - unreachable_since > patience:
                log("the controller is gone; stopping" if refused else
                    f"the controller has not answered for {patience:.0f} s "
                    "(cluster.join_timeout_s); stopping")
                return
        time.sleep(1.0)
