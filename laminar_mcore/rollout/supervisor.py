"""A rollout node's supervisor: its relay (one per stripe) and engines, kept alive.

Laminar isolates failures: a rollout machine that loses an engine or its relay recovers on its
own while the trainer and the other machines go on. ``NodeSupervisor`` starts this node's relay
(the master, which trainers publish to, or one that chains from it: the controller says which
in ``/relay_role``) and ``rollout.num_engines`` engines, registers them with the controller and
then watches them. With versions striped over ``weight_sync.master_relays`` master relays
(issue 52) the node runs one relay per stripe, each in the role the controller gives it for
that stripe (controller/masters.py), and its engines read them as one
(``relay.striped.StripedRelay``):

* engines start (all of a node at once) and restart within ``rollout.start_timeout_s`` (1800 s
  for SGLang, 180 s for the CPU engine by default): ready means SGLang's ``/ready`` answers 200,
  a probe that does not generate. A start that runs out of time fails with the key, its value
  and the engine's log tail.
* an engine whose process ends, or whose ``/health_generate`` fails (or does not answer within
  ``rollout.engine_heartbeat_timeout_s``, never less than SGLang's health window
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` + 5 s: SGLang itself answers 503 only after that window)
  twice in a row, is killed, reported down (the controller stops giving it work; its
  trajectories resume on engines of their version) and started again; the new one registers in
  its place and pulls the newest version before it takes work. An engine restarted more than
  ``rollout.engine_restarts_per_hour`` times in an hour is evicted, with the reason.
* pauses are not failures: a failed check of an engine that the controller reports paused,
  pulling or updating weights (``GET /engine_states``), now or at any moment of the check, does
  not count toward the two in a row (it is logged as ``busy_check``): a paused SGLang holds the
  check's generation at its pause gate and answers 503 once its window ends.
* a relay whose process ends is started again in the role the controller gives it now: a
  chained relay rejoins the chain (its master catches it up); a dead master is replaced by a
  relay the controller elected among the others, or, when it was the only one, by the restarted
  relay, which hosts the trainers' publish group again. Trainers find the new master through
  the controller and send the version in flight again, whole.
* a process killed with -9 cannot free its shared memory: its buckets are reclaimed here (the
  supervisor knows its pid) before anything restarts.

Every transition is printed and reported to the controller, which records it in the run's
books (``restarts``, ``evicted_engines``) and metrics (``fault`` records).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Callable, Dict, List, Optional

from ..config.budgets import join_timeout_s
from ..config.gpu_map import NodeGpus
from ..config.plan import relay_model_bytes
from ..netutil import engine_api_key
from ..relay.launch import relay_process
from ..relay.server import RelayConfig
from ..server_process import ServerProcess
from ..weights.bucket import reclaim_segments
from ..weights.shards import publish_parts, run_stripes
from .launcher import (EngineProcess, engine_health_window_s, engine_heartbeat_timeout_s,
                       engine_process, engine_start_timeout_s)


class NodeSupervisor:
    def __init__(self, cfg, client, model_path: str, logs: str, name: str,
                 log: Callable[[str], None] = print, gpus: Optional[NodeGpus] = None):
        """``client``: a ``ControllerClient`` of the run's controller; ``gpus``: this node's
        share of the GPU map (config/gpu_map.py: each engine's and the relay's
        ``CUDA_VISIBLE_DEVICES``, the relay's device); None: no GPUs, nothing is masked."""
        self.cfg = cfg
        self.client = client
        self.model_path = model_path
        self.logs = logs
        self.name = name
        self.log = log
        self.gpus = gpus
        self.stripes = run_stripes(cfg)
        # per stripe: this node's relay, whether it is the stripe's master, its publish port
        self.relays: List[Optional[ServerProcess]] = [None] * self.stripes
        self.masters = [False] * self.stripes
        self.publish_ports: List[Optional[int]] = [None] * self.stripes
        self.engines: List[EngineProcess] = []
        self.restarts: Dict[int, deque] = {}  # engine slot -> times of its restarts
        self.evicted: Dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._starting: List[ServerProcess] = []  # processes being (re)started right now
        self._threads: List[threading.Thread] = []
        r = cfg.rollout
        # start-up budget (first start and restarts) and the /health_generate probe's timeout,
        # never shorter than SGLang's health window + a margin (launcher.py)
        self.start_timeout_s = engine_start_timeout_s(r)
        self.heartbeat_timeout_s = engine_heartbeat_timeout_s(r)
        if self.heartbeat_timeout_s > float(r.engine_heartbeat_timeout_s):
            self.log(f"[supervisor {name}] rollout.engine_heartbeat_timeout_s="
                     f"{r.engine_heartbeat_timeout_s:g} is under SGLang's health window "
                     f"(SGLANG_HEALTH_CHECK_TIMEOUT={engine_health_window_s():g} s) + margin: "
                     f"engine checks wait {self.heartbeat_timeout_s:g} s")

    # ------------------------------------------------------------------ start
    def start(self) -> "NodeSupervisor":
        """Start the relay (in the role the controller gives), then the engines, all at once
        (a big model loads for minutes: one after the other would add them up), each within
        ``rollout.start_timeout_s``. The first that fails stops the others and the relay; its
        error (with its log's tail) is raised."""
        for stripe in range(self.stripes):
            try:
                self._start_relay(stripe)
            except BaseException:
                self.stop()  # the relays of the stripes before: nothing is left running
                raise
        engines = [self._new_engine(i) for i in range(self.cfg.rollout.num_engines)]
        failed: List[BaseException] = []  # the first failure, the cause (the rest follow it)
        failed_lock = threading.Lock()

        def start_one(engine: EngineProcess) -> None:
            try:
                with failed_lock:
                    if failed:
                        return
                self._start(engine)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
                with failed_lock:
                    failed.append(exc)

        threads = [threading.Thread(target=start_one, args=(e,), daemon=True,
                                    name=f"laminar-start-engine{i}")
                   for i, e in enumerate(engines)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if failed:  # the others would only wait out their budgets: their starts fail now
                for e in engines:
                    if e.alive():
                        e.stop(grace_s=2.0)
            time.sleep(0.2)
        if failed:
            for e in engines:
                e.stop(grace_s=2.0)
                if e.proc is not None:
                    reclaim_segments(e.proc.pid)
            self.stop()  # and the relay: nothing of this node is left running
            raise failed[0]
        self.engines.extend(engines)
        return self

    def register(self) -> dict:
        """Register the engines: they take work from now on."""
        return self.client.register(self.relay.url, [e.url for e in self.engines],
                                    relay_urls=[r.url for r in self.relays]
                                    if self.stripes > 1 else None)

    @property
    def relay(self) -> Optional[ServerProcess]:
        """Stripe 0's relay (the node's only one, unstriped)."""
        return self.relays[0]

    @property
    def publish_port(self) -> Optional[int]:
        """Stripe 0's publish port, when this node hosts its master."""
        return self.publish_ports[0]

    def watch(self) -> None:
        """Start watching (background threads; ``stop`` ends them)."""
        for i in range(len(self.engines)):
            self._spawn(self._watch_engine, i, name=f"laminar-supervise-engine{i}")
        for stripe in range(self.stripes):
            self._spawn(self._watch_relay, stripe, name=f"laminar-supervise-relay{stripe}")

    def stop(self) -> None:
        self._stop.set()
        with self._lock:  # a restart under way: its start fails now, its thread ends
            starting = list(self._starting)
        for p in starting:
            p.stop(grace_s=2.0)
        for t in self._threads:
            t.join(timeout=30)
        with self._lock:
            procs = list(self.engines) + [r for r in self.relays if r]
        for p in reversed(procs):
            pid = p.proc.pid if p.proc is not None else None
            p.stop()
            if pid is not None:
                reclaim_segments(pid)

    @property
    def procs(self) -> list:
        return list(self.engines) + [r for r in self.relays if r]

    def _spawn(self, fn, *args, name: str) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _new_engine(self, index: int) -> EngineProcess:
        return engine_process(self.cfg, self.model_path,
                              os.path.join(self.logs, f"engine-{self.name}-{index}.log"), index,
                              api_key=engine_api_key(self.client.token),
                              visible=self.gpus.engines[index] if self.gpus else None)

    def _relay_process(self, master: bool, master_url: Optional[str],
                       stripe: int = 0) -> ServerProcess:
        """This node's relay of ``stripe`` (not started); under the GPU map it sees its
        engines' GPUs and its own (last), and stages on that one or, without one, on the
        host."""
        ws = self.cfg.weight_sync
        if self.gpus is not None:
            ws = self.gpus.relay_weight_sync(ws)
        striped = self.stripes > 1
        relay_id = f"{self.name}-stripe{stripe}" if striped else self.name
        relay_cfg = RelayConfig(token=self.client.token, host=self.cfg.rollout.host,
                                relay_id=relay_id, master=master, stripe=stripe,
                                stripes=self.stripes,
                                master_url=None if master else master_url,
                                trainer_stages=publish_parts(
                                    self.cfg.parallel.pp, self.cfg.parallel.tp, ws.export,
                                    self.cfg.parallel.ep),
                                weight_sync=ws,
                                # /dev/shm checked at start-up for relay_versions of these:
                                # striped, stripe 0's relay checks the node's whole need (its
                                # relays share the mount), the others once a version comes
                                model_bytes=relay_model_bytes(self.cfg) if stripe == 0 else 0)
        relay = relay_process(relay_cfg, os.path.join(self.logs, f"relay-{relay_id}.log"))
        if self.gpus is not None:
            relay.env.update(self.gpus.relay_env())
        return relay

    def _relay_role(self, stripe: int) -> dict:
        """The controller's role for this node's relay of ``stripe``, asked in rounds of up to
        10 s (a stripe's master may be another node's, still starting) until
        ``cluster.join_timeout_s``, or until this node stops (another node's start failed)."""
        deadline = time.time() + join_timeout_s(self.cfg)
        while True:
            try:
                role = self.client.relay_role(min(10.0, max(deadline - time.time(), 0.0)),
                                              stripe=stripe, node=self.name)
                break
            except RuntimeError as exc:  # (ControllerError) LMC-E406: not registered yet
                if "LMC-E406" not in str(exc) or time.time() >= deadline:
                    raise
                if self._stop.is_set():
                    raise RuntimeError("the node is stopping") from None
        if int(role.get("stripes", 1)) != self.stripes:
            raise RuntimeError(
                f"LMC-E518: the controller stripes this run's versions over {role.get('stripes')}"
                f" master relays and this node's config over {self.stripes} "
                "(weight_sync.master_relays, parallel.pp, cluster.trainer.nnodes): give every "
                "role of the run the same values")
        return role

    def _start_relay(self, stripe: int = 0) -> None:
        role = self._relay_role(stripe)
        master = bool(role["master"])
        relay = self._relay_process(master, role.get("master_url"), stripe)
        self._start(relay)
        port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")) if master else None
        self.masters[stripe], self.publish_ports[stripe] = master, port
        self.relays[stripe] = relay
        if master:  # trainers may connect from now on
            self._report("/register_relay", {"relay_url": relay.url, "stripe": stripe,
                                             "node": self.name,
                                             "publish": {"host": relay.host, "port": port}})

    def _start(self, proc: ServerProcess) -> None:
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the node is stopping")
            self._starting.append(proc)
        try:
            proc.start()
        finally:
            with self._lock:
                self._starting.remove(proc)

    # ------------------------------------------------------------------ watch
    def _event(self, kind: str, what: str, **info) -> None:
        """Printed; the controller records what it is told (``_report``)."""
        self.log(f"[supervisor {self.name}] {kind} {what}: "
                 + ", ".join(f"{k}={v}" for k, v in info.items()))

    def _health_generate(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health_generate",
                                        timeout=self.heartbeat_timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _busy(self, url: str, checked_s: float) -> Optional[str]:
        """Why the controller says engine ``url`` was busy (paused, pulling or updating its
        weights) now or within the last ``checked_s`` seconds (the check's duration), or None:
        not busy, or the controller could not say (then the failure counts)."""
        try:
            states = self.client.engine_states([url])
        except Exception as exc:  # noqa: BLE001 - unknown: count the failure
            self._event("state_unknown", url, error=str(exc)[:200])
            return None
        state = states.get(url.rstrip("/"))
        if not state:
            return None
        now = [k for k in ("paused", "pulling", "updating") if state.get(k)]
        if now:
            return " and ".join(now)
        ago = state.get("busy_ago_s")
        if ago is not None and float(ago) <= checked_s + 1.0:
            return f"busy {float(ago):.1f} s ago"
        return None

    def _responsive(self, url: str) -> bool:
        """Whether the engine's HTTP server answers a request that does not generate
        (``/model_info``, served by SGLang's tokenizer manager also while generation is paused
        or weights load) within the heartbeat interval: a paused or updating engine does, a
        hung (e.g. stopped) process does not."""
        try:
            with urllib.request.urlopen(url + "/model_info",
                                        timeout=max(self.cfg.rollout.engine_heartbeat_s, 5.0)):
                return True
        except urllib.error.HTTPError:
            return True  # it answered (e.g. 401 behind an API key)
        except (urllib.error.URLError, OSError):
            return False

    def _out_of_service(self, url: str) -> Optional[str]:
        """Why the controller has taken engine ``url`` out of service although it answers its
        health check (a weight update that failed half-way, streams that broke), or None. Such
        an engine gets no work until it is restarted, so it is restarted."""
        try:
            state = self.client.engine_states([url]).get(url.rstrip("/"))
        except Exception:  # noqa: BLE001 - the controller is busy or gone: ask next round
            return None
        if not state or state.get("healthy", True) or state.get("restarting"):
            return None
        return ("the controller took it out of service (its requests or a weight update "
                "failed) although it answers /health_generate")

    def _watch_engine(self, index: int) -> None:
        r = self.cfg.rollout
        failures = 0
        while not self._stop.wait(r.engine_heartbeat_s):
            if index in self.evicted:
                return
            engine = self.engines[index]
            if not engine.alive():
                reason = f"the process exited with {engine.proc.returncode}"
            else:
                t0 = time.monotonic()
                if self._health_generate(engine.url):
                    failures = 0
                    reason = self._out_of_service(engine.url)
                    if reason is None:
                        continue
                else:
                    if self._stop.is_set() or not engine.alive():
                        continue  # stopping, or it died meanwhile: the next round says so
                    busy = self._busy(engine.url, time.monotonic() - t0)
                    if busy is not None and not self._responsive(engine.url):
                        busy = None  # paused or pulling, but its HTTP server is silent: hung
                    if busy is not None:  # a pause is not a failure: SGLang holds the check
                        self._event("busy_check", f"engine{index}", url=engine.url,
                                    state=busy, counted=False, failures=failures)
                        continue
                    failures += 1
                    if failures < 2:  # one failed check may be a busy moment: ask again
                        continue
                    reason = (f"/health_generate failed or did not answer within "
                              f"{self.heartbeat_timeout_s:g} s twice in a row "
                              f"(rollout.engine_heartbeat_timeout_s), while the controller "
                              f"reported it neither paused, pulling nor updating")
            failures = 0
            try:
                self._restart_engine(index, reason)
            except Exception as exc:  # noqa: BLE001 - keep supervising; the next round retries
                # the error names rollout.start_timeout_s when it ran out of time; keep the
                # engine's log tail it carries
                self._event("restart_failed", f"engine{index}", error=str(exc)[:2000])

    def _restart_engine(self, index: int, reason: str) -> None:
        t0 = time.time()
        old = self.engines[index]
        pid = old.proc.pid
        old.stop(grace_s=2.0)
        reclaimed = len(reclaim_segments(pid))
        window = self.restarts.setdefault(index, deque())
        while window and window[0] < t0 - 3600:
            window.popleft()
        budget = self.cfg.rollout.engine_restarts_per_hour
        if len(window) >= budget:
            why = (f"LMC-E609: {reason}; restarted {len(window)} times in the last hour "
                   f"(rollout.engine_restarts_per_hour={budget}); see {old.log_path}")
            self.evicted[index] = why
            self._event("evicted", f"engine{index}", url=old.url, reason=why)
            self._report("/engine_down", {"url": old.url, "reason": why, "evict": True})
            return
        window.append(t0)
        self._event("down", f"engine{index}", url=old.url, reason=reason, reclaimed=reclaimed)
        self._report("/engine_down", {"url": old.url, "reason": reason, "evict": False})
        new = self._new_engine(index)
        self._start(new)
        with self._lock:
            if self._stop.is_set():  # the node stopped meanwhile
                new.stop()
                return
            self.engines[index] = new
        self._report("/engine_replaced", {"old_url": old.url, "new_url": new.url})
        self._event("restarted", f"engine{index}", url=new.url, seconds=round(time.time() - t0, 3))

    def _watch_relay(self, stripe: int = 0) -> None:
        while not self._stop.wait(self.cfg.rollout.engine_heartbeat_s / 2):
            relay = self.relays[stripe]
            if relay.alive():
                continue
            try:
                self._restart_relay(f"the process exited with {relay.proc.returncode}", stripe)
            except Exception as exc:  # noqa: BLE001 - keep supervising; the next round retries
                self._event("restart_failed", self._relay_name(stripe), error=str(exc)[:500])

    def _relay_name(self, stripe: int) -> str:
        return f"relay{stripe}" if self.stripes > 1 else "relay"

    def _restart_relay(self, reason: str, stripe: int = 0) -> None:
        t0 = time.time()
        old = self.relays[stripe]
        name = self._relay_name(stripe)
        pid = old.proc.pid
        old.stop(grace_s=2.0)
        reclaimed = len(reclaim_segments(pid))
        self._event("down", name, url=old.url, master=self.masters[stripe], reason=reason,
                    reclaimed=reclaimed)
        self._start_relay(stripe)
        new = self.relays[stripe]
        publish = {"host": new.host, "port": self.publish_ports[stripe]} \
            if self.masters[stripe] else None
        self._report("/relay_replaced", {"old_url": old.url, "new_url": new.url,
                                        "publish": publish, "stripe": stripe})
        self._event("restarted", name, url=new.url, master=self.masters[stripe],
                    seconds=round(time.time() - t0, 3))

    def _report(self, path: str, body: dict) -> None:
        """Tell the controller (retried: it may be busy; a controller that is gone ends the
        node anyway)."""
        deadline = time.time() + 60
        while True:
            try:
                self.client.call_post(path, body)
                return
            except Exception:  # noqa: BLE001
                if time.time() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.5)
