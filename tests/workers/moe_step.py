"""Worker (under torchrun): one decoupled-PPO step of a tiny Qwen3-MoE at several layouts.

Layout "tXpYeZ[xW]": TP X, PP Y, EP Z, expert TP W (default 1); DP and the experts' DP take
the rest of the world. For
each it builds the actor from the same weights, trains one step on the same batch, saves the
updated full weights of its stage (experts gathered over EP) and the stage's export as the
publisher sends it (Hugging Face names, experts gathered layer by layer)."""

import argparse
import os
import re

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="t1p1e1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from safetensors.torch import save_file

    from laminar_mcore.config.schema import AlgoConfig, ParallelConfig, TrainerConfig
    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.testing.synthetic import random_trajectories
    from laminar_mcore.trainer.actor import MegatronActor
    from laminar_mcore.trainer.export import iter_stage_hf_tensors
    from laminar_mcore.trainer.model import stage_full_tensors

    torch.set_num_threads(1)
    cfg = tiny_hf_config("qwen3_moe", mlp_only_layers=[2])
    full = get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 3))
    batch = random_trajectories(4, 4, cfg.vocab_size, seed=5)
    result = {"rank": int(os.environ["RANK"]), "stats": {}}
    for layout in args.layouts.split(","):
        tp, pp, ep, etp = (int(x or 1) for x in
                           re.fullmatch(r"t(\d+)p(\d+)e(\d+)(?:x(\d+))?", layout).groups())
        init_trainer_parallel(tp=tp, pp=pp, ep=ep, expert_tp=etp, seed=1)
        from megatron.core import parallel_state as ps

        algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28)
        trainer = TrainerConfig(lr=1e-3, adam_eps=1e-6, grad_clip=1.0,
                                max_tokens_per_microbatch=60, logprob_chunk_size=7)
        actor = MegatronActor(cfg, algo, trainer, ParallelConfig(), full_state=full)
        result["stats"][layout] = actor.train_step(batch)
        weights = stage_full_tensors(actor.model.module, cfg)
        exported = {n: t.contiguous().clone() for n, t in iter_stage_hf_tensors(actor.model, cfg)}
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            stage = ps.get_pipeline_model_parallel_rank()
            save_file(weights, os.path.join(args.out, f"weights_{layout}_pp{stage}.safetensors"))
            save_file(exported, os.path.join(args.out, f"export_{layout}_pp{stage}.safetensors"))
    write_rank_result(args.out, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
