"""Fault isolation: processes killed with -9 while a run goes on, and engines paused rather than
hung (real processes, loopback)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from laminar_mcore.weights.bucket import SHM_DIR, reclaim_segments

CHILD = """
import sys, time
from laminar_mcore.weights.bucket import ShmBucket
b = ShmBucket(4096, prefix="laminar-relay")
b.buffer[:4] = 7
print(b.path, flush=True)
time.sleep(600)
"""


def test_a_process_killed_with_minus_9_leaves_segments_that_its_supervisor_reclaims(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        assert reclaim_segments(child.pid + 10**7) == []  # another pid's: untouched
        assert path not in reclaim_segments()  # its owner is alive: kept
        assert os.path.exists(path)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert os.path.exists(path), "a -9 kill cannot clean up: the segment is stranded"
        assert reclaim_segments(child.pid) == [path]
        assert not os.path.exists(path)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_segments_of_dead_processes_are_reclaimed_without_their_pid(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    path = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    mine = os.path.join(SHM_DIR, f"laminar-relay-{os.getpid()}-{'a' * 12}")
    open(mine, "wb").close()
    try:
        removed = reclaim_segments()  # what a relay does when it starts
        assert path in removed and mine not in removed and os.path.exists(mine)
    finally:
        os.unlink(mine)


# The chaos runs' common settings: a laminar run over two rollout nodes of one engine each,
# checkpoints every 2 steps, engines probed every second (each test adds its trainer layout).
CHAOS_RUN = [
    "experiment=cpu_reverse", "mode=laminar", "trainer.total_steps=1000",
    "trainer.train_batch_prompts=4", "data.num_eval=8", "data.warmup_steps=20",
    "rollout.num_engines=1", "cluster.rollout_nodes=2", "trainer.save_interval=2",
    "rollout.engine_heartbeat_s=1", "rollout.engine_heartbeat_timeout_s=5"]


def run_chaos(tmp_path, monkeypatch, kinds, overrides):
    """A chaos run of ``CHAOS_RUN`` + ``overrides`` killing ``kinds`` in a seeded order
    (``LAMINAR_CHAOS_SEED``, printed), each once the previous has recovered, then ended by its
    STOP file; returns (its result, the seed)."""
    from laminar_mcore.testing.chaos import ChaosRun, plan

    # the engines' health window (and so the supervisor's probe floor, window + 5 s): 2 s
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")
    seed = int(os.environ.get("LAMINAR_CHAOS_SEED", time.time_ns() % 1000))
    kills = plan(seed, kinds)
    print(f"chaos seed {seed}: " + ", ".join(k.kind for k in kills))
    return ChaosRun(tmp_path, CHAOS_RUN + list(overrides), kills, seed=seed,
                    stop_after_s=5.0).run(timeout_s=600), seed


def assert_the_run_lost_nothing(result, seed) -> None:
    """A chaos run's outcome: it ended well, every kill happened and recovered, the books
    balance, no trajectory was lost or mixed versions, versions stayed monotone across the
    trainer's restart, both engines end on the last version with equal weights, and nothing
    is left behind."""
    tail = result.output[-6000:]
    assert result.returncode == 0, tail
    for k in result.kills:
        assert k.time is not None, (f"seed {seed}: {k.kind} was never killed (the run ended "
                                    f"first)", tail)
        assert k.recovered_at is not None, (f"seed {seed}: {k.kind} did not recover", tail)
    s = result.summary
    # the books balance exactly; nothing is unaccounted for
    assert s["books_balance"] and s["trajectories_generated"] == (
        s["trajectories_consumed"] + s["trajectories_buffered"] + s["trajectories_discarded"])
    assert "lost" not in s["discarded_reasons"] and s["trajectories_in_flight_at_stop"] == 0
    # every consumed trajectory came from exactly one version
    assert s["trajectories_mixed_versions"] == 0
    # versions are monotone: each step's version is newer than the last, also across the
    # trainer's restart from an older checkpoint (its first version is newer than any held)
    versions = [r["version"] for r in result.records if r["kind"] == "train"]
    assert all(b > a for a, b in zip(versions, versions[1:])), versions
    # every engine (restarted or not) ends on the last published version, with equal weights:
    # greedy log-probs of one prompt agree exactly
    assert set(s["final_engine_versions"].values()) == {s["final_version"]}, s
    assert len(s["final_engine_versions"]) == 2 and s["engines_agree"]
    # nothing is left behind: no process, no shared memory
    assert result.leftover_processes == []
    assert result.leftover_segments == []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_chaos_engine_relay_master_relay_and_trainer_die_and_the_run_loses_nothing(tmp_path,
                                                                                     monkeypatch):
    """One run: kill -9 an engine, a chained relay, the master relay and a trainer process and
    SIGSTOP another engine, in a seeded order (printed), each once the previous has recovered."""
    # the four kinds of the issue, and an engine that hangs instead of dying
    result, seed = run_chaos(tmp_path, monkeypatch,
                             ("engine", "relay", "master_relay", "trainer", "engine_hang"), [
        # two trainer ranks publishing their own shards (TP2): a master relay killed mid-version
        # is survived by each rank's part, and the relays put every version together whole
        "parallel.tp=2", "cluster.trainer.nproc_per_node=2", "weight_sync.export=per_rank"])
    assert_the_run_lost_nothing(result, seed)
    s = result.summary
    # each role came back
    assert s["engine_restarts"] >= 2 and s["relay_failovers"] >= 1 and s["trainer_restarts"] == 1
    # the heartbeat's own reason (an engine taken out of service after a failed weight update
    # also mentions /health_generate, which it still answers)
    hung = [r for r in result.records if r["kind"] == "fault" and r["event"] == "down"
            and r.get("reason", "").startswith("/health_generate failed")]
    assert len(hung) == 1, "the stopped engine was found by its heartbeat"
    assert s["evicted_engines"] == {}
    resumed = [r for r in result.records if r["kind"] == "fault" and r["event"] == "resumed"]
    assert len(resumed) == 1
    summary_text = json.dumps(s)
    assert "restart_failed" not in result.output, summary_text


@contextlib.contextmanager
def _supervised_node(tmp_path, token, **rollout):
    """A real controller (it gives the engine no work: capacity 0, so only the supervisor's
    checks reach it) and one rollout node's supervisor with one CPU engine, started and
    registered; yields (controller, supervisor, the supervisor's log lines) and stops both."""
    from dataclasses import replace

    from laminar_mcore.config.schema import LaminarConfig
    from laminar_mcore.controller.client import ControllerClient
    from laminar_mcore.controller.episode import TaskCodec
    from laminar_mcore.controller.server import Controller, TaskData
    from laminar_mcore.metrics import MetricsWriter
    from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
    from laminar_mcore.rollout.supervisor import NodeSupervisor

    model = str(tmp_path / "m")
    hf = tiny_hf_config("llama", tie_word_embeddings=True)
    save_hf_checkpoint(model, hf, initial_hf_state(type("M", (), {"path": None})(), hf, 0))
    base = LaminarConfig(output_dir=str(tmp_path), seed=0)
    cfg = replace(base, rollout=replace(base.rollout, num_engines=1, engine_heartbeat_s=0.2,
                                        start_timeout_s=120, **rollout))
    controller_cfg = replace(cfg, rollout=replace(cfg.rollout, max_running_requests=0))
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path=model)
    controller = Controller(controller_cfg, task, metrics, token, info={"model_path": model})
    controller.start()
    lines = []
    supervisor = NodeSupervisor(cfg, ControllerClient(controller.url, token), model,
                                str(tmp_path / "logs"), "n0", log=lines.append)
    try:
        supervisor.start()
        supervisor.register()
        yield controller, supervisor, lines
    finally:
        supervisor.stop()
        controller.stop()
        metrics.close()


@pytest.mark.multiprocess
def test_a_paused_engine_is_not_restarted_and_a_hung_one_is(tmp_path, monkeypatch):
    """Pauses are not failures. A node's supervisor (real relay, real CPU engine, real
    controller) checks an engine that is paused for a weight update: SGLang's check fails after
    its health window (SGLANG_HEALTH_CHECK_TIMEOUT, 1 s here), but while the controller reports
    the engine paused no failure counts and the engine keeps running. Once the controller no
    longer reports it paused, the same failing checks count: two in a row and it is gone
    (evicted here: rollout.engine_restarts_per_hour=0)."""
    from laminar_mcore.netutil import engine_api_key

    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")  # the engine's window, and ours
    token = "faults-token-0123"
    with _supervised_node(tmp_path, token, engine_heartbeat_timeout_s=1.0,
                          engine_restarts_per_hour=0) as (controller, supervisor, lines):
        engine = supervisor.engines[0]
        assert any("engine checks wait 6 s" in line for line in lines), lines  # 1 s window + 5
        handle = controller.manager.engines[0]
        assert handle.client.base_url == engine.url
        with pytest.raises(urllib.error.HTTPError, match="401"):  # the run token is needed
            urllib.request.urlopen(controller.url + "/engine_states", timeout=10)

        def set_paused(value):
            controller.loop.call_soon_threadsafe(setattr, handle, "paused", value)

        set_paused(True)  # what the manager does before it pauses the engine for an update
        req = urllib.request.Request(engine.url + "/pause_generation", method="POST",
                                     data=json.dumps({"mode": "abort"}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {engine_api_key(token)}"})
        urllib.request.urlopen(req, timeout=30).read()
        supervisor.watch()
        deadline = time.time() + 120
        while sum("busy_check" in line for line in lines) < 3 and time.time() < deadline:
            time.sleep(0.2)
        busy = [line for line in lines if "busy_check" in line]
        assert len(busy) >= 3, lines
        assert all("state=paused" in line and "counted=False" in line for line in busy), busy
        assert engine.alive() and supervisor.engines[0] is engine, "a paused engine stays"
        assert not any(" down " in line or " evicted " in line for line in lines), lines

        set_paused(False)  # the controller says it is not paused, yet it answers no check
        while handle.evicted is None and time.time() < deadline:
            time.sleep(0.2)
        assert handle.evicted is not None, lines
        assert "twice in a row" in handle.evicted and "neither paused" in handle.evicted
        assert not engine.alive()


@pytest.mark.multiprocess
def test_an_engine_the_controller_took_out_of_service_is_restarted(tmp_path):
    """An engine the rollout manager marked unhealthy (a weight update that failed half-way, a
    stream that broke) gets no more work, yet may still pass its health checks: its
    supervisor sees the controller's word and restarts it, and the new process takes its
    place in service (it was lost for good before)."""
    with _supervised_node(tmp_path, "faults-token-4567") as (controller, supervisor, lines):
        supervisor.watch()
        old = supervisor.engines[0]
        handle = controller.manager.engines[0]
        controller.loop.call_soon_threadsafe(controller.manager._mark_unhealthy, handle)
        deadline = time.time() + 120
        while (supervisor.engines[0] is old or not handle.healthy) and time.time() < deadline:
            time.sleep(0.2)
        assert supervisor.engines[0] is not old and handle.healthy, lines
        assert not old.alive() and supervisor.engines[0].alive()
        assert handle.client.base_url == supervisor.engines[0].url
        down = [line for line in lines if " down engine0" in line]
        assert len(down) == 1 and "took it out of service" in down[0], lines
