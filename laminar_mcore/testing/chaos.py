"""Kill -9 the roles of a running ``job=train`` at chosen training steps and watch it recover.

``ChaosRun`` starts the single-machine train job as a subprocess (its own session), follows its
``metrics.jsonl`` and, at each planned step, kills one process of a kind:

* ``engine``: an engine server (a ``laminar_mcore.rollout.cpu_engine`` process);
* ``relay``: a relay that is not the master (needs ``cluster.rollout_nodes`` >= 2);
* ``master_relay``: the relay the trainers publish to (its ``/health``, asked with the run
  token from the relay's environment, says ``master``);
* ``trainer``: a trainer rank (it names itself ``laminar-trainer``: ``procname.py``);
* ``engine_hang``: an engine stopped with SIGSTOP (alive, but it answers nothing: its
  supervisor's ``/health_generate`` heartbeat must find it).

After each kill it waits for the controller's ``fault`` record that says the role is back
(``engine`` serving again, ``relay`` restarted, ``master_relay`` elected or restarted, ``trainer``
resumed) before the next one, and reports when each happened. The chaos test and
``bench.faults`` use it; nothing here is a stand-in for a component.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from ..netutil import TOKEN_ENV
from ..procname import TRAINER, process_name

KINDS = ("engine", "relay", "master_relay", "trainer")
# the controller's ``fault`` record that says a kind has recovered
# A relay process younger than this is not chosen: after the master relay's kill, its node's
# supervisor restarts the relay while the election has already counted as the recovery, and a
# kill in those seconds would hit a relay that has not finished starting (restart_failed).
MIN_RELAY_AGE_S = 8.0
RECOVERED = {"engine": ("engine", "serving"), "engine_hang": ("engine", "serving"),
             "relay": ("relay", "restarted"),
             "master_relay": ("master_relay", ("elected", "restarted")),
             "trainer": ("trainer", "resumed")}


def _engines_down(records: List[dict]) -> List[str]:
    """The engines whose last ``down`` / ``serving`` / ``evicted`` fault record is ``down``
    (an evicted engine is not coming back: nothing waits for it)."""
    last: dict = {}
    for r in records:
        if r.get("kind") == "fault" and r.get("fault") == "engine" and \
                r.get("event") in ("down", "serving", "evicted"):
            last[r.get("engine")] = r["event"]
    return [e for e, event in last.items() if event == "down"]


@dataclass
class Kill:
    kind: str
    at_step: int = 0
    at_time_s: Optional[float] = None  # or: seconds after the first training step
    pid: Optional[int] = None
    time: Optional[float] = None
    recovered_at: Optional[float] = None
    # a relay: when the master relay's chain no longer held it (the chain rebuilt around it)
    chain_rebuilt_at: Optional[float] = None

    @property
    def chain_rebuild_s(self) -> Optional[float]:
        if self.time is None or self.chain_rebuilt_at is None:
            return None
        return self.chain_rebuilt_at - self.time

    @property
    def recovery_s(self) -> Optional[float]:
        if self.time is None or self.recovered_at is None:
            return None
        return self.recovered_at - self.time


@dataclass
class ChaosResult:
    returncode: int
    kills: List[Kill]
    summary: Optional[dict]
    records: List[dict]
    output: str
    leftover_processes: List[str] = field(default_factory=list)
    leftover_segments: List[str] = field(default_factory=list)


def _records(path: Path) -> List[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _descendants(pid: int) -> List[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _relay_token(p: psutil.Process) -> str:
    """The run token of a relay process: its environment (a relay is started with it there,
    never on its command line); the relay's details need it."""
    try:
        return p.environ().get(TOKEN_ENV, "")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _relay_health(p: psutil.Process) -> Optional[dict]:
    """Ask each port the relay listens on for /health, with the relay's token (the control
    port answers; with the token it says whether it is the master)."""
    try:
        conns = p.net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    token = _relay_token(p)
    for c in conns:
        if c.status != psutil.CONN_LISTEN:
            continue
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{c.laddr.port}/health",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=1.0) as resp:
                health = json.loads(resp.read())
            if "relay_id" in health:  # the control port, and the token was right
                p.laminar_token = token
                return health
        except (OSError, ValueError, http.client.HTTPException):  # a port that is not HTTP
            continue
    return None


def _age_s(p: psutil.Process) -> float:
    try:
        return time.time() - p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0.0


def find_victim(root_pid: int, kind: str, rng,
                stripe: Optional[list] = None) -> Optional[psutil.Process]:
    """A live process of ``kind`` under ``root_pid`` (chosen with ``rng`` among several); a
    relay of ``stripe`` only (``[S, N]``, a striped tier's), when given."""
    candidates = []
    for p in _descendants(root_pid):
        cmd = _cmdline(p)
        if kind in ("engine", "engine_hang") and "laminar_mcore.rollout.cpu_engine" in cmd:
            candidates.append(p)
        elif kind in ("relay", "master_relay") and "-m laminar_mcore.relay" in cmd:
            if _age_s(p) < MIN_RELAY_AGE_S:
                continue  # still being (re)started by its supervisor: not yet a relay to kill
            health = _relay_health(p)
            if health is not None and bool(health.get("master")) == (kind == "master_relay") \
                    and (stripe is None or health.get("stripe", [0, 1]) == stripe):
                p.laminar_health = health
                candidates.append(p)
        elif kind == "trainer" and process_name(p.pid) == TRAINER:
            candidates.append(p)
    return rng.choice(candidates) if candidates else None


def plan(seed: int, kinds: Sequence[str] = KINDS, first_step: int = 2,
         spacing: int = 2) -> List[Kill]:
    """The kinds in a seeded order: the first at step ``first_step``, each next one ``spacing``
    training steps after the previous fault has recovered (``Kill.at_step`` is relative to
    that)."""
    import random

    order = list(kinds)
    random.Random(seed).shuffle(order)
    return [Kill(kind, first_step if i == 0 else spacing) for i, kind in enumerate(order)]


class ChaosRun:
    def __init__(self, workdir: Path, overrides: Sequence[str], kills: List[Kill], *,
                 seed: int = 0, run_name: str = "chaos", recovery_timeout_s: float = 240.0,
                 stop_after_s: Optional[float] = None, log=print):
        """``stop_after_s``: once every kill has recovered and this long has passed since
        the last one, stop the run gracefully (its STOP file; the summary is written)."""
        self.stop_after_s = stop_after_s
        self.workdir = Path(workdir)
        self.overrides = list(overrides)
        self.kills = kills
        self.seed = seed
        self.run_name = run_name
        self.recovery_timeout_s = recovery_timeout_s
        self.log = log
        self.out_dir = self.workdir / "out" / run_name

    def run(self, timeout_s: float = 900.0) -> ChaosResult:
        import random

        rng = random.Random(self.seed)
        metrics = self.out_dir / "metrics.jsonl"
        if metrics.exists():
            metrics.unlink()
        cmd = [sys.executable, "-m", "laminar_mcore.launch", "job=train", "output_dir=out",
               f"run_name={self.run_name}", *self.overrides]
        out_path = self.workdir / f"{self.run_name}.log"
        segments_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env=dict(os.environ, PYTHONWARNINGS="ignore"))
        pending = list(self.kills)
        deadline = time.time() + timeout_s
        descendants: Dict[int, str] = {}
        base_step = 0  # the step at which the previous fault had recovered
        try:
            while proc.poll() is None and time.time() < deadline:
                for p in _descendants(proc.pid):
                    descendants.setdefault(p.pid, _cmdline(p)[:120])
                records = _records(metrics)
                steps = [r["step"] for r in records if r.get("kind") == "train"]
                step = max(steps, default=0)
                current = next((k for k in self.kills if k.time is not None
                                and k.recovered_at is None), None)
                if current is not None:
                    self._check_recovered(current, records)
                    if current.recovered_at is not None:
                        base_step = step
                        self.log(f"[chaos] step {step}: {current.kind} recovered after "
                                 f"{current.recovery_s:.2f} s")
                    if current.recovered_at is None and \
                            time.time() - current.time > self.recovery_timeout_s:
                        self.log(f"[chaos] {current.kind} did not recover within "
                                 f"{self.recovery_timeout_s:.0f} s")
                        break
                elif pending and self._due(pending[0], step, base_step, records):
                    kill = pending[0]
                    victim = find_victim(proc.pid, kill.kind, rng)
                    if victim is not None:
                        watcher = self._chain_watcher(proc.pid, kill, victim, rng)
                        kill.pid, kill.time = victim.pid, time.time()
                        victim.send_signal(signal.SIGSTOP if kill.kind == "engine_hang"
                                           else signal.SIGKILL)
                        if watcher is not None:
                            watcher.start()
                        pending.pop(0)
                        how = "kill -STOP" if kill.kind == "engine_hang" else "kill -9"
                        self.log(f"[chaos] step {step}: {how} {kill.kind} (pid {victim.pid})")
                elif not pending and self.stop_after_s is not None and self.kills and \
                        time.time() > self.kills[-1].time + self.stop_after_s:
                    (self.out_dir / "STOP").touch()
                time.sleep(0.2)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        time.sleep(1.0)
        leftover = [f"{pid} {cmd}" for pid, cmd in descendants.items() if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        segments_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        # segments of this run's processes (their names carry the owner's pid); other runs on
        # the machine may create their own meanwhile
        pids = {str(pid) for pid in descendants}
        new_segments = sorted(n for n in segments_after - segments_before
                              if n.startswith("laminar-") and any(
                                  f"-{pid}-" in n for pid in pids))
        summary_path = self.out_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        return ChaosResult(proc.returncode, self.kills, summary, _records(metrics),
                           out_path.read_text(), leftover, new_segments)

    @staticmethod
    def _due(kill: Kill, step: int, base_step: int, records: List[dict]) -> bool:
        if kill.at_time_s is not None:
            first = next((r["time"] for r in records if r.get("kind") == "train"), None)
            return first is not None and time.time() - first >= kill.at_time_s
        # and no engine is still down from the previous fault's side effects (the master
        # relay's kill once took an engine out of service with its failed pull; hanging that
        # same engine next left its heartbeat nothing to find: test_faults seed 413)
        return step >= base_step + kill.at_step and not _engines_down(records)

    @staticmethod
    def _chain_watcher(root_pid: int, kill: Kill, victim, rng):
        """For a relay that is not the master: a thread that notes when the master's chain
        no longer holds it."""
        import threading

        if kill.kind != "relay":
            return None
        health = getattr(victim, "laminar_health", None)
        if health is None:
            return None
        # the master of the victim's stripe (a striped tier's other masters never chain it)
        master = find_victim(root_pid, "master_relay", rng, stripe=health.get("stripe"))
        if master is None:
            return None
        url = master.laminar_health["control_url"]
        chain_request = urllib.request.Request(url + "/chain", headers={
            "Authorization": f"Bearer {getattr(master, 'laminar_token', '')}"})

        def watch():
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    with urllib.request.urlopen(chain_request, timeout=1.0) as resp:
                        chain = json.loads(resp.read())["chain"]
                    if health["relay_id"] not in chain:
                        kill.chain_rebuilt_at = time.time()
                        return
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.02)

        return threading.Thread(target=watch, daemon=True)

    @staticmethod
    def _check_recovered(kill: Kill, records: List[dict]) -> None:
        """An engine has recovered when *it* serves again: the first engine taken down after
        the kill (the victim: killed, or hung until its heartbeat finds it) and then serving.
        Another engine's ``serving`` (one restarted earlier, just back) is not it -- taking it
        for the hung engine's once ended a run while the hung engine still held requests."""
        kind, events = RECOVERED[kill.kind]
        events = events if isinstance(events, tuple) else (events,)
        victim, since = None, kill.time
        if kind == "engine":
            down = next((r for r in records if r.get("kind") == "fault" and r.get("fault") ==
                         "engine" and r.get("event") == "down" and r.get("time", 0) >= kill.time),
                        None)
            if down is None:
                return
            victim, since = down.get("engine"), down["time"]
        for r in records:
            if r.get("kind") == "fault" and r.get("fault") == kind and r.get("event") in events \
                    and r.get("time", 0) >= since and victim in (None, r.get("engine")):
                kill.recovered_at = r["time"]
                return
