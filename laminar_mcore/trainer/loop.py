"""The trainer's side of a run, one function per rank (started by torchrun or its API).

Rank 0 takes each batch from the controller (``GET /batch``) and the batch is scattered to DP
ranks by the actor; after each optimizer step every stage publishes the new version once to the
master relay (the trainer waits only for the host copy) and rank 0 reports the step
(``POST /trained``). Checkpoints are saved every ``trainer.save_interval`` steps and
``trainer.resume=auto`` continues from the newest complete one. ``weight_sync.publish_lag`` = L
(a benchmark knob) publishes, at step v, the weights of step v - L instead (``lag.py``) and the
final weights after the last step; a resumed world publishes its resumed weights at once, then
lags again from there.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
import torch.distributed as dist


def trainer_main(cfg_dict: dict, model_path: str, controller_url: str, token: str,
                 relay_host: str, publish_port: int, ckpt_dir: str) -> dict:
    from ..config import typed
    from ..weights.delta import triton_importable
    from ..weights.shards import run_stripes
    from ..controller.client import STOP, ControllerClient
    from ..data.checkpoints import resolve_resume
    from ..models.hf import SafetensorsReader, load_hf_config
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel
    from ..parallel.groups import agreed_restarts, broadcast_int
    from .lag import LaggedPublisher
    from .publisher import WeightPublisher, parameter_dtype
    from ..config.plan import delta_choice
    from .actor import MegatronActor
    from .checkpoint import load_checkpoint, save_checkpoint
    from ..weights.snapshots import snapshot_dir
    from .export import save_snapshot
    from .model import load_hf_checkpoint, resolve_dtype
    from ..procname import TRAINER, set_process_name

    set_process_name(TRAINER)  # what top, pgrep and the chaos harness see
    cfg = typed(cfg_dict)
    controller = ControllerClient(controller_url, token)
    if cfg.cluster.threads_per_process > 0:
        torch.set_num_threads(cfg.cluster.threads_per_process)
    p = cfg.parallel
    init_trainer_parallel(tp=p.tp, pp=p.pp, cp=p.cp, seed=cfg.seed,
                          timeout_s=cfg.trainer.collective_timeout_s, ep=p.ep,
                          expert_tp=p.expert_tp)
    try:
        hf_config = load_hf_config(model_path)
        algo, trainer = cfg.algo, cfg.trainer
        reader = SafetensorsReader(model_path)
        actor = MegatronActor(hf_config, algo, trainer, p, dtype=resolve_dtype(cfg.model.dtype),
                              init_weights=lambda model: load_hf_checkpoint(model, hf_config, reader))
        if dist.get_rank() == 0:
            print(f"[trainer] {actor.describe()}", flush=True)
        ws = cfg.weight_sync
        # The master relay may have changed since this world was started (elected or
        # restarted after a failure): the controller knows the current one (striped
        # over weight_sync.master_relays: one per stripe, controller/masters.py).
        masters = _current_masters(controller, [(relay_host, publish_port)],
                                   stripes=run_stripes(cfg))
        # (deltas found on this GPU where the publisher will: weights.delta.delta_placement)
        delta_on, delta_why = delta_choice(
            cfg, parameter_dtype(actor.model), hf_config,
            device_encode=torch.cuda.is_available() and triton_importable())
        if dist.get_rank() == 0:
            print(f"[trainer] {delta_why}", flush=True)
        publisher = WeightPublisher(actor.model, hf_config, master_relays=masters,
                                    bucket_bytes=ws.bucket_mb * 2**20,
                                    chunk_bytes=ws.chunk_mb * 2**20,
                                    timeout_s=ws.publish_timeout_s,
                                    locate_master=lambda failed: _next_master(
                                        controller, failed, publisher.stripe),
                                    failover_timeout_s=ws.failover_timeout_s, token=token,
                                    delta="on" if delta_on else "off",
                                    anchor_interval=ws.anchor_interval, export=ws.export)
        publisher.on_refused = controller.refused  # (stage leads: they talk to the relay)
        if delta_on and dist.get_rank() == 0:
            print(f"[trainer] {publisher.delta_where}", flush=True)
        start = 0
        rank = dist.get_rank()
        # A restart of this world after a crash (torchrun counts them) resumes from the newest
        # complete checkpoint even when the run started with trainer.resume=none.
        restarts = agreed_restarts()  # one decision for the whole world
        resume = trainer.resume if trainer.resume not in (None, "", "none") or not restarts \
            else "auto"
        path = resolve_resume(resume, ckpt_dir)
        if path:
            start, _ = load_checkpoint(path, actor)
        if path or restarts:
            # AReaL's recovery of the version counter: versions published before the crash
            # (after the checkpoint) are held by relays and engines; the resumed weights get a
            # newer number, so every engine pulls them and versions stay monotone.
            floor = broadcast_int(int(controller.cluster(newest=True).get("trainer_version")
                                      or 0)
                                  if rank == 0 else 0)
            if floor > actor.version:
                actor.version = floor + 1
            publisher.publish(actor.version)  # engines catch up to the resumed weights
            if rank == 0:
                controller.resumed(start, actor.version, restarts)
                print(f"[trainer] resumed at step {start} ({path or 'initial weights'}) as "
                      f"version {actor.version} (restart {restarts})", flush=True)
        # at step v, the weights of step v - publish_lag (0: v itself); the engines start with
        # version 0 or, after a resume, the version just published
        lagged = LaggedPublisher(publisher, actor.model, ws.publish_lag, published=actor.version)
        steps_done = start
        for step in range(start + 1, trainer.total_steps + 1):
            waited = time.perf_counter()
            limit = trainer.batch_timeout_s
            batch = controller.batch(deadline_s=limit) if rank == 0 else None
            # The other ranks wait on a gloo group with a longer timeout than the batch's, so a
            # long rollout never trips the world's collective timeout (or NCCL's watchdog).
            code = broadcast_int(0 if batch is None else 2 if batch == STOP else 1,
                                 timeout_s=limit + 600.0)
            if code == 2:  # the run's STOP file: end here, as if total_steps were reached
                if rank == 0:
                    print(f"[trainer] stopping after step {steps_done}: the run's STOP file",
                          flush=True)
                break
            if code == 0:
                raise RuntimeError(f"LMC-E301: no batch from the controller for {limit:.0f} s "
                                   "(trainer.batch_timeout_s); are the engines alive?")
            waited = time.perf_counter() - waited
            stats = actor.train_step(batch)
            published = lagged.publish(actor.version)
            if rank == 0:
                # the bytes of the newest version this stage lead finished sending (its full
                # size and what crossed the wire: less when it went as deltas)
                sent = publisher.sent_stats
                if sent:
                    stats = dict(stats, weights_version_sent=sent["version"],
                                 weights_full_bytes=sent["full_bytes"],
                                 weights_sent_bytes=sent["sent_bytes"],
                                 weights_delta_buckets=sent["delta_buckets"])
                controller.trained(step, actor.version, stats, published.blocked_s, waited)
            if trainer.eval_offline and trainer.eval_interval \
                    and step % trainer.eval_interval == 0 and step < trainer.total_steps:
                # evaluated after training (the final weights are evaluated live at the end)
                save_snapshot(actor.model, hf_config,
                              snapshot_dir(os.path.dirname(ckpt_dir), step),
                              step=step, version=actor.version)
            if trainer.save_interval and step % trainer.save_interval == 0:
                # The controller's data module (prompt pool position, buffer, in-flight
                # trajectories) is saved with the trainer's state, from rank 0.
                extra = controller.state() if rank == 0 else None
                save_checkpoint(ckpt_dir, step, actor, extra_state=extra)
            steps_done = step
        lagged.finish(actor.version)  # the final weights, for the final evaluation
        publisher.wait()
        publisher.close()
        return {"steps": steps_done, "version": actor.version}
    finally:
        destroy_trainer_parallel()


def _current_masters(controller, fallback, stripes: Optional[int] = None,
                     wait_s: float = 60.0):
    """Each stripe's master relay's publish address as the controller knows it (or, unstriped,
    ``fallback``: the launcher's address of the one master). ``stripes``: how many the run
    has (None: as many as the controller names). A striped run's trainer never falls back to
    one master: it asks for up to ``wait_s``, then raises (LMC-E406)."""
    deadline = time.time() + wait_s
    while True:
        try:
            info = controller.cluster()
        except Exception:  # noqa: BLE001 - an older controller, or none yet
            info = {}
        relays = info.get("master_relays") or [info.get("master_relay")]
        if all(r and r.get("publish_port") for r in relays) and \
                len(relays) == (stripes or len(relays)):
            return [(str(r["publish_host"]), int(r["publish_port"])) for r in relays]
        if (stripes or 1) == 1:
            return fallback
        if time.time() > deadline:
            raise RuntimeError(f"LMC-E406: the controller did not name the master relays of "
                               f"the {stripes} stripes (weight_sync.master_relays) within "
                               f"{wait_s:g} s: it names {relays}")
        time.sleep(1.0)


def _next_master(controller, failed, stripe: int = 0, wait_s: float = 15.0):
    """The publish address of the master relay of ``stripe`` that replaced ``failed`` (waits
    up to ``wait_s`` for the controller to learn of one; else the newest it knows)."""
    deadline = time.time() + wait_s
    current = tuple(failed)
    while time.time() < deadline:
        masters = _current_masters(controller, [failed], wait_s=0.0)
        current = tuple(masters[stripe] if stripe < len(masters) else failed)
        if current != tuple(failed):
            return current
        time.sleep(0.5)
    return current


def run(cfg, token: str) -> dict:
    """One trainer rank of a multi-node run (``job=trainer``, under torchrun: RANK, WORLD_SIZE,
    MASTER_ADDR/PORT from its env): waits until the rollout nodes are up, trains, and rank 0
    tells the controller it is done. Local rank 0 reports the node to the controller meanwhile
    (trainer/watch.py)."""
    from ..config import as_dict
    from ..config.budgets import join_timeout_s
    from ..controller.client import ControllerClient, ControllerError, controller_url
    from .watch import NodeReporter

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ControllerError("LMC-E203: job=trainer runs under torchrun (it reads RANK and "
                              "WORLD_SIZE); for one machine use job=train, which starts every role")
    world = int(os.environ["WORLD_SIZE"])
    t = cfg.cluster.trainer
    if world != t.nnodes * t.nproc_per_node:
        raise ControllerError(f"LMC-E203: torchrun started {world} processes but cluster.trainer "
                              f"is {t.nnodes} x {t.nproc_per_node}; make them agree")
    url = controller_url(cfg)
    client = ControllerClient(url, token)
    info = client.wait_for("the rollout nodes", client.cluster, lambda a: a.get("ready"),
                           join_timeout_s(cfg))
    relay = info["master_relay"]
    # local rank 0 reports this node to the controller; a node lost stops the run (watch.py)
    reporter = NodeReporter(client, limit_s=cfg.trainer.collective_timeout_s / 2).start() \
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    try:
        result = trainer_main(as_dict(cfg), info["model_path"], url, token,
                              relay["publish_host"], relay["publish_port"], info["checkpoint_dir"])
        if int(os.environ["RANK"]) == 0:
            client.done(result)
    except Exception as exc:
        if reporter is not None:  # a trainer node lost? the controller says within limit_s
            reporter.await_verdict(exc)
        raise
    finally:
        if reporter is not None:
            reporter.stop()
    return result
