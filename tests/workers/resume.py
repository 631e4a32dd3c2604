"""Worker (under torchrun): train, checkpoint, and resume a Megatron actor exactly (one run, or
several one after the other in the same world, separated by ``--next``)."""

import argparse
import os
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--family", default="qwen2", help="qwen2, or qwen3_moe (8 experts, top-2)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="none")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--sharding", default="dp_reshardable")
    ap.add_argument("--local-optimizer", action="store_true")
    ap.add_argument("--also-fully-reshardable", default=None,
                    help="also save the --save-at checkpoint fully_reshardable under this root")
    ap.add_argument("--optimizer", default="torch", choices=("torch", "te", "apex"),
                    help="the Adam Megatron picks: torch's (no TE/Apex), or the CPU twin of TE's "
                         "or Apex's FusedAdam selected as Megatron selects it")
    ap.add_argument("--refused", default="",
                    help="checkpoint roots whose newest checkpoint must be refused (comma-separated), "
                         "tried before --resume; each message goes to the rank's 'refused'")
    ap.add_argument("--no-train", action="store_true", help="stop after --refused and --resume")
    ap.add_argument("--out", required=True)
    # "--next" separates runs done one after the other in this world (each its own arguments)
    argv, runs = sys.argv[1:], [[]]
    for arg in argv:
        if arg == "--next":
            runs.append([])
        else:
            runs[-1].append(arg)
    for run_argv in runs:
        args = ap.parse_args(run_argv)
        if args.optimizer == "torch":
            run(args)
        else:
            from laminar_mcore.testing.fused_adam import megatron_selects

            with megatron_selects(args.optimizer):
                run(args)
    torch.distributed.destroy_process_group()


def run(args):

    from laminar_mcore.config.schema import AlgoConfig, ParallelConfig, TrainerConfig
    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.testing.synthetic import random_trajectories
    from laminar_mcore.trainer.actor import MegatronActor
    from laminar_mcore.data.checkpoints import resolve_resume
    from laminar_mcore.trainer.checkpoint import load_checkpoint, save_checkpoint
    from laminar_mcore.trainer.model import stage_full_tensors

    torch.set_num_threads(1)
    init_trainer_parallel(tp=args.tp, pp=1, ep=args.ep, seed=1)
    cfg = tiny_hf_config(args.family)
    full = get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 3))
    actor = MegatronActor(cfg, AlgoConfig(eps_clip_high=0.28),
                          TrainerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine",
                                        total_steps=args.steps, max_tokens_per_microbatch=80,
                                        ckpt_optim_sharding=args.sharding),
                          ParallelConfig(use_distributed_optimizer=not args.local_optimizer),
                          full_state=full, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]))
    start, extra = 0, None
    refused = {}
    for root in filter(None, args.refused.split(",")):
        try:
            load_checkpoint(resolve_resume("auto", root), actor)
        except RuntimeError as exc:  # refused before anything was loaded: the run goes on
            refused[root] = str(exc)
        else:
            raise AssertionError(f"{root} was not refused")
    path = resolve_resume(args.resume, args.ckpt)
    if path:
        start, extra = load_checkpoint(path, actor)
    losses = {}
    for step in range(start + 1, start if args.no_train else args.steps + 1):
        batch = random_trajectories(3, 4, cfg.vocab_size, seed=100 + step, version=step - 1)
        stats = actor.train_step(batch)
        losses[step] = {"loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"]}
        if step == args.save_at:
            save_checkpoint(args.ckpt, step, actor, extra_state={"prompt_pool_position": step * 3})
            if args.also_fully_reshardable:
                actor.trainer.ckpt_optim_sharding = "fully_reshardable"
                save_checkpoint(args.also_fully_reshardable, step, actor,
                                extra_state={"prompt_pool_position": step * 3})
                actor.trainer.ckpt_optim_sharding = args.sharding
    from safetensors.torch import save_file

    # Adam's moments and step as this rank holds them (a DP shard with the distributed optimizer).
    moments = {}
    for opt in actor.optimizer.chained_optimizers:
        for g, group in enumerate(opt.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                for key, value in opt.optimizer.state[param].items():
                    moments[f"{g}.{i}.{key}"] = value.detach().clone().reshape(-1)
    save_file(moments, os.path.join(args.out, f"adam_rank{os.environ['RANK']}.safetensors"))
    group_steps = [g.get("step") for opt in actor.optimizer.chained_optimizers
                   for g in opt.optimizer.param_groups]
    optimizer_class = [type(opt.optimizer).__name__ for opt in actor.optimizer.chained_optimizers]
    weights = stage_full_tensors(actor.model.module, cfg)
    if torch.distributed.get_rank() == 0:
        save_file(weights, os.path.join(args.out, "final.safetensors"))
    write_rank_result(args.out, {"rank": int(os.environ["RANK"]), "resumed_from": path,
                                 "start": start, "extra": extra, "losses": losses,
                                 "version": actor.version,
                                 "group_steps": [s if s is None or isinstance(s, int) else float(s)
                                                 for s in group_steps],
                                 "optimizer_class": optimizer_class, "refused": refused})


if __name__ == "__main__":
    main()
