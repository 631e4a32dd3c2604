"""The GPU check's shared parts: the run's ``Bench`` (figures, results, what each check exercised), digests, and helper processes spoken to over a pipe (``bench/gpu.py``)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import time
import traceback
from typing import Callable, Dict, Iterable, List, Tuple

import torch

GB = 1e9
QWEN2_5_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)


class Bench:
    def __init__(self, rehearsal: bool):
        self.rehearsal = rehearsal
        self.cuda = torch.cuda.is_available() and not rehearsal
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.figures: Dict[str, object] = {}
        self.results: List[Tuple[str, bool, str]] = []
        self.shared: Dict[str, object] = {}
        # check name -> (exercised, not exercised): "what: how" / "what: why" entries
        self.coverage: Dict[str, Tuple[List[str], List[str]]] = {}
        self.check = ""  # the running check, whose lists exercised()/not_exercised() extend

    def exercised(self, what: str, how: str) -> None:
        self.coverage.setdefault(self.check, ([], []))[0].append(f"{what}: {how}")

    def not_exercised(self, what: str, why: str) -> None:
        self.coverage.setdefault(self.check, ([], []))[1].append(f"{what}: {why}")

    def covered(self, what: str, done: bool, how: str, why: str) -> None:
        """``what`` exercised (``how``) if ``done``, else not exercised (``why``)."""
        if done:
            self.exercised(what, how)
        else:
            self.not_exercised(what, why)

    def short_of(self, gpus: int) -> str:
        """Why a path that needs ``gpus`` GPUs did not run on this machine."""
        return f"{self.gpus} GPU (needs {gpus})" if self.cuda else "no GPU (CPU rehearsal)"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable, repeat: int = 1) -> float:
        """Median seconds of ``fn()``."""
        times = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    @contextlib.contextmanager
    def peak(self, out: dict, key: str):
        """Peak device memory above the level at entry (GB); 0 on CPU."""
        if self.cuda:
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        yield
        if self.cuda:
            self.sync()
            out[key] = (torch.cuda.max_memory_allocated() - base) / GB
        else:
            out[key] = 0.0


def _digest(named: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of tensors' names, dtypes, shapes and bytes, in order (compared across processes)."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _own(name: str) -> Callable:
    """The GPU check's function ``name`` ("module:function", module under
    ``laminar_mcore.bench.gpu_checks``) as a spawned process can find it: through its module's importable
    name (run with ``python -m`` or ``runpy``, ``bench/gpu.py``'s functions belong to a
    ``__main__`` that a child cannot import)."""
    module, func = name.split(":")
    return getattr(importlib.import_module(f"laminar_mcore.bench.gpu_checks.{module}"), func)


class _Peer:
    """A helper process (spawned: CUDA is initialised here) running ``_own(target)(conn,
    *args)``, spoken to over a pipe. The child sends its pid once it is ready, then answers;
    a child that fails sends ``{"error": traceback}``, raised here as ``RuntimeError``."""

    def __init__(self, target: str, *args, timeout_s: float = 300.0):
        import torch.multiprocessing

        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(target=_own(target), args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.pid = self.recv()
        except BaseException:
            self.close()
            raise

    def recv(self):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"helper process {self.proc.pid} did not answer within "
                               f"{self.timeout_s:.0f} s")
        msg = self.conn.recv()  # EOFError if it died
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"helper process {self.proc.pid} failed:\n{msg['error']}")
        return msg

    def ask(self, msg):
        self.conn.send(msg)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)  # "stop"
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _child_failed(conn) -> None:
    """In a helper process: report the exception being handled to the parent."""
    with contextlib.suppress(OSError, ValueError):
        conn.send({"error": traceback.format_exc()})
