"""Training checkpoints: save every ``trainer.save_interval`` steps, resume exactly.

A checkpoint directory ``step_XXXXXXXX`` holds:

* ``model/``: the model as a dist_checkpointing (torch_dist) checkpoint, loadable at any TP/PP
  by the conversion tool;
* ``optimizer/``: the optimizer through Megatron's ``sharded_state_dict`` -- for the distributed
  optimizer its Adam moments and fp32 main parameters (``DistributedOptimizer.state_dict()``
  alone leaves them out), in the ``trainer.ckpt_optim_sharding`` format: ``dp_reshardable``
  (each rank writes its own shard; a resume may change the DP size) or ``fully_reshardable``
  (gathered in model space; a resume may also change TP and PP);
* ``trainer_state.json``: LR schedule, weight version, counters (the same on every rank);
* ``rng/rank_XXXXX.safetensors``: each rank's RNG states (CPU, CUDA and Megatron's tracker),
  restored when the layout is unchanged;
* rank 0's controller state (prompt pool position, experience buffer, partial pool) as JSON.

Nothing is a pickle: loading a checkpoint directory cannot run code planted in it. A save is
written under a ``.partial`` name and renamed, then marked complete last, so an interrupted save
is never picked by ``trainer.resume=auto``. The directory layout, and which checkpoint
``trainer.resume`` picks, are ``data/checkpoints.py``'s (the controller reads them too).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..data.checkpoints import COMPLETE, EXTRA_STATE, STEP_DIR
from ..models.hf import copy_side_files

logger = logging.getLogger(__name__)

OPTIM_SHARDING = ("dp_reshardable", "fully_reshardable")


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size()}


def _rank_key() -> str:
    return f"rank_{dist.get_rank():05d}.safetensors"


def _save_rng(path: str) -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from safetensors.torch import save_file

    tensors = {"cpu": torch.get_rng_state()}
    for name, state in mrandom.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker/{name}"] = state
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def _load_rng(path: str) -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from safetensors.torch import load_file

    tensors = load_file(path)
    torch.set_rng_state(tensors["cpu"])
    mrandom.get_cuda_rng_tracker().set_states(
        {k[len("tracker/"):]: v for k, v in tensors.items() if k.startswith("tracker/")})
    if torch.cuda.is_available() and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"])


def _sharding_metadata(actor) -> dict:
    """What Megatron's ``sharded_state_dict`` calls take (as Megatron-LM's training loop does)."""
    sharding = actor.trainer.ckpt_optim_sharding
    if sharding not in OPTIM_SHARDING:
        raise ValueError(f"trainer.ckpt_optim_sharding={sharding!r} is not one of {OPTIM_SHARDING}")
    return {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def _is_torch_adam(inner) -> bool:
    """Megatron-Core's fallback optimizer (neither Transformer Engine nor Apex importable):
    torch's Adam/AdamW, which keeps a per-parameter ``step`` tensor in its state. TE's and Apex's
    ``FusedAdam`` keep the step in each param group instead."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _prime_optimizer_state(optimizer) -> None:
    """Give an optimizer that has not stepped yet (a resume, a save at step 0) its state before
    Megatron reads it.

    Megatron's own ``init_state_fn`` creates the moments (what the first step would create; a
    load overwrites them). Only on the torch-Adam fallback is a per-parameter ``step`` added:
    Megatron-Core 0.19.2's ``DistributedOptimizer.state_dict()`` asserts that every parameter's
    state has one there. TE's ``FusedAdam`` must not get one: its ``state_dict`` and
    ``load_state_dict`` look every state key up in ``name_to_dtype_map`` and raise
    ``KeyError: 'step'`` (``transformer_engine/pytorch/optimizers/fused_adam.py``, 2.20.2).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state):
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, getattr(opt, "config", None))
        if not _is_torch_adam(inner):
            if not getattr(inner, "capturable", False):
                # FusedAdam's step lives in the group: step 0 is what it has before its first
                # step (its step() adds one either way). Saved as 0, a checkpoint taken before
                # the first step can also be resumed on torch's Adam.
                for group in inner.param_groups:
                    group.setdefault("step", 0)
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def _inner_optimizers(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(o, "optimizer", None) is not None]


def _adam_step(optimizer) -> Optional[float]:
    """Adam's step count: torch's per-parameter ``step`` (all equal), or FusedAdam's
    per-group one (groups with parameters); None when there is no single count."""
    steps = set()
    for inner in _inner_optimizers(optimizer):
        if _is_torch_adam(inner):
            steps |= {float(st["step"]) for st in inner.state.values()
                      if torch.is_tensor(st.get("step"))}
        else:
            steps |= {float(g["step"]) for g in inner.param_groups
                      if g["params"] and "step" in g and not torch.is_tensor(g["step"])}
    return steps.pop() if len(steps) == 1 else None


def _restore_adam_step(optimizer, step: Optional[float]) -> None:
    """Put back Adam's step after Megatron's load.

    torch's Adam: Megatron-Core 0.19.2's distributed optimizer, on its torch-Adam fallback (no
    Apex or Transformer Engine), copies the *template's* ``step`` over the loaded one when it
    loads a ``dp_reshardable`` state, and gives every parameter the same step tensor, which
    torch's Adam then increments once per parameter. Each parameter gets its own tensor with the
    saved count, so the bias correction of the first step after a resume is the uninterrupted
    run's. This also gives a checkpoint saved with TE's or Apex's FusedAdam its count.

    FusedAdam (TE, Apex): Megatron replaces each param group with the saved one, as it was
    saved. From a checkpoint torch's Adam wrote, the step is a float, which TE's and Apex's
    kernels refuse (their bindings take ``int step``): it is made an int, or set from ``step``
    where none was saved; and the group lacks FusedAdam's own keys (``bias_correction``, which
    its ``step`` reads): they come back from the optimizer's defaults, as torch's Adam's
    ``__setstate__`` does for its own keys.
    """
    for inner in _inner_optimizers(optimizer):
        if _is_torch_adam(inner):
            if step is None:
                continue
            for st in inner.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = torch.full_like(st["step"], step)
        elif not getattr(inner, "capturable", False):
            for group in inner.param_groups:
                for key, value in inner.defaults.items():
                    group.setdefault(key, value)
                if "step" in group:
                    group["step"] = int(group["step"])
                elif step is not None:
                    group["step"] = int(step)


@contextlib.contextmanager
def _tolerate_missing_step(optimizer):
    """Megatron-Core 0.19.2's ``fully_reshardable`` load copies every tensor of a parameter's
    optimizer state from the checkpoint, and torch's Adam (its fallback without Apex or
    Transformer Engine) keeps ``step`` there, which that format does not save: a KeyError.
    During the load, a missing ``step`` is passed as None, which Megatron skips;
    ``_restore_adam_step`` then sets it from ``trainer_state.json``."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or not _is_torch_adam(getattr(opt, "optimizer", None)):
            continue
        opt._set_main_param_and_optimizer_states = (
            lambda model_param, tensors, __orig=original: __orig(model_param,
                                                                 {"step": None, **tensors}))
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # the class's method again


def _module(actor):
    return actor.model.module if hasattr(actor.model, "module") else actor.model


def _trainer_state(actor) -> dict:
    return {"scheduler": actor.scheduler.state_dict(), "version": actor.version,
            "total_nonfinite": actor.total_nonfinite, "layout": _layout(),
            "optimizer_step": _adam_step(actor.optimizer),
            "optimizer_classes": [type(o).__name__ for o in _inner_optimizers(actor.optimizer)],
            "optim_sharding": _sharding_metadata(actor)["distrib_optim_sharding_type"],
            "distributed_optimizer": actor.use_distributed_optimizer,
            "optimizers": _optimizer_count(actor.optimizer)}


def _optimizer_count(optimizer) -> int:
    """How many optimizers Megatron chains: one, or (MoE with expert parallelism, when the
    experts' DP group differs from the dense one) one for dense and one for expert weights."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_checkpoint(root: str, step: int, actor, extra_state: Optional[dict] = None,
                    keep: int = 3) -> str:
    """Collective: every trainer rank calls it. Returns the checkpoint directory."""
    from .dist_save import save_sharded

    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        for sub in ("model", "optimizer", "rng"):
            os.makedirs(os.path.join(partial, sub), exist_ok=True)
    dist.barrier()
    start = time.perf_counter()
    model = _module(actor)
    metadata = _sharding_metadata(actor)
    model_sd = model.sharded_state_dict(metadata=metadata)
    save_sharded(model_sd, os.path.join(partial, "model"))
    _prime_optimizer_state(actor.optimizer)
    # A fresh model sharded state dict: the save applies its factories in place.
    optim_sd = actor.optimizer.sharded_state_dict(model.sharded_state_dict(metadata=metadata),
                                                  is_loading=False, metadata=metadata)
    save_sharded(optim_sd, os.path.join(partial, "optimizer"))
    _save_rng(os.path.join(partial, "rng", _rank_key()))
    if rank == 0:
        with open(os.path.join(partial, "trainer_state.json"), "w") as f:
            json.dump(_trainer_state(actor), f)
        if extra_state is not None:
            with open(os.path.join(partial, EXTRA_STATE), "w") as f:
                json.dump(extra_state, f)
        # so that tools/convert_checkpoint.py mcore-to-hf takes it as it is
        layout = _layout()
        dtype = next(model.parameters()).dtype
        write_model_meta(partial, actor.hf_config, tp=layout["tp"], pp=layout["pp"],
                         dtype="fp32" if dtype == torch.float32 else "bf16", source="trainer",
                         ep=layout["ep"])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        with open(os.path.join(final, COMPLETE), "w") as f:  # written last: marks completeness
            json.dump({"step": step, "version": actor.version, "layout": _layout(),
                       "seconds": time.perf_counter() - start}, f)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: str, keep: int) -> None:
    complete = sorted(n for n in os.listdir(root) if STEP_DIR.match(n)
                      and os.path.isfile(os.path.join(root, n, COMPLETE)))
    for name in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _check_layout(path: str, saved: dict, state: dict) -> None:
    now = _layout()
    saved = {"ep": 1, **saved}  # checkpoints from before expert parallelism
    if saved == now:
        return
    if os.path.isfile(os.path.join(path, "rank_00000.pt")):
        raise RuntimeError(f"LMC-E302: checkpoint {path} is in the old per-rank pickle format, "
                           "which is no longer loaded; resume it with the version that wrote it")
    sharding = state.get("optim_sharding", "dp_reshardable")
    if sharding == "fully_reshardable":
        return
    if (saved["tp"], saved["pp"], saved["ep"]) != (now["tp"], now["pp"], now["ep"]):
        raise RuntimeError(
            f"LMC-E302: checkpoint {path} was saved at layout {saved}, this run is {now}: its "
            "optimizer state (trainer.ckpt_optim_sharding=dp_reshardable) reshards over DP "
            f"only. Resume at tp={saved['tp']} pp={saved['pp']} ep={saved['ep']} (any DP size), "
            "save with trainer.ckpt_optim_sharding=fully_reshardable, or convert the model with "
            "tools/convert_checkpoint.py and start a new run from it")


def load_checkpoint(path: str, actor) -> Tuple[int, Optional[dict]]:
    """Restore ``actor`` from ``path``; returns (step, controller extra state or None).

    The model and the optimizer reshard over DP (and, when saved ``fully_reshardable``, over
    TP and PP); RNG states are restored only at the layout they were saved at."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, COMPLETE)) as f:
        marker = json.load(f)
    state_path = os.path.join(path, "trainer_state.json")
    state = {}
    if os.path.isfile(state_path):
        with open(state_path) as f:
            state = json.load(f)
    _check_layout(path, marker["layout"], state)
    if bool(state.get("distributed_optimizer", False)) != actor.use_distributed_optimizer:
        raise RuntimeError(
            f"LMC-E302: checkpoint {path} was saved with parallel.use_distributed_optimizer="
            f"{state.get('distributed_optimizer')}, this run has "
            f"{actor.use_distributed_optimizer}; resume with the same setting")
    saved_optimizers, optimizers = int(state.get("optimizers", 1)), _optimizer_count(actor.optimizer)
    if saved_optimizers != optimizers:
        raise RuntimeError(
            f"LMC-E302: checkpoint {path} holds the state of {saved_optimizers} chained "
            f"optimizers (dense and expert weights at ep={marker['layout'].get('ep', 1)}), this "
            f"run has {optimizers} (ep={_layout()['ep']}); Megatron-Core cannot load an optimizer "
            "state across that change, even fully_reshardable. Resume at an EP with the same "
            "split (ep > 1 keeps experts apart), or convert the model with "
            "tools/convert_checkpoint.py and start a new run from it")
    model = _module(actor)
    metadata = _sharding_metadata(actor)
    metadata["distrib_optim_sharding_type"] = state.get("optim_sharding",
                                                        metadata["distrib_optim_sharding_type"])
    loaded = dist_checkpointing.load(model.sharded_state_dict(metadata=metadata),
                                     os.path.join(path, "model"))
    model.load_state_dict(loaded)
    _prime_optimizer_state(actor.optimizer)
    optim_sd = actor.optimizer.sharded_state_dict(model.sharded_state_dict(metadata=metadata),
                                                  is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(optim_sd, os.path.join(path, "optimizer"))
    with torch.no_grad(), _tolerate_missing_step(actor.optimizer):
        actor.optimizer.load_state_dict(loaded)  # fp32 main params are views of leaf params
    _restore_adam_step(actor.optimizer, state.get("optimizer_step"))
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.version = int(state["version"])
    actor.total_nonfinite = int(state.get("total_nonfinite", 0))
    rng = os.path.join(path, "rng", _rank_key())
    if marker["layout"] == _layout() and os.path.isfile(rng):
        _load_rng(rng)
    else:
        logger.warning("checkpoint %s was saved at layout %s, this run is %s: RNG states start "
                       "fresh from the seed", path, marker["layout"], _layout())
    extra = None
    extra_path = os.path.join(path, EXTRA_STATE)
    if os.path.isfile(extra_path):
        with open(extra_path) as f:
            extra = json.load(f)
    return int(marker["step"]), extra


# ---------------------------------------------------------------------- streaming export
MODEL_META = "laminar_checkpoint.json"


def write_model_meta(ckpt_dir: str, hf_config, *, tp: int, pp: int, dtype: str, source: str,
                     hf_files_from: Optional[str] = None, ep: int = 1) -> None:
    """What ``tools/convert_checkpoint.py mcore-to-hf`` needs beside ``model/``: the Hugging Face
    config (and tokenizer files when ``hf_files_from`` has them) under ``hf_meta/`` and a
    ``laminar_checkpoint.json`` that names the format and the layout it was saved at."""
    meta_dir = os.path.join(ckpt_dir, "hf_meta")
    os.makedirs(meta_dir, exist_ok=True)
    hf_config.save_pretrained(meta_dir)
    if hf_files_from and os.path.isdir(hf_files_from):
        copy_side_files(hf_files_from, meta_dir)
    with open(os.path.join(ckpt_dir, MODEL_META), "w") as f:
        json.dump({"format": "laminar-mcore/torch_dist", "model_type": hf_config.model_type,
                   "tp": tp, "pp": pp, "ep": ep, "dtype": dtype, "source": source}, f, indent=2)


class CheckpointMismatch(ValueError):
    """A dist_checkpointing directory that does not hold the model its config describes."""


def _slice_planner(chunks: dict):
    """A DCP load planner that reads, for each key, only the region ``chunks[key]`` of the saved
    tensor into a buffer of that region's shape (DCP resharding, applied to a slice)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key in self.state_dict:
                items += create_read_items_for_chunk_list(
                    key, self.metadata.state_dict_metadata[key], [chunks[key]])
            return LoadPlan(items)

        def lookup_tensor(self, index):  # offsets are relative to the requested region
            return self.state_dict[index.fqn]

    return SlicePlanner()


def iter_checkpoint_hf_tensors(model_dir: str, hf_config):
    """(Hugging Face name, tensor) of a torch_dist model checkpoint, one conversion unit at a time.

    Whatever TP/PP it was saved at, each unit (the embedding, one layer, the final norm, the
    output layer) is read on its own -- a layer is one slice of Megatron's layer-stacked tensors
    -- so memory holds one unit, never the model. Runs in one process without a process group.
    A missing tensor or a shape the config does not predict raises CheckpointMismatch naming it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from ..models import get_adapter

    adapter = get_adapter(hf_config)
    layers = adapter.shape(hf_config).layers
    reader = dcp.FileSystemReader(model_dir)
    try:
        stored = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - missing/truncated metadata
        raise CheckpointMismatch(f"LMC-E303: {model_dir} is not a readable torch_dist checkpoint "
                                 f"(missing or truncated .metadata): {exc}") from exc
    for unit, names in adapter.export_units(hf_config):
        # one region per stored key: a layer's slice of a layer-stacked tensor, or a layer's
        # whole expert stack (the unit needs all of them), read once
        where = {name: _locate(stored, name, layers, model_dir) for name in names}
        buffers, chunks = {}, {}
        for key, lead, _ in where.values():
            if key in buffers:
                continue
            size = tuple(stored[key].size)
            buffers[key] = torch.empty((1,) * len(lead) + size[len(lead):],
                                       dtype=stored[key].properties.dtype)
            chunks[key] = ChunkStorageMetadata(
                offsets=torch.Size(lead + (0,) * (len(size) - len(lead))),
                sizes=torch.Size(buffers[key].shape))
        dcp.load(buffers, storage_reader=reader, planner=_slice_planner(chunks), no_dist=True)
        full = {}
        for name, (key, lead, expert) in where.items():
            tensor = buffers[key].reshape(buffers[key].shape[len(lead):])
            full[name] = tensor[expert] if expert is not None else tensor
        try:
            pairs = adapter.convert_unit_to_hf(hf_config, unit, full)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointMismatch(f"LMC-E303: {unit}: the checkpoint's tensors do not fit the "
                                     f"config ({exc}); a checkpoint of another model?") from exc
        for hf_name, tensor in pairs:
            yield hf_name, tensor
        del buffers, full, pairs


def _locate(stored, name: str, layers: int, model_dir: str):
    """Where full Megatron tensor ``name`` lives in a torch_dist checkpoint: (stored key, the
    indices of the leading dimensions it takes one slice of, its expert number or None).

    Dense models stack each tensor over layers (``decoder.layers.<suffix>`` [L, ...]); models
    with MoE layers keep one key per layer (``decoder.layers.{i}.<suffix>``) and stack a layer's
    experts (``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight`` [E, ...], whatever
    the EP layout). Norms are stored under their fused (Transformer Engine) names."""
    from ..models.moe import parse_expert

    index, suffix = _split_layer(name)
    expert = parse_expert(suffix) if index is not None else None
    if index is None:
        candidates = [(name, ())]
    elif expert is not None:
        candidates = [(f"decoder.layers.{index}.mlp.experts.experts.{expert[1]}", ()),
                      (f"decoder.layers.mlp.experts.experts.{expert[1]}", (index,))]
    else:
        candidates = []
        for sfx in (_CKPT_KEYS.get(suffix, suffix), suffix):
            candidates += [(f"decoder.layers.{index}.{sfx}", ()),
                           (f"decoder.layers.{sfx}", (index,))]
    for key, lead in candidates:
        meta = stored.get(key)
        if meta is None or not hasattr(meta, "size"):
            continue
        size = tuple(meta.size)
        if lead and (not size or size[0] != layers):
            raise CheckpointMismatch(f"LMC-E303: {key} holds {size[0] if size else 0} layers, "
                                     f"the config says {layers}: a checkpoint of another model")
        if expert is not None and (len(size) <= len(lead) or size[len(lead)] <= expert[0]):
            raise CheckpointMismatch(f"LMC-E303: {key} has shape {size}: no expert {expert[0]} "
                                     "(a checkpoint of another model?)")
        return key, lead, (expert[0] if expert is not None else None)
    raise CheckpointMismatch(f"LMC-E303: {model_dir} has no tensor {candidates[0][0]!r} (needed "
                             f"for {name}); a checkpoint of another model or architecture?")


def _split_layer(name: str):
    from ..models.base import split_layer_name

    return split_layer_name(name)


_CKPT_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
