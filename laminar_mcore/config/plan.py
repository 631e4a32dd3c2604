"""The capacity plan: what a run needs per trainer GPU, per rollout node and per host, from the
config alone (no checkpoint, no cluster, no GPU), and whether it fits.

``python -m laminar_mcore.launch job=plan experiment=...`` prints it and writes
``outputs/<run_name>/plan.json``; ``validate_config`` refuses a GPU run that does not fit, before
any process starts, naming the largest item and the knob to turn. ``fits_gpu`` and ``fits_host``
say which budget a problem is in; ``fits`` is both.

The model (bytes per element; ``p`` = this rank's parameters, TP-split; ``DP`` = data-parallel
size):

* weights ``2p`` (bf16; fp32 runs: ``4p``), gradients ``4p`` (Megatron's DDP reduces in fp32),
  optimizer ``12p / DP`` with the distributed optimizer (fp32 main params + Adam's two moments,
  sharded over DP; ``12p`` without it; fp32 runs keep no separate main copy: ``8p``);
* activations per token and layer, bf16, flash attention (Transformer Engine's, or without it
  ``trainer.attention``'s varlen/SDPA kernels over the packed sequences): the TP-split
  tensors (QKV, attention output, the SwiGLU MLP's ``2f`` and ``f`` intermediates) are divided
  by TP; the five ``h``-wide tensors around the norms and residuals are divided by TP only with
  sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation", with
  SwiGLU and GQA widths); full recompute keeps each layer group's ``2h`` input and one group's
  working set; 1F1B pipelining keeps ``min(PP, micro-batches)`` micro-batches in flight on the
  first stage (``max_tokens_per_microbatch`` tokens each);
* logits on the last stage: ``tokens x vocab / TP`` in bf16 plus their fp32 gradient;
* MoE layers: each token's top-k routed copies (the experts' fc1/SwiGLU intermediates, the
  dispatched input and the combined output), divided by TP under sequence parallelism (each TP
  rank dispatches its own ``s/TP`` tokens) and multiplied by ``plan.moe_imbalance`` (the busiest
  rank over a balanced router);
* the publish-time gather (MoE): ``trainer/export.py`` gathers one layer's experts over EP on
  every rank of the stage -- a whole layer's experts, plus their Hugging Face copies -- between
  training steps, when activations are freed: the peak is the larger of the two phases;
* per-rank deltas (``weight_sync.export=per_rank`` with deltas on, on GPUs): each rank's shard
  once more at the rollout dtype, its previous version, where the kernels compare the next;
* the reference policy (``algo.kl_coef > 0``): the stage's weights once more, frozen (no
  gradients, no optimizer state); with ``algo.ref_offload`` they live in host memory and visit
  the GPU for the reference's forward pass, before the training pass, beside that pass's logits;
* overhead: ``OVERHEAD_FRACTION`` of what the GPU holds (the caching allocator's fragmentation)
  on top of ``OVERHEAD_FLOOR_GB`` (the CUDA context, NCCL communicators and their buffers).

Rollout nodes: ``num_engines x engine_tp`` GPUs; each engine GPU holds its weight shard, the KV
cache up to ``mem_fraction_static`` of the GPU, and at most two of the relay's buckets while it
pulls; the relay's GPU (``weight_sync.relay_device``), one no engine holds or none: the GPU map
(``config/gpu_map.py``, ``gpu_map`` in the plan: ``job=train`` on one node, a trainer node and a
rollout node, each role's ``CUDA_VISIBLE_DEVICES``).

Host memory (``cluster.host_memory_gb`` per node; 0: not checked): a rollout node's relay keeps
``weight_sync.relay_versions`` copies of the model at the rollout dtype in ``/dev/shm``, which
must fit ``cluster.shm_gb`` (the tmpfs size; default half of the RAM, Linux's default) -- the
relay's store never holds more (relay/store.py); a trainer node holds the pinned publish
buffers of the stage leads placed on it (one stage's weights each) and, with
``algo.ref_offload``, every rank's stage of the reference model. Each node also gets
``PROCESS_HOST_GB`` per GPU process (trainer rank, engine worker, the relay): Python, torch, the
CUDA and NCCL host-side allocations.
"""

from __future__ import annotations

import math
from typing import Dict

from .budgets import controller_open_files, controller_streams
from .gpu_map import plan_gpu_maps

# The CUDA context (~0.5 GB with the kernels of torch, Transformer Engine and NCCL loaded) and
# NCCL's communicators: each keeps NCCL_BUFFSIZE (4 MiB) per channel and peer, and a trainer rank
# has a dozen groups (TP, PP, DP, EP, their combinations) -- about 2-3 GB in all at 8 GPUs/node.
OVERHEAD_FLOOR_GB = 3.0
# PyTorch's caching allocator: reserved exceeds allocated by fragmentation, typically 5-10% in
# Megatron training with variable sequence lengths (PyTorch's "Understanding CUDA Memory Usage"
# notes; expandable_segments lowers it). 8% of everything the rank holds.
OVERHEAD_FRACTION = 0.08
# A GPU process's own host memory: the interpreter, torch and its CUDA libraries (a few GB of
# resident code and data), CUDA's and NCCL's pinned host buffers; trainer and SGLang worker
# processes typically hold 4-8 GB resident besides what the plan counts apart.
PROCESS_HOST_GB = 8.0
GB = 1e9


def relay_model_bytes(cfg) -> int:
    """One version of the model as a relay stores it (the rollout dtype), for its start-up
    check of ``/dev/shm`` (``RelayConfig.model_bytes``); ``cfg``: composed or typed. Published
    per rank (``weight_sync.export=per_rank``) a relay also holds the whole tensors it puts
    together for pulls: twice the bytes."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    from ..weights.shards import relay_copies

    return int(param_counts(model_arch(cfg))["total"] * (4 if cfg.model.dtype == "fp32" else 2)
               * relay_copies(cfg.weight_sync.export, cfg.parallel.tp))


def delta_choice(cfg, dtype=None, hf_config=None, device_encode=None) -> tuple:
    """``weight_sync.delta`` resolved for ``cfg`` (weights/delta.py, ``choose_delta``): (on,
    why). ``dtype``: the trainer's weights (default from ``model.dtype``; auto is bf16 for
    SGLang engines, fp32 for the CPU engine: a GPU trainer beside CPU engines may decide
    otherwise and says so in its log); ``hf_config``: the model's transformers config (default:
    ``model_arch``'s). The encoders: every publishing part (``weights.shards.publish_parts``),
    on its GPU with the Triton kernels where the publisher puts them (``device_encode``: a
    per-rank export on a GPU with Triton; None: per-rank and ``cluster.gpus_per_node`` > 0)."""
    import torch

    from ..weights.delta import DEVICE_PATH_BYTES_S, ENCODE_BYTES_S, choose_delta
    from ..weights.shards import publish_parts

    if dtype is None:
        name = cfg.model.dtype
        if name == "auto":
            name = "bf16" if cfg.rollout.backend == "sglang" else "fp32"
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    arch = model_arch(cfg) if hf_config is None else arch_of_hf_config(hf_config)
    model_bytes = int(param_counts(arch)["total"]) * dtype.itemsize
    p, ws = cfg.parallel, cfg.weight_sync
    per_rank = ws.export == "per_rank"
    if device_encode is None:
        device_encode = per_rank and cfg.cluster.gpus_per_node > 0
    on_gpu = per_rank and device_encode
    return choose_delta(ws.delta, dtype, model_bytes=model_bytes,  # (encoders in parallel)
                        stages=publish_parts(max(p.pp, 1), max(p.tp, 1), ws.export,
                                             max(getattr(p, "ep", 1) or 1, 1)),
                        link_gbit=ws.link_gbit, lr=cfg.trainer.lr,
                        encode_bytes_s=DEVICE_PATH_BYTES_S if on_gpu else ENCODE_BYTES_S,
                        encoders=("ranks' GPUs" if on_gpu else "ranks" if per_rank
                                  else "stage leads"))


def model_arch(cfg) -> dict:
    """The architecture the plan uses: ``model.path``'s config.json when set, else
    ``model.arch`` (the recipes' model files carry the published architecture)."""
    from omegaconf import OmegaConf

    path = OmegaConf.select(cfg, "model.path", throw_on_missing=False)
    if path is not None and not OmegaConf.is_missing(cfg.model, "path"):
        from ..models.hf import load_hf_config

        return arch_of_hf_config(load_hf_config(path), source=f"model.path={path}")
    a = cfg.model.arch
    moe = {}
    if a.family == "qwen3_moe":  # which layers are sparse: the adapter's rule
        from ..models.hf import hf_config_from_arch

        moe = _moe_arch(hf_config_from_arch(a))
    return dict(family=a.family, hidden=a.hidden_size, ffn=a.intermediate_size,
                layers=a.num_hidden_layers, heads=a.num_attention_heads,
                kv_heads=a.num_key_value_heads,
                head_dim=a.head_dim or a.hidden_size // a.num_attention_heads,
                vocab=a.vocab_size, tied=bool(a.tie_word_embeddings), source="model.arch",
                **{**_NO_EXPERTS, **moe})


_NO_EXPERTS = {"experts": 0, "topk": 0, "moe_ffn": 0, "moe_layers": 0}


def _moe_arch(hf) -> dict:
    """The plan's expert fields of a mixture-of-experts transformers config."""
    from ..models import get_adapter

    m = get_adapter(hf).moe_shape(hf)
    return dict(experts=m.experts, topk=m.topk, moe_ffn=m.moe_ffn, moe_layers=sum(m.moe_layers))


def arch_of_hf_config(hf, source: str = "config") -> dict:
    """The plan's architecture fields of a transformers config."""
    heads = hf.num_attention_heads
    moe = _moe_arch(hf) if getattr(hf, "num_experts", 0) else {}
    return dict(family=hf.model_type, hidden=hf.hidden_size, ffn=hf.intermediate_size,
                layers=hf.num_hidden_layers, heads=heads,
                kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
                vocab=hf.vocab_size, tied=bool(getattr(hf, "tie_word_embeddings", False)),
                source=source, **{**_NO_EXPERTS, **moe})


def param_counts(arch: dict) -> Dict[str, int]:
    h, f, hd = arch["hidden"], arch["ffn"], arch["head_dim"]
    q, kv = arch["heads"] * hd, arch["kv_heads"] * hd
    layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * f + 2 * h  # qkv(+bias), o, mlp, norms
    if arch["family"] in ("qwen3", "qwen3_moe"):
        layer += 2 * hd - (q + 2 * kv)  # q/k norms, no qkv bias
    elif arch["family"] == "llama":
        layer -= q + 2 * kv
    embedding = arch["vocab"] * h
    output = 0 if arch["tied"] else arch["vocab"] * h
    # MoE layers swap the dense MLP for a router and `experts` SwiGLU experts
    n_moe = arch.get("moe_layers", 0)
    expert = 3 * h * arch.get("moe_ffn", 0)
    router = arch.get("experts", 0) * h
    expert_total = n_moe * arch.get("experts", 0) * expert
    dense_total = layer * arch["layers"] + n_moe * (router - 3 * h * f)
    return dict(embedding=embedding, layer=layer, final_norm=h, output=output,
                expert=expert, router=router, moe_layers=n_moe, expert_total=expert_total,
                dense_layers_total=dense_total,
                total=embedding + dense_total + expert_total + h + output)


def _activation_bytes_per_token_layer(arch: dict, tp: int, sp: bool, etp: int = 1,
                                      imbalance: float = 1.0) -> float:
    h, f = arch["hidden"], arch["ffn"]
    q, kv = arch["heads"] * arch["head_dim"], arch["kv_heads"] * arch["head_dim"]
    split = 2 * (q + 2 * kv) + 2 * q + 4 * f + 2 * f  # QKV, attention out, fc1 (2f), SwiGLU (f)
    around = 5 * 2 * h  # norm inputs/outputs and the residual, h wide
    dense = split / tp + around / (tp if sp else 1)
    n_moe = arch.get("moe_layers", 0)
    if not n_moe:
        return dense
    # an MoE layer: each token's top-k expert copies (fc1 2f', SwiGLU f', dispatched input and
    # combined output, h each) in place of the dense MLP's. Under SP a TP rank dispatches only
    # its s/TP tokens; Megatron's alltoall dispatcher then gathers the rows over expert TP
    # (token_dispatcher.py: tp_group = expt_tp), so a rank's experts see etp x s/TP x k rows
    # (h-wide inputs, etp-split intermediates), and reduce-scatter their outputs back to its
    # own s/TP x k rows; the busiest rank gets `imbalance` times the balanced share. Averaged
    # over the layers. (bench.memory traces it: etp=2 at 235B within 1% of this term.)
    fm, k = arch["moe_ffn"], arch["topk"]
    routed = k * imbalance * 2 * (3 * fm + h * etp + h) / (tp if sp else 1)
    moe = (2 * (q + 2 * kv) + 2 * q) / tp + around / (tp if sp else 1) + routed
    return (dense * (arch["layers"] - n_moe) + moe * n_moe) / arch["layers"]


def capacity_plan(cfg, digits: int = 2) -> dict:
    """The plan of ``cfg`` (a composed run config) as a flat-ish dict; see the module doc.
    ``digits``: the GB figures' rounding (None: unrounded, for comparisons)."""
    from ..weights.shards import run_stripes

    arch = model_arch(cfg)
    counts = param_counts(arch)
    p, t, r, cl = cfg.parallel, cfg.trainer, cfg.rollout, cfg.cluster
    tp, pp = max(p.tp, 1), max(p.pp, 1)
    world = cl.trainer.nnodes * cl.trainer.nproc_per_node
    dp = max(world // (tp * pp * max(p.cp, 1)), 1)
    fp32 = cfg.model.dtype == "fp32"
    layers_per_stage = arch["layers"] / pp
    tokens = t.max_tokens_per_microbatch
    delta_on, delta_why = delta_choice(cfg)
    base_b = (4 if fp32 else 2) * (delta_on and cfg.weight_sync.export == "per_rank"
                                   and cl.gpus_per_node > 0)  # per-rank deltas' GPU bases
    # -------------------------------------------------------------- trainer GPU, first/last stage
    batch_tokens_per_dp = (t.train_batch_prompts * cfg.algo.n_samples_per_prompt
                           * (cfg.data.max_prompt_len + r.sampling.max_new_tokens) / dp)
    microbatches = max(1, math.ceil(batch_tokens_per_dp / tokens))
    in_flight = min(pp, microbatches)
    ep, etp = max(p.ep, 1), max(p.expert_tp, 1)
    edp = max(world // (etp * ep * pp), 1)  # the experts' data-parallel size
    imbalance = float(cfg.plan.moe_imbalance) if "plan" in cfg else 1.25
    per_tl = _activation_bytes_per_token_layer(arch, tp, p.sequence_parallel, etp, imbalance)
    if t.recompute == "full":
        group = max(t.recompute_num_layers, 1)
        kept = (layers_per_stage / group) * 2 * arch["hidden"] / (tp if p.sequence_parallel else 1)
        act_first = tokens * (kept * in_flight + group * per_tl)
        act_last = tokens * (kept + group * per_tl)
    else:
        act_first = tokens * per_tl * layers_per_stage * in_flight
        act_last = tokens * per_tl * layers_per_stage
    weight_b, grad_b = (4, 4) if fp32 else (2, 4)
    reference = float(cfg.algo.get("kl_coef", 0.0) or 0.0) > 0
    ref_offload = reference and bool(cfg.algo.get("ref_offload", False))
    adam_b = 8 if fp32 else 12
    optim_b = adam_b / (dp if p.use_distributed_optimizer else 1)
    dense_per_layer = counts["dense_layers_total"] / arch["layers"]
    # the stage's experts: ep ranks share them, expert TP splits each
    experts_per_rank = counts["expert_total"] / pp / (ep * etp)
    body = dense_per_layer * layers_per_stage / tp
    # The publish-time gather (MoE): one layer's experts, all of them, on every rank of the stage
    # (gather_ep), and their Hugging Face tensors converted from them: twice the layer's experts.
    publish_gb = (2 * counts["expert_total"] / max(counts["moe_layers"], 1) * weight_b / GB
                  if counts["moe_layers"] else 0.0)
    stages = {}
    for name, params, act, extra in (
            ("first", body + counts["embedding"] / tp, act_first, 0.0),
            ("last", body + (counts["output"] or counts["embedding"]) / tp + counts["final_norm"],
             act_last, tokens * arch["vocab"] / tp * (2 + 4))):
        if pp == 1:  # one stage holds everything
            params = body + (counts["embedding"] + counts["output"]) / tp + counts["final_norm"]
            extra = tokens * arch["vocab"] / tp * (2 + 4)
        expert_optim = experts_per_rank * adam_b / (edp if p.use_distributed_optimizer else 1)
        params = params + experts_per_rank
        # the frozen reference policy (algo.kl_coef > 0): the stage's weights once more, held
        # (reference_gb) or, offloaded, only while its forward pass runs (reference_visit_gb,
        # beside that pass's logits; no training activations are held then)
        ref_gb = params * weight_b / GB if reference else 0.0
        items = {"weights_gb": params * weight_b / GB, "grads_gb": params * grad_b / GB,
                 "optimizer_gb": ((params - experts_per_rank) * optim_b + expert_optim) / GB,
                 "reference_gb": 0.0 if ref_offload else ref_gb,
                 "activations_gb": act / GB,
                 "logits_gb": extra / GB, "publish_gather_gb": publish_gb,
                 # (and while a bucket is compared: it and its changes, about two buckets)
                 "delta_base_gb": (params * base_b + 2 * cfg.weight_sync.bucket_mb * 2**20
                                   * bool(base_b)) / GB}
        static = (items["weights_gb"] + items["grads_gb"] + items["optimizer_gb"]
                  + items["reference_gb"] + items["delta_base_gb"])
        visit = ref_gb + items["logits_gb"] if ref_offload else 0.0
        held = static + max(items["activations_gb"] + items["logits_gb"], publish_gb, visit)
        items["overhead_gb"] = OVERHEAD_FLOOR_GB + OVERHEAD_FRACTION * held
        stages[name] = dict(items, peak_gb=held + items["overhead_gb"], params=params)
    peak_stage = max(stages, key=lambda k: stages[k]["peak_gb"])
    peak = stages[peak_stage]
    largest = max((k for k in peak if k.endswith("_gb")
                   and k not in ("peak_gb", "overhead_gb", "publish_gather_gb")),
                  key=lambda k: peak[k])

    # -------------------------------------------------------------- rollout node
    gpus, mem = cl.gpus_per_node, cl.gpu_memory_gb
    engine_gpus = r.num_engines * r.engine_tp
    rollout_bytes = 4 if fp32 else 2
    model_gb = counts["total"] * rollout_bytes / GB
    engine_weights_gb = model_gb / max(r.engine_tp, 1)
    # two buckets held while pulling; per-rank versions are served as whole tensors: a served
    # bucket holds the TP slices of up to a bucket per rank (weights/shards.py)
    relay_buckets_gb = 2 * cfg.weight_sync.bucket_mb * 2**20 / GB * (
        max(cfg.parallel.tp, 1) if cfg.weight_sync.export == "per_rank" else 1)
    static_gb = r.mem_fraction_static * mem
    kv_gb = static_gb - engine_weights_gb
    # the GPU map (config/gpu_map.py): a rollout node's relay on a GPU no engine holds, or none
    gpu_maps = plan_gpu_maps(cfg)
    relay_device = (gpu_maps["rollout_node"].get("rollout_nodes") or [{}])[0].get("relay")
    relay_device = f"cuda:{relay_device}" if relay_device not in (None, "no relay") else "cpu"

    # -------------------------------------------------------------- host memory
    stage_bytes = [(dense_per_layer * layers_per_stage + counts["expert_total"] / pp
                    + (counts["embedding"] if s == 0 else 0)
                    + ((counts["output"] + counts["final_norm"]) if s == pp - 1 else 0))
                   * rollout_bytes for s in range(pp)]
    per_node = max(cl.trainer.nproc_per_node, 1)
    leads: Dict[int, float] = {}
    for s in range(pp):  # Megatron's rank order tp-cp-ep-dp-pp: a stage lead is tp=dp=0
        node = (s * tp * max(p.cp, 1) * dp) // per_node
        leads[node] = leads.get(node, 0.0) + stage_bytes[s]
    pinned_gb = max(leads.values()) / GB if leads else 0.0
    # an offloaded reference: every trainer rank's stage of it in host memory
    ref_host_gb = (max(stages["first"]["params"], stages["last"]["params"]) * weight_b
                   * per_node / GB if ref_offload else 0.0)

    host = _host_plan(cfg, model_gb, pinned_gb, ref_host_gb, engine_gpus)
    problems = []
    if gpus > 0:
        if peak["peak_gb"] > mem:
            act = ("set trainer.recompute=full" if t.recompute != "full" else
                   "raise trainer.recompute_num_layers") + " or lower trainer.max_tokens_per_microbatch"
            if not p.sequence_parallel and tp > 1:
                act += ", or set parallel.sequence_parallel=true (needs Transformer Engine)"
            knob = {"activations_gb": act,
                    "optimizer_gb": "add trainer nodes (a larger DP shards Adam further) or "
                                    "raise parallel.pp",
                    "weights_gb": "raise parallel.tp or parallel.pp",
                    "delta_base_gb": "set weight_sync.delta=off or raise parallel.tp",
                    "reference_gb": "set algo.ref_offload=true (the reference waits in host "
                                    "memory) or raise parallel.tp or parallel.pp",
                    "grads_gb": "raise parallel.tp or parallel.pp",
                    "logits_gb": "lower trainer.max_tokens_per_microbatch or raise parallel.tp"}
            problems.append(
                "LMC-E120: "
                f"a trainer GPU ({peak_stage} pipeline stage) needs {peak['peak_gb']:.1f} GB, "
                f"cluster.gpu_memory_gb={mem:g}; the largest item is {largest[:-3]} "
                f"({peak[largest]:.1f} GB): {knob[largest]}")
        if cl.trainer.nproc_per_node > gpus:
            problems.append(f"LMC-E121: cluster.trainer.nproc_per_node={cl.trainer.nproc_per_node} "
                            f"is more than cluster.gpus_per_node={gpus}")
        if r.backend == "sglang":
            if engine_gpus > gpus:
                problems.append(
                    "LMC-E121: "
                    f"rollout.num_engines={r.num_engines} x rollout.engine_tp={r.engine_tp} = "
                    f"{engine_gpus} GPUs per rollout node, cluster.gpus_per_node={gpus}: lower "
                    "rollout.num_engines (engines per rollout node)")
            refused = gpu_maps["rollout_node"].get("refused")
            if refused and engine_gpus <= gpus:  # the relay's GPU (the engines': above)
                problems.append(refused)
            if kv_gb < 0.1 * mem:
                problems.append(
                    f"LMC-E122: an engine GPU holds {engine_weights_gb:.1f} GB of weights, leaving "
                    f"{max(kv_gb, 0):.1f} GB of KV cache under rollout.mem_fraction_static="
                    f"{r.mem_fraction_static}: raise rollout.engine_tp")
    return {
        "model": cfg.model.name, "arch_source": arch["source"], "params_b": counts["total"] / 1e9,
        "tp": tp, "pp": pp, "dp": dp, "ep": ep, "expert_tp": etp, "expert_dp": edp,
        "experts": arch.get("experts", 0), "moe_imbalance": imbalance, "active_params_b": (
            counts["total"] - counts["expert_total"] + counts["moe_layers"] * arch.get("topk", 0)
            * counts["expert"]) / 1e9,
        "sequence_parallel": bool(p.sequence_parallel),
        "recompute": t.recompute, "micro_batch_tokens": tokens, "microbatches_per_step": microbatches,
        "in_flight_microbatches": in_flight,
        "trainer_gpu_peak_gb": round(peak["peak_gb"], 2), "trainer_peak_stage": peak_stage,
        "trainer_largest_item": largest[:-3],
        **{f"trainer_{stage}_{k}": v if digits is None else round(v, digits)
           for stage, items in stages.items()
           for k, v in items.items() if k.endswith("_gb")},
        "gpus_per_node": gpus, "gpu_memory_gb": mem,
        "engine_gpus_per_node": engine_gpus, "engine_tp": r.engine_tp,
        "engine_weights_gb_per_gpu": round(engine_weights_gb, 2),
        "engine_kv_gb_per_gpu": round(max(kv_gb, 0.0), 2),
        "relay_buckets_gb_per_engine_gpu": round(relay_buckets_gb, 2),
        "relay_device": relay_device, "relay_shares_an_engine_gpu": False, "gpu_map": gpu_maps,
        "relay_shm_gb_per_rollout_node": round(host["shm_need_gb"], 1),
        "pinned_publish_gb_per_trainer_node": round(pinned_gb, 1),
        "reference_model": "offloaded" if ref_offload else "held" if reference else "none",
        "reference_host_gb_per_trainer_node": round(ref_host_gb, 1),
        **{k: v for k, v in host.items() if k not in ("problems", "shm_need_gb")},
        "weight_sync_delta": delta_on, "weight_sync_delta_why": delta_why,
        "weight_sync_stripes": run_stripes(cfg),  # master relays (weight_sync.master_relays)
        "controller_streams": controller_streams(cfg),
        "controller_open_files": controller_open_files(cfg),
        "fits_gpu": not problems, "fits_host": not host["problems"],
        "fits": not problems and not host["problems"], "problems": problems + host["problems"],
    }


def _host_plan(cfg, model_gb: float, pinned_gb: float, ref_host_gb: float,
               engine_gpus: int) -> dict:
    """Host memory per rollout and trainer node, against ``cluster.host_memory_gb`` and
    ``cluster.shm_gb``; the problems name the key to change."""
    cl, rv = cfg.cluster, int(cfg.weight_sync.relay_versions)
    host_gb = float(cl.host_memory_gb)
    shm_default = cl.shm_gb is None
    shm_gb = host_gb / 2 if shm_default else float(cl.shm_gb)
    from ..weights.shards import relay_copies

    shm_need = rv * model_gb * relay_copies(cfg.weight_sync.export, cfg.parallel.tp)
    rollout_gb = shm_need + PROCESS_HOST_GB * (engine_gpus + 1)  # engine workers, the relay
    trainer_gb = pinned_gb + ref_host_gb + PROCESS_HOST_GB * cl.trainer.nproc_per_node
    problems = []
    if rv < 2:
        problems.append("LMC-E103: "
                        f"weight_sync.relay_versions={rv} must be >= 2: a relay keeps the "
                        "newest complete version for pulls while it receives the next")
    if host_gb > 0:
        shm_key = ("cluster.shm_gb unset: half of cluster.host_memory_gb" if shm_default
                   else "cluster.shm_gb")
        if shm_gb > host_gb:
            problems.append(f"LMC-E123: cluster.shm_gb={shm_gb:g} is more than "
                            f"cluster.host_memory_gb={host_gb:g}: /dev/shm is a tmpfs, it lives "
                            "in RAM; lower it")
        if shm_need > shm_gb:
            size = math.ceil(shm_need * 1.05 / 10) * 10
            problems.append(
                "LMC-E123: "
                f"a rollout node's relay keeps weight_sync.relay_versions={rv} versions of "
                f"{model_gb:.1f} GB in /dev/shm ({shm_need:.1f} GB"
                + (", twice over: weight_sync.export=per_rank" if shm_need > rv * model_gb
                   else "") + f"), but /dev/shm holds "
                f"{shm_gb:g} GB ({shm_key}): "
                f"remount it larger (mount -o remount,size={size}G /dev/shm; docker: "
                f"--shm-size={size}g) and set cluster.shm_gb={size}"
                + (", or lower weight_sync.relay_versions (2 is the least)" if rv > 2 else ""))
        if rollout_gb > host_gb:
            problems.append(
                f"LMC-E124: a rollout node needs {rollout_gb:.1f} GB of host memory (the relay's "
                f"{shm_need:.1f} GB in /dev/shm, {PROCESS_HOST_GB:g} GB for each of its "
                f"{engine_gpus + 1} processes: engine workers and the relay), "
                f"cluster.host_memory_gb={host_gb:g}: "
                + ("lower weight_sync.relay_versions (2 is the least), or " if rv > 2 else "")
                + "use nodes with more RAM (cluster.host_memory_gb)")
        if trainer_gb > host_gb:
            problems.append(
                "LMC-E125: "
                f"a trainer node needs {trainer_gb:.1f} GB of host memory ({pinned_gb:.1f} GB of "
                f"pinned publish buffers, {ref_host_gb:.1f} GB of offloaded reference model, "
                f"{PROCESS_HOST_GB:g} GB for each of its {cl.trainer.nproc_per_node} ranks), "
                f"cluster.host_memory_gb={host_gb:g}: raise parallel.pp (smaller stages, their "
                "leads on other nodes)"
                + (" or set algo.ref_offload=false" if ref_host_gb else ""))
    return {"host_memory_gb": host_gb, "shm_gb": shm_gb, "relay_versions": rv,
            "shm_need_gb": shm_need, "rollout_host_gb_per_node": round(rollout_gb, 1),
            "trainer_host_gb_per_node": round(trainer_gb, 1), "problems": problems}
