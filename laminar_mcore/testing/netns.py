"""Separate hosts on one machine, for tests of the multi-node roles: each host is a Linux network
namespace with its own addresses and loopback, wired to the others through a bridge, and every
process started on it gets a private ``/dev/shm`` (a fresh tmpfs in its own mount namespace), so
nothing can cross between hosts except over the network. Each host also has its own host name
(a UTS namespace) and ``/etc/hosts`` as Debian and Ubuntu write it: its own name on
``127.0.1.1``, the other hosts' names on their addresses (what a cluster's DNS would answer), so
a role that trusts its host name to be reachable fails here as it would on such a cluster.

    with Hosts(["controller", "rollout0", "trainer0"]) as hosts:
        hosts.addr("controller")                     # e.g. 10.77.143.2
        proc = hosts.start("rollout0", [sys.executable, "-m", ...], log_path, env)
        hosts.link("rollout0", up=False)             # the host's cable pulled ...
        hosts.link("rollout0", up=True)              # ... and plugged back

Layout: a "switch" namespace holds the bridge; each host namespace holds ``eth0`` (its end of
a veth pair, the other end on the bridge) and ``lo``. Nothing is created in the machine's own
network namespace, so the machine's interfaces, routes and firewall are never touched; traffic
stays on the namespaces. ``close()`` (also on ``__exit__``, whatever happened) kills every
process group it started and deletes every namespace it made, which removes the bridge and
the links with them. Needs root (``ip netns``, ``unshare -m``): ``available()`` says whether
this machine permits it, and why not.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


def available() -> Tuple[bool, str]:
    """(True, "") where network namespaces and private mounts can be made here, else (False,
    why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (ip netns)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not installed"
    name = f"lmprobe{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                              timeout=30)
        if made.returncode != 0:
            return False, f"ip netns add is not permitted: {made.stderr.strip()}"
        probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "-m", "-u",
                                "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
                                "mount --bind /dev/null /etc/hosts && hostname probe"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return False, ("a private /dev/shm, /etc/hosts or host name cannot be made: "
                           f"{probe.stderr.strip()}")
        return True, ""
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def hosts_or_loopback(loopback: bool, who: str, instead: str) -> bool:
    """Whether a benchmark runs its roles as separate hosts: not with ``--loopback``, nor where
    namespaces cannot be made here (then it says why and what runs ``instead``)."""
    if loopback:
        return False
    ok, why = available()
    if not ok:
        print(f"[{who}] separate hosts unavailable ({why}): {instead}", flush=True)
    return ok


class Hosts:
    """Hosts named ``names`` on one /24 (a random 10.77.x.0 unless ``subnet`` is given)."""

    def __init__(self, names: List[str], *, subnet: Optional[str] = None, shm_mb: int = 2048,
                 workdir: Optional[str] = None):
        self.tag = f"lm{os.getpid() % 100000}{random.randrange(1000):03d}"
        self.subnet = subnet or f"10.77.{random.randrange(1, 255)}"
        self.shm_mb = int(shm_mb)
        self.switch = f"{self.tag}-sw"
        self.hosts: Dict[str, Tuple[str, str, str]] = {}  # name -> (namespace, address, port)
        self.procs: List[subprocess.Popen] = []
        self._names = list(names)
        self._made: List[str] = []
        self._workdir = workdir
        self._tmp: Optional[str] = None

    # ------------------------------------------------------------------ set-up and teardown
    def __enter__(self) -> "Hosts":
        # a SIGTERM (pytest killed by a time-out) still runs close(): no namespace outlives us
        self._old_term = None
        if threading.current_thread() is threading.main_thread():
            def _term(signum, frame):
                raise SystemExit(f"terminated by signal {signum}")

            self._old_term = signal.signal(signal.SIGTERM, _term)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)

    def _add_ns(self, ns: str) -> None:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
        self._made.append(ns)
        _ip("link", "set", "lo", "up", ns=ns)

    def _build(self) -> None:
        self._add_ns(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self._names):
            ns, port, addr = f"{self.tag}-{i}", f"p{i}", f"{self.subnet}.{i + 2}"
            self._add_ns(ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns,
                ns=self.switch)
            _ip("link", "set", port, "master", "br0", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            self.hosts[name] = (ns, addr, port)
        import tempfile

        self._tmp = tempfile.mkdtemp(prefix=f"{self.tag}-etc-", dir=self._workdir)
        for name in self._names:
            lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{name}", "::1\tlocalhost ip6-localhost"]
            lines += [f"{a}\t{n}" for n, (_, a, _) in self.hosts.items() if n != name]
            with open(self._hosts_file(name), "w") as fh:
                fh.write("\n".join(lines) + "\n")

    def _hosts_file(self, name: str) -> str:
        return os.path.join(self._tmp, f"hosts.{name}")

    def close(self) -> None:
        """Kill every process started here (their whole groups), then delete the namespaces."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            # a namespace with processes still in it outlives its name: kill them first
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                  timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------------ use
    def limit_ingress(self, gbit: float) -> None:
        """Rate-limit the link into every host (the bridge's port to it) to ``gbit`` with
        ``tc ... tbf`` (netem does not work here)."""
        for _ns, _addr, port in self.hosts.values():
            subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port,
                            "root", "tbf", "rate", f"{gbit:g}gbit", "burst", "4mb", "latency",
                            "400ms"], check=True, capture_output=True, timeout=30)

    def addr(self, name: str) -> str:
        return self.hosts[name][1]

    def start(self, name: str, args: List[str], log_path: str, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        """``args`` on host ``name``, in a new process group, with a private ``/dev/shm``, its
        own host name and ``/etc/hosts``."""
        ns = self.hosts[name][0]
        setup = (f"mount -t tmpfs -o size={self.shm_mb}m tmpfs /dev/shm && "
                 f"mount --bind {self._hosts_file(name)} /etc/hosts && hostname {name} && "
                 'exec "$@"')
        cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "-u", "--propagation", "private",
               "sh", "-c", setup, "sh", *args]
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=cwd, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    @staticmethod
    def role_env(token: str) -> dict:
        """The environment for a role started on these hosts: this process's, with the run
        token and one OpenMP thread, without the machine's own choices of gloo/NCCL interface
        or torchrun rendezvous (each host decides those for itself)."""
        env = dict(os.environ, PYTHONWARNINGS="ignore", LAMINAR_RUN_TOKEN=token,
                   OMP_NUM_THREADS="1")
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        return env

    def run(self, name: str, args: List[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """A short command on host ``name`` (its network namespace), output captured."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[name][0], *args],
                              capture_output=True, text=True, timeout=timeout)

    def link(self, name: str, up: bool) -> None:
        """Take host ``name``'s link to the bridge down (its processes live on, cut off) or up."""
        _ip("link", "set", self.hosts[name][2], "up" if up else "down", ns=self.switch)

    def kill(self, name: str) -> int:
        """Every process of host ``name`` killed at once (a host going away); how many."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts[name][0]], capture_output=True,
                              text=True, timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        return len(pids)

    def wait(self, procs: List[subprocess.Popen], timeout: float) -> List[Optional[int]]:
        """Until every one of ``procs`` exited, one failed, or ``timeout`` s: their codes."""
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(1.0)
        return [p.poll() for p in procs]
