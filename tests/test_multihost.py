"""The README's multi-node commands as five separate hosts on one machine: one network namespace
each on a bridge (own addresses and loopback; the machine's host name resolves to loopback, as
Debian's and Ubuntu's /etc/hosts make it) and a private /dev/shm per process tree
(laminar_mcore/testing/netns.py). The controller; two rollout nodes (the master relay and a
chained relay, one CPU engine each; one leaves rollout.host unset, the other passes its address
as `rollout.host=$(hostname -i)` would on a real node); two torchrun trainer nodes
(`--nnodes 2 --nproc-per-node 1`, gloo across hosts). Skipped, saying why, where namespaces
cannot be made (not root)."""

import json
import os
import sys

import pytest

from laminar_mcore.testing import netns

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKEN = "multihost-token-0123456789"
OK, WHY = netns.available()


@pytest.mark.skipif(not OK, reason=WHY or "network namespaces are available")
def test_readme_commands_run_as_five_hosts(tmp_path):
    names = ["controller", "rollout0", "rollout1", "trainer0", "trainer1"]
    with netns.Hosts(names, workdir=str(tmp_path)) as hosts:
        ctl = hosts.addr("controller")
        # every host has its own port space: the README's fixed ports
        common = ["experiment=cpu_reverse", "mode=sync", "output_dir=out", "run_name=hosts",
                  f"cluster.controller_addr={ctl}",
                  "cluster.controller_port=8500", "cluster.rollout_nodes=2",
                  "cluster.trainer.nnodes=2", "cluster.trainer.nproc_per_node=1",
                  "cluster.threads_per_process=1", "rollout.num_engines=1",
                  "trainer.total_steps=3",
                  "trainer.train_batch_prompts=4", "data.num_eval=8", "data.warmup_steps=20",
                  "cluster.shutdown_grace_s=20"]
        env = dict(os.environ, PYTHONWARNINGS="ignore", LAMINAR_RUN_TOKEN=TOKEN,
                   OMP_NUM_THREADS="1")
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        launch = [sys.executable, "-m", "laminar_mcore.launch"]
        logs = {n: str(tmp_path / f"{n}.log") for n in names}
        procs = [hosts.start("controller", launch + ["job=controller", *common],
                             logs["controller"], env, cwd=str(tmp_path)),
                 hosts.start("rollout0", launch + ["job=rollout", *common], logs["rollout0"],
                             env, cwd=str(tmp_path)),
                 hosts.start("rollout1", launch + ["job=rollout", *common,
                                                   f"rollout.host={hosts.addr('rollout1')}"],
                             logs["rollout1"], env, cwd=str(tmp_path))]
        # as README writes it: the rendezvous on the first trainer node's host name
        rdzv = "trainer0:29400"
        for n in ("trainer0", "trainer1"):
            procs.append(hosts.start(n, [sys.executable, "-m", "torch.distributed.run",
                                         "--nnodes=2", "--nproc-per-node=1",
                                         "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}",
                                         "--rdzv-id=hosts",
                                         "-m", "laminar_mcore.launch",
                                         "job=trainer", *common], logs[n], env,
                                     cwd=str(tmp_path)))
        codes = hosts.wait(procs, timeout=480)
        tails = {n: open(logs[n]).read()[-3000:] for n in names}
        assert codes == [0] * len(names), (codes, tails)
    text = {n: open(logs[n]).read() for n in names}
    summary = json.loads((tmp_path / "out" / "hosts" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_version"] == 3 and summary["books_balance"]
    assert summary["trajectories_consumed"] == 3 * 4 * 8
    # the relays and engines advertise their own host's address, never loopback
    assert f"advertising {hosts.addr('rollout0')}" in text["rollout0"]
    relays = [line for n in ("rollout0", "rollout1") for line in text[n].splitlines()
              if "registered:" in line]
    assert len(relays) == 2 and sum("master relay" in r for r in relays) == 1
    assert f"http://{hosts.addr('rollout0')}:" in text["rollout0"]
    assert f"http://{hosts.addr('rollout1')}:" in text["rollout1"]
    assert "127.0.0.1" not in "".join(relays)
    # gloo across hosts, on the interface of the route to the rendezvous
    assert "collectives on eth0" in text["trainer0"] + text["trainer1"]
    # every node's engine pulled new weights through its own host's relay
    versions = summary["engine_versions"]
    assert sorted(versions) == ["node0-engine0", "node1-engine0"], versions
    assert all(v >= 2 for v in versions.values()), versions
