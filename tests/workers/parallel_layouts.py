"""Worker (under torchrun, 4 ranks): the same model and batch at several TP x PP layouts.

For each layout it re-initialises Megatron's parallel state inside the same world (data
parallel takes the rest), loads the same weights, runs Megatron's schedule forward and backward
and writes the loss and the full gradients of its stage; then it saves a dist_checkpointing
checkpoint at one layout and loads it at others.
"""

import argparse
import os

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--layouts", default="1x1,2x1,1x2,2x2")
    ap.add_argument("--ckpt-save", default="", help="TPxPP layout to save a dist checkpoint at")
    ap.add_argument("--ckpt-load", default="", help="comma-separated TPxPP layouts to load it at")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from safetensors.torch import save_file

    from laminar_mcore.models import get_adapter
    from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
    from laminar_mcore.parallel import init_trainer_parallel
    from laminar_mcore.testing.dist import write_rank_result
    from laminar_mcore.trainer.lm_step import lm_forward_backward, split_micro_batches
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state, stage_full_tensors

    torch.set_num_threads(1)
    hf_config = tiny_hf_config(args.family)
    model_cfg = type("M", (), {"path": None})()
    full = get_adapter(hf_config).hf_to_mcore(hf_config, initial_hf_state(model_cfg, hf_config, 7))
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, hf_config.vocab_size, (4, 25), generator=gen)
    mask = (torch.rand(4, 25, generator=gen) > 0.2).long()

    def setup(layout):
        tp, pp = (int(x) for x in layout.split("x"))
        init_trainer_parallel(tp=tp, pp=pp, seed=3)
        from megatron.core import parallel_state as ps

        return ps, build_gpt_model(hf_config)

    result = {"rank": int(os.environ["RANK"]), "loss": {}, "ckpt_loss": {}}
    for layout in args.layouts.split(","):
        if not layout:
            continue
        ps, model = setup(layout)
        load_full_state(model, hf_config, full)
        if ps.get_data_parallel_rank() == 0:  # each rank's own Hugging Face slices, no gather
            from laminar_mcore.trainer.export import iter_rank_hf_shards

            shards = {f"{name}|{dim}|{offset}": t.contiguous()
                      for name, t, dim, offset in iter_rank_hf_shards(model, hf_config)}
            save_file(shards, os.path.join(
                args.out, f"shards_{layout}_rank{torch.distributed.get_rank()}.safetensors"))
        result["loss"][layout] = lm_forward_backward(model, split_micro_batches(tokens, mask, 2))
        grads = stage_full_tensors(model, hf_config, grads=True)
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            stage = ps.get_pipeline_model_parallel_rank()
            save_file(grads, os.path.join(args.out, f"grads_{layout}_pp{stage}.safetensors"))

    if args.ckpt_save:
        from megatron.core import dist_checkpointing

        from laminar_mcore.trainer.dist_save import save_sharded

        ckpt_dir = os.path.join(args.out, "ckpt")
        os.makedirs(ckpt_dir, exist_ok=True)  # dist_checkpointing needs an existing directory
        ps, model = setup(args.ckpt_save)
        load_full_state(model, hf_config, full)
        save_sharded(model.sharded_state_dict(), ckpt_dir)
        result["ckpt_loss"]["saved@" + args.ckpt_save] = lm_forward_backward(
            model, split_micro_batches(tokens, mask, 2), forward_only=True)
        for layout in args.ckpt_load.split(","):
            if not layout:
                continue
            ps, model = setup(layout)  # fresh weights from Megatron's own random init
            result["ckpt_loss"]["fresh@" + layout] = lm_forward_backward(
                model, split_micro_batches(tokens, mask, 2), forward_only=True)
            state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
            model.load_state_dict(state)
            result["ckpt_loss"][layout] = lm_forward_backward(
                model, split_micro_batches(tokens, mask, 2), forward_only=True)
            weights = stage_full_tensors(model, hf_config)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                stage = ps.get_pipeline_model_parallel_rank()
                save_file(weights, os.path.join(args.out, f"loaded_{layout}_pp{stage}.safetensors"))
    write_rank_result(args.out, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
