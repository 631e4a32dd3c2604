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
import socket
import time
import urllib.error
from typing import Optional

from ..config.schema import LaminarConfig
from ..netutil import engine_api_key
from .launcher import engine_process


def start_engines(cfg: LaminarConfig, model_path: str, logs: str, procs: list,
                  name: str = "master", api_key: Optional[str] = None) -> list:
    """``rollout.num_engines`` engines of this node (appended to ``procs`` as they start)."""
    engines = []
    for i in range(cfg.rollout.num_engines):
        engine = engine_process(cfg, model_path, os.path.join(logs, f"engine-{name}-{i}.log"), i,
                                api_key=api_key)
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

    client.wait_for("the controller", client.health, lambda a: a.get("ok"),
                    cfg.cluster.join_timeout_s)
    procs: list = []
    agent = None
    supervisor = None
    try:
        if cfg.rollout.relay == "remote":
            agent = _run_remote_node(cfg, client, name, logs, procs, log)
            _watch(cfg, client, procs, log)
        else:
            supervisor = _run_relay_node(cfg, client, name, logs, log)
            _watch(cfg, client, [], log)
    finally:
        if agent is not None:
            agent.stop()
        if supervisor is not None:
            supervisor.stop()
        for p in reversed(procs):
            p.stop()


def _run_relay_node(cfg, client, name, logs, log):
    """A relay and engines under a ``NodeSupervisor``: what dies is restarted."""
    from .supervisor import NodeSupervisor

    info = client.wait_for("the model path", client.cluster, lambda a: a.get("model_path"),
                           cfg.cluster.join_timeout_s)
    supervisor = NodeSupervisor(cfg, client, info["model_path"], logs, name, log=log)
    supervisor.start()
    supervisor.register()
    supervisor.watch()
    log(f"registered: {'master ' if supervisor.master else ''}relay {supervisor.relay.url}, "
        f"{len(supervisor.engines)} {cfg.rollout.backend} engines (supervised)")
    return supervisor


def _run_remote_node(cfg, client, name, logs, procs, log):
    """Engines only; versions come from the master relay through the pull agent."""
    from .launcher import engine_pull_spec
    from .pull_agent import PullAgent

    info = client.wait_for("the master relay", client.cluster,
                           lambda a: a.get("master_relay"), cfg.cluster.join_timeout_s)
    relay_url = info["master_relay"]["url"]
    engines = start_engines(cfg, info["model_path"], logs, procs, name,
                            api_key=engine_api_key(client.token))
    agent = PullAgent(relay_url, [e.url for e in engines],
                      [engine_pull_spec(cfg.rollout, i, cfg.weight_sync)
                       for i in range(len(engines))], client.token, host=cfg.rollout.host)
    agent.start()
    client.register(relay_url, [e.url for e in engines], pull_agent=agent.url)
    log(f"registered: no relay here, {len(engines)} {cfg.rollout.backend} engines pulling from "
        f"{relay_url} through Mooncake (pull agent {agent.url})")
    return agent


def _watch(cfg, client, procs, log) -> None:
    """Until the run is done (or the controller gone): every process of the node must live."""
    unreachable_since = None
    while True:
        for p in procs:
            if p.proc.poll() is not None:
                raise NodeError(f"{p.command[2]} exited with {p.proc.returncode}; see {p.log_path}")
        try:
            if client.health().get("done"):
                log("the run is done; stopping")
                return
            unreachable_since = None
        except (urllib.error.URLError, OSError):
            unreachable_since = unreachable_since or time.time()
            if time.time() - unreachable_since > cfg.cluster.shutdown_grace_s:
                log("the controller is gone; stopping")
                return
        time.sleep(1.0)
