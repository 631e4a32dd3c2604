"""The multi-node commands of the README, on loopback: the controller, rollout nodes (the first
hosts the master relay, the second chains from it, a third -- where Mooncake's transfer engine
runs -- has no relay and reads every version from the master through Mooncake) and a trainer
started by torchrun, each its own process, finding each other through the controller address;
a rollout node joins the running job and another leaves it."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from laminar_mcore.netutil import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKEN = "test-token-0123456789"
SLOW_START_S = 8  # an engine's start, beyond the old join budget (scaled: 600 s -> 6 s)


def _start(args, cwd, log_name, env):
    log = open(cwd / log_name, "w")
    return subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def test_controller_rollout_nodes_and_torchrun_trainer_run_a_job(tmp_path):
    """The README's commands as processes: the controller, two rollout nodes (one hosts the
    master relay, one chains from it; a third without a relay, through Mooncake, where it
    runs) and a torchrun trainer. The job is elastic: a node started while it trains
    registers, pulls the newest version from its relay and generates trajectories the trainer
    consumes; a node stopped with SIGTERM leaves (its trajectories finish or are handed back)
    and exits 0, with no engine restarted, none lost, and the books balanced.

    The first nodes' engines start slowly, as SGLang's do at scale, scaled down 100x: 8 s
    (800 s) longer than the 6 s (600 s) every role used to wait for the others, within a start
    budget of 24 s (2,400 s: an engine process under a loaded CI machine's imports took over
    10 s before its slow start began, and 18 s was once too little); the join budget left to
    its default (the start budget + a margin) lets every role wait for them."""
    from laminar_mcore.relay.transports import mooncake

    remote = mooncake.available()
    port = free_port()
    run = tmp_path / "out" / "cluster"
    # the run ends with its STOP file once the late node's engine generated for it and the
    # leaver left, not at a fixed step count (the late node's cold start under load once took
    # longer than a fixed 20-30 steps); total_steps is only a bound
    bound = 400
    # mode=sync: every engine moves to each version before generating with it, so every node's
    # engine pulls (training takes a fraction of a second here: in laminar mode an engine busy
    # with its trajectories may never get to pull before the run ends)
    common = ["experiment=cpu_reverse", "mode=sync", "output_dir=out", "run_name=cluster",
              "cluster.controller_addr=127.0.0.1", f"cluster.controller_port={port}",
              f"cluster.rollout_nodes={3 if remote else 2}", "rollout.num_engines=1",
              f"trainer.total_steps={bound}", "trainer.train_batch_prompts=16",
              "data.num_eval=8", "data.warmup_steps=20", "cluster.shutdown_grace_s=20",
              "rollout.start_timeout_s=24"]
    slow = [f"rollout.cpu_startup_delay_s={SLOW_START_S}"]  # the nodes the run starts with
    if remote:
        common.append("weight_sync.mooncake_protocol=tcp")
    env = dict(os.environ, PYTHONWARNINGS="ignore", LAMINAR_RUN_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "laminar_mcore.launch"]
    procs = {}

    def log(name):
        return (tmp_path / f"{name}.log").read_text()

    def wait(what, check, timeout=300):
        deadline = time.time() + timeout
        while not check():
            failed = {n: p.poll() for n, p in procs.items() if p.poll() not in (None, 0)}
            ended = what != "the run ends" and procs["controller"].poll() is not None
            assert not failed and not ended and time.time() < deadline, (what, failed, {
                n: log(n)[-2000:] for n in procs})
            time.sleep(0.5)

    def steps_done():
        path = run / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return sum(json.loads(line)["kind"] == "train" for line in lines if line.strip())

    try:
        procs["controller"] = _start(launch + ["job=controller", *common], tmp_path,
                                     "controller.log", env)
        for name in ("rollout0", "rollout1"):
            procs[name] = _start(launch + ["job=rollout", *common, *slow], tmp_path,
                                 f"{name}.log", env)
        if remote:
            procs["rollout2"] = _start(launch + ["job=rollout", *common, *slow,
                                                 "rollout.relay=remote"],
                                       tmp_path, "rollout2.log", env)
        procs["trainer"] = _start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                                   "--nproc-per-node=1", "--master-addr=127.0.0.1",
                                   f"--master-port={free_port()}", "--local-addr=127.0.0.1",
                                   "-m", "laminar_mcore.launch", "job=trainer", *common],
                                  tmp_path, "trainer.log", env)
        wait("the first step", lambda: steps_done() >= 1)
        # the late node starts beside a training run on a loaded machine: the 24 s budget is
        # the first nodes' subject, not its own (its engine once printed no port in 24 s)
        late = [a for a in common if not a.startswith("rollout.start_timeout_s=")]
        procs["late"] = _start(launch + ["job=rollout", *late, "rollout.start_timeout_s=120"],
                               tmp_path, "late.log", env)
        wait("the late node registers", lambda: "registered:" in log("late"))
        # the node that leaves: the one of the two that does not hold the master relay
        leaver = next(n for n in ("rollout0", "rollout1")
                      if "registered: master relay" not in log(n))
        at = steps_done()
        wait("a step with the late node", lambda: steps_done() >= at + 1)
        procs[leaver].send_signal(signal.SIGTERM)
        assert procs[leaver].wait(timeout=120) == 0, log(leaver)[-3000:]
        late = f"node{3 if remote else 2}-engine0"  # nodes that registered first are 0..n-1

        def late_generated():
            path = run / "trajectories.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            return any(late in json.loads(line)["engines"] for line in lines[:-1])

        wait("a trajectory of the late node's engine consumed", late_generated)
        at = steps_done()
        wait("a step after the leaver left", lambda: steps_done() >= at + 1)
        (run / "STOP").touch()
        wait("the run ends", lambda: all(p.poll() is not None for p in procs.values()))
        codes = {n: p.poll() for n, p in procs.items()}
        assert set(codes.values()) == {0}, (codes, {n: log(n)[-2500:] for n in procs})
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    summary = json.loads((run / "summary.json").read_text())
    steps = summary["steps"]
    assert 3 <= steps < bound and summary["final_version"] == steps
    assert summary["books_balance"] and summary["trajectories_consumed"] == steps * 16 * 8
    assert summary["trajectories_lost"] == 0 and summary["engine_restarts"] == 0
    assert not summary["evicted_engines"] and len(summary["engines_left"]) == 1
    nodes = 3 if remote else 2
    assert f"{nodes} rollout node(s), {nodes} engines" in log("controller")
    rollouts = [n for n in procs if n.startswith("rollout") or n == "late"]
    # the first nodes' engines took their slow start, and every role waited for them (the late
    # node starts at once: it joins a run already under way, with steps left to generate for)
    took = [float(t) for n in rollouts if n != "late"
            for t in re.findall(r"started in ([\d.]+) s", log(n))]
    assert len(took) == nodes and min(took) >= SLOW_START_S, took
    assert sum(log(n).count("registered: master relay") for n in rollouts) == 1
    assert sum(log(n).count("registered: no relay here") for n in rollouts) == int(remote)
    assert "left the run:" in log(leaver) and "could not leave" not in log(leaver)
    assert sum(log(n).count("the run is done; stopping") for n in rollouts) == nodes
    # every engine still in the run pulled new weights: a chained relay's, Mooncake's (no
    # relay) and the late node's, which also generated trajectories the trainer consumed
    versions = summary["engine_versions"]
    assert len(versions) == nodes and summary["engines_left"][0] not in versions, versions
    assert all(v >= 1 for v in versions.values()) and max(versions.values()) >= 2, versions
    assert late in versions, versions
    trace = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert any(late in r["engines"] for r in trace), "the late node's engine generated none"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))


def test_cluster_roles_refuse_a_missing_token_or_port(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LAMINAR_RUN_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.launch", "job=rollout",
                          "cluster.controller_port=1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=dict(env, PYTHONWARNINGS="ignore"))
    assert out.returncode == 2 and "LAMINAR_RUN_TOKEN" in out.stderr
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.launch", "job=trainer"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(env, PYTHONWARNINGS="ignore", LAMINAR_RUN_TOKEN=TOKEN))
    assert out.returncode == 2 and "torchrun" in out.stderr
