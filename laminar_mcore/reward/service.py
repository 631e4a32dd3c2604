"""An asynchronous reward service: reward functions run in a process pool so that slow
verifiers never block the controller's event loop. Functions are named by dotted path
(``package.module:function`` or ``package.module.function``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger("laminar_mcore.reward")


def load_reward_fn(path: str) -> Callable[..., float]:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"LMC-E703: reward function {path!r} must be 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"LMC-E703: cannot load reward function {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"LMC-E703: reward function {path!r} is not callable")
    return fn


def _score(path: str, response_text: str, answer, row: dict) -> float:
    fn = load_reward_fn(path)
    extra = {k: v for k, v in row.items() if k not in ("response_text", "answer")}
    value = float(fn(response_text, answer, **extra))
    if not math.isfinite(value):
        raise ValueError(f"LMC-E703: reward {value} is not finite")
    return value


START_TIMEOUT_S = 120.0  # a worker's start (interpreter, imports, the reward function's module)


def _worker_main(conn, fn_path: Optional[str] = None) -> None:
    """A reward worker: import the reward function (``fn_path``), say it is ready, then score
    requests from ``conn`` until told to stop or the pipe closes."""
    try:
        if fn_path:
            load_reward_fn(fn_path)
        conn.send(("ready", None))
    except Exception as exc:  # noqa: BLE001 - told to the service, which says it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            reply = ("ok", _score(*msg))
        except Exception as exc:  # noqa: BLE001 - sent back as the call's error
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


class _Worker:
    def __init__(self, ctx, fn_path: Optional[str] = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        """A started worker, its reward function imported: a call's ``timeout_s`` counts the
        scoring only, never the start (a cold worker on a loaded host takes seconds)."""
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, fn_path),
                                name="laminar-reward", daemon=True)
        self.proc.start()
        child.close()
        try:
            if not self.conn.poll(start_timeout_s):
                raise RuntimeError(f"LMC-E703: a reward worker did not start within "
                                   f"{start_timeout_s:g} s")
            status, why = self.conn.recv()
        except (EOFError, OSError):
            status, why = "error", "the reward worker died while starting"
        except BaseException:
            self.kill()
            raise
        if status != "ready":
            self.kill()
            raise RuntimeError(f"LMC-E703: a reward worker could not start: {why}")

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.proc.join(timeout=grace_s)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


class RewardService:
    """Scores responses in ``workers`` worker processes (spawned, so that none inherits the
    controller's threads), each call on one worker of its own. Failures stay with the response
    being scored:

    * the function raises or returns a non-finite value: that response gets an error;
    * its worker dies (a crashing verifier, the OOM killer): the worker is replaced and the call
      retried ``retries`` times on fresh workers, then it gets an error;
    * it runs longer than ``timeout_s`` (a verifier stuck on a pathological answer): its worker
      is killed and replaced, and it gets an error.

    Calls running on other workers never notice. The caller discards errored trajectories with
    a reason and the run goes on.
    """

    def __init__(self, fn_path: str, workers: int = 1, timeout_s: float = 60.0, retries: int = 1):
        load_reward_fn(fn_path)  # fail at start-up, not at the first trajectory
        if workers < 1 or timeout_s <= 0 or retries < 0:
            raise ValueError("reward service needs workers >= 1, timeout_s > 0 and retries >= 0")
        self.fn_path = fn_path
        self.workers, self.timeout_s, self.retries = workers, timeout_s, retries
        self.restarts = 0  # workers replaced after dying or getting stuck
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: List[_Worker] = []
        self._busy: List[_Worker] = []
        self._lock = threading.Lock()
        self._free = threading.Semaphore(workers)
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="laminar-reward")
        self._closed = False

    def _acquire(self) -> _Worker:
        self._free.acquire()
        with self._lock:
            if self._closed:
                self._free.release()
                raise RuntimeError("the reward service is closed")
            worker = self._idle.pop() if self._idle else None
        try:
            worker = worker or _Worker(self._ctx, self.fn_path)
        except BaseException:
            self._free.release()
            raise
        with self._lock:
            self._busy.append(worker)
        return worker

    def _release(self, worker: _Worker, reuse: bool = True) -> None:
        """Give a slot back; a healthy worker goes back to the idle list (or stops once the
        service is closed), a killed one (``reuse=False``) is just forgotten."""
        with self._lock:
            if worker in self._busy:
                self._busy.remove(worker)
            keep = reuse and not self._closed
            if keep:
                self._idle.append(worker)
        if reuse and not keep:
            worker.stop(1.0)
        self._free.release()

    def _discard(self, worker: _Worker, why: str) -> None:
        worker.kill()
        with self._lock:
            self.restarts += 1
        logger.warning("reward service: %s; worker replaced (%d so far)", why, self.restarts)
        self._release(worker, reuse=False)

    def _call(self, msg) -> Tuple[str, object]:
        """Runs in a thread: one call on one worker, retried on fresh workers if it dies."""
        for _ in range(self.retries + 1):
            worker = self._acquire()
            deadline = time.monotonic() + self.timeout_s
            try:
                worker.conn.send(msg)
                if not worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                    self._discard(worker, f"a reward call ran longer than {self.timeout_s:g} s")
                    return "error", (f"TimeoutError: the reward function ran longer than "
                                     f"{self.timeout_s:g} s (data.reward_timeout_s)")
                reply = worker.conn.recv()
            except (EOFError, OSError):
                self._discard(worker, "a reward worker died")
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. a row that cannot be pickled
                self._release(worker)
                return "error", f"{type(exc).__name__}: {exc}"
            self._release(worker)
            return reply
        return "error", (f"WorkerDied: the reward worker died {self.retries + 1} times scoring "
                         "this response")

    async def score(self, response_text: str, answer, row: Optional[dict] = None
                    ) -> Tuple[Optional[float], Optional[str]]:
        """(reward, None), or (None, error message) when the reward could not be computed."""
        loop = asyncio.get_running_loop()
        msg = (self.fn_path, response_text, answer, dict(row or {}))
        try:
            status, value = await loop.run_in_executor(self._threads, self._call, msg)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable row
            return None, f"{type(exc).__name__}: {exc}"
        return (value, None) if status == "ok" else (None, str(value))

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers: idle ones exit at once; one stuck in a verifier is killed after
        ``grace_s`` so that it never holds up the end of the run."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop(grace_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                busy = list(self._busy)
            if not busy:
                break
            time.sleep(0.05)
        for worker in busy:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)
