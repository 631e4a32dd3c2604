"""Worker (under torchrun): one decoupled-PPO step of a tiny Qwen3-MoE at several layouts.

Layout "tXpYeZ[xW][s]": TP X, PP Y, EP Z, expert TP W (default 1), "s": sequence parallelism;
DP and the experts' DP take the rest of the world. For
each it builds the actor from the same weights, trains one step on the same batch, saves the
updated full weights of its stage (experts gathered over EP) and the stage's export as the
publisher sends it (Hugging Face names, experts gathered layer by layer)."""

import argparse
import dataclasses
import os
import re

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="t1p1e1")
    ap.add_argument("--replay", action="store_true",
                    help="also recompute near-tie trajectories' log-probs with routing replay")
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
    if args.replay:
        from laminar_mcore.testing.moe import engine_trajectories, near_tie_model

        tcfg, thf = near_tie_model()
        tfull = get_adapter(tcfg).hf_to_mcore(tcfg, thf)
        tbatch = engine_trajectories(tcfg, thf, n=8)
    result = {"rank": int(os.environ["RANK"]), "stats": {}}
    for layout in args.layouts.split(","):
        m = re.fullmatch(r"t(\d+)p(\d+)e(\d+)(?:x(\d+))?(s?)", layout)
        tp, pp, ep, etp = (int(x or 1) for x in m.groups()[:4])
        sp = m.group(5) == "s"
        init_trainer_parallel(tp=tp, pp=pp, ep=ep, expert_tp=etp, seed=1)
        from megatron.core import parallel_state as ps

        algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28)
        trainer = TrainerConfig(lr=1e-3, adam_eps=1e-6, grad_clip=1.0,
                                max_tokens_per_microbatch=60, logprob_chunk_size=7)
        actor = MegatronActor(cfg, algo, trainer, ParallelConfig(sequence_parallel=sp),
                              full_state=full)
        if args.replay:
            # routing replay at this layout: the engine's routing of near-tie routers, replayed
            # through the EP dispatcher, across pipeline stages and, with sequence
            # parallelism, each TP rank replaying its slice of the sequence
            ractor = MegatronActor(tcfg, AlgoConfig(routing_replay=True), trainer,
                                   ParallelConfig(sequence_parallel=sp), full_state=tfull)
            mbs = ractor.distribute(tbatch if torch.distributed.get_rank() == 0 else None)
            ractor.compute_logprobs(mbs)
            if ps.is_pipeline_last_stage():
                gaps = [float((mb.prox_logprobs - mb.behav_logprobs)[mb.loss_mask > 0].abs().max())
                        for mb in mbs if mb.loss_mask.sum() > 0]
                result.setdefault("replay_gap", {})[layout] = max(gaps) if gaps else 0.0
            ractor = None
            if sp or pp > 1:  # and through activation recompute: the same replayed step
                # either way (with PP, 1F1B runs a micro-batch's forward before the backward
                # of the one before it: the recompute must take that one's routes)
                trained = {}
                for recompute in ("none", "full"):
                    ractor = MegatronActor(tcfg, AlgoConfig(routing_replay=True),
                                           dataclasses.replace(trainer, recompute=recompute),
                                           ParallelConfig(sequence_parallel=sp),
                                           full_state=tfull)
                    ractor.train_step(tbatch)
                    trained[recompute] = stage_full_tensors(ractor.model.module, tcfg)
                    ractor = None
                result.setdefault("replay_recompute_gap", {})[layout] = max(
                    float((trained["none"][n] - trained["full"][n]).abs().max())
                    for n in trained["none"])
        result["stats"][layout] = actor.train_step(batch)
        weights = stage_full_tensors(actor.model.module, cfg)
        exported = {n: t.contiguous().clone() for n, t in iter_stage_hf_tensors(actor.model, cfg)}
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            stage = ps.get_pipeline_model_parallel_rank()
            save_file(weights, os.path.join(args.out, f"weights_{layout}_pp{stage}.safetensors"))
            save_file(exported, os.path.join(args.out, f"export_{layout}_pp{stage}.safetensors"))
        if tp == 1 and etp == 1:  # per-rank export (issue 52): each EP rank its own experts
            from laminar_mcore.trainer.export import iter_rank_hf_shards, publish_part

            publishes, part, per_stage = publish_part(cfg)
            if publishes:
                stage = ps.get_pipeline_model_parallel_rank()
                shards = {f"{name}|{dim}": t.contiguous().clone()
                          for name, t, dim, _ in iter_rank_hf_shards(actor.model, cfg)}
                save_file(shards, os.path.join(
                    args.out, f"shards_{layout}_part{stage * per_stage + part}.safetensors"))
    write_rank_result(args.out, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
