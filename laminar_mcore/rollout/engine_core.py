"""The CPU engine's scheduler: continuous batching over a token-capacity KV cache.

One thread runs the loop. Each iteration it applies queued commands (new requests, aborts,
pause/continue, weight updates, cache flushes) -- so weights change only *between* steps --
admits waiting requests whose KV reservation fits, prefills them, decodes one token for every
running request, and reports progress. Requests join and leave the running batch every step.

Pause modes (SGLang's): ``abort`` finishes every request with finish_reason abort; ``retract``
frees the KV of running requests and queues them again (they resume by recomputing their
prefix); ``in_place`` keeps everything and only stops stepping. ``continue`` resumes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from .model import DecoderLM

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as given (answered with 400)."""


class SegmentAllocator:
    """First-fit allocator of contiguous KV slots, merging neighbours on free."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: List[Tuple[int, int]] = [(0, capacity)]  # (start, length), sorted

    def allocate(self, length: int) -> Optional[int]:
        for i, (start, size) in enumerate(self.free):
            if size >= length:
                if size == length:
                    self.free.pop(i)
                else:
                    self.free[i] = (start + length, size - length)
                return start
        return None

    def release(self, start: int, length: int) -> None:
        self.free.append((start, length))
        self.free.sort()
        merged: List[Tuple[int, int]] = []
        for s, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free = merged

    @property
    def reserved(self) -> int:
        return self.capacity - sum(n for _, n in self.free)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None

    @classmethod
    def from_request(cls, raw: Optional[dict]) -> "SamplingParams":
        raw = dict(raw or {})
        if "sampling_seed" in raw and "seed" not in raw:
            raw["seed"] = raw.pop("sampling_seed")
        known = {k: raw.pop(k) for k in list(raw) if k in cls.__dataclass_fields__}
        # Fields SGLang accepts that do not change this engine's sampling are ignored; the rest
        # are errors so that a typo never silently changes a run.
        tolerated = {"min_new_tokens", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim", "stop", "n", "frequency_penalty", "presence_penalty",
                     "repetition_penalty", "min_p"}
        unknown = set(raw) - tolerated
        if unknown:
            raise RequestError(f"unknown sampling_params: {sorted(unknown)}")
        for name in ("frequency_penalty", "presence_penalty", "min_p"):
            if raw.get(name) not in (None, 0, 0.0):
                raise RequestError(f"sampling_params.{name} is not supported by the CPU engine")
        if raw.get("repetition_penalty") not in (None, 1, 1.0):
            raise RequestError("sampling_params.repetition_penalty is not supported by the CPU engine")
        if raw.get("n") not in (None, 1):
            raise RequestError("sampling_params.n > 1 is not supported; send n requests")
        try:
            p = cls(**known)
            p.max_new_tokens = int(p.max_new_tokens)
            p.temperature = float(p.temperature)
            p.top_p = float(p.top_p)
            p.top_k = int(p.top_k)
            p.stop_token_ids = [int(t) for t in (p.stop_token_ids or [])]
            p.seed = None if p.seed is None else int(p.seed)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad sampling_params: {exc}") from None
        if p.max_new_tokens < 0:
            raise RequestError("sampling_params.max_new_tokens must be >= 0")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k == 0 or p.top_k < -1:
            raise RequestError("need temperature >= 0, 0 < top_p <= 1 and top_k = -1 or >= 1")
        return p


@dataclass
class Request:
    rid: str
    input_ids: List[int]
    params: SamplingParams
    on_event: Callable[["Request", bool], None]  # (request, finished) from the engine thread
    output_ids: List[int] = field(default_factory=list)
    output_logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    kv_start: Optional[int] = None
    kv_reserved: int = 0
    cached_len: int = 0
    generator: Optional[torch.Generator] = None
    created: float = field(default_factory=time.time)
    first_token_time: Optional[float] = None
    weight_versions: List[str] = field(default_factory=list)

    @property
    def prefix(self) -> List[int]:
        return self.input_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


class EngineCore:
    """Owns the model, the KV cache and every request; all mutation happens on its thread."""

    def __init__(self, model: DecoderLM, *, kv_capacity_tokens: int = 16384,
                 max_running_requests: int = 64, max_prefill_tokens: int = 4096,
                 eos_token_ids: Optional[List[int]] = None, weight_version: str = "0",
                 seed: int = 0):
        self.model = model
        self.kv = model.new_kv_cache(kv_capacity_tokens)
        self.allocator = SegmentAllocator(kv_capacity_tokens)
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos = set(eos_token_ids or [])
        self.weight_version = str(weight_version)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[str, Request] = {}
        self.paused: Optional[str] = None
        self.commands: "queue.Queue[Tuple[str, tuple, Callable]]" = queue.Queue()
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.generated_tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="laminar-cpu-engine", daemon=True)

    # ---------------------------------------------------------------- thread-safe API
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(("noop", (), lambda result, error: None))
        self._thread.join(timeout=30)

    def submit(self, name: str, args: tuple, done: Callable[[object, Optional[BaseException]], None]):
        """Queue a command; ``done(result, error)`` is called from the engine thread."""
        self.commands.put((name, args, done))

    def stats(self) -> dict:
        used = sum(r.cached_len for r in self.running)
        cap = self.allocator.capacity
        return {
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "kv_capacity_tokens": cap, "kv_used_tokens": used,
            "kv_reserved_tokens": self.allocator.reserved,
            "kv_utilization": used / cap, "token_usage": used / cap,
            "paused": self.paused, "weight_version": self.weight_version,
            "steps": self.steps, "generated_tokens": self.generated_tokens,
            "max_running_requests": self.max_running,
        }

    # ---------------------------------------------------------------- commands (engine thread)
    def _cmd_noop(self):
        return None

    def _cmd_add(self, req: Request):
        need = len(req.input_ids) + req.params.max_new_tokens
        if need > self.allocator.capacity:
            raise RequestError(f"request needs {need} KV tokens (prompt {len(req.input_ids)} + "
                               f"max_new_tokens {req.params.max_new_tokens}) but the cache holds "
                               f"{self.allocator.capacity}; lower max_new_tokens or raise "
                               "--kv-capacity-tokens")
        if req.rid in self.requests:
            raise RequestError(f"request id {req.rid!r} is already in flight")
        vocab = self.model.shape.vocab
        if any(t < 0 or t >= vocab for t in req.input_ids):
            raise RequestError(f"input_ids must be in [0, {vocab})")
        if req.params.seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        self.requests[req.rid] = req
        if req.params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)

    def _cmd_abort(self, rid: Optional[str], abort_all: bool):
        targets = list(self.requests.values()) if abort_all else (
            [self.requests[rid]] if rid in self.requests else [])
        for req in targets:
            self._finish(req, {"type": "abort", "message": "aborted by request"})
        return len(targets)

    def _cmd_pause(self, mode: str):
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        if mode == "abort":
            self._cmd_abort(None, True)
        elif mode == "retract":
            for req in reversed(self.running):
                self._release_kv(req)
                req.cached_len = 0
                self.waiting.appendleft(req)
            self.running = []
        self.paused = mode
        return mode

    def _cmd_continue(self):
        self.paused = None

    def _cmd_update_weights(self, named_tensors: dict, version: Optional[str], abort_all: bool):
        if abort_all:
            self._cmd_abort(None, True)
        count = self.model.load_weights(named_tensors)
        if version is not None:
            self.weight_version = str(version)
        return count

    def _cmd_call(self, fn: Callable[[], object]):
        """Run ``fn`` on the engine thread between steps (weight loaders use it)."""
        return fn()

    def _cmd_flush_cache(self):
        if self.requests:
            raise RequestError(f"cannot flush the cache while {len(self.requests)} requests run")
        self.kv[0].zero_()
        self.kv[1].zero_()
        return True

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = self.paused is not None or not (self.waiting or self.running)
            try:
                command = self.commands.get(timeout=0.05) if idle else self.commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._run_command(*command)
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.paused is None and (self.waiting or self.running):
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - keep serving, fail the batch
                    logger.exception("engine step failed")
                    for req in list(self.running) + list(self.waiting):
                        self._finish(req, {"type": "abort", "message": f"engine error: {exc}"})

    def _run_command(self, name: str, args: tuple, done: Callable) -> None:
        try:
            result = getattr(self, "_cmd_" + name)(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            done(None, exc)
        else:
            done(result, None)

    def _step(self) -> None:
        self._admit_and_prefill()
        if self.running:
            self._decode()
        self.steps += 1

    def _admit_and_prefill(self) -> None:
        batch: List[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req = self.waiting[0]
            prefix = len(req.prefix)
            if batch and prefix > budget:
                break
            reserve = prefix + req.remaining
            start = self.allocator.allocate(reserve)
            if start is None:
                break  # wait for memory to free up (FIFO: no overtaking)
            self.waiting.popleft()
            req.kv_start, req.kv_reserved, req.cached_len = start, reserve, 0
            batch.append(req)
            budget -= prefix
        if not batch:
            return
        logits = self.model.forward([r.prefix for r in batch], [r.kv_start for r in batch],
                                    [0] * len(batch), self.kv)
        for req in batch:
            req.cached_len = len(req.prefix)
        self.running.extend(batch)
        self._sample_and_emit(batch, logits)

    def _decode(self) -> None:
        batch = list(self.running)
        logits = self.model.forward([[r.prefix[-1]] for r in batch], [r.kv_start for r in batch],
                                    [r.cached_len for r in batch], self.kv)
        for req in batch:
            req.cached_len += 1
        self._sample_and_emit(batch, logits)

    def _sample_and_emit(self, batch: List[Request], logits: torch.Tensor) -> None:
        for req, row in zip(batch, logits):
            token, logprob = self._sample(req, row)
            if req.first_token_time is None:
                req.first_token_time = time.time()
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            req.weight_versions.append(self.weight_version)
            self.generated_tokens += 1
            stop = token in req.params.stop_token_ids or (
                token in self.eos and not req.params.ignore_eos)
            if stop:
                self._finish(req, {"type": "stop", "matched": token})
            elif req.remaining <= 0:
                self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
            else:
                req.on_event(req, False)  # its KV is written by the next decode step

    def _sample(self, req: Request, logits: torch.Tensor) -> Tuple[int, float]:
        p = req.params
        if p.temperature == 0:
            logprobs = torch.log_softmax(logits, -1)
            token = int(torch.argmax(logits))
            return token, float(logprobs[token])
        logprobs = torch.log_softmax(logits / p.temperature, -1)
        probs = logprobs.exp()
        if p.top_k > 0 and p.top_k < probs.numel():
            kth = torch.topk(probs, p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, 0)
            drop = cum - sorted_probs > p.top_p * cum[-1]
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = int(torch.multinomial(probs, 1, generator=req.generator or self.generator))
        # The behaviour log-prob of the sampling distribution at this temperature (before top-k
        # / top-p truncation, as SGLang reports it).
        return token, float(logprobs[token])

    def _release_kv(self, req: Request) -> None:
        if req.kv_start is not None:
            self.allocator.release(req.kv_start, req.kv_reserved)
            req.kv_start, req.kv_reserved = None, 0

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        self._release_kv(req)
        if req in self.running:
            self.running.remove(req)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        self.requests.pop(req.rid, None)
        req.on_event(req, True)
