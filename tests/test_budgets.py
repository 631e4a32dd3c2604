"""Budgets derived, not scattered (issue 50): the join budget follows the engines' start budget
and is never below it; pauses have their own budget; the controller's file descriptors are
counted, its soft limit raised at start, and a hard limit below the need refused; and 2,048
streams run through one rollout manager with every trajectory accounted for."""

import asyncio
import json
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir

from laminar_mcore.config import ConfigError, register_configs, typed, validate_config
from laminar_mcore.config.budgets import (JOIN_MARGIN_S, controller_open_files,
                                          controller_streams, join_timeout_s,
                                          raise_open_files_limit)
from laminar_mcore.config.paths import conf_dir

register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_the_join_budget_follows_the_engines_start_budget():
    assert join_timeout_s(_compose()) == 180 + JOIN_MARGIN_S  # the CPU engine's start budget
    sglang = _compose("rollout=sglang")
    assert join_timeout_s(sglang) == 1800 + JOIN_MARGIN_S  # a big checkpoint's 30 minutes
    assert join_timeout_s(_compose("rollout.start_timeout_s=40")) == 40 + JOIN_MARGIN_S
    assert join_timeout_s(_compose("cluster.join_timeout_s=2000", "rollout=sglang")) == 2000
    # the old constant (600 s) under SGLang's 1800 s start: refused, naming both keys
    with pytest.raises(ConfigError, match=r"LMC-E108: cluster.join_timeout_s=600.0 is below the "
                                          r"engines' start budget rollout.start_timeout_s=None "
                                          r"\(1800 s for rollout.backend=sglang\)"):
        validate_config(_compose("rollout=sglang", "cluster.join_timeout_s=600"))
    with pytest.raises(ConfigError, match="LMC-E103: rollout.pause_timeout_s=0"):
        validate_config(_compose("rollout.pause_timeout_s=0"))
    assert _compose().rollout.pause_timeout_s >= 60  # SGLang's abort loop: a second a round


def test_the_controllers_open_files_are_planned(tmp_path):
    recipe = _compose("experiment=qwen2_5_7b_math", "job=plan")
    streams = controller_streams(recipe)
    r = recipe.rollout
    assert streams == recipe.cluster.rollout_nodes * r.num_engines * r.max_running_requests
    assert streams >= 3072  # the 7B recipe: thousands of streams in one controller
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.launch",
                          "experiment=qwen2_5_7b_math", "job=plan", "output_dir=out"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"up to {streams} streams at once, {controller_open_files(recipe)} open files" \
        in out.stdout


# a controller started under RLIMIT_NOFILE (soft, hard): its limit after start, or its refusal
_START = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, int(sys.argv[1])))
from laminar_mcore.config import typed
from laminar_mcore.config.budgets import raise_open_files_limit
cfg = typed(json.loads(sys.argv[2]))
try:
    print(json.dumps(raise_open_files_limit(cfg) + resource.getrlimit(resource.RLIMIT_NOFILE)))
except RuntimeError as exc:
    print(json.dumps(str(exc)))
"""


def test_the_soft_limit_is_raised_and_a_low_hard_limit_refused():
    from laminar_mcore.config import as_dict

    cfg = _compose("cluster.rollout_nodes=3", "rollout.num_engines=8",
                   "rollout.max_running_requests=256")
    body = json.dumps(as_dict(typed(cfg)))
    needed = controller_open_files(cfg)
    assert needed > 6144

    def start(hard):
        out = subprocess.run([sys.executable, "-c", _START, str(hard), body],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    soft, need, now_soft, now_hard = start(needed + 1000)  # 1,024 soft: raised at start
    assert soft == now_soft == needed + 1000 and need == needed
    refusal = start(4096)
    assert refusal.startswith("LMC-E610") and f"about {needed} open files" in refusal
    assert "6144 streams" in refusal and "hard limit is 4096" in refusal
    assert "rollout.max_running_requests=256" in refusal and "ulimit -Hn" in refusal


@pytest.mark.multiprocess
def test_2048_streams_through_one_rollout_manager(tmp_path):
    """Four CPU engines x 512 streams, all open at once through one manager, short answers;
    every trajectory is accounted for (generated = consumed + buffered + discarded, none
    lost)."""
    from laminar_mcore.config.schema import RolloutConfig
    from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
    from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

    from .test_rollout_manager import (RecordingBuffer, _handle, _manager, _master_relay,
                                      _state, _stop_manager)

    engines_n, per_engine = 4, 512
    cfg = typed(_compose(f"rollout.num_engines={engines_n}",
                         f"rollout.max_running_requests={per_engine}"))
    raise_open_files_limit(cfg)  # as the controller does at its start
    hf = tiny_hf_config("qwen2", max_position_embeddings=256)
    save_hf_checkpoint(str(tmp_path / "m"), hf, _state(hf, 0))
    relay = _master_relay(tmp_path)
    engines = [EngineProcess(cpu_engine_command(str(tmp_path / "m"), seed=i,
                                                max_running_requests=per_engine,
                                                kv_capacity_tokens=per_engine * 64,
                                                incremental_streaming_output=True,
                                                stream_interval=8),
                             log_path=str(tmp_path / f"e{i}.log")) for i in range(engines_n)]
    rows = [{"prompt_ids": [i % 50 + 1, 7, 3], "answer": ""} for i in range(1024)]
    try:
        for e in engines:
            e.start()

        async def run():
            buffer = RecordingBuffer(group_size=4)
            handles = [_handle(f"e{i}", e.url, relay.url, per_engine, timeout_s=30,
                               incremental_stream=True)
                       for i, e in enumerate(engines)]
            manager = _manager(handles, rows, buffer, {"max_new_tokens": 8, "temperature": 1.0,
                                                       "ignore_eos": True},
                               batch=engines_n * per_engine, rollout=RolloutConfig(repack=False))
            runner = asyncio.create_task(manager.run())
            peak, deadline = 0, time.time() + 300
            while peak < engines_n * per_engine or manager.stats.generated < engines_n * per_engine:
                assert time.time() < deadline and not runner.done(), manager.error
                peak = max(peak, sum(len(h.in_flight) for h in handles))
                await asyncio.sleep(0.02)
            await _stop_manager(manager, runner, handles)
            return manager, handles, buffer, peak

        manager, handles, buffer, peak = asyncio.run(run())
    finally:
        for e in engines:
            e.stop()
        relay.stop()
    assert peak == engines_n * per_engine  # 2,048 streams at once
    assert all(h.healthy for h in handles) and manager.error is None
    discarded = sum(buffer.discarded.values())
    assert manager.stats.generated == buffer.consumed + buffer.buffered + discarded
    assert manager.stats.started == manager.stats.generated + len(manager.partial)
    assert not buffer.discarded or set(buffer.discarded) <= {"stopped"}, buffer.discarded
