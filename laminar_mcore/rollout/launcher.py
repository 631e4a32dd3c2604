"""Start, watch and stop rollout engine servers: SGLang on GPUs, the CPU engine elsewhere.

``sglang_command`` builds ``python -m sglang.launch_server`` from the rollout config;
``cpu_engine_command`` the CPU engine's. ``EngineProcess`` (a ``server_process.ServerProcess``)
runs either in its own session with its output captured to a log file, waits until it answers
``/ready`` (SGLang 0.5.23: 200 once started and not paused, 503 while starting; it does not
generate) for at most ``rollout.start_timeout_s`` (``engine_start_timeout_s``: 1800 s for SGLang,
180 s for the CPU engine), and stops it cleanly (SIGTERM, then SIGKILL for the whole process
group), also when the launcher itself fails.

Engine health (``/health``, ``/health_generate``) generates one token and answers within
SGLang's health window (``engine_health_window_s``: env ``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s,
polled every second): a probe of it must wait longer (``engine_heartbeat_timeout_s``).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import replace
from typing import List, Mapping, Optional, Sequence, Tuple

from ..config.budgets import DEFAULT_START_TIMEOUT_S, engine_start_timeout_s  # noqa: F401
from ..netutil import free_port  # noqa: F401  (re-exported)
from ..relay.transports import PullSpec, transport_module
from ..server_process import ServerProcess, ServerStartError

# an engine that exits or stays unhealthy while starting (the message has its log's tail)
EngineStartError = ServerStartError

# What a probe of /health_generate waits beyond SGLang's health window: the window is polled
# every second (an answer comes up to ~1 s after it) and a busy server answers late.
HEALTH_MARGIN_S = 5.0


def engine_health_window_s(env: Optional[Mapping[str, str]] = None) -> float:
    """SGLang's health window: ``/health_generate`` answers 503 when no scheduler output came
    for ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20; read as SGLang 0.5.23 reads it,
    ``http_server.HEALTH_CHECK_TIMEOUT``). The CPU engine honours the same variable."""
    env = os.environ if env is None else env
    return float(int(env.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)))


def engine_heartbeat_timeout_s(rollout_cfg, env: Optional[Mapping[str, str]] = None) -> float:
    """How long the supervisor's ``/health_generate`` probe waits: ``rollout.
    engine_heartbeat_timeout_s``, but never less than the health window + ``HEALTH_MARGIN_S``
    (a shorter probe would call a healthy engine that is merely busy, or paused for an update,
    hung before SGLang itself answers)."""
    return max(float(rollout_cfg.engine_heartbeat_timeout_s),
               engine_health_window_s(env) + HEALTH_MARGIN_S)


def _protocol_args(weight_version, incremental_streaming_output: bool, stream_interval: int,
                   deterministic: bool) -> List[str]:
    """Flags SGLang 0.5.23 and the CPU engine share: the start version (``--weight-version``;
    SGLang reports "default" without it), O(L) streams (``--incremental-streaming-output``,
    ``--stream-interval``) and, when the run is seeded, ``--enable-deterministic-inference``
    (without it SGLang ignores ``sampling_seed``; on GPUs it costs throughput: batch-invariant
    kernels, about 1.3-2x slower decoding in SGLang's own measurements)."""
    args = []
    if weight_version is not None:
        args += ["--weight-version", str(weight_version)]
    if incremental_streaming_output:
        args.append("--incremental-streaming-output")
    if stream_interval:
        args += ["--stream-interval", str(int(stream_interval))]
    if deterministic:
        args.append("--enable-deterministic-inference")
    return args


def sglang_command(model_path: str, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                   base_gpu_id: int = 0, ep: int = 1, moe_runner_backend: str = "auto",
                   mem_fraction_static: float = 0.8, api_key: Optional[str] = None,
                   max_running_requests: Optional[int] = None, weight_version: Optional[str] = "0",
                   incremental_streaming_output: bool = True, stream_interval: int = 8,
                   deterministic: bool = False, routed_experts: bool = False,
                   extra_args: Sequence[str] = (), python: str = sys.executable) -> List[str]:
    """The ``sglang.launch_server`` command line for one rollout engine (``routed_experts``:
    capture MoE routings for routing replay, ``--enable-return-routed-experts``; ``ep``,
    ``moe_runner_backend``: ``--ep-size``, ``--moe-runner-backend`` where not SGLang's default)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp), "--base-gpu-id", str(base_gpu_id),
           "--mem-fraction-static",
           str(mem_fraction_static), "--skip-server-warmup"]
    if int(ep) > 1:
        cmd += ["--ep-size", str(int(ep))]
    if moe_runner_backend != "auto":
        cmd += ["--moe-runner-backend", moe_runner_backend]
    if max_running_requests:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += _protocol_args(weight_version, incremental_streaming_output, stream_interval,
                          deterministic)
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + list(extra_args)


def cpu_engine_command(model_path: str, *, port: int = 0, host: str = "127.0.0.1",
                       api_key: Optional[str] = None, kv_capacity_tokens: int = 16384,
                       max_running_requests: int = 64, threads: int = 1, seed: int = 0,
                       weight_version: Optional[str] = "0",
                       incremental_streaming_output: bool = False, stream_interval: int = 1,
                       deterministic: bool = False, routed_experts: bool = False,
                       startup_delay_s: float = 0.0, decode_delay_s: float = 0.0,
                       tp: int = 1, ep: int = 1, python: str = sys.executable) -> List[str]:
    """The CPU engine's command line; stream style and determinism default to SGLang's
    defaults (cumulative chunks every token, ``sampling_seed`` ignored). ``startup_delay_s``
    (a test/twin knob, ``rollout.cpu_startup_delay_s``): it answers 503 ("Starting") on
    /health, /health_generate and /ready for that long after it binds, as a big model does;
    ``decode_delay_s`` (a test knob) slows each decode step by that much."""
    cmd = [python, "-m", "laminar_mcore.rollout.cpu_engine", "--model", model_path, "--host", host,
           "--port", str(port), "--kv-capacity-tokens", str(kv_capacity_tokens),
           "--max-running-requests", str(max_running_requests), "--threads", str(threads),
           "--seed", str(seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if int(tp) > 1:  # one weight payload per rank (the CPU computes every rank's part)
        cmd += ["--tp-size", str(int(tp))]
    if int(ep) > 1:  # which experts each rank's payload holds
        cmd += ["--ep-size", str(int(ep))]
    if startup_delay_s and float(startup_delay_s) > 0:
        cmd += ["--startup-delay-s", f"{float(startup_delay_s):g}"]
    if decode_delay_s and float(decode_delay_s) > 0:
        cmd += ["--decode-delay-s", f"{float(decode_delay_s):g}"]
    return cmd + _protocol_args(weight_version, incremental_streaming_output, stream_interval,
                                deterministic)


def engine_command_from_config(rollout_cfg, model_path: str, *, port: int,
                               api_key: Optional[str] = None, index: int = 0,
                               seed: Optional[int] = None, routed_experts: bool = False,
                               base_gpu_id: Optional[int] = None) -> List[str]:
    """The command for engine ``index`` of ``cfg.rollout`` (backend cpu or sglang); SGLang's
    ``--base-gpu-id`` is ``base_gpu_id`` (0 under a mask of the engine's own GPUs: the GPU
    map), by default the first of ``engine_gpu_ids``. Engines of
    a run start at version 0, stream incrementally every ``rollout.stream_interval`` tokens
    (the controller's clients read them so: ``Controller._handle``) and, with a run ``seed``
    and ``rollout.deterministic_inference``, honour per-trajectory sampling seeds."""
    if rollout_cfg.backend not in ("cpu", "sglang"):
        raise ValueError(f"LMC-E102: rollout.backend={rollout_cfg.backend!r} is not one of cpu, "
                         "sglang")
    common = dict(incremental_streaming_output=True,
                  stream_interval=int(rollout_cfg.stream_interval),
                  deterministic=seed is not None and bool(rollout_cfg.deterministic_inference),
                  weight_version="0", routed_experts=routed_experts)
    if rollout_cfg.backend == "sglang":
        return sglang_command(model_path, port=port, host=rollout_cfg.host, tp=rollout_cfg.engine_tp,
                              ep=int(rollout_cfg.engine_ep),
                              moe_runner_backend=rollout_cfg.moe_runner_backend,
                              base_gpu_id=engine_gpu_ids(rollout_cfg, index)[0]
                              if base_gpu_id is None else base_gpu_id,
                              mem_fraction_static=rollout_cfg.mem_fraction_static, api_key=api_key,
                              max_running_requests=rollout_cfg.max_running_requests,
                              extra_args=list(rollout_cfg.extra_args), **common)
    return cpu_engine_command(model_path, port=port, host=rollout_cfg.host, api_key=api_key,
                              kv_capacity_tokens=rollout_cfg.kv_capacity_tokens,
                              max_running_requests=rollout_cfg.max_running_requests,
                              seed=index, tp=int(rollout_cfg.engine_tp),
                              ep=int(rollout_cfg.engine_ep),
                              startup_delay_s=float(getattr(rollout_cfg, "cpu_startup_delay_s",
                                                            0.0) or 0.0),
                              **common)


# SGLang 0.5.23's keys for a model's context (utils/hf_transformers/common.py), in its order
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def served_context_length(rollout_cfg, model_path: Optional[str]) -> Optional[int]:
    """The context (prompt + generated tokens) the run's engines serve, as SGLang 0.5.23
    derives it: ``--context-length`` in ``rollout.extra_args`` (sglang), else the checkpoint's
    config.json (``get_context_length``: the first of CONTEXT_LENGTH_KEYS, times the rope
    scaling factor unless the scaling names its original length or is llama3's); None when
    there is no config to read (then nothing is filtered before it is sent)."""
    import json

    args = list(getattr(rollout_cfg, "extra_args", None) or []) \
        if getattr(rollout_cfg, "backend", "cpu") == "sglang" else []
    for i, arg in enumerate(args):
        if arg == "--context-length" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--context-length="):
            return int(arg.split("=", 1)[1])
    path = os.path.join(model_path or "", "config.json")
    if not model_path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config") or config if isinstance(config, dict) else {}
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1) if isinstance(scaling, dict) else 1
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048


def engine_gpu_ids(rollout_cfg, index: int) -> List[int]:
    """The GPUs of SGLang engine ``index`` of a rollout node as its relay numbers them (where the
    relay's CUDA-IPC exporter places its buckets): ``rollout.engine_tp`` consecutive GPUs each
    (engine i starts at i * engine_tp), TP rank r on the r-th. Under the GPU map the relay sees
    its engines' GPUs first, in engine order (config/gpu_map.py); without one, the node's."""
    tp = int(rollout_cfg.engine_tp)
    return list(range(index * tp, (index + 1) * tp))


def engine_transport(rollout_cfg, weight_sync=None) -> str:
    """``weight_sync.engine_transport``; ``auto``: CUDA IPC for SGLang, shared memory for the
    CPU engine (both from the relay on the engine's machine)."""
    name = getattr(weight_sync, "engine_transport", "auto") if weight_sync is not None else "auto"
    if name == "auto":
        if getattr(rollout_cfg, "relay", "local") == "remote":
            return "mooncake"  # no relay on this node: read from one on another node
        return "sglang_cuda_ipc" if rollout_cfg.backend == "sglang" else "shm"
    return name


def engine_pull_spec(rollout_cfg, index: int, weight_sync=None,
                     model_path: Optional[str] = None) -> PullSpec:
    """How engine ``index`` of a rollout node takes weights from its relay (the transport's
    ``spec_for``: CUDA IPC payloads on its GPUs for SGLang, shared-memory handles for the CPU
    engine, Mooncake reads from a relay on another machine), and whether each of its TP ranks
    pulls only its own shard (``shard_pull``; needs the served model, ``model_path``)."""
    if weight_sync is None:
        from ..config.schema import WeightSyncConfig

        weight_sync = WeightSyncConfig()
    name = engine_transport(rollout_cfg, weight_sync)
    devices = tuple(f"cuda:{g}" for g in engine_gpu_ids(rollout_cfg, index))
    spec = transport_module(name).spec_for(rollout_cfg, weight_sync, devices)
    shard = shard_pull(rollout_cfg, weight_sync, model_path, name)
    if not shard:
        return spec
    # the engine's own /server_info confirms its layout at the first pull (SGLang's resolved
    # arguments: an SM100 GPU's MoE runner, extra_args'): ``verify`` says what to do if not
    moe = _layout_facts(model_path, shard[0], shard[3])[2]
    return replace(spec, options=spec.options + (
        ("shard", shard), ("verify", getattr(weight_sync, "engine_pull", "auto")),
        ("moe", moe)))


@functools.lru_cache(maxsize=16)
def _layout_facts(model_path: str, tp: int, ep: int):
    """(attention heads, tied embeddings, mixture of experts) of the checkpoint at
    ``model_path`` laid out at TP ``tp`` and EP ``ep``, or why it cannot be (read once per run,
    not once per engine)."""
    from ..models import get_adapter, load_hf_config
    from ..weights.engine_layout import layout_for_config

    try:
        config = load_hf_config(model_path)
        adapter = get_adapter(config)
        return (layout_for_config(config, tp, adapter, ep).heads,
                adapter.tied_embeddings(config), adapter.is_moe)
    except (ValueError, OSError) as exc:  # LayoutError, AdapterError, no config.json
        return str(exc)


def shard_pull(rollout_cfg, weight_sync, model_path: Optional[str],
               transport: str) -> Optional[Tuple[int, int, bool, int]]:
    """(engine TP, attention heads, tied embeddings, engine EP) when an engine's ranks pull only
    their own shards (``weight_sync.engine_pull``: shard; auto: at ``rollout.engine_tp`` > 1
    pulling from its node's relay; for an MoE model with ``rollout.moe_runner_backend`` auto or
    triton, the engine's own ``/server_info`` confirming the layout at its first pull:
    ``engine_pull_spec``), else None. ``shard`` where it cannot be is refused; ``auto`` falls
    back to whole tensors where the model cannot be read or laid out."""
    mode, tp = getattr(weight_sync, "engine_pull", "auto"), int(rollout_cfg.engine_tp)
    ep = int(getattr(rollout_cfg, "engine_ep", 1))
    if mode == "whole" or (mode == "auto" and tp < 2):
        return None
    if transport not in ("shm", "sglang_cuda_ipc"):
        why = f"weight_sync.engine_transport={transport} reads whole buckets"
    elif model_path is None:
        why = "the served model is not known here"
    else:
        facts = _layout_facts(model_path, tp, ep)
        if isinstance(facts, str):
            why = facts
        else:
            heads, tied, moe = facts
            runner = getattr(rollout_cfg, "moe_runner_backend", "auto")
            why = (f"rollout.moe_runner_backend={runner} keeps SGLang's experts in a layout of "
                   "its own (auto and triton are covered)") \
                if moe and runner not in ("auto", "triton") else ""
            if not why:
                return (tp, heads, tied, ep)
    if mode == "shard":
        raise ValueError(f"LMC-E519: weight_sync.engine_pull=shard: {why}")
    return None


def check_sglang_serves(model_path: str) -> None:
    """Refuse (``ValueError``, LMC-E314) a checkpoint SGLang 0.5.23 would serve wrong without
    saying so: a Qwen3-MoE with dense layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1)
    -- its Qwen3-MoE makes every layer sparse (``models/qwen3_moe.py`` ``stage_facts``), so it
    would generate with experts those layers do not have. A config that cannot be read is left
    to SGLang."""
    from ..models import get_adapter, load_hf_config

    try:
        config = load_hf_config(model_path)
        adapter = get_adapter(config)
    except (ValueError, OSError):
        return
    if adapter.is_moe:
        dense = [i for i, moe in enumerate(adapter.moe_shape(config).moe_layers) if not moe]
        if dense:
            raise ValueError(f"LMC-E314: {model_path}: layers {dense[:8]} are dense "
                             "(mlp_only_layers / decoder_sparse_step), but SGLang 0.5.23 serves "
                             "every Qwen3-MoE layer as a mixture of experts: it would generate "
                             "with experts they do not have. Use rollout.backend=cpu, or a "
                             "checkpoint whose every layer is sparse")


def engine_process(cfg, model_path: str, log_path: str, index: int,
                   api_key: Optional[str] = None,
                   visible: Optional[str] = None) -> "EngineProcess":
    """Engine ``index`` of a rollout node of run ``cfg`` (not started): the CPU engine picks
    its own port, SGLang gets a free one. ``start()`` waits for ``/ready`` for at most
    ``rollout.start_timeout_s`` (``engine_start_timeout_s``). ``api_key`` (a run's:
    ``netutil.engine_api_key`` of its token) never goes on the command line, which every user
    of the machine can read: the CPU engine takes it from its environment, SGLang from a
    ``--config`` file only its owner can read, next to the log. ``visible``: its
    ``CUDA_VISIBLE_DEVICES`` (the GPU map's mask of its own GPUs, '' for none; SGLang's
    ``--base-gpu-id`` is then 0); None: the launcher's environment, unchanged. A checkpoint
    SGLang would serve wrong is refused (``check_sglang_serves``)."""
    if cfg.rollout.backend == "sglang":
        check_sglang_serves(model_path)
    port = 0 if cfg.rollout.backend == "cpu" else free_port()
    command = engine_command_from_config(cfg.rollout, model_path, port=port, index=index,
                                         seed=cfg.seed,
                                         routed_experts=bool(cfg.algo.routing_replay),
                                         base_gpu_id=None if visible is None else 0)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    if api_key and cfg.rollout.backend == "cpu":
        env["LAMINAR_ENGINE_API_KEY"] = api_key
    elif api_key:
        command += ["--config", _private_config(log_path + ".args.yaml", {"api_key": api_key})]
    return EngineProcess(command, log_path=log_path, host=cfg.rollout.host, port=port or None,
                         env=env, api_key=api_key,
                         start_timeout_s=engine_start_timeout_s(cfg.rollout))


def _private_config(path: str, options: dict) -> str:
    """SGLang's ``--config`` YAML of ``options``, readable by its owner only."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        for key, value in options.items():
            f.write(f"{key}: {json.dumps(value)}\n")  # a JSON string is a YAML scalar
    os.chmod(path, 0o600)
    return path


class EngineProcess(ServerProcess):
    """One engine server process (SGLang or the CPU engine). Ready when ``/ready`` answers 200
    (never a generating probe: SGLang's ``/health`` runs a one-token generation that may take
    its whole health window); a start that runs out of time names ``rollout.start_timeout_s``
    and its value, with the log's tail."""

    what = "engine"
    ready_path = "/ready"
    timeout_key = "rollout.start_timeout_s"
