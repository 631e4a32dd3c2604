"""Export a Megatron-Core model stage as Hugging Face tensors (the trainer side of publishing).

Per pipeline stage, unit by unit (embedding, each layer, final norm, output layer): gather the
tensor-parallel shards (``trainer.model.gather_tp``: column, row and vocab-parallel; gate/up of
linear_fc1 per rank) and undo Megatron's layouts with the model family's adapter (the one the
checkpoint tools use). ``weights.bucket.BucketPacker`` then casts them to the rollout dtype and
writes buckets of at most ``bucket_bytes``; only the tensors of one bucket are alive at a time.
Collective over the stage's tensor-parallel group.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from ..models import get_adapter
from ..models.moe import is_expert_param
from .model import gather_ep, gather_tp, global_param_name


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def iter_stage_hf_tensors(model, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for everything this pipeline stage holds, in order.

    Every rank of the stage's TP group must iterate together (the gathers are collective).
    """
    model = _unwrap(model)
    adapter = get_adapter(hf_config)
    tied = adapter.tied_embeddings(hf_config)
    params = {}
    for local, param in model.named_parameters():
        if tied and local == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding: the first stage exports it
        params[global_param_name(model, local)] = param
    for unit, names in adapter.export_units(hf_config):
        # experts of other EP ranks come from the EP gather below
        own = [n for n in names if n in params or not is_expert_param(n)]
        if not all(n in params for n in own):
            if any(n in params for n in own):
                missing = [n for n in own if n not in params]
                raise RuntimeError(f"stage holds part of unit {unit}; missing {missing}")
            continue
        full = {name: gather_tp(adapter, name, params[name].detach())
                for name in names if name in params}
        experts = {n: t for n, t in full.items() if is_expert_param(n)}
        if experts:
            full.update(gather_ep(model, experts))
        yield from adapter.convert_unit_to_hf(hf_config, unit, full)


def save_snapshot(model, hf_config, path: str, *, step: int, version: int) -> None:
    """This model's weights as a Hugging Face checkpoint directory at ``path`` (config.json,
    one safetensors file per pipeline stage, an index when there are several, and
    ``laminar_snapshot.json`` with the step and weight version): what ``trainer.eval_offline``
    evaluates after training (``weights/snapshots.py``). Collective over the whole trainer world (the export's gathers,
    then barriers); each stage lead writes its stage; the directory appears complete or not at
    all (written as ``path.partial``, then renamed by rank 0)."""
    import json
    import os
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..models.hf import SAFETENSORS_INDEX
    from ..weights.snapshots import SNAPSHOT_META

    partial = path + ".partial"
    stage, stages = (ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size())
    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    lead = first_replica and ps.get_tensor_model_parallel_rank() == 0
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    if first_replica or get_adapter(hf_config).is_moe:  # the publisher's exporting ranks
        tensors = {}
        for name, tensor in iter_stage_hf_tensors(model, hf_config):
            if lead:
                tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if lead:
            save_file(tensors, os.path.join(
                partial, f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"))
    dist.barrier()
    if dist.get_rank() == 0:
        hf_config.save_pretrained(partial)
        files = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
        if len(files) == 1:
            os.replace(os.path.join(partial, files[0]), os.path.join(partial, "model.safetensors"))
        else:
            weight_map = {}
            for f in files:
                with safe_open(os.path.join(partial, f), "pt") as handle:
                    weight_map.update({k: f for k in handle.keys()})
            with open(os.path.join(partial, SAFETENSORS_INDEX), "w") as out:
                json.dump({"metadata": {}, "weight_map": weight_map}, out, indent=2)
        with open(os.path.join(partial, SNAPSHOT_META), "w") as out:
            json.dump({"step": int(step), "version": int(version)}, out)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
