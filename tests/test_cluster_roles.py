"""The multi-node commands of the README, on loopback: the controller, rollout nodes (the first
hosts the master relay, the second chains from it, a third -- where Mooncake's transfer engine
runs -- has no relay and reads every version from the master through Mooncake) and a trainer
started by torchrun, each its own process, finding each other through the controller address."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from laminar_mcore.netutil import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKEN = "test-token-0123456789"


def _start(args, cwd, log_name, env):
    log = open(cwd / log_name, "w")
    return subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def test_controller_rollout_nodes_and_torchrun_trainer_run_a_job(tmp_path):
    from laminar_mcore.relay.transports import mooncake

    remote = mooncake.available()
    nodes = 3 if remote else 2
    port = free_port()
    # mode=sync: every engine moves to each version before generating with it, so every node's
    # engine pulls (training takes a fraction of a second here: in laminar mode an engine busy
    # with its trajectories may never get to pull before the run ends)
    common = ["experiment=cpu_reverse", "mode=sync", "output_dir=out", "run_name=cluster", "cluster.controller_addr=127.0.0.1",
              f"cluster.controller_port={port}", f"cluster.rollout_nodes={nodes}",
              "rollout.num_engines=1", "trainer.total_steps=3", "trainer.train_batch_prompts=4",
              "data.num_eval=8", "data.warmup_steps=20", "cluster.shutdown_grace_s=20"]
    if remote:
        common.append("weight_sync.mooncake_protocol=tcp")
    env = dict(os.environ, PYTHONWARNINGS="ignore", LAMINAR_RUN_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "laminar_mcore.launch"]
    procs = []
    try:
        procs.append(_start(launch + ["job=controller", *common], tmp_path, "controller.log", env))
        procs.append(_start(launch + ["job=rollout", *common], tmp_path, "rollout0.log", env))
        procs.append(_start(launch + ["job=rollout", *common], tmp_path, "rollout1.log", env))
        if remote:
            procs.append(_start(launch + ["job=rollout", *common, "rollout.relay=remote"],
                                tmp_path, "rollout2.log", env))
        procs.append(_start([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                             "--nproc-per-node=1", "--master-addr=127.0.0.1",
                             f"--master-port={free_port()}", "--local-addr=127.0.0.1",
                             "-m", "laminar_mcore.launch", "job=trainer", *common],
                            tmp_path, "trainer.log", env))
        deadline = time.time() + 420
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(1)
        codes = [p.poll() for p in procs]
        names = ["controller.log", "rollout0.log", "rollout1.log"] + (
            ["rollout2.log"] if remote else []) + ["trainer.log"]
        logs = {n: (tmp_path / n).read_text()[-2500:] for n in names}
        assert codes == [0] * len(names), (codes, logs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    summary = json.loads((tmp_path / "out" / "cluster" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_version"] == 3 and summary["books_balance"]
    assert summary["trajectories_consumed"] == 3 * 4 * 8
    controller_log = (tmp_path / "controller.log").read_text()
    assert f"{nodes} rollout node(s), {nodes} engines" in controller_log
    rollout_logs = "".join((tmp_path / n).read_text() for n in names if n.startswith("rollout"))
    assert rollout_logs.count("registered: master relay") == 1  # one master, one chained relay
    assert rollout_logs.count("registered: no relay here") == (1 if remote else 0)
    assert rollout_logs.count("the run is done; stopping") == nodes
    # every node's engines pulled new weights: the second node's through its chained relay,
    # the third's (no relay) through Mooncake from the master
    assert sorted(summary["engine_versions"]) == [f"node{i}-engine0" for i in range(nodes)]
    versions = summary["engine_versions"]
    assert all(v >= 1 for v in versions.values()) and max(versions.values()) >= 2, versions
    records = [json.loads(l) for l in (tmp_path / "out" / "cluster" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]


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
