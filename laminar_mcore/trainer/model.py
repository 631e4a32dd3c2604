"""Build a Megatron-Core ``GPTModel`` stage from a Hugging Face config and load full weights.

Owns the run-side half of ``TransformerConfig`` (parallel sizes, dtype, fusions that need CUDA)
and the loading of full Megatron tensors (from ``ModelAdapter.hf_to_mcore``) into this rank's
tensor- and pipeline-parallel shards, checking every parameter and shape.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch

from ..models import get_adapter
from ..models.base import AdapterError, split_layer_name
from ..models.moe import is_expert_param, parse_expert
from ..parallel import apply_cpu_compat


def resolve_dtype(name: str) -> torch.dtype:
    """``model.dtype``: auto is bf16 on GPUs and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"model.dtype={name!r} is not one of auto, fp32, bf16, fp16")
    return table[name]


def te_importable() -> bool:
    """Whether Transformer Engine's torch layers load, as Megatron-Core checks it
    (``megatron/core/extensions/transformer_engine.py`` imports ``transformer_engine`` and
    ``transformer_engine.pytorch``). The top-level package can import while its torch extension,
    built against one torch version, fails to load: then Megatron falls back to its local
    layers, and so must we."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401 - loads the torch extension
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def te_available() -> bool:
    """Transformer Engine layers are used: TE's torch layers load and there is a GPU."""
    return torch.cuda.is_available() and te_importable()


# The CUDA extensions behind Megatron's fusion flags (Apex builds them; PyPI has no Apex):
# ``masked_softmax_fusion`` -> the local attention's fused softmax
# (``megatron/core/fusions/fused_softmax.py``), ``gradient_accumulation_fusion`` -> the weight-
# gradient GEMM of Megatron's own ``ColumnParallelLinear`` (``tensor_parallel/layers.py``), which
# is ``GPTModel``'s output layer even when Transformer Engine builds every other layer.
SOFTMAX_EXTENSIONS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                      "scaled_softmax_cuda")
WGRAD_EXTENSION = "fused_weight_gradient_mlp_cuda"


def module_findable(name: str) -> bool:
    """Whether ``import name`` would find a module (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def fusion_flags(*, on_gpu: bool, use_te: bool, packed: bool = True, findable=None) -> dict:
    """Megatron's fusion flags from the facts that decide them, as NVIDIA's Megatron-Bridge
    probes them (``can_enable_masked_softmax_fusion``, ``can_enable_gradient_accumulation_fusion``):
    a flag is on only where the kernel that serves it exists.

    - ``bias_activation_fusion``: Megatron's jit-fused bias-SwiGLU (torch's own compiler) on GPUs;
    - ``masked_softmax_fusion``: never with packed sequences -- the local spec declares a causal
      mask, and the fused causal kernel ignores the block-diagonal mask of packed sequences (they
      would attend to each other); otherwise only where Apex's softmax extensions are findable;
    - ``gradient_accumulation_fusion``: Transformer Engine for its layers *and* Apex's
      ``fused_weight_gradient_mlp_cuda`` for the output layer (Megatron raises without it);
    - ``apply_rope_fusion``: Transformer Engine's fused RoPE (THD without it syncs the host in
      every layer).

    ``findable`` (module name -> bool) defaults to :func:`module_findable`; tests pass their own."""
    findable = module_findable if findable is None else findable
    softmax = all(findable(m) for m in SOFTMAX_EXTENSIONS)
    return dict(
        bias_activation_fusion=bool(on_gpu),
        masked_softmax_fusion=bool(on_gpu and softmax and not packed),
        gradient_accumulation_fusion=bool(on_gpu and use_te and findable(WGRAD_EXTENSION)),
        apply_rope_fusion=bool(on_gpu and use_te),
    )


RECOMPUTE = ("none", "selective", "full")


def memory_config(*, sequence_parallel: bool = False, recompute: str = "none",
                  recompute_num_layers: int = 1) -> dict:
    """The activation-memory levers as ``TransformerConfig`` keys.

    ``sequence_parallel`` splits the activations outside attention/MLP over the TP group (needs
    tp > 1). ``recompute``: none; ``selective`` (Megatron's default modules: the attention core
    is recomputed in the backward pass, not stored); ``full`` (each group of
    ``recompute_num_layers`` layers keeps only its input and reruns its forward)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"trainer.recompute={recompute!r} is not one of {', '.join(RECOMPUTE)}")
    out = dict(sequence_parallel=bool(sequence_parallel))
    if recompute == "selective":
        out.update(recompute_granularity="selective")
    elif recompute == "full":
        out.update(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=max(int(recompute_num_layers), 1))
    return out


def transformer_config(hf_config, *, dtype: torch.dtype = torch.float32, use_te=None,
                       **overrides):
    """Megatron ``TransformerConfig`` for the current parallel state."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    adapter = get_adapter(hf_config)
    on_gpu = torch.cuda.is_available()
    use_te = te_available() if use_te is None else use_te
    kwargs = adapter.transformer_config_kwargs(hf_config)
    if adapter.is_moe:
        kwargs.update(
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
            # Transformer Engine's grouped GEMM on GPUs; SequentialMLP (a loop of experts) on CPU
            moe_grouped_gemm=bool(on_gpu and use_te),
        )
    kwargs.update(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # each fusion only where its kernel exists (fusion_flags); on CPU the plain torch path
        **fusion_flags(on_gpu=on_gpu, use_te=use_te),
        persist_layer_norm=False,
        variable_seq_lengths=True,  # packed micro-batches differ in length under PP
        moe_token_dispatcher_type="alltoall",  # the one Megatron allows with variable lengths
        attention_softmax_in_fp32=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(adapter, use_te: bool, config):
    """The adapter's layer spec; without Transformer Engine its core attention takes packed
    sequences in O(T) memory (``trainer.attention``) instead of a dense T x T mask."""
    spec = adapter.layer_spec(use_te, config)
    if use_te:
        return spec
    from .attention import with_packed_attention

    return with_packed_attention(spec)


def build_gpt_model(hf_config, *, dtype: torch.dtype = torch.float32,
                    use_te: Optional[bool] = None, **config_overrides):
    """This rank's pipeline stage of the model (call after ``init_trainer_parallel``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    apply_cpu_compat()
    adapter = get_adapter(hf_config)
    use_te = te_available() if use_te is None else use_te
    config = transformer_config(hf_config, dtype=dtype, use_te=use_te, **config_overrides)
    tp = config.tensor_model_parallel_size
    pp = config.pipeline_model_parallel_size
    if config.sequence_parallel and not use_te and torch.cuda.is_available():
        raise AdapterError("LMC-E330: parallel.sequence_parallel=true needs Transformer Engine on "
                           "GPUs: Megatron's local layer spec has no sequence-parallel norm "
                           "there. Install transformer-engine on the trainer nodes, or set it "
                           "false (and use trainer.recompute to save activation memory)")
    if hf_config.vocab_size % tp:
        raise AdapterError("LMC-E111: "
                           f"vocab_size {hf_config.vocab_size} is not divisible by tp={tp}")
    if hf_config.num_hidden_layers % pp:
        raise AdapterError("LMC-E111: "
                           f"num_hidden_layers {hf_config.num_hidden_layers} is not divisible "
                           f"by pp={pp}")
    if adapter.num_experts(hf_config) % config.expert_model_parallel_size:
        raise AdapterError("LMC-E111: "
                           f"num_experts {adapter.num_experts(hf_config)} is not divisible by "
                           f"ep={config.expert_model_parallel_size}")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(adapter, use_te, config),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        **adapter.gpt_model_kwargs(hf_config),
    )
    apply_cpu_compat()  # rebinds megatron modules that building the model imported
    cast_parameters(model, dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def cast_parameters(model, dtype: torch.dtype) -> None:
    """One dtype for every parameter, as Megatron-LM's and verl's ``Float16Module`` casts a
    half-precision model: the local spec's norms (``torch.nn.RMSNorm`` built without a dtype)
    would otherwise stay fp32 in a bf16 model. Parameters keep their identity and attributes
    (TP layout, sequence-parallel marks); only their data is cast."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def check_parameter_dtypes(model) -> None:
    """Refuse a model whose optimizer parameter groups would mix dtypes (LMC-E333).

    Megatron's optimizer groups parameters by weight decay (biases and 1-D tensors such as norms
    go without) and by expert or dense; the distributed optimizer records each parameter's place
    in buffer order but regroups a group's shards fp32 first, so in a group of mixed dtypes its
    checkpoint looks state up by the wrong order: every format's save asserts, or saves one
    layer's Adam state under another's name."""
    from ..models.moe import is_expert_param

    groups: Dict[Tuple[bool, bool], Dict[torch.dtype, list]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = name.endswith(".bias") or p.dim() == 1
        groups.setdefault((no_decay, is_expert_param(name)), {}).setdefault(
            p.dtype, []).append(name)
    for (no_decay, expert), by_dtype in groups.items():
        if len(by_dtype) > 1:
            what = "; ".join(f"{str(d).replace('torch.', '')}: {', '.join(n[:4])}"
                             f"{f' and {len(n) - 4} more' if len(n) > 4 else ''}"
                             for d, n in sorted(by_dtype.items(), key=lambda kv: str(kv[0])))
            group = ("no-weight-decay" if no_decay else "weight-decay") + (
                " expert" if expert else "")
            raise AdapterError(
                f"LMC-E333: the optimizer's {group} parameter group mixes dtypes ({what}); "
                "the distributed optimizer's checkpoints need one dtype per group. Build the "
                "model with build_gpt_model(dtype=...), which casts every parameter, or cast "
                "the parameters named here before the optimizer is built")


def _expert_layout(model) -> Tuple[int, int]:
    """(first global expert of this rank, experts per rank) under expert parallelism."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = (model.config.num_moe_experts or 0) // ep
    return parallel_state.get_expert_model_parallel_rank() * per_rank, per_rank


def global_param_name(model, local_name: str) -> str:
    """``decoder.layers.{local}.x`` -> ``decoder.layers.{global}.x`` using each layer's number;
    an expert's local number becomes its global one (its EP rank's first expert + local)."""
    local, suffix = split_layer_name(local_name)
    if local is None:
        return local_name
    layer_number = model.decoder.layers[local].layer_number  # 1-based, global
    expert = parse_expert(suffix)
    if expert is not None:
        first, _ = _expert_layout(model)
        suffix = f"mlp.experts.local_experts.{first + expert[0]}.{expert[1]}"
    return f"decoder.layers.{layer_number - 1}.{suffix}"


def _tp_layout(name: str) -> Tuple[int, int, object]:
    """(rank, size, group) of the group that splits ``name``: expert TP for experts, TP
    otherwise."""
    from megatron.core import parallel_state as ps

    if is_expert_param(name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def local_full_names(model, hf_config) -> Dict[str, str]:
    """Local parameter name -> the full Megatron name whose shard it holds."""
    tied = get_adapter(hf_config).tied_embeddings(hf_config)
    names = {}
    for name, _ in model.named_parameters():
        full = global_param_name(model, name)
        if full == "output_layer.weight" and tied:
            full = "embedding.word_embeddings.weight"  # last stage's copy of the tied embedding
        names[name] = full
    return names


@torch.no_grad()
def load_full_state(model, hf_config, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shards of full Megatron tensors into ``model``; every shape is checked."""

    adapter = get_adapter(hf_config)
    params = dict(model.named_parameters())
    for local, full_name in local_full_names(model, hf_config).items():
        if full_name not in full_state:
            raise AdapterError("LMC-E303: "
                               f"no source tensor for parameter {local!r} ({full_name!r})")
        shard = adapter.shard(full_name, full_state[full_name], *_tp_layout(full_name)[:2])
        param = params[local]
        if tuple(shard.shape) != tuple(param.shape):
            raise AdapterError("LMC-E312: "
                               f"{local}: source shard has shape {tuple(shard.shape)}, the model "
                               f"expects {tuple(param.shape)} (wrong config or tp size?)")
        param.copy_(shard.to(param.dtype))


@torch.no_grad()
def stage_full_tensors(model, hf_config, *, grads: bool = False) -> Dict[str, torch.Tensor]:
    """This pipeline stage's parameters (or their gradients) as full tensors, gathered over TP.

    Returned on every rank of the tensor-parallel group, keyed by full Megatron names with
    global layer numbers; experts are gathered over expert parallelism too (every expert of
    the stage). The last stage's copy of a tied embedding is left out (the first stage holds
    it). Collective over the TP, expert-TP and EP groups.
    """
    adapter = get_adapter(hf_config)
    tied = adapter.tied_embeddings(hf_config)
    out: Dict[str, torch.Tensor] = {}
    experts: Dict[str, torch.Tensor] = {}
    for local, param in model.named_parameters():
        if tied and local == "output_layer.weight":
            continue
        full_name = global_param_name(model, local)
        tensor = param.grad if grads else param
        if tensor is None:
            tensor = torch.zeros_like(param)
        gathered = gather_tp(adapter, full_name, tensor.detach()).cpu().clone()
        (experts if is_expert_param(full_name) else out)[full_name] = gathered
    out.update({n: t.clone() for n, t in gather_ep(model, experts).items()})  # own memory each
    return out


def gather_ep(model, experts: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Every EP rank's experts from this rank's ``experts`` (full names, global numbers, each
    already whole over expert TP). One all-gather per layer and tensor kind (a layer's local
    fc1s stacked, then its fc2s), not one per expert. Every rank of the EP group calls it with
    the same layers (the same structure), so the gathers line up. Collective over EP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1 or not experts:
        return dict(experts)
    first, per_rank = _expert_layout(model)
    groups: Dict[Tuple[int, str], list] = {}
    for name in sorted(experts, key=_expert_sort_key):
        layer, suffix = split_layer_name(name)
        e, which = parse_expert(suffix)
        groups.setdefault((layer, which), []).append((e - first, experts[name]))
    out: Dict[str, torch.Tensor] = {}
    for (layer, which), local in groups.items():
        stacked = torch.stack([t for _, t in local]).contiguous()
        parts = [torch.empty_like(stacked) for _ in range(ep)]
        dist.all_gather(parts, stacked, group=ps.get_expert_model_parallel_group())
        for r, part in enumerate(parts):
            for j, (offset, _) in enumerate(local):
                out[f"decoder.layers.{layer}.mlp.experts.local_experts."
                    f"{r * per_rank + offset}.{which}"] = part[j]
    return out


def _expert_sort_key(name: str):
    layer, suffix = split_layer_name(name)
    e, which = parse_expert(suffix)
    return layer, e, which


def gather_tp(adapter, name: str, shard: torch.Tensor) -> torch.Tensor:
    """The full tensor of Megatron parameter ``name`` from every TP rank's ``shard`` (column,
    row and vocab-parallel; per-rank gate/up of linear_fc1), laid out as one unsharded
    Megatron tensor; a replicated parameter as it is. Collective over the TP group."""
    import torch.distributed as dist

    _, tp, group = _tp_layout(name)
    if adapter.tp_dim(name) is None or tp == 1:
        return shard
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(shards, shard, group=group)
    return adapter.unshard(name, shards)


@torch.no_grad()
def load_hf_checkpoint(model, hf_config, reader) -> int:
    """Load this rank's shards straight from a Hugging Face checkpoint, unit by unit (at most one
    layer's tensors in memory). ``reader``: a ``SafetensorsReader``. Returns bytes read."""

    adapter = get_adapter(hf_config)
    adapter.check_hf_names(hf_config, reader.names())
    params = dict(model.named_parameters())
    wanted = {}  # full name -> local param names (the tied embedding can have two)
    for local, full in local_full_names(model, hf_config).items():
        wanted.setdefault(full, []).append(local)
    loaded, nbytes = set(), 0
    for unit, names in adapter.export_units(hf_config):
        if not any(n in wanted for n in names):
            continue
        hf = {n: reader.get(n) for n in adapter.hf_unit_names(hf_config, unit)}
        nbytes += sum(t.numel() * t.element_size() for t in hf.values())
        for full, tensor in adapter.convert_unit_from_hf(hf_config, unit, hf).items():
            for local in wanted.get(full, []):
                shard = adapter.shard(full, tensor, *_tp_layout(full)[:2])
                if tuple(shard.shape) != tuple(params[local].shape):
                    raise AdapterError("LMC-E312: "
                                       f"{local}: checkpoint shard {tuple(shard.shape)} does not "
                                       f"match the model's {tuple(params[local].shape)}")
                params[local].copy_(shard.to(params[local].dtype))
                loaded.add(local)
    missing = sorted(set(params) - loaded)
    if missing:
        raise AdapterError(f"LMC-E303: parameters not found in the checkpoint: {missing[:8]}")
    return nbytes
