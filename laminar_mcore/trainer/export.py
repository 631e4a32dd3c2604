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
