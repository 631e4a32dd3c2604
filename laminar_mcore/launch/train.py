"""The ``train`` job on one machine: relay, engines, controller and the trainer world.

    python -m laminar_mcore.launch job=train [mode=laminar|one_step|sync] ...

Composes the roles (rollout/node.py, controller/, trainer/loop.py) in one process tree: with no
``data.train_files`` and no ``model.path`` it runs the built-in demo (a synthetic verifiable
task, a tiny Qwen2-architecture model and a short supervised warm-up, cached, that builds the
starting checkpoint). Every process it starts is stopped when it returns, fails or is
interrupted. It writes ``outputs/<run>/metrics.jsonl`` and the other ``trainer.loggers``
(TensorBoard events by default; W&B, MLflow), ``summary.png`` and ``summary.json``.
"""

from __future__ import annotations

import os
import secrets
import time

from ..config import as_dict, typed
from ..netutil import engine_api_key


def run_train(cfg) -> dict:
    from ..config.gpu_map import machine_gpu_map
    from ..controller.client import ControllerClient
    from ..controller.role import Progress, evaluate_engine, finish_run, load_task, resume_state
    from ..controller.server import Controller
    from ..metrics import MetricsWriter
    from ..rollout.supervisor import NodeSupervisor
    from .local import launch_trainer_world, trainer_nproc

    cfg = typed(cfg)
    t_start = time.time()
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)
    logs = os.path.join(out_dir, "logs")

    def log(msg: str) -> None:
        print(msg, flush=True)

    nproc = trainer_nproc(cfg)
    # each role's GPUs on this machine (config/gpu_map.py; GpuMapError before anything starts
    # if they cannot be disjoint); None without GPUs: no process is masked
    gmap = machine_gpu_map(cfg, "train")
    if gmap is not None:
        log(f"[train] GPU map ({gmap.source}): {gmap.describe()}")
    task = load_task(cfg, out_dir, log)
    token = secrets.token_hex(16)
    nodes: list = []
    controller = None
    metrics = MetricsWriter.for_run(cfg, out_dir)
    try:
        controller = Controller(cfg, task, metrics, token,
                                initial_state=resume_state(cfg, out_dir, log))
        controller_url = controller.start()
        client = ControllerClient(controller_url, token)
        # cluster.rollout_nodes supervised rollout nodes on this machine: the first hosts the
        # master relay, the others chain from it (rollout/supervisor.py); striped, stripe s's
        # master is on the s-th node, so they start side by side
        for k in range(cfg.cluster.rollout_nodes):
            nodes.append(NodeSupervisor(cfg, client, task.model_path, logs, f"node{k}", log=log,
                                        gpus=gmap.node(k) if gmap is not None else None))
        _start_nodes(nodes, together=nodes[0].stripes > 1)
        engines = [e for node in nodes for e in node.engines]
        masters = [r.url for n in nodes for r, m in zip(n.relays, n.masters) if m]
        log(f"[train] mode={cfg.mode}: {len(nodes)} rollout node(s) (master relay(s) "
            f"{', '.join(masters)}), "
            f"{len(engines)} {cfg.rollout.backend} engines, {nproc} trainer processes "
            f"(tp={cfg.parallel.tp} pp={cfg.parallel.pp}); Prometheus: "
            f"{controller_url}/metrics/targets")
        initial = evaluate_engine(cfg, task, engines[0].url, engine_api_key(token))
        metrics.log("eval", step=0, **initial.record(), wall_s=0.0)
        log(f"[train] initial accuracy {initial.accuracy:.3f} (greedy "
            f"{initial.accuracy_greedy:.3f}) on {len(task.evals)} eval prompts")
        for node in nodes:
            node.register()
            node.watch()
        progress = Progress(cfg.trainer.total_steps, metrics)
        try:
            results = launch_trainer_world(
                _trainer_entry, (as_dict(cfg), task.model_path, controller_url, token,
                                 nodes[0].relay.host, nodes[0].publish_port,
                                 os.path.join(out_dir, "checkpoints")),
                nproc, max_restarts=cfg.trainer.max_restarts,
                env=gmap.trainer_env() if gmap is not None else None)
        finally:
            progress.close()
        return finish_run(controller, results[0], initial, t_start, out_dir, log)
    finally:
        if controller is not None:
            controller.stop()
        for node in reversed(nodes):
            node.stop()
        metrics.close()


def _start_nodes(nodes: list, together: bool) -> None:
    """Start the rollout nodes one after the other, or ``together`` (each in a thread); the
    first failure is raised once every start has ended (``run_train`` stops them all)."""
    import threading

    if not together:
        for node in nodes:
            node.start()
        return
    failed: list = []

    def start(node) -> None:
        try:
            node.start()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
            failed.append(exc)
            for other in nodes:  # the others would wait for this node's master relays
                if other is not node:
                    other.stop()

    threads = [threading.Thread(target=start, args=(n,), daemon=True,
                                name=f"laminar-start-{n.name}") for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def _trainer_entry(*args):
    from ..trainer.loop import trainer_main

    return trainer_main(*args)
