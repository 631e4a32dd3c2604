"""The capacity plan checked against the real model, traced on fake tensors.

    python -m laminar_mcore.bench.memory --json out.json [--experiment E ...] [--layers N]

For each GPU recipe (``qwen2_5_7b_math``, ``qwen2_5_72b_math``, ``qwen3_235b_a22b_math``) this
builds the trainer's own Megatron-Core model (``trainer.model.build_gpt_model``, wrapped in
Megatron's DDP, with Megatron's optimizer, as ``trainer.actor`` builds them) for the pipeline
stage the plan says peaks, at that rank's shapes, in a fake process group of the recipe's whole
world (``init_process_group("fake")`` on torch's ``FakeStore``, at the rank whose stage that is),
on ``FakeTensorMode`` tensors: nothing is allocated, every shape and dtype is the real one. It
runs a forward and a backward pass of one ``trainer.max_tokens_per_microbatch``-token micro-batch
under torch's ``MemTracker``, then the optimizer step (Megatron's main gradients from DDP's
buffers and the inner Adam's step, which creates Adam's state), for ``--layers N`` layers in the stage (the embedding or output layer where
the stage has them), and compares item by item with ``config/plan.py`` evaluated for the same
traced stage (unrounded):

* weights, gradients (Megatron's DDP buffers) and optimizer state (fp32 main params and Adam's
  moments, sharded by the distributed optimizer): the bytes of the real tensors;
* activations per layer: every storage autograd saves for the backward pass inside the
  transformer layers (each once; parameters are not activations), divided by N, with
  trainer.recompute=none. MemTracker's own activation and peak figures are reported beside
  (they include this CPU build's attention scores).

``<recipe>plan_vs_traced_max_error`` is the largest relative error over those items.

What differs on this CPU build is measured apart, not hidden in the comparison: without
Transformer Engine the trainer uses Megatron's local layer spec, whose unfused attention core
keeps the ``heads x s x s`` softmax scores for the backward pass where flash attention keeps
O(s). The bytes autograd saves inside ``core_attention`` are counted on their own
(``traced_attention_core_gb_per_layer``) and taken out of the per-layer activations the plan is
compared with. MoE layers are traced with Megatron's static-shape dispatch
(``moe_expert_capacity_factor`` = ``plan.moe_imbalance``, padded to capacity): fake tensors have
no values, so a data-dependent all-to-all cannot run; padded capacity is exactly the plan's
routed-token allowance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict

GB = 1e9
RECIPES = {"qwen2_5_7b_": "qwen2_5_7b_math", "qwen2_5_72b_": "qwen2_5_72b_math",
           "qwen3_235b_": "qwen3_235b_a22b_math"}
COMPARED = ("weights_gb", "grads_gb", "optimizer_gb", "activation_gb_per_layer")


def compose(experiment: str, overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ..config import register_configs
    from ..config.paths import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return hydra_compose(config_name="config",
                             overrides=[f"experiment={experiment}", *overrides])


def _fake_world(world: int, rank: int) -> None:
    """A process group of ``world`` ranks in which this process is ``rank``: torch's fake
    backend (collectives return at once, nothing is sent). Megatron's gloo side groups become
    fake groups too, and ``all_gather_object`` -- which Megatron uses to check that every rank
    built the same parameter groups, and which a fake tensor cannot carry -- returns this
    rank's object for every rank (every rank of a stage builds the same groups)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = None
        return new_group(*args, **kwargs)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    dist.new_group = fake_new_group
    dist.all_gather_object = all_gather_object


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (id(t.untyped_storage()) if not hasattr(t, "fake_mode") else id(t))
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


@contextlib.contextmanager
def _padded_experts():
    """Padded to capacity, every local expert receives exactly ``capacity`` tokens, so the
    per-expert split that ``SequentialMLP`` reads off a device tensor (which a fake tensor
    cannot give) is known: the dispatched rows divided evenly."""
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = SequentialMLP.forward

    def forward(self, hidden, tokens_per_expert, probs, *args, **kwargs):
        rows = hidden.shape[0]
        n = self.num_local_experts
        assert rows % n == 0, (rows, n)
        with unset_fake_temporarily():  # a real tensor: its values are known
            even = torch.full((n,), rows // n, dtype=torch.long)
        return original(self, hidden, even, probs, *args, **kwargs)

    SequentialMLP.forward = forward
    try:
        yield
    finally:
        SequentialMLP.forward = original


def _trace_stage(hf, cfg, plan, layers: int, tokens: int) -> Dict[str, float]:
    """Build this rank's stage with ``layers`` layers on fake tensors; its item bytes."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from ..trainer.model import build_gpt_model

    p, t = cfg.parallel, cfg.trainer
    pp = max(p.pp, 1)
    hf.num_hidden_layers = layers * pp
    dtype = torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16
    # Megatron's fused bias-SwiGLU (what GPUs run: it keeps fc1's output only) runs on CPU too.
    overrides = {"bias_activation_fusion": True}
    if plan["experts"]:
        overrides.update(moe_expert_capacity_factor=float(plan["moe_imbalance"]),
                         moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="probs")

    with FakeTensorMode(allow_non_fake_inputs=True), _padded_experts():
        model = build_gpt_model(hf, dtype=dtype, use_te=False,
                                sequence_parallel=bool(p.sequence_parallel), **overrides)
        ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=bool(p.use_distributed_optimizer)), model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, bf16=dtype == torch.bfloat16,
                            params_dtype=dtype,
                            use_distributed_optimizer=bool(p.use_distributed_optimizer)), [ddp])
        weights = _unique_bytes(model.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                    for b in list(ddp.buffers) + list(ddp.expert_parallel_buffers))

        # What the backward pass needs: every storage autograd saves during the forward pass,
        # once, charged to where it was saved -- inside an attention core (unfused on this
        # build: heads x s x s scores), elsewhere in a transformer layer, or outside the layers
        # (embedding, output layer, loss).
        from torch.multiprocessing.reductions import StorageWeakRef

        seq = tokens

        seen, where = set(), ["other"]
        saved = {"core": 0, "layer": 0, "other": 0, "norm": 0}
        params = {id(q) for q in model.parameters()}  # weights saved for backward are not
        # activations (each is a view of DDP's whole parameter buffer)

        def pack(x):
            if id(x) in params:
                return x
            ref = StorageWeakRef(x.untyped_storage())
            if ref not in seen:
                seen.add(ref)
                kind = where[-1]
                if kind == "core" and tuple(x.shape[-2:]) != (seq, seq):
                    kind = "layer"  # q, k, v: flash attention keeps them too
                saved[kind] += x.untyped_storage().nbytes()
            return x

        def enter(kind):
            return lambda *_a: where.append(kind)

        def leave(*_a):
            where.pop()

        hooks = []
        for layer in model.decoder.layers:
            core = layer.self_attention.core_attention
            norms = [getattr(layer, n) for n in ("input_layernorm", "pre_mlp_layernorm")
                     if isinstance(getattr(layer, n, None), torch.nn.Module)]
            for module, kind in [(layer, "layer"), (core, "core")] + [(m, "norm") for m in norms]:
                hooks.append(module.register_forward_pre_hook(enter(kind)))
                hooks.append(module.register_forward_hook(leave))

        input_ids = torch.zeros(1, seq, dtype=torch.long)
        position_ids = torch.arange(seq).unsqueeze(0)
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
        if not ps.is_pipeline_first_stage():
            local = seq // (max(p.tp, 1) if p.sequence_parallel else 1)
            hidden = torch.zeros(local, 1, hf.hidden_size, dtype=dtype, requires_grad=True)
            model.set_input_tensor(hidden)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = model(input_ids, position_ids, attention_mask=mask)
            act = tracker.get_tracker_snapshot("current")
            act_bytes = sum(v for d in act.values() for k, v in d.items() if "ACT" in str(k))
        with tracker:
            out.float().sum().backward()
            # The optimizer step as Megatron takes it, past its gradient-norm and clipping
            # (a fake tensor has no norm): the main gradients from DDP's buffers, then the
            # inner Adam's step, which creates its state.
            chained = getattr(optimizer, "chained_optimizers", [optimizer])
            for opt in chained:
                opt._copy_model_grads_to_main_grads()
                opt.optimizer.step()
        peak = tracker.get_tracker_snapshot("peak")
        opt_tensors = []
        for opt in chained:
            for group in opt.optimizer.param_groups:
                for main in group["params"]:
                    if main.dtype == torch.float32 and dtype != torch.float32:
                        opt_tensors.append(main)  # the fp32 main copy (bf16 runs)
                    opt_tensors += [v for v in opt.optimizer.state[main].values()
                                    if torch.is_tensor(v) and v.dim() > 0]
        optim = _unique_bytes(opt_tensors)
        peak_bytes = max(d.get("Total", 0) for d in peak.values())
        for h in hooks:
            h.remove()
        n = len(model.decoder.layers)
    return {"weights_gb": weights / GB, "grads_gb": grads / GB, "optimizer_gb": optim / GB,
            "memtracker_activations_gb": act_bytes / GB, "peak_gb": peak_bytes / GB,
            "activation_gb_per_layer": saved["layer"] / n / GB,
            "attention_core_gb_per_layer": saved["core"] / n / GB,
            "local_norm_gb_per_layer": saved["norm"] / n / GB,
            "norm_rows": tokens // (max(p.tp, 1) if p.sequence_parallel else 1),
            "outside_layers_gb": saved["other"] / GB, "layers": n}


def trace(experiment: str, layers: int, overrides=()) -> Dict[str, object]:
    """Child process: trace ``experiment``'s (with Hydra ``overrides``) peak stage."""
    import torch

    from ..config.plan import _activation_bytes_per_token_layer, capacity_plan, model_arch
    from ..models.hf import hf_config_from_arch
    from ..parallel.cpu_compat import apply_cpu_compat

    torch.set_num_threads(1)
    cfg = compose(experiment, overrides)
    plan = capacity_plan(cfg)
    p = cfg.parallel
    tp, pp = max(p.tp, 1), max(p.pp, 1)
    world = cfg.cluster.trainer.nnodes * cfg.cluster.trainer.nproc_per_node
    stage = plan["trainer_peak_stage"]
    pp_rank = 0 if stage == "first" else pp - 1
    rank = pp_rank * (world // pp)  # Megatron's order tp-cp-ep-dp-pp: pp outermost
    _fake_world(world, rank)
    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=max(p.cp, 1), expert_model_parallel_size=max(p.ep, 1),
        expert_tensor_parallel_size=max(p.expert_tp, 1))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    tokens = cfg.trainer.max_tokens_per_microbatch
    hf = hf_config_from_arch(cfg.model.arch)
    a = _trace_stage(hf, cfg, plan, layers, tokens)
    # the plan of the traced stage: the same recipe with `layers` layers per stage
    small = capacity_plan(compose(experiment, [*overrides,
                                               f"model.arch.num_hidden_layers={layers * pp}"]),
                          digits=None)
    arch = model_arch(cfg)
    per_layer_plan = _activation_bytes_per_token_layer(
        arch, tp, bool(p.sequence_parallel), max(p.expert_tp, 1),
        imbalance=float(plan["moe_imbalance"])) * tokens / GB
    te_norm = 2 * a["norm_rows"] * (2 * hf.hidden_size + 4) / GB
    return {"experiment": experiment, "world": world, "rank": rank, "stage": stage,
            "tp": tp, "pp": pp, "ep": plan["ep"], "dp": plan["dp"], "tokens": tokens,
            "traced_layers": a["layers"],
            "traced_weights_gb": a["weights_gb"], "traced_grads_gb": a["grads_gb"],
            "traced_optimizer_gb": a["optimizer_gb"],
            # comparable with a GPU: the layer's saved tensors outside the attention scores
            # and the norms, plus what TE's RMSNorm keeps for each of the layer's two norms
            # (its bf16 input and an fp32 rstd per row)
            "traced_activation_gb_per_layer": a["activation_gb_per_layer"] + te_norm,
            "te_norm_gb_per_layer": te_norm,
            "traced_local_norm_gb_per_layer": a["local_norm_gb_per_layer"],
            "traced_attention_core_gb_per_layer": a["attention_core_gb_per_layer"],
            "traced_outside_layers_activation_gb": a["outside_layers_gb"],
            "memtracker_activation_gb": a["memtracker_activations_gb"],
            "memtracker_peak_gb": a["peak_gb"],
            "plan_weights_gb": small[f"trainer_{stage}_weights_gb"],
            "plan_grads_gb": small[f"trainer_{stage}_grads_gb"],
            "plan_optimizer_gb": small[f"trainer_{stage}_optimizer_gb"],
            "plan_activation_gb_per_layer": per_layer_plan,
            "plan_full_stage_peak_gb": plan["trainer_gpu_peak_gb"]}


def compare(t: Dict[str, object]) -> Dict[str, float]:
    errors = {}
    for item in COMPARED:
        plan, traced = float(t[f"plan_{item}"]), float(t[f"traced_{item}"])
        errors[item] = abs(plan - traced) / max(abs(traced), 1e-12)
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--experiment", action="append", default=None,
                    help=f"a recipe (repeatable); default: {', '.join(RECIPES.values())}")
    ap.add_argument("--layers", type=int, default=1, help="layers in the traced stage (N)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every recipe, "
                                                 "e.g. parallel.expert_tp=2")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one recipe per process: the fake world and Megatron's state are global
        with open(args.out, "w") as f:
            json.dump(trace(args.child, args.layers, args.overrides), f)
        return 0
    experiments = args.experiment or list(RECIPES.values())
    prefixes = {v: k for k, v in RECIPES.items()}
    figures: Dict[str, object] = {"layers": args.layers}
    ok = True
    for experiment in experiments:
        prefix = prefixes.get(experiment, experiment + "_")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "trace.json")
            proc = subprocess.run(
                [sys.executable, "-m", "laminar_mcore.bench.memory", "--child", experiment,
                 "--layers", str(args.layers), "--out", out, *args.overrides],
                capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
            if proc.returncode != 0:
                print(f"[FAIL] {experiment}: the trace exited {proc.returncode}\n"
                      f"{proc.stderr[-3000:]}", file=sys.stderr)
                figures[f"{prefix}traced"] = False
                ok = False
                continue
            with open(out) as f:
                t = json.load(f)
        errors = compare(t)
        t["plan_vs_traced_max_error"] = max(errors.values())
        t["seconds"] = round(time.perf_counter() - start, 1)
        for k, v in t.items():
            if k != "experiment":
                figures[f"{prefix}{k}"] = round(v, 4) if isinstance(v, float) else v
        for item, err in errors.items():
            figures[f"{prefix}error_{item}"] = round(err, 4)
        print(f"{experiment}: rank {t['rank']} of {t['world']} ({t['stage']} stage, TP{t['tp']} "
              f"PP{t['pp']} EP{t['ep']} DP{t['dp']}), {t['traced_layers']} layer(s), "
              f"{t['tokens']} tokens, {t['seconds']} s")
        print(f"  {'item':<28}{'plan':>10}{'traced':>10}{'error':>8}")
        for item in COMPARED:
            print(f"  {item:<28}{t[f'plan_{item}']:>10.3f}{t[f'traced_{item}']:>10.3f}"
                  f"{errors[item]:>8.1%}")
        print(f"  measured apart (this CPU build only): the unfused attention core's "
              f"heads x s x s scores {t['traced_attention_core_gb_per_layer']:.3f} GB per layer "
              f"(flash attention: O(s)); the local spec's fp32 RMSNorm "
              f"{t['traced_local_norm_gb_per_layer']:.3f} GB per layer (replaced by TE's "
              f"{t['te_norm_gb_per_layer']:.3f})")
    figures["all_traced"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
