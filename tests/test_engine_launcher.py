"""Engine launchers: SGLang command lines from the rollout config (the GPU path, checked by
construction on CPU), the process wrapper's failure reporting and clean stop, and the start-up
budget (``rollout.start_timeout_s``, readiness on ``/ready``)."""

import os
import sys
import time
import urllib.error
import urllib.request

import pytest
from hydra import compose, initialize_config_dir

from laminar_mcore.config import register_configs
from laminar_mcore.config.paths import conf_dir
from laminar_mcore.relay.transports import PullSpec
from laminar_mcore.rollout.launcher import (EngineProcess, EngineStartError, cpu_engine_command,
                                            engine_command_from_config, engine_heartbeat_timeout_s,
                                            engine_process, engine_pull_spec,
                                            engine_start_timeout_s, sglang_command)

register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_sglang_command_from_the_rollout_config():
    cfg = _cfg("rollout=sglang", "rollout.engine_tp=4", "rollout.mem_fraction_static=0.7",
               "rollout.extra_args=[--attention-backend,fa3]")
    cmd = engine_command_from_config(cfg.rollout, "/models/qwen", port=31000, api_key="k")
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for part in ("--model-path /models/qwen", "--port 31000", "--tp-size 4",
                 "--mem-fraction-static 0.7", "--api-key k", "--host 127.0.0.1",
                 "--max-running-requests 256"):
        assert part in joined, part
    assert cmd[-2:] == ["--attention-backend", "fa3"]
    assert "--weight-version" in sglang_command("/m", port=1, weight_version="7")


def test_sglang_engines_of_a_node_get_disjoint_gpus_and_pull_onto_them():
    """Engine i of a node takes GPUs [i*tp, (i+1)*tp) and pulls CUDA IPC payloads for exactly
    those GPUs, one per TP rank in rank order (SGLang's rank r reads entry r)."""
    cfg = _cfg("rollout=sglang", "rollout.engine_tp=2", "rollout.num_engines=4")
    gpus = []
    for i in range(4):
        cmd = engine_command_from_config(cfg.rollout, "/m", port=31000 + i, index=i)
        base = int(cmd[cmd.index("--base-gpu-id") + 1])
        spec = engine_pull_spec(cfg.rollout, i)
        assert spec == PullSpec("sglang_cuda_ipc", (f"cuda:{base}", f"cuda:{base + 1}"))
        gpus += [base, base + 1]
    assert gpus == list(range(8))
    assert engine_pull_spec(_cfg().rollout, 3) == PullSpec("shm")


def test_cpu_engine_command_from_the_rollout_config():
    cfg = _cfg()
    cmd = engine_command_from_config(cfg.rollout, "/tmp/m", port=0, index=3)
    assert cmd[1:3] == ["-m", "laminar_mcore.rollout.cpu_engine"]
    assert "--kv-capacity-tokens" in cmd and cmd[cmd.index("--seed") + 1] == "3"
    with pytest.raises(ValueError, match="backend"):
        engine_command_from_config(type("R", (), {"backend": "vllm"})(), "/m", port=1)


@pytest.mark.multiprocess
def test_a_failing_engine_reports_its_log_and_leaves_nothing(tmp_path):
    cmd = cpu_engine_command(str(tmp_path / "no-model"))
    proc = EngineProcess(cmd, log_path=str(tmp_path / "e.log"))
    with pytest.raises(EngineStartError, match="is not a directory"):
        proc.start(timeout_s=60)
    assert not proc.alive()


@pytest.mark.multiprocess
def test_engine_stops_cleanly(tmp_path):
    from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config

    cfg = tiny_hf_config("llama", tie_word_embeddings=True)
    save_hf_checkpoint(tmp_path / "m", cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0))
    with EngineProcess(cpu_engine_command(str(tmp_path / "m")), log_path=str(tmp_path / "e.log")) as p:
        assert p.alive() and p.port > 0
        pid = p.proc.pid
    assert not p.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.multiprocess
def test_a_runs_engines_need_its_key_which_never_shows_on_a_command_line(tmp_path):
    """A run's engines take weights and commands over the network, so they are started with
    an API key derived from the run token (never the token: SGLang logs its arguments): the
    CPU engine from its environment, SGLang from a --config file only its owner reads. Only
    SGLang's open probes answer without it."""
    from laminar_mcore.config import typed
    from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
    from laminar_mcore.netutil import engine_api_key

    token = "run-token-0123456789"
    key = engine_api_key(token)
    assert key != token and token not in key and len(key) == 64
    cfg = typed(_cfg("rollout=sglang"))
    proc = engine_process(cfg, "/models/Qwen3-8B", str(tmp_path / "logs" / "e0.log"), 0,
                          api_key=key)
    assert key not in " ".join(proc.command)
    config = proc.command[proc.command.index("--config") + 1]
    assert oct(os.stat(config).st_mode & 0o777) == "0o600"
    assert open(config).read() == f'api_key: "{key}"\n'

    hf = tiny_hf_config("qwen2")
    save_hf_checkpoint(tmp_path / "m", hf, initial_hf_state(type("M", (), {"path": None})(), hf, 0))
    engine = engine_process(typed(_cfg()), str(tmp_path / "m"), str(tmp_path / "e1.log"), 0,
                            api_key=key)
    assert key not in " ".join(engine.command)
    with engine:
        def status(path, auth=None):
            req = urllib.request.Request(engine.url + path)
            if auth:
                req.add_header("Authorization", f"Bearer {auth}")
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert status("/model_info") == 401 and status("/model_info", token) == 401
        assert status("/model_info", key) == 200
        assert status("/ready") == 200  # SGLang's open probes
        with open(f"/proc/{engine.proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
    assert key not in open(tmp_path / "e1.log").read()


def test_start_up_budget_and_health_probe_timeout_by_backend():
    """Null ``rollout.start_timeout_s``: 1800 s for SGLang (big checkpoints), 180 s for the CPU
    engine; a set value wins for both. The /health_generate probe never waits less than
    SGLang's health window (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) + 5 s."""
    assert engine_start_timeout_s(_cfg("rollout=sglang").rollout) == 1800
    assert engine_start_timeout_s(_cfg().rollout) == 180
    assert engine_start_timeout_s(_cfg("rollout=sglang", "rollout.start_timeout_s=600").rollout) \
        == 600
    with pytest.raises(ValueError, match="rollout.start_timeout_s=0"):
        engine_start_timeout_s(_cfg("rollout.start_timeout_s=0").rollout)
    r = _cfg("rollout.engine_heartbeat_timeout_s=5").rollout
    assert engine_heartbeat_timeout_s(r, env={}) == 25
    assert engine_heartbeat_timeout_s(r, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "60"}) == 65
    assert engine_heartbeat_timeout_s(_cfg().rollout, env={}) == 60  # the default is above it
    cmd = engine_command_from_config(_cfg("rollout.cpu_startup_delay_s=2.5").rollout, "/m", port=0)
    assert cmd[cmd.index("--startup-delay-s") + 1] == "2.5"
    assert "--startup-delay-s" not in engine_command_from_config(_cfg().rollout, "/m", port=0)


def _tiny_model(path):
    from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config

    cfg = tiny_hf_config("llama", tie_word_embeddings=True)
    save_hf_checkpoint(path, cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0))
    return str(path)


def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.multiprocess
def test_the_configured_start_up_budget_not_a_constant_governs(tmp_path):
    """An engine that needs longer than a probe's timeout to come up (a big model; here the
    CPU engine answering 503 "Starting" for a while after it binds) starts when its start-up
    fits ``rollout.start_timeout_s`` and fails, naming the key and its value, with the
    engine's log tail, when it does not."""
    model = _tiny_model(tmp_path / "m")
    cfg = _cfg("rollout.cpu_startup_delay_s=2", "rollout.start_timeout_s=120")
    t0 = time.monotonic()
    with engine_process(cfg, model, str(tmp_path / "fits.log"), 0) as engine:
        took = time.monotonic() - t0  # the process's boot (imports, model) + the 2 s delay
        assert engine.alive()
        assert _status(engine.url + "/ready") == 200
        assert _status(engine.url + "/health_generate") == 200  # up: it generates
    # A budget the boot fits in with room to spare (this machine may be slow), and a start-up
    # phase far longer than it: the budget, not the phase, ends the wait.
    # (3x: a second boot under a busy suite took more than twice the first: CI, 2026-11-28)
    budget = max(6, round(3 * took))
    cfg = _cfg(f"rollout.cpu_startup_delay_s={budget + 600}", f"rollout.start_timeout_s={budget}")
    engine = engine_process(cfg, model, str(tmp_path / "late.log"), 0)
    with pytest.raises(EngineStartError) as failed:
        engine.start()
    message = str(failed.value)
    assert f"rollout.start_timeout_s={budget}" in message, message
    assert "/ready" in message and "LAMINAR_ENGINE_PORT=" in message, \
        "it listened and answered 503 until the budget ran out; its log tail comes along"
    assert not engine.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(engine.proc.pid, 0)
