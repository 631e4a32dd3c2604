"""The README's multi-node commands as five separate hosts on one machine: one network namespace
each on a bridge (own addresses and loopback; the machine's host name resolves to loopback, as
Debian's and Ubuntu's /etc/hosts make it) and a private /dev/shm per process tree
(laminar_mcore/testing/netns.py). The controller; two rollout nodes (the master relay and a
chained relay, one CPU engine each; one leaves rollout.host unset, the other passes its address
as `rollout.host=$(hostname -i)` would on a real node); two torchrun trainer nodes
(`--nnodes 2 --nproc-per-node 1`, gloo across hosts). Skipped, saying why, where namespaces
cannot be made (not root)."""

import json
import sys

import pytest

from laminar_mcore.testing import netns

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKEN = "multihost-token-0123456789"
OK, WHY = netns.available()


@pytest.mark.skipif(not OK, reason=WHY or "network namespaces are available")
def test_readme_commands_run_as_five_hosts(tmp_path):
    from laminar_mcore.relay.transports import mooncake

    remote = mooncake.available()  # a third rollout node reads through Mooncake TCP
    names = (["controller", "rollout0", "rollout1"] + (["rollout2"] if remote else [])
             + ["trainer0", "trainer1"])
    with netns.Hosts(names, workdir=str(tmp_path)) as hosts:
        ctl = hosts.addr("controller")
        # every host has its own port space: the README's fixed ports
        common = ["experiment=cpu_reverse", "mode=sync", "output_dir=out", "run_name=hosts",
                  f"cluster.controller_addr={ctl}",
                  "cluster.controller_port=8500", f"cluster.rollout_nodes={3 if remote else 2}",
                  "cluster.trainer.nnodes=2", "cluster.trainer.nproc_per_node=1",
                  "cluster.threads_per_process=1", "rollout.num_engines=1",
                  "trainer.total_steps=3",
                  "trainer.train_batch_prompts=4", "data.num_eval=8", "data.warmup_steps=20",
                  "cluster.shutdown_grace_s=20"] + (
                      ["weight_sync.mooncake_protocol=tcp"] if remote else [])
        env = hosts.role_env(TOKEN)
        launch = [sys.executable, "-m", "laminar_mcore.launch"]
        logs = {n: str(tmp_path / f"{n}.log") for n in names}
        procs = [hosts.start("controller", launch + ["job=controller", *common],
                             logs["controller"], env, cwd=str(tmp_path)),
                 hosts.start("rollout0", launch + ["job=rollout", *common], logs["rollout0"],
                             env, cwd=str(tmp_path)),
                 hosts.start("rollout1", launch + ["job=rollout", *common,
                                                   f"rollout.host={hosts.addr('rollout1')}"],
                             logs["rollout1"], env, cwd=str(tmp_path))]
        if remote:
            procs.append(hosts.start("rollout2", launch + ["job=rollout", *common,
                                                           "rollout.relay=remote"],
                                     logs["rollout2"], env, cwd=str(tmp_path)))
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
    if remote:  # no relay there: every version read from the master relay's host by Mooncake
        assert "registered: no relay here" in text["rollout2"], text["rollout2"][-2000:]
    # gloo across hosts, on the interface of the route to the rendezvous
    assert "collectives on eth0" in text["trainer0"] + text["trainer1"]
    # every node's engine pulled new weights through its own host's relay
    versions = summary["engine_versions"]
    assert sorted(versions) == [f"node{i}-engine0" for i in range(3 if remote else 2)], versions
    assert all(v >= 2 for v in versions.values()), versions


def _python_on(hosts, name, code):
    out = hosts.run(name, [sys.executable, "-c", code], timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not OK, reason=WHY or "network namespaces are available")
def test_roles_advertise_their_route_to_the_controller_and_refuse_a_loopback_rendezvous(tmp_path):
    """What each role advertises, decided on a host whose names resolve to loopback."""
    with netns.Hosts(["node", "controller"], workdir=str(tmp_path)) as hosts:
        ctl, mine = hosts.addr("controller"), hosts.addr("node")
        prelude = ("from types import SimpleNamespace as N\n"
                   "from laminar_mcore.launch import cluster as c\n"
                   f"cfg = N(rollout=N(host='127.0.0.1'), cluster=N(controller_addr='{ctl}'))\n")
        # rollout.host left at loopback (or 0.0.0.0): the address of the route to the controller
        assert _python_on(hosts, "node", prelude + "print(c.advertised_host(cfg))") == mine
        assert _python_on(hosts, "node", prelude + "cfg.rollout.host = '0.0.0.0'\n"
                          "print(c.advertised_host(cfg))") == mine
        # an address given is kept; on one machine (a loopback controller) loopback stays
        assert _python_on(hosts, "node", prelude + "cfg.rollout.host = '10.9.9.9'\n"
                          "print(c.advertised_host(cfg))") == "10.9.9.9"
        assert _python_on(hosts, "node", prelude + "cfg.cluster.controller_addr = '127.0.0.1'\n"
                          "print(c.advertised_host(cfg))") == "127.0.0.1"
        # a trainer whose torchrun rendezvous host is loopback ('localhost', as torchrun sends
        # a host name that resolves to loopback): gloo on the route to the controller ...
        line = _python_on(hosts, "node", prelude + "env = {'MASTER_ADDR': 'localhost'}\n"
                          "print(c.pin_trainer_interfaces(cfg, env), env['GLOO_SOCKET_IFNAME'],"
                          " env['NCCL_SOCKET_IFNAME'])")
        assert f"collectives on eth0 ({mine}, the route to the controller {ctl})" in line
        assert line.endswith("eth0 eth0")
        # ... a user's own choice stands
        assert _python_on(hosts, "node", prelude + "env = {'MASTER_ADDR': 'localhost', "
                          "'GLOO_SOCKET_IFNAME': 'ib0', 'NCCL_SOCKET_IFNAME': 'ib0'}\n"
                          "c.pin_trainer_interfaces(cfg, env); print(env['GLOO_SOCKET_IFNAME'])"
                          ) == "ib0"
        # ... and a node other than the first cannot reach a loopback store: it stops, saying
        # which torchrun flag to pass
        refused = hosts.run("node", [sys.executable, "-c", prelude + (
            "c.check_trainer_rendezvous(cfg, {'MASTER_ADDR': 'localhost', 'GROUP_RANK': '0'})\n"
            "c.check_trainer_rendezvous(cfg, {'MASTER_ADDR': 'localhost', 'GROUP_RANK': '1'})")])
        assert refused.returncode != 0
        assert "trainer node 1 MASTER_ADDR=localhost" in refused.stderr
        assert "--local-addr" in refused.stderr


@pytest.mark.skipif(not OK, reason=WHY or "network namespaces are available")
def test_a_trainer_host_that_goes_away_stops_the_whole_run_naming_it(tmp_path):
    """Every process of one trainer host killed at once mid-run: the controller names the
    node and stops the run within half of trainer.collective_timeout_s of its silence; the
    other trainer node stops its torchrun agent; the rollout node stops. Nothing waits on."""
    import time

    names = ["controller", "rollout0", "trainer0", "trainer1"]
    timeout_s = 24
    with netns.Hosts(names, workdir=str(tmp_path)) as hosts:
        common = ["experiment=cpu_reverse", "mode=sync", "output_dir=out", "run_name=lost",
                  f"cluster.controller_addr={hosts.addr('controller')}",
                  "cluster.controller_port=8500", "cluster.rollout_nodes=1",
                  "cluster.trainer.nnodes=2", "cluster.trainer.nproc_per_node=1",
                  "cluster.threads_per_process=1", "rollout.num_engines=1",
                  "trainer.total_steps=200", f"trainer.collective_timeout_s={timeout_s}",
                  "trainer.train_batch_prompts=4", "data.num_eval=8", "data.warmup_steps=20",
                  "cluster.shutdown_grace_s=10"]
        env = hosts.role_env(TOKEN)
        launch = [sys.executable, "-m", "laminar_mcore.launch"]
        logs = {n: str(tmp_path / f"{n}.log") for n in names}
        procs = {n: hosts.start(n, launch + [job, *common], logs[n], env, cwd=str(tmp_path))
                 for n, job in (("controller", "job=controller"), ("rollout0", "job=rollout"))}
        for n in ("trainer0", "trainer1"):
            procs[n] = hosts.start(n, [sys.executable, "-m", "torch.distributed.run",
                                       "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                                       "--rdzv-endpoint=trainer0:29400", "--rdzv-id=lost",
                                       "--max-restarts=3", "-m", "laminar_mcore.launch",
                                       "job=trainer", *common], logs[n], env,
                                   cwd=str(tmp_path))
        metrics = tmp_path / "out" / "lost" / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs.values()):
            if metrics.exists() and sum('"kind": "train"' in line
                                        for line in metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert all(p.poll() is None for p in procs.values()), {
            n: open(logs[n]).read()[-2000:] for n in names}
        killed_at = time.time()
        assert hosts.kill("trainer1") > 0
        survivors = [procs[n] for n in ("controller", "rollout0", "trainer0")]
        ended = {}
        while time.time() < killed_at + timeout_s + 60 and len(ended) < len(survivors):
            for p in survivors:
                if p.pid not in ended and p.poll() is not None:
                    ended[p.pid] = time.time() - killed_at
            time.sleep(0.2)
        codes = {n: procs[n].poll() for n in ("controller", "rollout0", "trainer0")}
        text = {n: open(logs[n]).read() for n in names}
        assert None not in codes.values(), (codes, {n: text[n][-2000:] for n in names})
    print(f"trainer_host_lost: the run stopped {max(ended.values()):.1f} s after the kill "
          f"(trainer.collective_timeout_s={timeout_s})")
    assert codes["controller"] != 0 and codes["trainer0"] != 0
    assert "trainer node" in text["controller"] and "host trainer1" in text["controller"]
    assert "host trainer1" in text["trainer0"] and "stops:" in text["trainer0"]
