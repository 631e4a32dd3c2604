"""Worker (under torchrun): one decoupled-PPO optimizer step at several layouts.

For each TPxPP layout (DP takes the rest of the world) it builds the actor from the same
weights, trains one step on the same batch and saves the updated full weights of its stage.
Options add: micro-batch splitting at a small token budget, vocab-parallel log-prob checks,
and a NaN-weight fault that must skip steps and finally stop the run.
"""

import argparse
import dataclasses
import json
import os

import torch


def vocab_parallel_check(ps):
    """Log-probs/entropy from this rank's vocab slice equal the full-vocabulary reference, and
    so does the gradient of the slice."""
    from laminar_mcore.trainer.logprobs import megatron_vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    full = torch.randn(29, 102, generator=g) * 4
    targets = torch.randint(0, 102, (29,), generator=g)
    w1, w2 = torch.randn(29, generator=g), torch.randn(29, generator=g)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    part = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    lp, ent = megatron_vocab_parallel_logprobs(part, targets, chunk_size=5)
    (lp * w1 + ent * w2).sum().backward()
    ref = full.double().requires_grad_()
    ls = torch.log_softmax(ref, -1)
    rlp, rent = ls.gather(-1, targets[:, None])[:, 0], -(ls.exp() * ls).sum(-1)
    (rlp * w1 + rent * w2).sum().backward()
    out = {"lp": (lp.double() - rlp).abs().max().item(),
           "entropy": (ent.double() - rent).abs().max().item(),
           "grad": (part.grad.double() - ref.grad.chunk(tp, dim=-1)[rank]).abs().max().item()}
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        # The Triton kernels, with the TP exchange between their passes, on this rank's device
        # (compiled kernels cannot read host memory); compared on the CPU.
        from laminar_mcore.kernels.logprobs import logprobs_entropy_triton
        from laminar_mcore.parallel import device

        dev = device() if os.environ.get("TRITON_INTERPRET") != "1" else torch.device("cpu")
        tpart = full.chunk(tp, dim=-1)[rank].clone().to(dev).requires_grad_()
        tlp, tent = logprobs_entropy_triton(tpart, targets.to(dev), rank * tpart.shape[-1],
                                            ps.get_tensor_model_parallel_group())
        (tlp * w1.to(dev) + tent * w2.to(dev)).sum().backward()
        tlp, tent, tgrad = tlp.detach().cpu(), tent.detach().cpu(), tpart.grad.cpu()
        out["triton_lp"] = (tlp.double() - rlp).abs().max().item()
        out["triton_entropy"] = (tent.double() - rent).abs().max().item()
        out["triton_grad"] = (tgrad.double() - ref.grad.chunk(tp, dim=-1)[rank]).abs().max().item()
    return out


def reference_check(actor, cfg, full, batch, trainer):
    """The reference's log-probs equal a fresh actor's on the initial weights (bit for bit),
    and the k3 KL the next step should report: token mean over this batch of k3(pi_theta,
    pi_ref), pi_theta being the current weights (the prox log-probs)."""
    from laminar_mcore.algos import kl_penalty
    from laminar_mcore.config.schema import AlgoConfig
    from laminar_mcore.trainer.actor import MegatronActor

    mbs = actor.distribute(batch)
    actor.compute_ref_logprobs(mbs)
    actor.compute_logprobs(mbs)
    fresh = MegatronActor(cfg, AlgoConfig(), trainer, full_state=full)
    again = fresh.distribute(batch)
    fresh.compute_logprobs(again)
    out = {"ref_equal_initial": all(torch.equal(a.extras["ref_logprobs"], b.prox_logprobs)
                                    for a, b in zip(mbs, again)) if mbs[0].prox_logprobs
           is not None else None,
           "ref_params_frozen": not any(p.requires_grad for p in actor.ref_model.parameters()),
           "ref_param_device": str(next(actor.ref_model.parameters()).device)}
    if mbs and mbs[0].prox_logprobs is not None:  # the last pipeline stage
        kl = sum(float((kl_penalty(m.prox_logprobs, m.extras["ref_logprobs"], "k3")
                        * m.loss_mask).sum()) for m in mbs)
        n = sum(float(m.loss_mask.sum()) for m in mbs)
        out.update(kl_sum=kl, n_tokens=n)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1x1")
    ap.add_argument("--budgets", default="4096", help="max_tokens_per_microbatch values")
    ap.add_argument("--nan-fault", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from safetensors.torch import save_file

    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.testing.synthetic import random_trajectories
    from laminar_mcore.config.schema import AlgoConfig, ParallelConfig, TrainerConfig
    from laminar_mcore.trainer.actor import MegatronActor, NonFiniteLossError
    from laminar_mcore.trainer.model import stage_full_tensors

    torch.set_num_threads(1)
    cfg = tiny_hf_config("qwen2")
    full = get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 3))
    batch = random_trajectories(4, 4, cfg.vocab_size, seed=5)
    result = {"rank": int(os.environ["RANK"]), "stats": {}}

    for layout in args.layouts.split(","):
        # "TxP" or "TxP-lever": sp (sequence parallel), selective or full (recompute), gspo
        # (GSPO with RLOO advantages and seq-mean-token-mean aggregation), kl / kl-offload
        # (entropy bonus and a KL penalty against the reference, two steps), zeroadv / skip
        # (a batch in which two groups' samples share one reward; skip: with
        # trainer.skip_zero_advantage), zeroall / skipall (every group's do); gspo-zeroadv /
        # gspo-skip: the same with GSPO's per-sequence aggregation.
        shape, _, lever = layout.partition("-")
        tp, pp = (int(x) for x in shape.split("x"))
        init_trainer_parallel(tp=tp, pp=pp, seed=1)
        from megatron.core import parallel_state as ps

        if tp > 1 and not lever:
            result["vocab_parallel_check"] = vocab_parallel_check(ps)
        for budget in (int(b) for b in args.budgets.split(",")):
            algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=5.0)
            if lever.startswith("gspo"):  # a verl loss, estimator and aggregation mode
                algo = AlgoConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                                  advantage="rloo", eps_clip=3e-4, eps_clip_high=4e-4,
                                  behav_imp_weight_cap=5.0)
            trainer = TrainerConfig(lr=1e-3, adam_eps=1e-6, grad_clip=1.0,
                                    max_tokens_per_microbatch=budget, logprob_chunk_size=7,
                                    skip_zero_advantage=lever.endswith(("skip", "skipall")),
                                    recompute=lever if lever in ("selective", "full") else "none",
                                    recompute_num_layers=2)
            if lever.startswith("kl"):  # entropy bonus + k3 KL against the reference
                algo = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28, behav_imp_weight_cap=5.0,
                                  entropy_coef=0.01, kl_coef=0.5, kl_estimator="k3",
                                  ref_offload=lever == "kl-offload")
            actor = MegatronActor(cfg, algo, trainer, ParallelConfig(sequence_parallel=lever == "sp"),
                                  full_state=full)
            steps = batch
            if lever.endswith(("zeroadv", "skip", "zeroall", "skipall")):
                same = ("g0", "g2") if lever.endswith(("zeroadv", "skip")) \
                    else ("g0", "g1", "g2", "g3")
                steps = [dataclasses.replace(t, reward=1.0 if t.group_id == "g0" else 0.0)
                         if t.group_id in same else t for t in batch]
            stats = actor.train_step(steps)
            if lever.startswith("kl"):  # a second step: the policy has left the reference
                result["stats"][f"{layout}@{budget}#1"] = stats
                result[f"ref_check_{layout}@{budget}"] = reference_check(
                    actor, cfg, full, batch, trainer)
                stats = actor.train_step(batch)
            result["stats"][f"{layout}@{budget}"] = stats
            weights = stage_full_tensors(actor.model.module, cfg)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                name = f"weights_{layout}@{budget}_pp{ps.get_pipeline_model_parallel_rank()}"
                save_file(weights, os.path.join(args.out, name + ".safetensors"))
            if not lever:  # trainer.eval_offline's snapshot of the same weights (collective)
                from laminar_mcore.trainer.export import save_snapshot

                save_snapshot(actor.model, cfg, os.path.join(args.out, f"snap_{layout}@{budget}"),
                              step=1, version=actor.version, max_shard_bytes=64 * 1024)

    if args.nan_fault:
        init_trainer_parallel(tp=1, pp=1, seed=1)
        actor = MegatronActor(cfg, AlgoConfig(), TrainerConfig(lr=1e-2, max_consecutive_nonfinite=2),
                              full_state=full)
        before = {k: v.clone() for k, v in actor.model.module.state_dict().items()
                  if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            actor.model.module.decoder.final_layernorm.weight[0] = float("nan")
        first = actor.train_step(batch)
        result["nan_first"] = {"skipped": first["skipped"], "version": actor.version}
        unchanged = all(torch.equal(v, actor.model.module.state_dict()[k]) for k, v in before.items()
                        if "final_layernorm" not in k)
        result["nan_weights_unchanged"] = unchanged
        try:
            actor.train_step(batch)
            result["nan_error"] = None
        except NonFiniteLossError as exc:
            result["nan_error"] = str(exc)
    write_rank_result(args.out, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
