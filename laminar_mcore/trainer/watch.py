"""A trainer node's reports to the controller of a multi-node run, and its way out when the run
is stopped under it.

Local rank 0 of every trainer node (``job=trainer``) posts ``/trainer_alive`` every
``interval_s`` from a daemon thread (controller/trainers.py watches them). When the controller
answers that it stopped the run (another trainer node fell silent), or the controller itself
has not answered for ``limit_s``, this node cannot finish: its ranks may be blocked in a
collective with the lost node for up to ``trainer.collective_timeout_s``, and torchrun would
then restart them into a rendezvous that waits for the lost node. So the thread prints why,
stops this node's torchrun agent (SIGTERM: it ends its workers and exits, no restart) and
exits the process.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.error
from typing import Optional


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer went away or timed out
    (gloo raises plain RuntimeErrors naming its transport)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("gloo/transport", "Connection reset", "Connection closed",
                            "Connection refused", "NCCL", "timed out", "Timed out"))


class NodeReporter:
    def __init__(self, client, limit_s: float, interval_s: float = 2.0):
        self.client = client
        self.limit_s = float(limit_s)
        self.interval_s = float(interval_s)
        self.rank = int(os.environ.get("RANK", "0"))
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "NodeReporter":
        self._thread = threading.Thread(target=self._run, name="laminar-trainer-alive",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 15)

    def await_verdict(self, exc: BaseException) -> None:
        """After a collective failed with a peer gone (``exc``): keep reporting for up to
        ``limit_s`` so the controller can say whether a node was lost (then ``_end`` stops
        this node, from the reporting thread). A peer's crash that torchrun restarts ends this
        wait sooner: the agent stops these workers to restart the world. Returns (the caller
        re-raises) when no word came."""
        if not lost_peer(exc) or self._thread is None:
            return
        print(f"[trainer] node {self.node}: a collective failed ({str(exc)[:200]}); waiting up "
              f"to {self.limit_s + 2 * self.interval_s:.0f} s for the controller's word on the "
              "other trainer nodes", flush=True)
        self._stop.wait(self.limit_s + 2 * self.interval_s)

    def _run(self) -> None:
        from ..controller.client import ControllerError

        answered = time.time()
        while not self._stop.is_set():
            try:
                why = self.client.trainer_alive(self.rank, self.node, self.host, self.restarts)
                answered = time.time()
            except (ControllerError, urllib.error.URLError, OSError, KeyError, TypeError) as exc:
                why = None
                if time.time() - answered > self.limit_s:
                    why = (f"LMC-E606: the controller at {self.client.url} has not answered for "
                           f"{time.time() - answered:.0f} s ({exc})")
            if why and not self._stop.is_set():
                self._end(why)
            self._stop.wait(self.interval_s)

    def _end(self, why: str) -> None:
        print(f"[trainer] node {self.node} ({self.host}) stops: {why}", flush=True)
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
            try:  # torchrun's agent: ends this node's workers and exits, restarting nothing
                os.kill(os.getppid(), signal.SIGTERM)
            except OSError:
                pass
            time.sleep(2.0)
        os._exit(1)
