"""The ``train`` job on one machine: relay, engines, controller and the trainer world.

    python -m laminar_mcore.launch job=train [mode=laminar|one_step|sync] ...

With no ``data.train_files`` and no ``model.path`` it runs the built-in demo: a synthetic
verifiable task, a tiny Qwen2-architecture model and a short supervised warm-up (cached) that
builds the starting checkpoint. Every process it starts is stopped when it returns, fails or is
interrupted. It writes ``outputs/<run>/metrics.jsonl``, TensorBoard events, ``summary.png`` and
``summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from typing import List, Optional

from omegaconf import OmegaConf


def _codec_and_rows(cfg, out_dir: str, log):
    """(codec, train rows, eval rows, model path) for the configured data and model."""
    from ..data import tasks
    from ..data.pools import load_prompts
    from .controller import TaskCodec

    d = cfg.data
    if d.train_files:
        from transformers import AutoTokenizer

        if cfg.model.path is None:
            raise ValueError("data.train_files needs model.path (its tokenizer encodes the prompts)")
        tok = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
        rows = load_prompts(list(d.train_files), d.prompt_key)
        evals = load_prompts(list(d.eval_files), d.prompt_key) if d.eval_files else rows[: d.num_eval]
        codec = TaskCodec(encode_prompt=lambda row: tok.encode(row[d.prompt_key]),
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        return codec, rows, evals, cfg.model.path
    rows = tasks.make_dataset(d.num_train, d.digits, d.task, seed=cfg.seed)
    evals = tasks.make_dataset(d.num_eval, d.digits, d.task, seed=cfg.seed + 10_000)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    tasks.write_dataset(os.path.join(data_dir, "train.jsonl"), rows)
    tasks.write_dataset(os.path.join(data_dir, "eval.jsonl"), evals)
    codec = TaskCodec(encode_prompt=lambda row: tasks.encode(row["prompt"]), decode=tasks.decode)
    model_path = cfg.model.path
    if model_path is None:
        from ..trainer.warmup import warmup_checkpoint

        cache = os.path.join(cfg.output_dir, ".cache")
        model_path = warmup_checkpoint(cache, problems=rows, steps=d.warmup_steps,
                                       wrong_fraction=d.warmup_wrong_fraction,
                                       hidden=cfg.model.arch.hidden_size,
                                       layers=cfg.model.arch.num_hidden_layers, seed=cfg.seed, log=log)
    return codec, rows, evals, model_path


async def evaluate(url: str, rows: List[dict], codec, sampling: dict, reward_fn: str,
                   seed: int = 0) -> float:
    """Mean reward of the engine's samples on ``rows`` (the policy's success rate)."""
    from ..reward import load_reward_fn
    from ..rollout.client import SGLangClient

    fn = load_reward_fn(reward_fn)
    async with SGLangClient(url) as client:
        outs = await asyncio.gather(*[
            client.generate(codec.encode_prompt(row), dict(sampling, sampling_seed=seed * 100_003 + i))
            for i, row in enumerate(rows)])
    scores = [fn(codec.decode(o["output_ids"]), row.get("answer"),
                 **{k: v for k, v in row.items() if k not in ("answer", "response_text")})
              for o, row in zip(outs, rows)]
    return sum(scores) / max(len(scores), 1)


def length_fn_from_config(rollout_cfg):
    """Deterministic per-trajectory lengths for ``rollout.forced_*`` (same in every mode)."""
    if not rollout_cfg.forced_short_length:
        return None
    import zlib

    short, long_ = rollout_cfg.forced_short_length, rollout_cfg.forced_long_length
    fraction = rollout_cfg.forced_long_fraction

    def length(group_id: str, k: int) -> int:
        u = zlib.crc32(f"{group_id}/{k}".encode()) / 2**32
        if long_ and u < fraction:
            return long_
        return max(1, int(short * (0.5 + (u - fraction) / max(1 - fraction, 1e-9))))

    return length


def start_rollout_node(cfg, model_path: str, token: str, logs: str, procs: list, *,
                       master_url: Optional[str] = None, relay_id: str = "master"):
    """This machine's rollout tier: a relay (the master, which trainers publish to, unless
    ``master_url`` names one to chain from) and ``rollout.num_engines`` engines, bound to
    ``rollout.host``. Started processes are appended to ``procs`` as they start (the caller
    stops them). Returns (relay, engines, publish port or None)."""
    from ..relay.launch import relay_command
    from ..rollout.launcher import EngineProcess, engine_command_from_config, free_port

    host = cfg.rollout.host
    relay = EngineProcess(relay_command(token, master=master_url is None, master_url=master_url,
                                        trainer_stages=cfg.parallel.pp, relay_id=relay_id,
                                        host=host, chain_chunks=cfg.weight_sync.chain_chunks,
                                        mooncake_protocol=cfg.weight_sync.mooncake_protocol,
                                        mooncake_device=cfg.weight_sync.mooncake_device,
                                        publish_backend=cfg.weight_sync.publish_backend,
                                        relay_device=cfg.weight_sync.relay_device),
                          log_path=os.path.join(logs, f"relay-{relay_id}.log"), host=host,
                          port_key="LAMINAR_RELAY_PORT")
    procs.append(relay.start())
    publish_port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")) if master_url is None else None
    engines = []
    for i in range(cfg.rollout.num_engines):
        port = 0 if cfg.rollout.backend == "cpu" else free_port()
        engine = EngineProcess(engine_command_from_config(cfg.rollout, model_path, port=port, index=i,
                                                          seed=cfg.seed),
                               log_path=os.path.join(logs, f"engine-{relay_id}-{i}.log"), host=host,
                               port=port or None)
        procs.append(engine.start())
        engines.append(engine)
    return relay, engines, publish_port


def resume_state(cfg, out_dir: str, log) -> Optional[dict]:
    """The controller's saved state when ``trainer.resume`` picks a checkpoint, else None."""
    from ..trainer.checkpoint import resolve_resume

    resume_from = resolve_resume(cfg.trainer.resume, os.path.join(out_dir, "checkpoints"))
    if not resume_from:
        return None
    log(f"[train] resuming from {resume_from}")
    extra = os.path.join(resume_from, "extra_state.json")
    if os.path.isfile(extra):
        with open(extra) as f:
            return json.load(f)
    return None


def make_controller(cfg, *, engine_urls, relay_url, token, rows, codec, metrics, initial_state,
                    host: str = "127.0.0.1", port: int = 0, info: Optional[dict] = None):
    from ..rollout.launcher import engine_pull_spec
    from .controller import Controller

    sampling = OmegaConf.to_container(cfg.rollout.sampling)
    return Controller(
        mode=cfg.mode, engine_urls=engine_urls, relay_url=relay_url, token=token,
        rows=rows, codec=codec, reward_fn=cfg.data.reward_fn,
        reward_workers=cfg.data.reward_workers, reward_timeout_s=cfg.data.reward_timeout_s,
        n_samples=cfg.algo.n_samples_per_prompt,
        batch_prompts=cfg.trainer.train_batch_prompts, sampling=sampling,
        capacity=cfg.rollout.max_running_requests, max_staleness=cfg.algo.max_staleness,
        metrics=metrics, seed=cfg.seed, host=host, port=port,
        length_fn=length_fn_from_config(cfg.rollout), initial_state=initial_state, info=info,
        repack={"repack": cfg.rollout.repack, "repack_interval_s": cfg.rollout.repack_interval_s,
                "repack_max_requests": cfg.rollout.repack_max_requests},
        pull_spec=lambda index: engine_pull_spec(cfg.rollout, index))


def run_train(cfg) -> dict:
    from ..metrics import MetricsWriter
    from .local import launch_trainer_world, trainer_nproc

    t_start = time.time()
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)
    logs = os.path.join(out_dir, "logs")

    def log(msg: str) -> None:
        print(msg, flush=True)

    nproc = trainer_nproc(cfg)
    codec, rows, evals, model_path = _codec_and_rows(cfg, out_dir, log)
    token = secrets.token_hex(16)
    eval_sampling = OmegaConf.to_container(cfg.rollout.sampling)
    procs: list = []
    controller = None
    metrics = MetricsWriter(out_dir)
    try:
        relay, engines, publish_port = start_rollout_node(cfg, model_path, token, logs, procs)
        log(f"[train] mode={cfg.mode}: relay {relay.url}, {len(engines)} {cfg.rollout.backend} "
            f"engines, {nproc} trainer processes (tp={cfg.parallel.tp} pp={cfg.parallel.pp})")
        initial = asyncio.run(evaluate(engines[0].url, evals, codec, eval_sampling, cfg.data.reward_fn))
        metrics.log("eval", step=0, accuracy=initial)
        log(f"[train] initial accuracy {initial:.3f} on {len(evals)} eval prompts")
        controller = make_controller(cfg, engine_urls=[e.url for e in engines], relay_url=relay.url,
                                     token=token, rows=rows, codec=codec, metrics=metrics,
                                     initial_state=resume_state(cfg, out_dir, log))
        controller_url = controller.start()
        progress = _progress(cfg.trainer.total_steps, metrics)
        try:
            results = launch_trainer_world(
                _trainer_entry, (OmegaConf.to_container(cfg, resolve=True), model_path, controller_url,
                                 token, relay.host, publish_port, os.path.join(out_dir, "checkpoints")),
                nproc)
        finally:
            progress.close()
        return finish_run(cfg, controller, relay.url, engines[0].url, token, evals, codec,
                          eval_sampling, metrics, results[0], initial, t_start, model_path,
                          out_dir, log)
    finally:
        if controller is not None:
            controller.stop()
        for p in reversed(procs):
            p.stop()
        metrics.close()


def finish_run(cfg, controller, relay_url: str, engine_url: str, token: str, evals, codec,
               eval_sampling: dict, metrics, result: dict, initial: float, t_start: float,
               model_path: str, out_dir: str, log) -> dict:
    """After training: bring one engine to the final version, evaluate, keep the books and
    write ``summary.json`` and the plot. Raises if the books do not balance."""
    from ..relay.client import RelayClient, pull_latest_into_engine
    from ..rollout.client import SGLangClient
    from ..rollout.launcher import engine_pull_spec

    version = result["version"]

    async def final_pull():
        async with RelayClient(relay_url, token) as rc, SGLangClient(engine_url) as ec:
            deadline = time.time() + 120
            served = await ec.get_weight_version()  # SGLang says "default" before any update
            current = int(served) if served.isdigit() else 0
            while current < version and time.time() < deadline:
                pulled = await pull_latest_into_engine(rc, ec, current,
                                                       spec=engine_pull_spec(cfg.rollout, 0))
                current = pulled if pulled is not None else current
                await asyncio.sleep(0.05)
            return current

    utilisation = controller.utilisation()
    controller.stop_generation()
    engine_version = asyncio.run(final_pull())
    final = asyncio.run(evaluate(engine_url, evals, codec, eval_sampling, cfg.data.reward_fn))
    metrics.log("eval", step=result["steps"], accuracy=final, version=engine_version)
    books = controller.books()
    summary = {"mode": cfg.mode, "initial_accuracy": initial, "final_accuracy": final,
               "steps": result["steps"], "final_version": version, **books,
               "trajectories_in_flight_at_stop": len(controller.partial), **utilisation,
               "wall_seconds": time.time() - t_start, "model_path": model_path}
    balanced = books["trajectories_generated"] == (books["trajectories_consumed"]
                                                   + books["trajectories_buffered"]
                                                   + books["trajectories_discarded"])
    summary["books_balance"] = balanced
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot = metrics.plot()
    log(f"[train] accuracy {initial:.3f} -> {final:.3f}; trajectories generated "
        f"{books['trajectories_generated']}, consumed {books['trajectories_consumed']}, buffered "
        f"{books['trajectories_buffered']}, discarded {books['trajectories_discarded']} "
        f"({'balanced' if balanced else 'NOT BALANCED'}); max staleness "
        f"{books['max_staleness_observed']}; {summary['wall_seconds']:.0f}s. "
        f"Wrote {out_dir}/summary.json, metrics.jsonl, {os.path.basename(plot or '')}")
    if not balanced:
        raise RuntimeError("trajectory accounting does not balance; see summary.json")
    return summary


def _trainer_entry(*args):
    from ..trainer.loop import trainer_main

    return trainer_main(*args)


class _progress:
    """A tqdm bar that follows the controller's ``train`` records."""

    def __init__(self, total: int, metrics):
        import threading

        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self):
        seen = 0
        while not self._stop.wait(0.5):
            records = [r for r in list(self.metrics.records) if r["kind"] == "train"]
            if len(records) > seen:
                last = records[-1]
                self.bar.update(len(records) - seen)
                self.bar.set_postfix(reward=f"{last.get('reward_mean', 0):.2f}",
                                     stale=f"{last.get('staleness_mean', 0):.1f}")
                seen = len(records)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.bar.close()
