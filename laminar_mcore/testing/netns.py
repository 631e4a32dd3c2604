"""Separate hosts on one machine, for tests of the multi-node roles: each host is a Linux network
namespace with its own addresses and loopback, wired to the others through a bridge, and every
process started on it gets a private ``/dev/shm`` (a fresh tmpfs in its own mount namespace), so
nothing can cross between hosts except over the network.

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
        probe = subprocess.run(["ip", "netns", "exec", name, "unshare", "-m", "--propagation",
                                "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return False, f"a private /dev/shm cannot be mounted: {probe.stderr.strip()}"
        return True, ""
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class Hosts:
    """Hosts named ``names`` on one /24 (a random 10.77.x.0 unless ``subnet`` is given)."""

    def __init__(self, names: List[str], *, subnet: Optional[str] = None, shm_mb: int = 2048):
        self.tag = f"lm{os.getpid() % 100000}{random.randrange(1000):03d}"
        self.subnet = subnet or f"10.77.{random.randrange(1, 255)}"
        self.shm_mb = int(shm_mb)
        self.switch = f"{self.tag}-sw"
        self.hosts: Dict[str, Tuple[str, str, str]] = {}  # name -> (namespace, address, port)
        self.procs: List[subprocess.Popen] = []
        self._names = list(names)
        self._made: List[str] = []

    # ------------------------------------------------------------------ set-up and teardown
    def __enter__(self) -> "Hosts":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    # ------------------------------------------------------------------ use
    def addr(self, name: str) -> str:
        return self.hosts[name][1]

    def start(self, name: str, args: List[str], log_path: str, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> subprocess.Popen:
        """``args`` on host ``name``, in a new process group, with a private ``/dev/shm``."""
        ns = self.hosts[name][0]
        cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh",
               "-c", f'mount -t tmpfs -o size={self.shm_mb}m tmpfs /dev/shm && exec "$@"', "sh",
               *args]
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=cwd, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

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
