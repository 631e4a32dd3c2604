"""The `smoke` job: the configured model, at the configured TP x PP x DP, forward and backward.

A check of a parallel layout before a run: it builds the Megatron-Core model from the run config
in every trainer process, loads the same weights at any layout, runs Megatron's pipeline schedule
on a fixed batch and checks the loss against transformers' implementation of the same model.
"""

from __future__ import annotations

import json
import os
import time

import torch


def smoke_worker(cfg_dict: dict) -> dict:
    from omegaconf import OmegaConf

    from ..models import get_adapter
    from ..models.hf import hf_config_for, initial_hf_state
    from ..parallel import destroy_trainer_parallel, init_trainer_parallel
    from ..trainer.lm_step import lm_forward_backward, split_micro_batches
    from ..trainer.model import build_gpt_model, load_full_state

    cfg = OmegaConf.create(cfg_dict)
    if cfg.cluster.threads_per_process > 0:
        torch.set_num_threads(cfg.cluster.threads_per_process)
    p = cfg.parallel
    init_trainer_parallel(tp=p.tp, pp=p.pp, cp=p.cp, seed=cfg.seed)
    try:
        hf_config = hf_config_for(cfg.model)
        hf_state = initial_hf_state(cfg.model, hf_config, cfg.seed)
        full = get_adapter(hf_config).hf_to_mcore(hf_config, hf_state)
        start = time.perf_counter()
        model = build_gpt_model(hf_config)
        load_full_state(model, hf_config, full)
        gen = torch.Generator().manual_seed(cfg.seed)
        tokens = torch.randint(0, hf_config.vocab_size, (4, 33), generator=gen)
        mask = torch.ones_like(tokens)
        loss = lm_forward_backward(model, split_micro_batches(tokens, mask, 2))
        elapsed = time.perf_counter() - start
        result = {"rank": torch.distributed.get_rank(), "loss": loss, "seconds": elapsed}
        if torch.distributed.get_rank() == 0:
            result["reference_loss"] = _transformers_loss(hf_config, hf_state, tokens)
        return result
    finally:
        destroy_trainer_parallel()


def _transformers_loss(hf_config, hf_state, tokens) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.load_state_dict(hf_state)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


def run_smoke(cfg) -> dict:
    from omegaconf import OmegaConf

    from .local import launch_trainer_world, trainer_nproc

    nproc = trainer_nproc(cfg)
    p = cfg.parallel
    print(f"[smoke] end-to-end RL is not wired yet; running the Megatron-Core check instead: "
          f"model {cfg.model.name}, tp={p.tp} pp={p.pp} dp={nproc // (p.tp * p.pp * p.cp)} "
          f"({nproc} trainer processes)", flush=True)
    results = launch_trainer_world(smoke_worker, (OmegaConf.to_container(cfg, resolve=True),),
                                   nproc)
    rank0 = results[0]
    losses = [r["loss"] for r in results.values()]
    summary = {
        "job": "smoke", "model": cfg.model.name, "tp": p.tp, "pp": p.pp,
        "world_size": nproc, "loss": rank0["loss"], "reference_loss": rank0["reference_loss"],
        "abs_diff": abs(rank0["loss"] - rank0["reference_loss"]),
        "max_rank_spread": max(losses) - min(losses),
        "seconds": max(r["seconds"] for r in results.values()),
    }
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "smoke.json"), "w") as f:
        json.dump(summary, f, indent=2)
    ok = summary["abs_diff"] < 1e-4 and summary["max_rank_spread"] < 1e-6
    print(f"[smoke] Megatron loss {summary['loss']:.6f} vs transformers {summary['reference_loss']:.6f} "
          f"(|diff| {summary['abs_diff']:.2e}) on {nproc} processes in {summary['seconds']:.1f}s: "
          f"{'OK' if ok else 'MISMATCH'}; wrote {out_dir}/smoke.json", flush=True)
    if not ok:
        raise SystemExit(1)
    return summary
