"""The trainer's side of a run, one function per rank (started by torchrun or its API).

Rank 0 takes each batch from the controller (``GET /batch``) and the batch is scattered to DP
ranks by the actor; after each optimizer step every stage publishes the new version once to the
master relay (the trainer waits only for the host copy) and rank 0 reports the step
(``POST /trained``). Checkpoints are saved every ``trainer.save_interval`` steps and
``trainer.resume=auto`` continues from the newest complete one.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Optional

import torch
import torch.distributed as dist


def _http(method: str, url: str, token: str, body: Optional[dict] = None, timeout: float = 120.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
        return resp.status, (json.loads(text) if text else None)


def fetch_batch(controller_url: str, token: str, deadline_s: float):
    """Rank 0: the next batch of trajectories, or None if none came before the deadline."""
    from ..data.trajectory import Trajectory

    end = time.time() + deadline_s
    while time.time() < end:
        status, body = _http("GET", f"{controller_url}/batch?timeout=5", token)
        if status == 200:
            return [Trajectory.from_dict(t) for t in body["trajectories"]]
    return None


def trainer_main(cfg_dict: dict, model_path: str, controller_url: str, token: str,
                 relay_host: str, publish_port: int, ckpt_dir: str) -> dict:
    from omegaconf import OmegaConf

    from ..config.schema import AlgoConfig, TrainerConfig
    from ..models.hf import SafetensorsReader, load_hf_config
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel, wait_for_rank0
    from ..weights.publisher import WeightPublisher
    from .actor import MegatronActor
    from .checkpoint import load_checkpoint, resolve_resume, save_checkpoint
    from .model import load_hf_checkpoint, resolve_dtype

    cfg = OmegaConf.create(cfg_dict)
    if cfg.cluster.threads_per_process > 0:
        torch.set_num_threads(cfg.cluster.threads_per_process)
    p = cfg.parallel
    init_trainer_parallel(tp=p.tp, pp=p.pp, cp=p.cp, seed=cfg.seed,
                          timeout_s=cfg.trainer.collective_timeout_s)
    try:
        hf_config = load_hf_config(model_path)
        algo = AlgoConfig(**OmegaConf.to_container(cfg.algo))
        trainer = TrainerConfig(**OmegaConf.to_container(cfg.trainer))
        reader = SafetensorsReader(model_path)
        actor = MegatronActor(hf_config, algo, trainer, dtype=resolve_dtype(cfg.model.dtype),
                              use_distributed_optimizer=p.use_distributed_optimizer,
                              sequence_parallel=p.sequence_parallel,
                              init_weights=lambda model: load_hf_checkpoint(model, hf_config, reader))
        publisher = WeightPublisher(actor.model, hf_config, relay_host=relay_host,
                                    publish_port=publish_port,
                                    bucket_bytes=cfg.weight_sync.bucket_mb * 2**20,
                                    chunk_bytes=cfg.weight_sync.chunk_mb * 2**20)
        start = 0
        path = resolve_resume(trainer.resume, ckpt_dir)
        if path:
            start, _ = load_checkpoint(path, actor)
            publisher.publish(actor.version)  # engines catch up to the resumed weights
        rank = dist.get_rank()
        steps_done = start
        for step in range(start + 1, trainer.total_steps + 1):
            waited = time.perf_counter()
            limit = trainer.batch_timeout_s
            batch = fetch_batch(controller_url, token, deadline_s=limit) if rank == 0 else None
            # The other ranks wait on a gloo group with a longer timeout than the batch's, so a
            # long rollout never trips the world's collective timeout (or NCCL's watchdog).
            if not wait_for_rank0(batch is not None, timeout_s=limit + 600.0):
                raise RuntimeError(f"no batch from the controller for {limit:.0f} s "
                                   "(trainer.batch_timeout_s); are the engines alive?")
            waited = time.perf_counter() - waited
            stats = actor.train_step(batch)
            published = publisher.publish(actor.version)
            if rank == 0:
                _http("POST", f"{controller_url}/trained", token,
                      {"step": step, "version": actor.version, "stats": stats,
                       "publish_blocked_s": published.blocked_s, "wait_s": waited})
            if trainer.save_interval and step % trainer.save_interval == 0:
                # The controller's data module (prompt pool position, buffer, in-flight
                # trajectories) is saved with the trainer's state, from rank 0.
                extra = _http("GET", f"{controller_url}/state", token)[1] if rank == 0 else None
                save_checkpoint(ckpt_dir, step, actor, extra_state=extra)
            steps_done = step
        publisher.wait()
        publisher.close()
        return {"steps": steps_done, "version": actor.version}
    finally:
        destroy_trainer_parallel()
