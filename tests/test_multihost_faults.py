"""A rollout host goes away, on separate hosts (network namespaces, laminar_mcore/testing/netns.py):
the controller, two rollout hosts (one CPU engine each; one holds the master relay, the other
chains from it) and one torchrun trainer host (``--nnodes=1``). Mid-run (once the controller has
recorded three training steps in metrics.jsonl):

* ``test_rollout_hosts_killed``: every process of the host that does not hold the master relay
  is killed at once (``Hosts.kill``); the run goes on with the other host. The host comes back
  (its ``job=rollout`` started again, as after a reboot) and rejoins. Then every process of the
  host holding the master relay is killed: the controller elects the returned host's relay, the
  trainer sends its version there, and the run ends on that host alone.
* ``test_rollout_link_down_15s``: the chained host's link is down for 15 s (``Hosts.link``),
  its processes alive but cut off (the master relay cuts its relay out of the chain), then up:
  its relay rejoins the chain, its engine is back in service on the newest version.

Each run is stopped gracefully (its STOP file) two steps after the last recovery; its books must
balance with ``trajectories_lost`` 0, every discarded trajectory counted under a reason.

Measured (printed, asserted finite, no bound; the controller's ``/engine_states`` and
``/cluster`` and the master relay's ``/chain`` are polled twice a second with curl on the
controller's host -- the test's own namespace has no route to the hosts):

* ``host_recovery_s`` (and ``master_host_recovery_s``): from the kill until the run is back to
  the service the surviving host gives -- every engine of the dead host out of service in the
  controller (its trajectories resumed on engines of their version or discarded with a
  reason), and an engine of the surviving host in service on a weight version newer than the
  newest the run had at the kill (so the trainer's publish, the master relay -- a newly
  elected one when the master's host died -- and the surviving host's pulls work again);
* ``rejoin_s``: from starting the killed host's rollout node again until its engine is in
  service on at least the newest version the run had then;
* ``link_recovery_s``: from the link coming back until the host is back in service -- its relay
  in the master relay's chain again, and each of its engines in service in the controller, on
  at least the newest version the run had when the link came back, with trajectories in
  flight.

The rest are the mechanisms alone, without processes: the controller's watch of engines whose
host went away, ending the streams of a lost engine, and a lease release sent again.
"""

import json
import math
import os
import sys
import time

import pytest

from laminar_mcore.testing import netns

OK, WHY = netns.available()


def on_hosts(test):
    """A test on network-namespace hosts: several processes, tens of seconds; skipped, saying
    why, where namespaces cannot be made."""
    marks = [pytest.mark.multiprocess, pytest.mark.slow,
             pytest.mark.skipif(not OK, reason=WHY or "network namespaces are available")]
    for mark in marks:
        test = mark(test)
    return test


TOKEN = "multihost-faults-token-0123456789"
NAMES = ["controller", "rollout0", "rollout1", "trainer0"]
PORT = 8500


class Cluster:
    """One run on the hosts: its processes, its metrics and the controller's API (curl on the
    controller's host: the test's own namespace has no route to the hosts)."""

    def __init__(self, hosts, tmp_path, run, extra=()):
        self.hosts, self.tmp, self.run = hosts, tmp_path, run
        self.out = tmp_path / "out" / run
        self.ctl = hosts.addr("controller")
        self.common = ["experiment=cpu_reverse", "output_dir=out", f"run_name={run}",
                       f"cluster.controller_addr={self.ctl}", f"cluster.controller_port={PORT}",
                       "cluster.rollout_nodes=2", "cluster.trainer.nnodes=1",
                       "cluster.trainer.nproc_per_node=1", "cluster.threads_per_process=1",
                       "rollout.num_engines=1", "trainer.total_steps=100000",
                       "trainer.train_batch_prompts=4", "trainer.eval_interval=0",
                       "data.num_eval=8", "data.warmup_steps=20", *extra]
        self.env = hosts.role_env(TOKEN)
        self.logs = {n: str(tmp_path / f"{run}-{n}.log") for n in NAMES}
        self.procs = {}
        self.gone: set = set()  # hosts whose processes were killed

    def start(self) -> None:
        launch = [sys.executable, "-m", "laminar_mcore.launch"]
        self._start("controller", launch + ["job=controller", *self.common])
        for n in ("rollout0", "rollout1"):
            self._start(n, launch + ["job=rollout", *self.common])
        self._start("trainer0", [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                                 "--nproc-per-node=1", "--rdzv-backend=c10d",
                                 "--rdzv-endpoint=trainer0:29400", f"--rdzv-id={self.run}",
                                 "-m", "laminar_mcore.launch", "job=trainer", *self.common])

    def _start(self, name, args) -> None:
        self.procs[name] = self.hosts.start(name, args, self.logs[name], self.env,
                                            cwd=str(self.tmp))

    def tails(self, n: int = 3000) -> dict:
        return {k: open(v).read()[-n:] for k, v in self.logs.items() if os.path.exists(v)}

    def get(self, url: str):
        """GET ``url`` (a controller or relay path) from the controller's host; None when it
        does not answer."""
        out = self.hosts.run("controller", ["curl", "-sf", "-m", "3", "-H",
                                            f"Authorization: Bearer {TOKEN}", url], timeout=10)
        try:
            return json.loads(out.stdout) if out.returncode == 0 else None
        except ValueError:
            return None

    def api(self, path: str):
        return self.get(f"http://{self.ctl}:{PORT}{path}")

    def records(self, kind: str) -> list:
        path = self.out / "metrics.jsonl"
        found = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("kind") == kind:
                    found.append(r)
        return found

    def steps(self) -> int:
        return max((r["step"] for r in self.records("train")), default=0)

    def wait_until(self, what: str, ready, timeout: float, poll: float = 0.5):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0) and name not in self.gone:
                    raise AssertionError(f"{name} exited with {proc.poll()} while waiting for "
                                         f"{what}: {self.tails()}")
            value = ready()
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"{what}: not within {timeout:.0f} s: {self.tails()}")

    def wait_steps(self, n: int, timeout: float) -> int:
        return self.wait_until(f"training step {n}", lambda: self.steps() >= n and self.steps(),
                               timeout)

    def master_host(self) -> str:
        """The rollout host whose relay is the master (the controller's /cluster)."""
        info = self.wait_until("the master relay", lambda: (self.api("/cluster") or {}).get(
            "master_relay"), 60)
        return next(n for n in ("rollout0", "rollout1")
                    if f"//{self.hosts.addr(n)}:" in info["url"])

    def engines_of(self, states: dict, host: str) -> dict:
        return {u: s for u, s in states.items() if f"//{self.hosts.addr(host)}:" in u}

    def newest_version(self) -> int:
        return int(self.wait_until("the controller's /cluster",
                                   lambda: self.api("/cluster"), 30)["trainer_version"])

    def stop_and_check(self, timeout: float = 180.0) -> dict:
        """Stop the run gracefully (its STOP file), wait for every process still running; the
        summary, checked: the books balance, nothing lost, every discard with a reason."""
        (self.out / "STOP").touch()
        procs = [p for n, p in self.procs.items() if n not in self.gone]
        codes = self.hosts.wait(procs, timeout=timeout)
        assert codes == [0] * len(procs), (codes, self.tails())
        summary = json.loads((self.out / "summary.json").read_text())
        assert summary["books_balance"], summary
        lost = summary["trajectories_generated"] - (summary["trajectories_consumed"]
                                                     + summary["trajectories_buffered"]
                                                     + summary["trajectories_discarded"])
        assert lost == 0 and summary["trajectories_lost"] == 0, summary
        reasons = summary["discarded_reasons"]
        assert sum(reasons.values()) == summary["trajectories_discarded"], summary
        assert all(isinstance(k, str) and k for k in reasons), reasons
        return summary


def _recovered(c, victim: str, survivor: str, before: int):
    """host_recovery_s's condition (see the module docstring), or None."""
    states = (c.api("/engine_states") or {}).get("engines", {})
    dead, alive = c.engines_of(states, victim), c.engines_of(states, survivor)
    return (dead and alive and not any(s["healthy"] for s in dead.values())
            and any(s["healthy"] and s["version"] > before for s in alive.values())
            and time.time())


def _kill(c, victim: str, survivor: str) -> float:
    """Kill every process of ``victim`` at once; host_recovery_s."""
    before = c.newest_version()
    t_kill = time.time()
    assert c.hosts.kill(victim) > 0
    c.gone.add(victim)
    t_back = c.wait_until(f"the run back in service after {victim} died",
                          lambda: _recovered(c, victim, survivor, before), 240)
    return t_back - t_kill


@on_hosts
def test_rollout_hosts_killed(tmp_path):
    """Mid-run the rollout host without the master relay is killed (every process at once);
    the run goes on with the other. The host comes back (its ``job=rollout`` started again, as
    after a reboot) and rejoins: a new node, its relay at the end of the chain, its engine in
    service on the newest version. Then the host holding the master relay is killed: the
    controller elects the returned host's relay, the trainer publishes there, and the run goes
    on to its end on that host alone."""
    with netns.Hosts(NAMES, workdir=str(tmp_path)) as hosts:
        c = Cluster(hosts, tmp_path, "killed", ["cluster.shutdown_grace_s=5"])
        c.start()
        c.wait_steps(3, timeout=240)
        master = c.master_host()
        chained = ({"rollout0", "rollout1"} - {master}).pop()
        host_recovery_s = _kill(c, chained, master)

        # the host comes back: its rollout node starts again and rejoins
        c.gone.discard(chained)
        c.logs[chained] = str(tmp_path / f"killed-{chained}-again.log")
        t_start = time.time()
        c._start(chained, [sys.executable, "-m", "laminar_mcore.launch", "job=rollout",
                           *c.common])
        newest = c.newest_version()

        def rejoined():
            states = (c.api("/engine_states") or {}).get("engines", {})
            back = [s for s in c.engines_of(states, chained).values() if s["healthy"]]
            return back and all(s["version"] >= newest for s in back) and time.time()
        rejoin_s = c.wait_until(f"{chained} back in the run", rejoined, 180) - t_start

        def found_lost():  # no supervisor reported the first one: the controller found it
            states = (c.api("/engine_states") or {}).get("engines", {})
            return [s["lost"] for s in c.engines_of(states, chained).values() if s["lost"]]
        assert all("its host is gone" in why for why in c.wait_until(
            f"{chained}'s first engine found lost", found_lost, 60))

        master_recovery_s = _kill(c, master, chained)
        c.wait_steps(c.steps() + 2, timeout=120)
        summary = c.stop_and_check()
    print(f"\nhost_recovery_s={host_recovery_s:.2f} (the chained relay's host killed); "
          f"rejoin_s={rejoin_s:.2f} (its rollout node started again -> its engine in service); "
          f"master_host_recovery_s={master_recovery_s:.2f} (the master relay's host killed); "
          f"steps {summary['steps']}, discarded {summary['discarded_reasons']}, lost engines "
          f"{sorted(summary['lost_engines'])}, relay failovers {summary['relay_failovers']}")
    assert math.isfinite(host_recovery_s) and math.isfinite(master_recovery_s)
    assert summary["relay_failovers"] >= 1, summary
    assert len(summary["lost_engines"]) >= 1, summary
    # the run ended on the host that came back (node 2): its engine holds the final version
    assert summary["final_engine_versions"] == {"node2-engine0": summary["final_version"]}, \
        summary


@on_hosts
def test_rollout_link_down_15s(tmp_path):
    """The chained host's link is down for 15 s, then up. Its processes live on cut off: the
    master relay cuts its relay out of the chain, the node waits for its controller, the
    controller's streams to its engine stall. When the link is back the relay registers again,
    is caught up, and the engine -- the same process, not restarted -- drains and pulls."""
    with netns.Hosts(NAMES, workdir=str(tmp_path)) as hosts:
        c = Cluster(hosts, tmp_path, "link")
        c.start()
        c.wait_steps(3, timeout=240)
        master = c.master_host()
        victim = ({"rollout0", "rollout1"} - {master}).pop()
        hosts.link(victim, up=False)
        t_down = time.time()
        time.sleep(15.0)
        hosts.link(victim, up=True)
        t_up = time.time()
        before = c.newest_version()
        master_url = c.api("/cluster")["master_relay"]["url"]

        def back():
            states = c.engines_of((c.api("/engine_states") or {}).get("engines", {}), victim)
            chain = c.get(master_url + "/chain") or {}
            relays = [r for r in chain.get("chain", [])]
            rejoined = any(victim in r for r in relays[1:])
            return (states and rejoined
                    and all(s["healthy"] and s["version"] >= before and s["in_flight"] > 0
                            for s in states.values()) and time.time())

        t_back = c.wait_until(f"{victim} back in service after its link came back", back, 180)
        link_recovery_s = t_back - t_up
        c.wait_steps(c.steps() + 2, timeout=120)
        summary = c.stop_and_check()
    print(f"\nlink_recovery_s={link_recovery_s:.2f} (link of {victim} down "
          f"{t_up - t_down:.1f} s; steps {summary['steps']}, discarded "
          f"{summary['discarded_reasons']}, max staleness {summary['max_staleness_observed']})")
    assert math.isfinite(link_recovery_s)
    # the host came back with its processes: nothing restarted, nothing found lost
    assert summary["engine_restarts"] == 0 and not summary["lost_engines"], summary
    node = open(c.logs[victim]).read()
    assert "the controller does not answer" in node and "answers again" in node, node[-2000:]
    relay_logs = [os.path.join(d, f) for d, _, files in os.walk(c.out / "logs") for f in files
                  if f.startswith(f"relay-{victim}")]
    assert any("had cut this relay out of its chain" in open(f).read() for f in relay_logs)


# ---------------------------------------------------------------------- the mechanisms, alone
def test_an_engine_is_lost_only_when_no_supervisor_speaks_for_it():
    """The controller's watch of engines (``_watch_engines``): refused for longer than a living
    supervisor needs to report it, or silent for 2 x rollout.engine_heartbeat_timeout_s, and
    the engine is lost (out of service, streams ended, a fault recorded); an answer, a restart
    reported by its supervisor or a new process (epoch) starts the count again."""
    from types import SimpleNamespace

    from laminar_mcore.controller.cluster import ClusterAPI

    lost, faults = [], []

    def engine(name):
        return SimpleNamespace(name=name, epoch=0, restarting=False, evicted=None, lost=None,
                               client=SimpleNamespace(base_url=f"http://127.0.0.1:1/{name}"))

    def engine_lost(e, reason):
        e.lost = reason
        lost.append(e.name)
        return 3

    api = ClusterAPI()
    api._fault = lambda kind, what, **info: faults.append((kind, what, info))
    gone, silent, back, restarted = (engine(n) for n in ("gone", "silent", "back", "restarted"))
    api.manager = SimpleNamespace(engine_lost=engine_lost,
                                  engines=[gone, silent, back, restarted])
    down: dict = {}

    def round_(now, **states):
        pairs = [(e, states[e.name]) for e in (gone, silent, back, restarted) if e.name in states]
        api._check_engines(down, pairs, gone_s=9.0, silent_s=120.0, now=now)

    round_(0.0, gone="gone", silent="silent", back="gone", restarted="gone")
    round_(5.0, gone="gone", silent="silent", back="alive", restarted="gone")
    restarted.epoch += 1  # its supervisor restarted it: the new process is counted afresh
    round_(10.0, gone="gone", silent="silent", back="gone", restarted="gone")
    assert lost == ["gone"] and "nothing has listened on its port for 10 s" in gone.lost
    assert faults[0][:2] == ("engine", "lost") and faults[0][2]["streams_ended"] == 3
    round_(60.0, silent="gone", back="gone", restarted="gone")  # gone after silent: silent
    assert lost == ["gone", "back", "restarted"]
    round_(119.0, silent="silent")
    assert "silent" not in lost
    round_(121.0, silent="silent")
    assert lost[-1] == "silent" and "has not answered for 121 s" in silent.lost
    # all four of that host lost: the host is (loopback: no relay is asked to release leases)
    assert [f[:2] for f in faults].count(("host", "lost")) == 1 and faults[-1][:2] == (
        "host", "lost") and faults[-1][2]["engines"] == "gone,silent,back,restarted"


def test_streams_of_a_lost_engine_end_at_once():
    """``SGLangClient.break_streams``: a stream from a host that went silent would wait forever
    (streams have no read timeout, and closing the session does not wake the reader); broken,
    its reader gets an EngineError at once and the trajectory moves on."""
    import asyncio

    from aiohttp import web

    from laminar_mcore.netutil import EngineError
    from laminar_mcore.rollout.client import SGLangClient

    async def slow(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = {"output_ids": [5], "meta_info": {"completion_tokens": 1,
                                                  "output_token_logprobs": [[-0.1, 5, None]]}}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await silence.wait()  # then silence, as from a host whose link is down
        return resp

    silence = None

    async def main():
        nonlocal silence
        silence = asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = SGLangClient(f"http://127.0.0.1:{port}", incremental_stream=True)
        got = []

        async def read():
            async for chunk in client.stream_tokens([1, 2], {"max_new_tokens": 4}):
                got.append(chunk.new_ids)

        task = asyncio.create_task(read())
        while not got:
            await asyncio.sleep(0.05)
        assert client.break_streams("engine e lost: its host is gone") == 1
        # the server stays silent until the end: only break_streams can end the stream
        with pytest.raises(EngineError, match="its host is gone"):
            await asyncio.wait_for(task, 60)
        assert got == [[5]]
        assert client.break_streams("again") == 0
        silence.set()
        await client.close()
        await runner.cleanup()

    asyncio.run(main())


def test_a_release_the_relay_missed_is_sent_again():
    """``RelayClient.release`` when the relay cannot be reached (its host's link down): no
    error for the pull, which applied its version; the release is sent again until the relay
    answers, so the lease does not hold the version's buffers for the relay's 600 s TTL."""
    import asyncio
    import socket

    from aiohttp import web

    from laminar_mcore.relay.client import Lease, RelayClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    released = []

    async def release(request):
        released.append((await request.json())["lease_id"])
        return web.json_response({"released": True})

    async def main():
        client = RelayClient(f"http://127.0.0.1:{port}", "token-0123456789", timeout_s=2)
        lease = Lease(version=3, lease_id="lease-a", num_buckets=1, nbytes=8)
        assert await client.release(lease) is False  # nothing listens yet: later
        app = web.Application()
        app.router.add_post("/release", release)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()  # the relay is reachable again
        deadline = time.monotonic() + 10
        while not client.last_release and time.monotonic() < deadline:  # the answer, not just
            await asyncio.sleep(0.1)  # the relay's side: it is set after the reply is read
        assert released == ["lease-a"] and client.last_release == {"released": True}
        assert await client.release(Lease(3, "lease-b", 1, 8)) is True
        await client.close()
        await runner.cleanup()

    asyncio.run(main())
