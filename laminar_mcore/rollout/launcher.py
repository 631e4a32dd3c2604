"""Start, watch and stop rollout engine servers: SGLang on GPUs, the CPU engine elsewhere.

``sglang_command`` builds ``python -m sglang.launch_server`` from the rollout config;
``cpu_engine_command`` the CPU engine's. ``EngineProcess`` runs either in its own session with
its output captured to a log file, waits for /health, and stops it cleanly (SIGTERM, then
SIGKILL for the whole process group), also when the launcher itself fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Sequence

from ..netutil import free_port  # noqa: F401  (re-exported)
from ..relay.transports import PullSpec, transport_module


class EngineStartError(RuntimeError):
    """An engine exited or stayed unhealthy while starting; the message has its log's tail."""


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
                   base_gpu_id: int = 0,
                   mem_fraction_static: float = 0.8, api_key: Optional[str] = None,
                   max_running_requests: Optional[int] = None, weight_version: Optional[str] = "0",
                   incremental_streaming_output: bool = True, stream_interval: int = 8,
                   deterministic: bool = False, routed_experts: bool = False,
                   extra_args: Sequence[str] = (), python: str = sys.executable) -> List[str]:
    """The ``sglang.launch_server`` command line for one rollout engine (``routed_experts``:
    capture MoE routings for routing replay, ``--enable-return-routed-experts``)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
           "--port", str(port), "--tp-size", str(tp), "--base-gpu-id", str(base_gpu_id),
           "--mem-fraction-static",
           str(mem_fraction_static), "--skip-server-warmup"]
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
                       python: str = sys.executable) -> List[str]:
    """The CPU engine's command line; stream style and determinism default to SGLang's
    defaults (cumulative chunks every token, ``sampling_seed`` ignored)."""
    cmd = [python, "-m", "laminar_mcore.rollout.cpu_engine", "--model", model_path, "--host", host,
           "--port", str(port), "--kv-capacity-tokens", str(kv_capacity_tokens),
           "--max-running-requests", str(max_running_requests), "--threads", str(threads),
           "--seed", str(seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + _protocol_args(weight_version, incremental_streaming_output, stream_interval,
                                deterministic)


def engine_command_from_config(rollout_cfg, model_path: str, *, port: int,
                               api_key: Optional[str] = None, index: int = 0,
                               seed: Optional[int] = None,
                               routed_experts: bool = False) -> List[str]:
    """The command for engine ``index`` of ``cfg.rollout`` (backend cpu or sglang). Engines of
    a run start at version 0, stream incrementally every ``rollout.stream_interval`` tokens
    (the controller's clients read them so: ``Controller._handle``) and, with a run ``seed``
    and ``rollout.deterministic_inference``, honour per-trajectory sampling seeds."""
    if rollout_cfg.backend not in ("cpu", "sglang"):
        raise ValueError(f"rollout.backend={rollout_cfg.backend!r} is not one of cpu, sglang")
    common = dict(incremental_streaming_output=True,
                  stream_interval=int(rollout_cfg.stream_interval),
                  deterministic=seed is not None and bool(rollout_cfg.deterministic_inference),
                  weight_version="0", routed_experts=routed_experts)
    if rollout_cfg.backend == "sglang":
        return sglang_command(model_path, port=port, host=rollout_cfg.host, tp=rollout_cfg.engine_tp,
                              base_gpu_id=engine_gpu_ids(rollout_cfg, index)[0],
                              mem_fraction_static=rollout_cfg.mem_fraction_static, api_key=api_key,
                              max_running_requests=rollout_cfg.max_running_requests,
                              extra_args=list(rollout_cfg.extra_args), **common)
    return cpu_engine_command(model_path, port=port, host=rollout_cfg.host, api_key=api_key,
                              kv_capacity_tokens=rollout_cfg.kv_capacity_tokens,
                              max_running_requests=rollout_cfg.max_running_requests,
                              seed=index, **common)


def engine_gpu_ids(rollout_cfg, index: int) -> List[int]:
    """The GPUs of SGLang engine ``index`` on its node: engines take ``rollout.engine_tp``
    consecutive GPUs each (engine i starts at GPU i * engine_tp), TP rank r on the r-th."""
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


def engine_pull_spec(rollout_cfg, index: int, weight_sync=None) -> PullSpec:
    """How engine ``index`` of a rollout node takes weights from its relay (the transport's
    ``spec_for``: CUDA IPC payloads on its GPUs for SGLang, shared-memory handles for the CPU
    engine, Mooncake reads from a relay on another machine)."""
    if weight_sync is None:
        from ..config.schema import WeightSyncConfig

        weight_sync = WeightSyncConfig()
    name = engine_transport(rollout_cfg, weight_sync)
    devices = tuple(f"cuda:{g}" for g in engine_gpu_ids(rollout_cfg, index))
    return transport_module(name).spec_for(rollout_cfg, weight_sync, devices)


def engine_process(cfg, model_path: str, log_path: str, index: int) -> "EngineProcess":
    """Engine ``index`` of a rollout node of run ``cfg`` (not started): the CPU engine picks
    its own port, SGLang gets a free one."""
    port = 0 if cfg.rollout.backend == "cpu" else free_port()
    return EngineProcess(engine_command_from_config(cfg.rollout, model_path, port=port,
                                                    index=index, seed=cfg.seed,
                                                    routed_experts=bool(cfg.algo.routing_replay)),
                         log_path=log_path, host=cfg.rollout.host, port=port or None)


class EngineProcess:
    """One engine server process. Use as a context manager, or call ``start``/``stop``."""

    def __init__(self, command: List[str], *, log_path: str, host: str = "127.0.0.1",
                 port: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 api_key: Optional[str] = None, port_key: str = "LAMINAR_ENGINE_PORT"):
        self.command = command
        self.port_key = port_key
        self.log_path = log_path
        self.host = host
        self.port = port
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env.setdefault("PYTHONWARNINGS", "ignore")
        self.api_key = api_key
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "EngineProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 180.0) -> "EngineProcess":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # a restart appends: read only this run's lines
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"engine exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.port in (None, 0):
                value = self.printed(self.port_key)
                if value:
                    self.port = int(value)
            if self.port and self._healthy():
                return
            time.sleep(0.1)
        raise EngineStartError(f"engine not healthy after {timeout_s}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def printed(self, key: str) -> Optional[str]:
        """The value of a ``KEY=value`` line the server printed (ports chosen at start-up)."""
        match = re.search(rf"{re.escape(key)}=(\S+)", self.log_text())
        return match.group(1) if match else None

    def wait_printed(self, key: str, timeout_s: float = 60.0) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = self.printed(key)
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise EngineStartError(f"{key} never printed:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_start", 0))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
