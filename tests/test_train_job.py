"""The train job end to end on CPU: relay, engines, controller and trainer world as real
processes; a few steps in laminar and sync modes; books balance; outputs are written."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mooncake_available() -> bool:
    from laminar_mcore.relay.transports import mooncake

    return mooncake.available()


def _launch(tmp_path, *overrides):
    out = subprocess.run(
        [sys.executable, "-m", "laminar_mcore.launch", "experiment=cpu_reverse", "output_dir=out",
         *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


# the sync run (the resume test's uninterrupted run): evaluations after training, on
# snapshots; generation waits for the trainer's first batch request. The snapshot is taken at
# step 3, not at step 2, whose checkpoint the resume starts from: a snapshot written before that
# checkpoint delays the controller's state past the moment the engines start step 3's
# generation, whose prompts the resumed run would then skip.
SYNC = ["mode=sync", "trainer.train_batch_prompts=4", "data.num_eval=16", "rollout.num_engines=2",
        "trainer.eval_interval=3", "trainer.eval_offline=true",
        "rollout.generate_before_trainer=false"]


@pytest.mark.parametrize("mode", ["laminar", "areal"])
def test_train_job_runs_and_keeps_the_books(tmp_path, mode):
    # The laminar run's engines take every version through Mooncake's transfer engine (TCP on
    # loopback), as engines reading from a relay on another machine do; areal's through shm.
    transport = "mooncake" if mode == "laminar" and _mooncake_available() else "shm"
    extra = (["weight_sync.mooncake_protocol=tcp", "weight_sync.engine_transport=mooncake"]
             if transport == "mooncake" else
             # engines of TP2 (a TP1 trainer): each rank pulls only its shard, SGLang's layout
             ["rollout.engine_tp=2"])
    if mode == "laminar":  # bf16 weights, published as deltas (auto would send them whole
        extra += ["model.dtype=bf16", "weight_sync.delta=on",  # on loopback: no link named)
                  # by a TP2 trainer whose two ranks publish their own shards (deltas of
                  # each); the relay puts them together as the engines pull
                  "parallel.tp=2", "cluster.trainer.nproc_per_node=2",
                  "weight_sync.export=per_rank"]
    _launch(tmp_path, f"mode={mode}", "run_name=e2e", "trainer.total_steps=3",
            "trainer.train_batch_prompts=4", "data.num_eval=16", "data.warmup_steps=20",
            "rollout.num_engines=2", "trainer.eval_interval=2", *extra)
    _check_books(tmp_path / "out" / "e2e", mode, 3, transport)
    summary = json.loads((tmp_path / "out" / "e2e" / "summary.json").read_text())
    assert summary["engine_pull"] == ("whole" if transport == "mooncake" else "shard")
    if transport != "mooncake":  # the versions engines applied were each rank's own shard
        assert summary["engine_pull_loads"]["direct"] >= 2, summary["engine_pull_loads"]
        assert "flattened_bucket" not in summary["engine_pull_loads"]


def _check_books(run_dir, mode, steps, transport, every=2):
    """What a finished train job of ``steps`` steps (evaluations every ``every``) leaves
    behind."""
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = {"initial_accuracy", "final_accuracy", "trajectories_generated", "trajectories_consumed",
            "trajectories_buffered", "trajectories_discarded", "max_staleness_observed", "wall_seconds",
            "staleness_trained"}
    assert keys <= set(summary)
    assert summary["books_balance"] and summary["steps"] == steps
    assert summary["final_version"] == steps
    assert summary["engine_transport"] == transport and summary["engine_pulls"] >= 1
    assert summary["trajectories_consumed"] == steps * 4 * 8
    assert summary["trajectories_generated"] == (summary["trajectories_consumed"]
                                                 + summary["trajectories_buffered"]
                                                 + summary["trajectories_discarded"])
    if mode == "sync":
        assert summary["max_staleness_observed"] == 0  # generate, train, sync: never stale
    trained_on = summary["staleness_trained"]  # the staleness of what was trained on
    assert sum(trained_on["histogram"].values()) == summary["trajectories_consumed"]
    assert trained_on["max"] == summary["max_staleness_observed"] == max(
        int(k) for k in trained_on["histogram"])
    assert ("staleness_trained_newest_token" in summary) == (mode == "areal")
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    sent = [r for r in records if r["kind"] == "train" and "weights_sent_bytes" in r]
    # the newest version sent by each step's record: step s's publish waits for version s - 1,
    # and its own (sent on the publisher's thread) may have finished too; step 1's may not
    assert all(r["weights_version_sent"] in (r["step"] - 1, r["step"]) for r in sent), sent
    assert [r["step"] for r in sent] in (list(range(1, steps + 1)), list(range(2, steps + 1)))
    by_version = {r["weights_version_sent"]: r for r in sent}
    assert set(range(1, steps)) <= set(by_version)
    if mode == "laminar":  # version 1 whole (the first), version 2 a delta, pulled by engines
        assert by_version[1]["weights_sent_bytes"] == by_version[1]["weights_full_bytes"]
        assert by_version[2]["weights_delta_buckets"] >= 1
        assert by_version[2]["weights_sent_bytes"] < by_version[2]["weights_full_bytes"] / 10
    else:  # fp32: auto leaves deltas off
        assert all(r["weights_sent_bytes"] == r["weights_full_bytes"] for r in sent)
    # evaluated before, every ``every`` steps (trainer.eval_interval) on weights of that version or
    # newer, and after
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    expected = sorted({0, *range(every, steps, every), steps})
    assert sorted(evals) == expected, evals
    assert evals[every]["version"] >= every and evals[steps]["version"] == steps
    assert evals[0]["wall_s"] == 0
    trained = {r["version"]: r["time"] for r in records if r["kind"] == "train"}
    if mode == "sync":  # offline: that step's own weights, from its snapshot, at its trained time
        snapshot = run_dir / "eval_snapshots" / f"step_{every:06d}"
        assert json.loads((snapshot / "laminar_snapshot.json").read_text()) == {
            "step": every, "version": every}
        assert evals[every]["version"] == every and evals[every]["offline"]
        assert evals[every]["wall_s"] == pytest.approx(
            trained[every] - summary["first_batch_request"], abs=0.05)
    # the share of time with generation under way (any engine) is at least the engines' mean
    assert 1 - summary["engine_idle_fraction"] <= summary["generation_fraction"] + 1e-9
    assert 0 < summary["generation_fraction"] <= 1
    for r in evals.values():
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["accuracy_greedy"] <= 1
    assert [e["step"] for e in summary["evals"]] == expected
    if mode != "areal":  # AReaL's interruptible generation lets a trajectory span versions
        assert summary["trajectories_interrupted"] == 0
    assert (run_dir / "summary.png").exists()
    assert any((run_dir / "tensorboard").iterdir())
    # the trace: one record per consumed or discarded trajectory, read by the trace tool
    from laminar_mcore.data.trace import read_trace
    from laminar_mcore.tools.trace import main as trace_tool

    trace = read_trace(str(run_dir))
    consumed = [r for r in trace if r["outcome"] == "consumed"]
    assert len(consumed) == summary["trajectories_consumed"] == len({r["id"] for r in consumed})
    assert max(r["staleness"] for r in consumed) == summary["max_staleness_observed"]
    assert all(r["segments"] and r["engines"] and "consumed" in r["timings"] for r in consumed)
    if mode == "sync":  # rollout.generate_before_trainer=false
        assert min(r["timings"]["submitted"] for r in trace) >= summary["first_batch_request"]
    figures = trace_tool([str(run_dir)])
    assert figures["consumed"] == summary["trajectories_consumed"]
    assert (run_dir / "timeline.png").exists()


def test_sync_run_resumed_at_step_k_matches_the_uninterrupted_run(tmp_path):
    """mode=sync, fixed seed: the uninterrupted run keeps the books (as the other modes' runs
    above), and losses of the steps after a resume equal the uninterrupted run's; the data
    module resumes with it (the prompt pool's position, the books of the steps before the
    restart)."""
    run_dir = tmp_path / "out" / "exact"
    metrics = run_dir / "metrics.jsonl"

    def run(*extra):
        return _launch(tmp_path, *SYNC, "run_name=exact", "trainer.save_interval=2",
                       "trainer.total_steps=4", *extra)

    def train_records(lines):
        return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}

    run()
    _check_books(run_dir, "sync", 4, "shm", every=3)
    first_lines = metrics.read_text().splitlines()
    uninterrupted = train_records(first_lines)
    ckpts = run_dir / "checkpoints"
    state = json.loads((ckpts / "step_00000002" / "extra_state.json").read_text())
    assert state["prompt_pool"]["issued"] > 0 and state["trainer_version"] == 2
    shutil.rmtree(ckpts / "step_00000004")  # as if the run had died after step 3
    out = run("trainer.resume=auto")
    assert "resuming from" in out.stdout and "step_00000002" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_version"] == 4 and summary["books_balance"]
    assert summary["trajectories_consumed"] == 4 * 4 * 8  # two steps before the restart, two after
    resumed = train_records(metrics.read_text().splitlines()[len(first_lines):])
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step]["reward_mean"] == uninterrupted[step]["reward_mean"]
        assert resumed[step]["n_tokens"] == uninterrupted[step]["n_tokens"]  # the same samples
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(resumed[step][key] - uninterrupted[step][key]) <= 1e-5, (
                step, key, resumed[step][key], uninterrupted[step][key])
    assert all(uninterrupted[s]["grad_norm"] > 0 for s in (3, 4))  # a learning signal to compare

    # A training checkpoint converts to Hugging Face as it is (the layout it was saved at).
    back = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           "mcore-to-hf", "--ckpt", str(ckpts / "step_00000004"),
                           "--out", str(tmp_path / "hf")], capture_output=True, text=True,
                          timeout=300)
    assert back.returncode == 0, back.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()


def _shm_names(pids=None):
    """Our shared-memory segments (``laminar-<kind>-<creator pid>-<id>``), of ``pids`` only if
    given: other tests running beside this one have segments of their own."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    ours = {n for n in names if n.startswith("laminar")}
    if pids is None:
        return ours
    return {n for n in ours if any(p.isdigit() and int(p) in pids for p in n.split("-"))}


@pytest.mark.parametrize("how", ["ctrl_c", "trainer_dies"])
def test_an_interrupt_or_a_dead_role_stops_every_process(tmp_path, how):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) or a trainer
    process killed mid-run with no restart left (trainer.max_restarts=0; test_faults.py has the
    restart): the launcher exits non-zero and leaves no process and no shared memory behind."""
    import signal
    import time

    import psutil

    from laminar_mcore.procname import TRAINER, process_name

    shm_before = _shm_names()
    proc = subprocess.Popen(
        [sys.executable, "-m", "laminar_mcore.launch", "experiment=cpu_reverse", "output_dir=out",
         "run_name=stop",
         "trainer.total_steps=1000", "trainer.train_batch_prompts=2", "data.num_eval=4",
         "data.warmup_steps=20", "rollout.num_engines=2", "trainer.max_restarts=0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    metrics = tmp_path / "out" / "stop" / "metrics.jsonl"
    seen = set()
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            if metrics.exists() and '"train"' in metrics.read_text():
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        seen |= {p.pid for p in children}
        assert len(seen) >= 4  # relay, two engines, a trainer process (and more)
        if how == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            # the trainer: the launcher's child that named itself so (procname.py)
            trainers = [p for p in psutil.Process(proc.pid).children()
                        if process_name(p.pid) == TRAINER]
            assert len(trainers) == 1, [(p.name(), p.cmdline()) for p in children]
            trainers[0].kill()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, output[-3000:]
    time.sleep(1.0)
    alive = [pid for pid in seen if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, (alive, output[-3000:])
    left = _shm_names(seen | {proc.pid}) - shm_before
    assert not left, left


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2_pp2_striped"])
def test_moe_train_job_with_expert_parallelism_and_routing_replay(tmp_path, layout):
    """experiment=cpu_moe in mode=sync: a Qwen3-MoE trained by two EP ranks, published per rank
    (weight_sync.export=per_rank: each EP rank sends its own experts, no gather; issue 52;
    test_moe checks the stage lead's EP gather), served by the CPU engine with routed experts
    returned and replayed; ``ep2_pp2_striped``: EP2 x PP2 (four ranks), the version striped
    over two master relays, one per stage, on two rollout nodes (weight_sync.master_relays=2),
    served to TP2 EP2 engines whose ranks each pull only their own experts (SGLang's direct
    payloads). Every step consumes tokens of the trainer's own version, so every step's
    mismatch says the engine served exactly the trainer's weights (fp32: below 1e-4) -- each
    published version, not only the first; the books balance; the MoE losses are reported."""
    extra = ["parallel.pp=2", "cluster.trainer.nproc_per_node=4", "weight_sync.master_relays=2",
             "cluster.rollout_nodes=2", "rollout.engine_tp=2",
             "rollout.engine_ep=2"] if layout == "ep2_pp2_striped" else []
    out = subprocess.run(
        [sys.executable, "-m", "laminar_mcore.launch", "experiment=cpu_moe", "mode=sync",
         "output_dir=out", "run_name=moe", "trainer.total_steps=3", "data.num_eval=16",
         "data.warmup_steps=20", "weight_sync.export=per_rank", *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "moe" / "summary.json").read_text())
    assert summary["books_balance"] and summary["steps"] == 3 and summary["final_version"] == 3
    records = [json.loads(l) for l in (tmp_path / "out" / "moe" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["mismatch_tokens"] > 0 and r["mismatch_max"] < 1e-4, r
        assert {"mismatch_mean", "mismatch_p99", "mismatch_max", "mismatch_frac_above",
                "moe_load_balancing_loss", "moe_z_loss"} <= set(r)
        assert r["moe_load_balancing_loss"] > 0
    if layout == "ep2_pp2_striped":  # parts 0-1 (stage 0's EP ranks) to one master, 2-3 another
        assert summary["engine_pull"] == "shard", summary
        assert summary["engine_pull_loads"]["direct"] >= 3, summary["engine_pull_loads"]
        assert "flattened_bucket" not in summary["engine_pull_loads"]
        to = dict(re.findall(r"\[publish\] stage (\d+): channel \w+ to (\S+)", out.stdout))
        assert to["0"] == to["1"] != to["2"] == to["3"], to
