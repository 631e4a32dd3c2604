"""Export a Megatron-Core model stage as Hugging Face tensors (the trainer side of publishing).

Per pipeline stage, unit by unit (embedding, each layer, final norm, output layer): gather the
tensor-parallel shards (``trainer.model.gather_tp``: column, row and vocab-parallel; gate/up of
linear_fc1 per rank) and undo Megatron's layouts with the model family's adapter (the one the
checkpoint tools use). ``weights.bucket.BucketPacker`` then casts them to the rollout dtype and
writes buckets of at most ``bucket_bytes``; only the tensors of one bucket are alive at a time.
Collective over the stage's tensor-parallel group.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..models import get_adapter
from ..models.moe import is_expert_param
from .model import gather_ep, gather_tp, global_param_name


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _held_units(model, adapter, hf_config) -> Iterator[Tuple[str, List[str], Dict]]:
    """(unit, its Megatron names, this rank's parameters by global name) for each export unit
    this pipeline stage holds (whole, but for the experts of other EP ranks)."""
    tied = adapter.tied_embeddings(hf_config)
    params = {}
    for local, param in model.named_parameters():
        if tied and local == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding: the first stage exports it
        params[global_param_name(model, local)] = param
    for unit, names in adapter.export_units(hf_config):
        own = [n for n in names if n in params or not is_expert_param(n)]
        if not all(n in params for n in own):
            if any(n in params for n in own):
                missing = [n for n in own if n not in params]
                raise RuntimeError(f"stage holds part of unit {unit}; missing {missing}")
            continue
        yield unit, names, params


def iter_stage_hf_tensors(model, hf_config) -> Iterator[Tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for everything this pipeline stage holds, in order.

    Every rank of the stage's TP group must iterate together (the gathers are collective).
    """
    model = _unwrap(model)
    adapter = get_adapter(hf_config)
    for unit, names, params in _held_units(model, adapter, hf_config):
        # experts of other EP ranks come from the EP gather below
        full = {name: gather_tp(adapter, name, params[name].detach())
                for name in names if name in params}
        experts = {n: t for n, t in full.items() if is_expert_param(n)}
        if experts:
            full.update(gather_ep(model, experts))
        yield from adapter.convert_unit_to_hf(hf_config, unit, full)


def iter_rank_hf_shards(model, hf_config) -> Iterator[Tuple[str, torch.Tensor, Optional[int],
                                                            int]]:
    """(Hugging Face name, this rank's slice of it, dim, offset) for everything this rank holds
    of its pipeline stage, with no collective and no copy (issue 52: every rank publishes its
    own shard). ``dim`` None: the whole tensor, replicated over tensor parallelism, which only
    TP rank 0 yields; else the slice starts at ``offset`` along ``dim`` of the full tensor.
    Concatenating every TP rank's slices of a name in offset order gives what
    ``iter_stage_hf_tensors`` gathers, bit for bit.

    Megatron's local shards are already whole Hugging Face rows (or columns): a rank's fused
    QKV holds whole query groups and its fc1 [gate_r; up_r], so the adapter's layout transform
    of the local shards, with the heads and query groups one rank holds, gives the slices.
    Mixture-of-experts families at TP1 and expert TP1 (``rank_moe_shards``): each EP rank
    yields its own experts whole, EP rank 0 the rest; other layouts: NotImplementedError."""
    import copy

    from megatron.core import parallel_state as ps

    model = _unwrap(model)
    adapter = get_adapter(hf_config)
    if adapter.is_moe:
        yield from rank_moe_shards(model, adapter, hf_config)
        return
    tp, rank = (ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank())
    shape = adapter.shape(hf_config)
    if shape.heads % tp or shape.groups % tp:  # then a rank's QKV cuts through a query group
        raise NotImplementedError(
            f"per-rank export needs the attention heads ({shape.heads}) and query groups "
            f"({shape.groups}) to divide by TP={tp}: use iter_stage_hf_tensors")
    local_cfg = copy.copy(hf_config)  # the heads and query groups of one TP rank
    local_cfg.num_attention_heads = shape.heads // tp
    local_cfg.num_key_value_heads = shape.groups // tp
    local_cfg.head_dim = shape.head_dim
    full_shapes = adapter.hf_shapes(hf_config)
    for unit, names, params in _held_units(model, adapter, hf_config):
        local = {n: params[n].detach() for n in names}
        for name, t in adapter.convert_unit_to_hf(local_cfg, unit, local):
            split = [d for d, (a, b) in enumerate(zip(t.shape, full_shapes[name])) if a != b]
            if not split:
                if rank == 0:
                    yield name, t, None, 0
                continue
            if len(split) != 1 or full_shapes[name][split[0]] != t.shape[split[0]] * tp:
                raise RuntimeError(f"{name}: local shape {tuple(t.shape)} is not a 1/{tp} slice "
                                   f"of {full_shapes[name]}")
            yield name, t, split[0], rank * t.shape[split[0]]


def rank_moe_shards(model, adapter, hf_config) -> Iterator[Tuple[str, torch.Tensor, None, int]]:
    """A mixture-of-experts stage's per-rank export (call through ``iter_rank_hf_shards``):
    this EP rank's experts, whole, under their global numbers; from EP rank 0 also everything
    that is not an expert (attention, norms, routers, embeddings, dense layers). No collective.
    Needs TP1 and expert TP1 (a rank then holds whole tensors): NotImplementedError otherwise."""
    from megatron.core import parallel_state as ps

    from .model import _expert_layout

    tp, etp = (ps.get_tensor_model_parallel_world_size(),
               ps.get_expert_tensor_parallel_world_size())
    if tp != 1 or etp != 1:
        raise NotImplementedError(
            f"per-rank export of {adapter.name} needs parallel.tp=1 and expert TP 1 (here "
            f"{tp} and {etp}): use weight_sync.export=stage_lead")
    first, per_rank = _expert_layout(model)
    mine = list(range(first, first + per_rank))
    lead = ps.get_expert_model_parallel_rank() == 0
    for unit, names, params in _held_units(model, adapter, hf_config):
        local = {n: params[n].detach() for n in names if n in params}
        if not any(is_expert_param(n) for n in names):
            if lead:
                for name, t in adapter.convert_unit_to_hf(hf_config, unit, local):
                    yield name, t, None, 0
            continue
        for name, t in adapter.convert_unit_to_hf(hf_config, unit, local, experts=mine,
                                                  dense=lead):
            yield name, t, None, 0


def stage_has_experts(model, hf_config) -> bool:
    """Whether this rank's pipeline stage holds a mixture-of-experts layer."""
    model = _unwrap(model)
    return any(is_expert_param(n) for _, names, _ in
               _held_units(model, get_adapter(hf_config), hf_config) for n in names)


def publish_part(hf_config) -> Tuple[bool, int, int]:
    """(publishes, part, parts per stage) of this rank with ``weight_sync.export=per_rank``:
    every rank of the first data-parallel replica, one part per TP rank; for a
    mixture-of-experts model every EP rank of the first expert-data-parallel replica, one part
    per EP rank (``rank_moe_shards``)."""
    from megatron.core import parallel_state as ps

    if get_adapter(hf_config).is_moe:  # (the expert grid has no CP axis)
        return (ps.get_expert_data_parallel_rank() == 0,
                ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
    return (ps.get_context_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0,
            ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())


def export_roles(hf_config) -> Tuple[bool, bool]:
    """(exports, lead) of this rank: whether it takes part in ``iter_stage_hf_tensors``'
    gathers (the stage's TP group at DP rank 0; for MoE models every rank of the stage, since
    experts are gathered over EP, whose groups span DP ranks), and whether it is its stage's
    lead (TP rank 0 of that replica), the one that keeps the tensors."""
    from megatron.core import parallel_state as ps

    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return (first_replica or get_adapter(hf_config).is_moe,
            first_replica and ps.get_tensor_model_parallel_rank() == 0)


def save_snapshot(model, hf_config, path: str, *, step: int, version: int,
                  max_shard_bytes: int = 2 * 2**30) -> None:
    """This model's weights as a Hugging Face checkpoint directory at ``path``: config.json,
    safetensors shards (each stage's, at most ``max_shard_bytes`` each: one shard in host
    memory at a time) with an index, and ``laminar_snapshot.json`` (step and weight version):
    what ``trainer.eval_offline`` evaluates after training (``weights/snapshots.py``).

    Collective over the whole trainer world (the export's gathers, then barriers). Each stage
    lead writes its stage into ``path.partial/stage_<k>``; rank 0 checks that every stage's
    index is there, gathers the shards under one index and renames the directory to ``path``,
    so that it appears complete or not at all."""
    import json
    import os
    import shutil

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..models.hf import SAFETENSORS_INDEX, ShardWriter
    from ..weights.snapshots import SNAPSHOT_META

    partial = path + ".partial"
    stage, stages = (ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size())
    exports, lead = export_roles(hf_config)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    if exports:
        writer = ShardWriter(os.path.join(partial, f"stage_{stage:03d}"), max_shard_bytes) \
            if lead else None
        for name, tensor in iter_stage_hf_tensors(model, hf_config):
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            writer.close()
    dist.barrier()
    if dist.get_rank() != 0:
        return
    weight_map = {}
    for k in range(stages):
        sub = os.path.join(partial, f"stage_{k:03d}")
        index = os.path.join(sub, SAFETENSORS_INDEX)
        if not os.path.isfile(index):
            raise RuntimeError(f"LMC-E304: snapshot {path}: stage {k} wrote no "
                               f"{SAFETENSORS_INDEX} (on several machines, trainer.eval_offline "
                               "needs a filesystem every trainer node writes to)")
        with open(index) as f:
            stage_map = json.load(f)["weight_map"]
        for file in sorted(set(stage_map.values())):
            os.replace(os.path.join(sub, file), os.path.join(partial, f"stage{k:03d}-{file}"))
        weight_map.update({name: f"stage{k:03d}-{file}" for name, file in stage_map.items()})
        shutil.rmtree(sub)
    hf_config.save_pretrained(partial)
    with open(os.path.join(partial, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(partial, SNAPSHOT_META), "w") as f:
        json.dump({"step": int(step), "version": int(version)}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
