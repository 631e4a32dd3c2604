"""``ControllerClient``: the one spelling of the controller's REST protocol.

Used by trainer rank 0 (``/batch``, ``/trained``, ``/state``, ``/done``) and by the cluster
roles (``/health``, ``/relay_role``, ``/register``, ``/cluster``, ``/engine_states``). Every
call carries the run token; a refused token says so. Synchronous (urllib): its callers are plain
threads.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, List, Optional

from ..data.trajectory import Trajectory
from ..netutil import TOKEN_ENV


class ControllerError(RuntimeError):
    pass


STOP = "stop"  # what ``ControllerClient.batch`` returns once the run's STOP file exists


def controller_url(cfg) -> str:
    """Where the controller of a multi-node run listens (``cluster.controller_addr``:
    ``cluster.controller_port``)."""
    port = int(cfg.cluster.controller_port)
    if port <= 0:
        raise ControllerError("LMC-E103: cluster.controller_port must be set (> 0) for job=rollout "
                              "and job=trainer: the port the controller listens on")
    return f"http://{cfg.cluster.controller_addr}:{port}"


class ControllerClient:
    def __init__(self, url: str, token: str, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: Optional[dict] = None,
              timeout: Optional[float] = None):
        """(HTTP status, JSON body or None)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                text = resp.read().decode()
                return resp.status, (json.loads(text) if text else None)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise ControllerError(f"LMC-E201: {self.url}{path} refused the run token: is "
                                      f"{TOKEN_ENV} the same on every node?") from None
            raise ControllerError(f"LMC-E208: {method} {self.url}{path}: HTTP {exc.code}: "
                                  f"{exc.read()[:300].decode(errors='replace')}") from None

    # ------------------------------------------------------------------ trainer rank 0
    def batch(self, deadline_s: float, poll_s: float = 5.0):
        """The next batch of trajectories, None if none came before the deadline, or ``STOP``
        when the run was asked to stop (its STOP file)."""
        end = time.time() + deadline_s
        while time.time() < end:
            status, body = self._call("GET", f"/batch?timeout={poll_s:g}",
                                      timeout=poll_s + self.timeout_s)
            if status == 200 and body.get("stop"):
                return STOP
            if status == 200:
                return [Trajectory.from_dict(t) for t in body["trajectories"]]
        return None

    def trained(self, step: int, version: int, stats: dict, publish_blocked_s: float,
                wait_s: float) -> None:
        self._call("POST", "/trained", {"step": step, "version": version, "stats": stats,
                                        "publish_blocked_s": publish_blocked_s, "wait_s": wait_s})

    def refused(self, version: int, reason: str = "") -> None:
        """A stage lead: the master relay refused ``version`` (barrier modes then generate
        with the newest version the relays hold)."""
        self._call("POST", "/refused", {"version": int(version), "reason": str(reason)[:2000]})

    def state(self) -> dict:
        """The controller's data module, for a training checkpoint."""
        return self._call("GET", "/state")[1]

    def done(self, result: dict) -> None:
        self._call("POST", "/done", result)

    def resumed(self, step: int, version: int, restarts: int) -> None:
        """The trainer world (re)started from step ``step`` and published ``version``."""
        self._call("POST", "/resumed", {"step": step, "version": version, "restarts": restarts})

    def trainer_alive(self, rank: int, node: int, host: str, restarts: int) -> Optional[str]:
        """A trainer rank's report; the controller's reason if it stopped the run, else None."""
        return self._call("POST", "/trainer_alive", {"rank": rank, "node": node, "host": host,
                                                     "restarts": restarts}, timeout=10)[1]["stop"]

    def call_post(self, path: str, body: dict) -> Optional[dict]:
        """A rollout node's report (``/engine_down``, ``/engine_replaced``,
        ``/relay_replaced``)."""
        return self._call("POST", path, body, timeout=30)[1]

    # ------------------------------------------------------------------ cluster roles
    def health(self, timeout: float = 10.0) -> dict:
        return self._call("GET", "/health", timeout=timeout)[1]

    def relay_role(self, timeout_s: float, stripe: int = 0, node: Optional[str] = None) -> dict:
        """The role of this node's relay of ``stripe`` (controller/masters.py): master, or
        which master it chains from. ``node``: the node's name (striped, stripe s's master is
        on the s-th node to ask, mod cluster.rollout_nodes)."""
        body = {"stripe": stripe, **({"node": node} if node else {})}
        return self._call("POST", f"/relay_role?timeout={timeout_s:g}", body,
                          timeout=timeout_s + 30)[1]

    def register(self, relay_url: str, engines: List[str], publish: Optional[dict] = None,
                 pull_agent: Optional[str] = None,
                 relay_urls: Optional[List[str]] = None) -> dict:
        body = {"relay_url": relay_url, "engines": list(engines)}
        if relay_urls:
            body["relay_urls"] = list(relay_urls)
        if publish is not None:
            body["publish"] = publish
        if pull_agent is not None:
            body["pull_agent"] = pull_agent
        return self._call("POST", "/register", body)[1]

    def leave(self, engines: List[str], grace_s: float) -> dict:
        """This node's ``engines`` leave the run gracefully (controller/elastic.py); answered
        once they have (their trajectories finished, handed back or discarded)."""
        return self._call("POST", "/leave", {"engines": list(engines), "grace_s": grace_s},
                          timeout=grace_s + 60.0)[1]

    def cluster(self, newest: bool = False) -> dict:
        """Where the roles are. ``newest``: ``trainer_version`` also counts every relay of a
        striped tier (asked of each relay: for a restarted trainer's version floor)."""
        return self._call("GET", "/cluster?newest=1" if newest else "/cluster", timeout=30)[1]

    def engine_states(self, urls: Optional[List[str]] = None, timeout: float = 10.0) -> dict:
        """{engine url: {paused, pulling, updating, busy, busy_ago_s, ...}} as the controller's
        manager sees them (``urls``: only these)."""
        query = "&".join("url=" + urllib.parse.quote(u.rstrip("/"), safe="") for u in urls or ())
        path = "/engine_states" + ("?" + query if query else "")
        return self._call("GET", path, timeout=timeout)[1]["engines"]

    def wait_for(self, what: str, get: Callable[[], dict], ready: Callable[[dict], bool],
                 timeout_s: float) -> dict:
        """Poll ``get()`` until ``ready(answer)``; unreachable counts as not yet."""
        deadline, last = time.time() + timeout_s, None
        while time.time() < deadline:
            try:
                answer = get()
                if ready(answer):
                    return answer
            except ControllerError as exc:
                if "refused the run token" in str(exc):
                    raise
                last = exc
            except (urllib.error.URLError, OSError) as exc:
                last = exc
            time.sleep(0.5)
        raise ControllerError(f"LMC-E204: gave up waiting for {what} at {self.url} after "
                              f"{timeout_s:.0f}s ({last})")
