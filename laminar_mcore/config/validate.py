"""Checks of a composed run config that span sections; run before any process starts.

Type and key errors are caught by the schemas when Hydra composes the config; this module
catches what a type cannot say: sizes that must divide, paths that must exist, enum values.
Every error names the key and the fix.
"""

from __future__ import annotations

import os
from typing import List

from omegaconf import DictConfig

from ..modes import MODES
from .budgets import budget_problems
from ..data.tasks import TASKS
from ..errors import within
from ..relay.transports import TRANSPORTS


class ConfigError(ValueError):
    """An invalid run config. The message lists every problem found, each with its fix."""


_CHOICES = {
    "mode": tuple(MODES),
    "job": ("smoke", "train", "plan", "controller", "rollout", "trainer"),
    "model.dtype": ("auto", "fp32", "bf16", "fp16"),
    "rollout.backend": ("cpu", "sglang"),
    "rollout.relay": ("local", "remote"),
    "data.task": TASKS,
    "algo.cap_mode": ("mask", "clamp"),
    "algo.cap_level": ("token", "sequence"),
    "trainer.lr_decay_style": ("constant", "linear", "cosine"),
    "trainer.ckpt_optim_sharding": ("dp_reshardable", "fully_reshardable"),
    "trainer.recompute": ("none", "selective", "full"),
}


def _get(cfg: DictConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def model_shape(cfg: DictConfig, arch_only: bool = False) -> dict:
    """Vocab, heads, groups and layers of the configured model (from config.json if a path)."""
    if not arch_only and cfg.model.path is not None:
        from ..models.hf import load_hf_config

        hf = load_hf_config(cfg.model.path)
        return dict(vocab=hf.vocab_size, heads=hf.num_attention_heads,
                    groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                    layers=hf.num_hidden_layers, family=hf.model_type, source="model.path",
                    experts=int(getattr(hf, "num_experts", 0) or 0))
    a = cfg.model.arch
    return dict(vocab=a.vocab_size, heads=a.num_attention_heads, groups=a.num_key_value_heads,
                layers=a.num_hidden_layers, family=a.family, source="model.arch",
                experts=a.num_experts)


def _check_stripes(cfg, problems: list) -> None:
    """``weight_sync.master_relays`` divides ``parallel.pp`` (LMC-E127); a striped tier is read
    by engines through their node's relays (not Mooncake, nor a pull agent: LMC-E110)."""
    from ..weights.shards import run_stripes

    try:
        stripes = run_stripes(cfg)
    except ValueError as exc:
        problems.append(str(exc))
        return
    ws = cfg.weight_sync
    if stripes > 1 and (cfg.rollout.relay == "remote" or ws.engine_transport == "mooncake"):
        problems.append(f"LMC-E110: weight_sync.master_relays={stripes} stripes every version "
                        "over that many master relays, pulled from the relays of the engines' "
                        "own node; rollout.relay=remote and weight_sync.engine_transport="
                        "mooncake read one relay: set weight_sync.master_relays=1 (or null)")


def validate_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` listing every problem of ``cfg``; return silently if it is valid."""
    problems: List[str] = []
    _check_against_schema(cfg)
    from omegaconf import OmegaConf

    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
    if cfg.job == "plan":  # the plan needs the architecture, not a checkpoint or a cluster
        missing = [k for k in missing if k not in ("model.path", "cluster.controller_addr")]
    if missing:
        raise ConfigError("LMC-E101: invalid configuration: mandatory values are not set: "
                          + ", ".join(missing) + "; give them on the command line, e.g. "
                          + " ".join(f"{k}=..." for k in missing))
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            problems.append(f"LMC-E102: {key}={value!r} is not one of {', '.join(choices)}")

    p = cfg.parallel
    for key in ("tp", "pp", "cp", "ep", "expert_tp"):
        if p[key] < 1:
            problems.append(f"LMC-E103: parallel.{key}={p[key]} must be >= 1")
    if p.cp > 1:
        problems.append("LMC-E112: "
                        f"parallel.cp={p.cp}: context parallelism is not implemented yet (the "
                        "packed sequences are not split over CP ranks, so every CP rank would "
                        "train on whole sequences); use parallel.cp=1 and raise parallel.tp or "
                        "trainer.recompute for long sequences")
    if p.sequence_parallel and p.tp == 1:
        problems.append("LMC-E112: "
                        "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits "
                        "activations over the TP group); set it false or raise parallel.tp")
    t = cfg.cluster.trainer
    world = t.nnodes * t.nproc_per_node
    model_parallel = max(p.tp, 1) * max(p.pp, 1) * max(p.cp, 1)
    if world < 1:
        problems.append("LMC-E103: cluster.trainer.nnodes * cluster.trainer.nproc_per_node must be "
                        ">= 1")
    elif world % model_parallel:
        problems.append(
            f"LMC-E111: trainer world size {world} (cluster.trainer.nnodes={t.nnodes} x "
            f"cluster.trainer.nproc_per_node={t.nproc_per_node}) is not divisible by "
            f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel}; change parallel.tp/pp/cp or "
            "the trainer process count")
    elif world % (max(p.expert_tp, 1) * max(p.ep, 1) * max(p.pp, 1)):
        problems.append(
            f"LMC-E111: trainer world size {world} is not divisible by expert_tp*ep*pp = "
            f"{p.expert_tp}*{p.ep}*{p.pp} (Megatron's expert grid); change parallel.ep/"
            "expert_tp or the trainer process count")
    # estimator / policy loss / aggregation names and their combinations (torch-free)
    from ..algos.spec import algo_problems

    problems += algo_problems(cfg.algo)
    if cfg.algo.mismatch_threshold <= 0:
        problems.append("LMC-E103: "
                        f"algo.mismatch_threshold={cfg.algo.mismatch_threshold} must be > 0")
    if cfg.trainer.moe_aux_loss_coeff < 0 or cfg.trainer.moe_z_loss_coeff < 0:
        problems.append("LMC-E103: trainer.moe_aux_loss_coeff and trainer.moe_z_loss_coeff must be "
                        ">= 0")

    path = OmegaConf.select(cfg, "model.path", throw_on_missing=False)
    if OmegaConf.is_missing(cfg.model, "path"):
        _check_model_divisibility(model_shape(cfg, arch_only=True), p, problems,
                                  cfg.weight_sync.export)
    elif path is not None and not os.path.isdir(path):
        problems.append("LMC-E114: "
                        f"model.path={path!r} does not exist or is not a directory; give a "
                        "Hugging Face checkpoint directory, or model.path=null to build from "
                        "model.arch")
    elif path is not None and not os.path.isfile(os.path.join(path, "config.json")):
        problems.append("LMC-E114: "
                        f"model.path={path!r} has no config.json; it must be a Hugging Face "
                        "checkpoint directory")
    else:
        try:
            shape = model_shape(cfg)
        except Exception as exc:  # noqa: BLE001 - an unreadable config.json is a config error
            problems.append(f"LMC-E114: model.path={path!r}: cannot read config.json: {exc}")
        else:
            _check_model_divisibility(shape, p, problems, cfg.weight_sync.export)

    if cfg.algo.n_samples_per_prompt < 1:
        problems.append("LMC-E103: algo.n_samples_per_prompt must be >= 1")
    if cfg.algo.max_staleness is not None and cfg.algo.max_staleness < 0:
        problems.append("LMC-E103: algo.max_staleness must be >= 0, or null for unbounded "
                        "staleness")
    if cfg.data.reward_workers < 1 or cfg.data.reward_timeout_s <= 0:
        problems.append(f"LMC-E103: data.reward_workers={cfg.data.reward_workers} must be >= 1 and "
                        f"data.reward_timeout_s={cfg.data.reward_timeout_s} > 0")
    d = cfg.data
    if d.digits < 1 or (d.task == "reverse_longtail" and d.long_fraction > 0
                        and d.long_digits <= d.digits) or not 0 <= d.long_fraction <= 1:
        problems.append(f"LMC-E103: data.digits={d.digits}, data.long_digits={d.long_digits} and "
                        f"data.long_fraction={d.long_fraction}: need digits >= 1, long_fraction "
                        "in [0, 1] and, for a long tail, long_digits > digits")
    from ..algos.spec import skip_zero_advantage_problem

    skip = skip_zero_advantage_problem(cfg.algo, cfg.trainer)
    if skip:
        problems.append(skip)
    if cfg.trainer.eval_interval < 0:
        problems.append("LMC-E103: trainer.eval_interval must be >= 0 (0: evaluate only before "
                        "and after)")
    from ..metrics.loggers import logger_problems, missing_packages

    problems += logger_problems(list(cfg.trainer.loggers))
    if cfg.job in ("train", "controller"):  # the jobs that write the run's metrics
        problems += missing_packages(cfg.trainer.loggers)
    r, ws = cfg.rollout, cfg.weight_sync
    for key, value in (("rollout.engine_heartbeat_s", r.engine_heartbeat_s),
                       ("rollout.engine_heartbeat_timeout_s", r.engine_heartbeat_timeout_s),
                       ("weight_sync.publish_timeout_s", ws.publish_timeout_s),
                       ("weight_sync.failover_timeout_s", ws.failover_timeout_s)):
        if value <= 0:
            problems.append(f"LMC-E103: {key}={value} must be > 0 (seconds)")
    if r.start_timeout_s is not None and not r.start_timeout_s > 0:
        problems.append(f"LMC-E103: rollout.start_timeout_s={r.start_timeout_s} must be > 0 "
                        "(seconds), or null for the backend's default (1800 sglang, 180 cpu)")
    if r.cpu_startup_delay_s < 0:
        problems.append("LMC-E103: "
                        f"rollout.cpu_startup_delay_s={r.cpu_startup_delay_s} must be >= 0")
    for key, value in (("rollout.engine_restarts_per_hour", r.engine_restarts_per_hour),
                       ("rollout.max_buffered_batches", r.max_buffered_batches),
                       ("trainer.max_restarts", cfg.trainer.max_restarts)):
        if value < 0:
            problems.append(f"LMC-E103: {key}={value} must be >= 0")
    if cfg.cluster.rollout_nodes < 1:
        problems.append(f"LMC-E103: cluster.rollout_nodes={cfg.cluster.rollout_nodes} must be >= 1")
    for key in ("max_turns", "max_tool_calls", "max_episode_tokens"):
        if getattr(r, key) < (0 if key == "max_tool_calls" else 1):
            problems.append(f"LMC-E103: rollout.{key}={getattr(r, key)} must be >= "
                            f"{0 if key == 'max_tool_calls' else 1}")
    if r.sandbox not in ("bubblewrap", "unsafe-local"):
        problems.append(f"LMC-E102: rollout.sandbox={r.sandbox!r} must be bubblewrap or "
                        "unsafe-local")
    agent = cfg.data.get("agent")
    if agent is not None and (not isinstance(agent, str) or agent.count(":") != 1):
        problems.append(f"LMC-E705: data.agent={agent!r} must name an async function as "
                        "'module:function' (e.g. laminar_mcore.agents.builtin:calculator)")
    if cfg.rollout.num_engines < 1:
        problems.append(f"LMC-E103: rollout.num_engines={cfg.rollout.num_engines} must be >= 1")
    if r.engine_tp < 1 or r.engine_ep < 1 or r.engine_tp % r.engine_ep:
        problems.append(f"LMC-E103: rollout.engine_tp={r.engine_tp} and rollout.engine_ep="
                        f"{r.engine_ep} must be >= 1, engine_ep dividing engine_tp (SGLang "
                        "splits the experts over engine_ep of the TP ranks)")
    if cfg.rollout.stream_interval < 1:
        problems.append(f"LMC-E103: rollout.stream_interval={cfg.rollout.stream_interval} must be "
                        ">= 1 (tokens per stream chunk)")
    if cfg.weight_sync.bucket_mb < 1 or cfg.weight_sync.chunk_mb < 1:
        problems.append(f"LMC-E103: weight_sync.bucket_mb={cfg.weight_sync.bucket_mb} and "
                        f"weight_sync.chunk_mb={cfg.weight_sync.chunk_mb} must be >= 1")
    if cfg.weight_sync.publish_backend not in ("auto", "gloo", "nccl", "shm"):
        problems.append("LMC-E102: "
                        f"weight_sync.publish_backend={cfg.weight_sync.publish_backend!r} "
                        "must be auto, gloo, nccl or shm")
    _check_publish_lag(cfg, problems)
    problems.extend(budget_problems(cfg))
    _check_delta(cfg, problems)
    rd = cfg.weight_sync.relay_device
    if not (rd in ("auto", "cpu") or (rd.startswith("cuda:") and rd[5:].isdigit())):
        problems.append(f"LMC-E102: weight_sync.relay_device={rd!r} must be auto, cpu or cuda:N")
    if cfg.weight_sync.mooncake_protocol not in (None, "tcp", "rdma"):
        problems.append("LMC-E102: "
                        f"weight_sync.mooncake_protocol={cfg.weight_sync.mooncake_protocol!r} "
                        "must be null, tcp or rdma")
    et = cfg.weight_sync.engine_transport
    _check_stripes(cfg, problems)
    if cfg.rollout.relay == "remote":
        if cfg.job == "train":
            problems.append("LMC-E110: "
                            "rollout.relay=remote is for job=rollout nodes of a cluster (a "
                            "node without a relay); on one machine set "
                            "weight_sync.engine_transport=mooncake to pull through Mooncake")
        if et not in ("auto", "mooncake"):
            problems.append(f"LMC-E110: rollout.relay=remote reads weights through Mooncake; "
                            f"weight_sync.engine_transport={et} cannot reach another node")
        et = "mooncake" if et == "auto" else et
    if et not in ("auto", *TRANSPORTS):
        problems.append(f"LMC-E102: weight_sync.engine_transport={et!r} must be auto or one of "
                        f"{', '.join(TRANSPORTS)}")
    elif et == "mooncake" and not cfg.weight_sync.mooncake_protocol:
        problems.append("LMC-E110: weight_sync.engine_transport=mooncake needs "
                        "weight_sync.mooncake_protocol=tcp|rdma (the relays must serve Mooncake)")
    elif et in ("shm", "mooncake") and cfg.rollout.backend == "sglang":
        problems.append(f"LMC-E110: weight_sync.engine_transport={et} hands the engine shared-"
                        "memory handles, which SGLang cannot map; use auto (sglang_cuda_ipc)")
    elif et == "sglang_cuda_ipc" and cfg.rollout.backend != "sglang":
        problems.append("LMC-E110: weight_sync.engine_transport=sglang_cuda_ipc needs "
                        "rollout.backend=sglang; the CPU engine takes auto (shm) or mooncake")
    if et == "mooncake" and cfg.rollout.backend == "cpu" and cfg.rollout.engine_tp > 1:
        problems.append("LMC-E110: a CPU engine of rollout.engine_tp > 1 takes one payload per "
                        "rank from its node's relay; Mooncake reads one: use engine_tp=1 there")
    ep = cfg.weight_sync.engine_pull
    if ep not in ("auto", "shard", "whole"):
        problems.append(f"LMC-E102: weight_sync.engine_pull={ep!r} must be auto, shard or whole")
    elif ep == "shard" and et == "mooncake":
        problems.append("LMC-E110: weight_sync.engine_pull=shard needs engines pulling from "
                        "their own node's relay (shm or sglang_cuda_ipc): Mooncake reads whole "
                        "buckets; use engine_pull=auto or whole")
    tr = cfg.trainer
    if tr.max_tokens_per_microbatch < 1:
        problems.append("LMC-E103: trainer.max_tokens_per_microbatch must be >= 1")
    if tr.batch_timeout_s <= 0 or tr.collective_timeout_s <= 0:
        problems.append(f"LMC-E103: trainer.batch_timeout_s={tr.batch_timeout_s} and "
                        f"trainer.collective_timeout_s={tr.collective_timeout_s} must be > 0")
    if cfg.plan.moe_imbalance < 1.0:
        problems.append(f"LMC-E103: plan.moe_imbalance={cfg.plan.moe_imbalance} must be >= 1 (the "
                        "busiest expert-parallel rank over a balanced router's share; 1 is "
                        "balanced)")
    if tr.lr <= 0 or tr.min_lr < 0 or tr.min_lr > tr.lr:
        problems.append(f"LMC-E103: trainer.lr={tr.lr} must be > 0 and trainer.min_lr={tr.min_lr} "
                        "in [0, lr]")
    if tr.lr_warmup_steps < 0 or (tr.lr_warmup_steps and tr.lr_warmup_steps >= tr.total_steps):
        problems.append(f"LMC-E103: trainer.lr_warmup_steps={tr.lr_warmup_steps} must be >= 0 "
                        f"and below trainer.total_steps={tr.total_steps} (the schedule warms up, "
                        "then decays over the run); lower it, or set it to 0 for a short run")
    if cfg.algo.eps_clip <= 0 or (cfg.algo.eps_clip_high is not None and cfg.algo.eps_clip_high <= 0):
        problems.append("LMC-E103: algo.eps_clip and algo.eps_clip_high must be > 0")
    if cfg.algo.dual_clip is not None and cfg.algo.dual_clip <= 1:
        problems.append(f"LMC-E103: algo.dual_clip={cfg.algo.dual_clip} must be > 1 (or null)")
    if cfg.algo.behav_imp_weight_cap is not None and cfg.algo.behav_imp_weight_cap <= 1:
        problems.append(f"LMC-E103: algo.behav_imp_weight_cap={cfg.algo.behav_imp_weight_cap} must "
                        "be > 1 (AReaL uses 5.0) or null")
    cl = cfg.cluster
    if ws.relay_versions < 2:
        problems.append(f"LMC-E103: weight_sync.relay_versions={ws.relay_versions} must be >= 2 (a "
                        "relay keeps the newest complete version for pulls while it receives the "
                        "next); set weight_sync.relay_versions=2, or 3 to let a slow pull hold "
                        "on without delaying versions")
    if cl.host_memory_gb < 0:
        problems.append(f"LMC-E103: cluster.host_memory_gb={cl.host_memory_gb:g} must be >= 0 (one "
                        "node's RAM in GB; 0: host memory not checked)")
    if cl.shm_gb is not None and not cl.shm_gb > 0:
        problems.append("LMC-E103: "
                        f"cluster.shm_gb={cl.shm_gb:g} must be > 0 (the size of a rollout "
                        "node's /dev/shm in GB), or null for half of cluster.host_memory_gb")
    if cl.gpus_per_node < 0 or cl.gpu_memory_gb <= 0:
        problems.append(f"LMC-E103: cluster.gpus_per_node={cl.gpus_per_node} must be >= 0 (0: no "
                        f"GPU) and cluster.gpu_memory_gb={cl.gpu_memory_gb} > 0")
    elif not problems and cfg.job != "plan" and (cl.gpus_per_node > 0 or cl.host_memory_gb > 0):
        # the GPU budget with GPUs; the host budget with a stated RAM (a CPU cluster's too;
        # local_cpu states none: its machine is shared with everything else). job=plan reports.
        from .plan import capacity_plan

        problems += [within("does not fit (job=plan shows the whole plan)", msg)
                     for msg in capacity_plan(cfg)["problems"]]
    if not problems and cl.gpus_per_node > 0:
        # the roles this job starts on one node, each on GPUs of its own (config/gpu_map.py)
        from .gpu_map import GpuMapError, config_gpu_map

        try:
            config_gpu_map(cfg)
        except GpuMapError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _check_against_schema(cfg: DictConfig) -> None:
    """Keys added with ``+key=value`` bypass Hydra's struct check; re-merge onto the schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .schema import LaminarConfig

    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    try:
        OmegaConf.merge(OmegaConf.structured(LaminarConfig), plain)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"LMC-E100: invalid configuration: key '{key}': "
                          f"{exc.msg if hasattr(exc, 'msg') else exc}; "
                          "remove it or fix its name/type (see laminar_mcore/config/schema.py)") from None


def _check_delta(cfg: DictConfig, problems: List[str]) -> None:
    """``weight_sync.delta`` / ``anchor_interval`` (weights/delta.py)."""
    from ..weights.delta import MODES as DELTA_MODES
    from ..weights.shards import EXPORTS

    ws = cfg.weight_sync
    if ws.delta not in DELTA_MODES:
        problems.append(f"LMC-E102: weight_sync.delta={ws.delta!r} is not one of "
                        f"{', '.join(DELTA_MODES)} (auto: deltas where they reach the relays "
                        "sooner than whole versions over weight_sync.link_gbit)")
    if ws.link_gbit < 0:
        problems.append(f"LMC-E103: weight_sync.link_gbit={ws.link_gbit} must be >= 0 (Gbit/s "
                        "of the slowest link a version crosses; 0: not named)")
    if ws.export not in EXPORTS:
        problems.append(f"LMC-E102: weight_sync.export={ws.export!r} is not one of "
                        f"{', '.join(EXPORTS)} (per_rank: every trainer rank publishes its own "
                        "shard)")
    if ws.anchor_interval < 1:
        problems.append(f"LMC-E103: weight_sync.anchor_interval={ws.anchor_interval} must be >= 1 "
                        "(a whole version every that many versions; 1: every version whole)")


def _check_publish_lag(cfg: DictConfig, problems: List[str]) -> None:
    """``weight_sync.publish_lag`` (bench.staleness): engines hold weights that many versions
    behind the trainer, which a barrier mode or a smaller staleness bound cannot allow."""
    from ..modes import policy_for

    lag = cfg.weight_sync.publish_lag
    if lag < 0:
        problems.append(f"LMC-E103: weight_sync.publish_lag={lag} must be >= 0 (0: publish every "
                        "version as it is made)")
        return
    if lag == 0 or cfg.mode not in MODES:
        return
    policy = policy_for(cfg.mode, cfg.algo.max_staleness)
    if policy.barrier:
        problems.append(f"LMC-E105: weight_sync.publish_lag={lag} with mode={cfg.mode}: this "
                        "mode's engines generate only with the trainer's current weights, which "
                        "a lagged publication never gives them (the run would stall); use "
                        "mode=laminar or mode=areal, or weight_sync.publish_lag=0")
    elif policy.bound is not None and lag > policy.bound:
        problems.append(f"LMC-E105: weight_sync.publish_lag={lag} > algo.max_staleness="
                        f"{policy.bound}: the engines hold weights at least {lag} versions "
                        "behind the trainer, so no trajectory could be consumed within the "
                        "bound; set algo.max_staleness=null (unbounded), or a bound >= "
                        "publish_lag")


def _check_model_divisibility(shape: dict, p, problems: List[str],
                              export: str = "stage_lead") -> None:
    from ..models import known_model_types

    src = shape["source"]
    if shape["family"] not in known_model_types():
        problems.append(f"LMC-E115: {src}: model family {shape['family']!r} has no adapter; known: "
                        f"{', '.join(known_model_types())}")
    if p.tp >= 1 and shape["vocab"] % p.tp:
        problems.append(f"LMC-E111: vocab size {shape['vocab']} ({src}) is not divisible by "
                        f"parallel.tp={p.tp}; choose a tp that divides it")
    if p.tp >= 1 and shape["heads"] % p.tp:
        problems.append("LMC-E111: "
                        f"num_attention_heads {shape['heads']} ({src}) is not divisible by "
                        f"parallel.tp={p.tp}")
    if p.tp >= 1 and shape["groups"] % p.tp:
        problems.append("LMC-E111: "
                        f"num_key_value_heads {shape['groups']} ({src}) is not divisible by "
                        f"parallel.tp={p.tp}")
    if p.pp >= 1 and shape["layers"] % p.pp:
        problems.append("LMC-E111: "
                        f"num_hidden_layers {shape['layers']} ({src}) is not divisible by "
                        f"parallel.pp={p.pp}")
    experts = shape.get("experts", 0)
    if experts and p.ep >= 1 and experts % p.ep:
        problems.append(f"LMC-E111: num_experts {experts} ({src}) is not divisible by "
                        f"parallel.ep={p.ep}")
    if experts and p.tp > 1 and not p.sequence_parallel:
        problems.append(f"LMC-E112: parallel.tp={p.tp} with a mixture-of-experts model needs "
                        "parallel.sequence_parallel=true (Megatron-Core's MoE layer refuses "
                        "to train with TP > 1 without it; on GPUs it needs Transformer "
                        "Engine), or parallel.tp=1 with parallel.ep / parallel.expert_tp")
    if experts and export == "per_rank" and (p.tp > 1 or p.expert_tp > 1):
        problems.append(f"LMC-E112: weight_sync.export=per_rank with {src} ({shape['family']}, "
                        f"a mixture-of-experts model) at parallel.tp={p.tp} / "
                        f"parallel.expert_tp={p.expert_tp}: per-rank export sends each EP "
                        "rank's experts whole, at tp=1 and expert_tp=1; use those or "
                        "weight_sync.export=stage_lead")
    if not experts and (p.ep > 1 or p.expert_tp > 1):
        problems.append(f"LMC-E112: parallel.ep={p.ep} / parallel.expert_tp={p.expert_tp} need a "
                        f"mixture-of-experts model; {src} ({shape['family']}) has no experts")
