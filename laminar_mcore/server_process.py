"""Child server processes of a run (engines, relays): each in its own session with its output
captured to a log file; ``start`` waits until the server answers 200 on its readiness path
(``ready_path``: ``/health`` for our own servers, ``/ready`` for engines, which must not be asked
to generate while they start) for at most its start-up budget (and for the port the server prints
when it picks its own), ``stop`` ends it cleanly (SIGTERM, then SIGKILL for the whole process
group), also when the launcher itself fails. Neutral: every role's launcher may use it; it imports
no role.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional


class ServerStartError(RuntimeError):
    """A server exited or stayed unhealthy while starting; the message has its log's tail."""


class ServerProcess:
    """One server process of ours (an engine, a relay). Use as a context manager, or call
    ``start``/``stop``. ``start_timeout_s``: how long ``start()`` waits for it to be ready
    (``timeout_key``, when set, is the config key that sets it: a start that runs out of time
    names it); ``ready_path``: the path that answers 200 once it is ready (it is probed every
    0.1 s with a ``probe_timeout_s`` timeout, so it must answer at once)."""

    what = "server"  # how its errors name it
    ready_path = "/health"
    timeout_key: Optional[str] = None
    start_timeout_s = 180.0
    probe_timeout_s = 2.0

    def __init__(self, command: List[str], *, log_path: str, host: str = "127.0.0.1",
                 port: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 api_key: Optional[str] = None, port_key: str = "LAMINAR_ENGINE_PORT",
                 start_timeout_s: Optional[float] = None, ready_path: Optional[str] = None):
        if start_timeout_s is not None:
            self.start_timeout_s = float(start_timeout_s)
        if ready_path is not None:
            self.ready_path = ready_path
        self.command = command
        self.port_key = port_key
        self.log_path = log_path
        self.host = host
        self.port = port
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env.setdefault("PYTHONWARNINGS", "ignore")
        self.api_key = api_key
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: Optional[float] = None) -> "ServerProcess":
        """Launch it and wait until it is ready, for at most ``timeout_s`` (default: its
        ``start_timeout_s``); on failure it is stopped and ``ServerStartError`` raised."""
        timeout_s = self.start_timeout_s if timeout_s is None else float(timeout_s)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # a restart appends: read only this run's lines
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"LMC-E205: {self.what} exited with "
                                       f"{self.proc.returncode}:\n{self.log_tail()}")
            if self.port in (None, 0):
                value = self.printed(self.port_key)
                if value:
                    self.port = int(value)
            if self.port and self._ready(max(0.1, min(self.probe_timeout_s,
                                                          deadline - time.time()))):
                return
            time.sleep(0.1)
        where = f" on {self.url}{self.ready_path}" if self.port else " (no port printed yet)"
        budget = f" ({self.timeout_key}={timeout_s:g}; raise it if it only starts slowly)" \
            if self.timeout_key else ""
        raise ServerStartError(f"LMC-E206: {self.what} not ready{where} after {timeout_s:g} s"
                               f"{budget}; its log ({self.log_path}) ends:\n{self.log_tail()}")

    def _ready(self, timeout: float) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def printed(self, key: str) -> Optional[str]:
        """The value of a ``KEY=value`` line the server printed (ports chosen at start-up).
        Two threads of a server printing at once may run two such lines together
        (``KEY=1234OTHER_KEY=5678``): the value ends where the next ``KEY=`` begins."""
        match = re.search(rf"{re.escape(key)}=(\S+)", self.log_text())
        if not match:
            return None
        return re.sub(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+=.*$", "", match.group(1)) or None

    def wait_printed(self, key: str, timeout_s: float = 60.0) -> str:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = self.printed(key)
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise ServerStartError(f"LMC-E205: {key} never printed:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_start", 0))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
