"""Multi-node roles: the controller, a rollout node and a trainer rank, each its own process.

    # one machine (or any): the controller; prints its URL
    python -m laminar_mcore.launch job=controller cluster=multinode cluster.controller_addr=HOST
    # every rollout node: a relay and rollout.num_engines engines on this node
    python -m laminar_mcore.launch job=rollout cluster=multinode cluster.controller_addr=HOST \\
        rollout.host=$(hostname -i)
    # every trainer node: torchrun runs one trainer rank per process
    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        -m laminar_mcore.launch job=trainer cluster=multinode cluster.controller_addr=HOST

All roles share the run token through ``LAMINAR_RUN_TOKEN`` and find each other through the
controller (``cluster.controller_addr``:``cluster.controller_port``): the first rollout node to
register hosts the master relay that trainers publish to, the others chain from it; trainers
wait until ``cluster.rollout_nodes`` nodes have registered. When training ends the controller
evaluates, writes the summary and tells the rollout nodes to stop; a rollout node whose
controller is gone stops its engines on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Optional

from omegaconf import OmegaConf

TOKEN_ENV = "LAMINAR_RUN_TOKEN"


class ClusterError(RuntimeError):
    pass


def run_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 8:
        raise ClusterError(f"multi-node roles share a secret run token: export {TOKEN_ENV}=<at "
                           "least 8 characters, e.g. $(openssl rand -hex 16)> on every node")
    return token


def controller_url(cfg) -> str:
    port = int(cfg.cluster.controller_port)
    if port <= 0:
        raise ClusterError("cluster.controller_port must be set (> 0) for job=rollout and "
                           "job=trainer: the port the controller listens on")
    return f"http://{cfg.cluster.controller_addr}:{port}"


def _call(method: str, url: str, token: str, body: Optional[dict] = None,
          timeout: float = 30.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def _wait_for(url: str, token: str, what: str, ready, timeout_s: float, log) -> dict:
    """Poll ``GET url`` until ``ready(answer)``; unreachable counts as not yet."""
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        try:
            answer = _call("GET", url, token, timeout=10)
            if ready(answer):
                return answer
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise ClusterError(f"{url} refused the run token: is {TOKEN_ENV} the same on "
                                   "every node?") from exc
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.5)
    raise ClusterError(f"gave up waiting for {what} at {url} after {timeout_s:.0f}s ({last})")


# ---------------------------------------------------------------------- controller
def run_controller(cfg) -> dict:
    from ..metrics import MetricsWriter
    from .train import _codec_and_rows, _progress, evaluate, finish_run, make_controller, resume_state

    token = run_token()
    t_start = time.time()
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    codec, rows, evals, model_path = _codec_and_rows(cfg, out_dir, log)
    metrics = MetricsWriter(out_dir)
    controller = None
    try:
        controller = make_controller(
            cfg, engine_urls=[], relay_url=None, token=token, rows=rows, codec=codec,
            metrics=metrics, initial_state=resume_state(cfg, out_dir, log),
            host=cfg.cluster.controller_addr, port=int(cfg.cluster.controller_port),
            info={"model_path": os.path.abspath(model_path),
                  "checkpoint_dir": os.path.abspath(os.path.join(out_dir, "checkpoints"))})
        url = controller.start()
        log(f"LAMINAR_CONTROLLER_URL={url}")
        log(f"[controller] mode={cfg.mode}; waiting for {cfg.cluster.rollout_nodes} rollout "
            f"node(s) and the trainer ranks (token in ${TOKEN_ENV})")
        deadline = time.time() + cfg.cluster.join_timeout_s
        while len(controller.rollout_nodes) < cfg.cluster.rollout_nodes or controller.master_relay is None:
            if time.time() > deadline:
                raise ClusterError(f"only {len(controller.rollout_nodes)} of "
                                   f"{cfg.cluster.rollout_nodes} rollout nodes registered within "
                                   f"cluster.join_timeout_s={cfg.cluster.join_timeout_s}")
            time.sleep(0.2)
        first_engine = controller.rollout_nodes[0]["engines"][0]
        eval_sampling = OmegaConf.to_container(cfg.rollout.sampling)
        initial = asyncio.run(evaluate(first_engine, evals, codec, eval_sampling, cfg.data.reward_fn))
        metrics.log("eval", step=0, accuracy=initial)
        log(f"[controller] {len(controller.rollout_nodes)} rollout node(s), "
            f"{len(controller.manager.engines)} engines; initial accuracy {initial:.3f}")
        controller.ready = True
        progress = _progress(cfg.trainer.total_steps, metrics)
        try:
            while not controller.trainer_done_event.wait(1.0):
                if controller.error is not None:
                    raise ClusterError(f"controller failed: {controller.error}")
        finally:
            progress.close()
        return finish_run(cfg, controller, controller.master_relay["url"], first_engine, token,
                          evals, codec, eval_sampling, metrics, controller.trainer_done, initial,
                          t_start, model_path, out_dir, log)
    finally:
        if controller is not None:
            controller.finished = True
            # rollout nodes poll /health for "done"; give them a moment before the server goes
            time.sleep(min(3.0, cfg.cluster.shutdown_grace_s))
            controller.stop()
        metrics.close()


# ---------------------------------------------------------------------- rollout node
def run_rollout(cfg) -> None:
    from .train import start_rollout_node

    token = run_token()
    url = controller_url(cfg)
    name = f"{socket.gethostname()}-{os.getpid()}"
    logs = os.path.join(cfg.output_dir, cfg.run_name, "logs", name)

    def log(msg: str) -> None:
        print(f"[rollout {name}] {msg}", flush=True)

    _wait_for(f"{url}/health", token, "the controller", lambda a: a.get("ok"),
              cfg.cluster.join_timeout_s, log)
    role = _call("POST", f"{url}/relay_role", token, {}, timeout=cfg.cluster.join_timeout_s + 30)
    procs: list = []
    try:
        relay, engines, publish_port = start_rollout_node(
            cfg, role["model_path"], token, logs, procs,
            master_url=None if role["master"] else role["master_url"],
            relay_id="master" if role["master"] else name)
        body = {"relay_url": relay.url, "engines": [e.url for e in engines]}
        if role["master"]:
            body["publish"] = {"host": relay.host, "port": publish_port}
        _call("POST", f"{url}/register", token, body)
        log(f"registered: {'master ' if role['master'] else ''}relay {relay.url}, "
            f"{len(engines)} {cfg.rollout.backend} engines")
        unreachable_since = None
        while True:
            for p in procs:
                if p.proc.poll() is not None:
                    raise ClusterError(f"{p.command[2]} exited with {p.proc.returncode}; see {p.log_path}")
            try:
                if _call("GET", f"{url}/health", token, timeout=10).get("done"):
                    log("the run is done; stopping")
                    return
                unreachable_since = None
            except (urllib.error.URLError, OSError):
                unreachable_since = unreachable_since or time.time()
                if time.time() - unreachable_since > cfg.cluster.shutdown_grace_s:
                    log("the controller is gone; stopping")
                    return
            time.sleep(1.0)
    finally:
        for p in reversed(procs):
            p.stop()


# ---------------------------------------------------------------------- trainer rank
def run_trainer(cfg) -> dict:
    """One trainer rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT from its env)."""
    from ..trainer.loop import trainer_main

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ClusterError("job=trainer runs under torchrun (it reads RANK and WORLD_SIZE); for "
                           "one machine use job=train, which starts every role")
    world = int(os.environ["WORLD_SIZE"])
    t = cfg.cluster.trainer
    if world != t.nnodes * t.nproc_per_node:
        raise ClusterError(f"torchrun started {world} processes but cluster.trainer is "
                           f"{t.nnodes} x {t.nproc_per_node}; make them agree")
    token = run_token()
    url = controller_url(cfg)
    info = _wait_for(f"{url}/cluster", token, "the rollout nodes", lambda a: a.get("ready"),
                     cfg.cluster.join_timeout_s, print)
    relay = info["master_relay"]
    result = trainer_main(OmegaConf.to_container(cfg, resolve=True), info["model_path"], url, token,
                          relay["publish_host"], relay["publish_port"], info["checkpoint_dir"])
    if int(os.environ["RANK"]) == 0:
        _call("POST", f"{url}/done", token, result)
    return result
