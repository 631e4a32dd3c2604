"""The CPU engine's scheduler: continuous batching over a paged KV cache, as SGLang's.

One thread runs the loop. Each iteration it applies queued commands (new requests, aborts,
pause/continue, weight updates, cache flushes) -- so weights change only *between* steps --
admits waiting requests whose prompt fits beside what running requests will likely still need,
prefills them, decodes one token for every running request (retracting the newest requests
when the cache runs out, as SGLang does), and reports progress. A request that does not fit
the cache now waits; it is never refused for that.

Pause modes (SGLang's): ``abort`` finishes every request with finish_reason abort; ``retract``
frees the KV of running requests and queues them again (they resume by recomputing their
prefix); ``in_place`` keeps everything and only stops stepping. ``continue`` resumes.

Owns the KV pool and the loop; a request's shape and its sampling parameters are
``engine_request``'s. It never speaks HTTP (``cpu_engine`` and its route modules do), and
nothing but its own thread mutates its state: everyone else queues a command with ``submit``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from .engine_request import (SGLANG_SAMPLING_FIELDS, TOP_K_OFF, Request, RequestError,
                             SamplingParams)
from .model import DecoderLM

# the request's names, importable from here as before the split
__all__ = ["EngineCore", "KVPool", "Request", "RequestError", "SamplingParams",
           "SGLANG_SAMPLING_FIELDS", "TOP_K_OFF"]

logger = logging.getLogger(__name__)


class KVPool:
    """Paged KV-cache slots, one per token (SGLang's token-to-KV pool): a request holds the
    slots of its cached positions and takes one more per decoded token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return torch.tensor(taken[::-1], dtype=torch.long)

    def release(self, slots: torch.Tensor) -> None:
        self._free.extend(slots.tolist())


class EngineCore:
    """Owns the model, the KV cache and every request; all mutation happens on its thread."""

    def __init__(self, model: DecoderLM, *, kv_capacity_tokens: int = 16384,
                 max_running_requests: int = 64, max_prefill_tokens: int = 4096,
                 eos_token_ids: Optional[List[int]] = None, weight_version: str = "0",
                 seed: int = 0, deterministic: bool = False,
                 decode: Optional[Callable[[List[int]], str]] = None,
                 decode_delay_s: float = 0.0):
        """``deterministic`` (SGLang's ``--enable-deterministic-inference``) makes requests
        honour ``sampling_seed``; without it the seed is ignored, as in SGLang. ``decode``
        (the checkpoint's tokenizer) enables stop strings and token texts; ``decode_delay_s``
        (a test knob) makes each decode step that much slower."""
        self.model = model
        self.kv = model.new_kv_cache(kv_capacity_tokens)
        self.pool = KVPool(kv_capacity_tokens)
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.eos = set(eos_token_ids or [])
        self.weight_version = str(weight_version)
        self.deterministic = deterministic
        self.decode = decode
        self.decode_delay_s = float(decode_delay_s)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[str, Request] = {}
        self.paused: Optional[str] = None
        self.commands: "queue.Queue[Tuple[str, tuple, Callable]]" = queue.Queue()
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.generated_tokens = 0
        self.retractions = 0
        self.cache_flushes = 0
        # SGLang's estimate of how much of max_new_tokens running requests will still use;
        # admission keeps room for it, a retraction raises it, each decode step lowers it.
        self.new_token_ratio = 0.4
        self._pending_flush: Optional[Tuple[Callable, float]] = None
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
        cap = self.pool.capacity
        used = cap - self.pool.available
        return {
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": used, "max_total_num_tokens": cap,
            "token_usage": used / cap, "max_running_requests": self.max_running,
            "paused": self.paused, "weight_version": self.weight_version,
            "steps": self.steps, "generated_tokens": self.generated_tokens,
            "retractions": self.retractions, "cache_flushes": self.cache_flushes,
        }

    # ---------------------------------------------------------------- commands (engine thread)
    def _cmd_noop(self):
        return None

    def _cmd_add(self, req: Request):
        if req.rid in self.requests:
            raise RequestError(f"request id {req.rid!r} is already in flight")
        vocab = self.model.shape.vocab
        if any(t < 0 or t >= vocab for t in req.input_ids):
            raise RequestError(f"input_ids must be in [0, {vocab})")
        if req.params.stop and self.decode is None:
            raise RequestError("sampling_params.stop (strings) needs a tokenizer and this "
                               "checkpoint has none; use stop_token_ids")
        if req.params.sampling_seed is not None and self.deterministic:
            req.generator = torch.Generator().manual_seed(req.params.sampling_seed)
        self.requests[req.rid] = req
        start = req.routed_experts_start_len
        if req.return_routed_experts and not 0 <= start <= len(req.input_ids):
            # SGLang's scheduler (handle_generate_request) finishes it with an abort
            req.routed_experts_start_len = 0
            bound = ("is lower than 0. Please use a non-negative routed_experts_start_len."
                     if start < 0 else f"is higher than the number of input tokens "
                     f"len(req.origin_input_ids)={len(req.input_ids)}. Please use a smaller "
                     "routed_experts_start_len.")
            self._finish(req, {"type": "abort", "message":
                               f"recv_req.routed_experts_start_len={start} {bound}"})
        elif req.params.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
        else:
            self.waiting.append(req)

    def _cmd_abort(self, rid: Optional[str], abort_all: bool):
        """SGLang's ``abort_request``: nothing unless ``rid`` is a request's id (the tokenizer
        manager's check), then every request whose id starts with it (the scheduler's), or all
        (health checks too). A request in the waiting queue (also one retracted there) ends at once
        and is marked ``aborted_waiting``."""
        if not abort_all and rid not in self.requests:  # the tokenizer manager's filter
            return 0
        targets = [r for r in self.requests.values() if abort_all or r.rid.startswith(rid)]
        waiting = {id(r) for r in self.waiting}
        for req in targets:
            if id(req) in waiting:
                req.aborted_waiting = True
                self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})
            else:
                self._finish(req, {"type": "abort", "message": "Aborted", "status_code": None,
                                   "err_type": None})
        return len(targets)

    def _cmd_pause(self, mode: str):
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        if mode == "abort":
            self._cmd_abort(None, True)
        elif mode == "retract":
            for req in reversed(self.running):
                self._retract(req)
            self.running = []
        self.paused = mode
        return mode

    def _cmd_continue(self):
        self.paused = None

    def _cmd_update_weights(self, named_tensors: dict, version: Optional[str]):
        """Whole tensors as SGLang's ``load_weights`` takes them (``DecoderLM.load_like_sglang``)."""
        count = self.model.load_like_sglang(named_tensors)
        if version is not None:
            self.weight_version = str(version)
        return count

    def _cmd_set_version(self, version: str):
        self.weight_version = str(version)

    def _cmd_call(self, fn: Callable[[], object]):
        """Run ``fn`` on the engine thread between steps (weight loaders use it)."""
        return fn()

    def _idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's ``is_fully_idle``: nothing running, and nothing waiting unless
        ``ignore_waiting``."""
        return not self.running and (ignore_waiting or not self.waiting)

    def _flush(self) -> bool:
        """SGLang's ``Scheduler.flush_cache``: refused unless idle, where waiting requests do
        not count while the scheduler is paused (``retract`` / ``in_place``; SGLang's ``abort``
        pause never reaches the scheduler). This engine keeps no prefix cache (a slot is always
        written before it is read), so nothing stale remains once no request holds KV; the
        flush is counted."""
        if not self._idle(ignore_waiting=self.paused in ("retract", "in_place")):
            return False
        self.cache_flushes += 1
        return True

    def _cmd_flush_cache(self, timeout_s: float = 0.0):
        """SGLang's flush (``scheduler_components/flush_wrapper.py``): at once when
        ``timeout_s`` is 0 (``_flush``'s rule); otherwise at once if nothing runs or waits, else
        deferred until then, up to ``timeout_s``. Returns ``(success, message)``, or ``None`` when deferred (the
        answer comes through ``done`` later)."""
        if self._pending_flush is not None:
            return False, "Another flush_cache is already in progress."
        if timeout_s <= 0 or self._idle():
            return self._flush(), None
        return None

    def _check_pending_flush(self) -> None:
        if self._pending_flush is None:
            return
        done, deadline = self._pending_flush
        if self._idle():
            self._pending_flush = None
            done((self._flush(), None), None)
        elif time.monotonic() >= deadline:
            self._pending_flush = None
            done((False, "Timed out waiting for idle state."), None)

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
            self._check_pending_flush()
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
            return
        if name == "flush_cache" and result is None:  # deferred until idle
            self._pending_flush = (done, time.monotonic() + float(args[0]))
            return
        done(result, None)

    def _step(self) -> None:
        self._admit_and_prefill()
        if self.running:
            self._decode()
            if self.decode_delay_s > 0:
                time.sleep(self.decode_delay_s)
        self.steps += 1

    def _reserve(self, reqs) -> int:
        return sum(min(r.remaining, max(1, int(r.remaining * self.new_token_ratio))) for r in reqs)

    def _admit_and_prefill(self) -> None:
        batch: List[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            req = self.waiting[0]
            prefix = len(req.prefix)
            if batch and prefix > budget:
                break
            # Room for the prompt now and for what running requests will likely still need;
            # a request that does not fit waits (FIFO: no overtaking).
            if self.pool.available < prefix + 1 + self._reserve(self.running + batch):
                break
            self.waiting.popleft()
            req.slots, req.cached_len = self.pool.allocate(prefix), 0
            batch.append(req)
            budget -= prefix
        if not batch:
            return
        want_all = [r.logprob_start_len >= 0 and r.input_logprobs is None for r in batch]
        routed = self._routed_out(batch)
        logits = self.model.forward([r.prefix for r in batch], [r.slots for r in batch],
                                    [0] * len(batch), self.kv, all_logits=any(want_all),
                                    routed_out=routed)
        self._keep_routed(batch, routed, reset=True)
        if any(want_all):
            for req, rows, want in zip(batch, logits, want_all):
                if want:
                    self._input_logprobs(req, rows)
            logits = torch.stack([rows[-1] for rows in logits])
        for req in batch:
            req.cached_len = len(req.prefix)
        self.running.extend(batch)
        self._sample_and_emit(batch, logits)

    def _routed_out(self, batch: List[Request]) -> Optional[list]:
        capture = self.model.moe is not None and any(r.return_routed_experts for r in batch)
        return [] if capture else None

    @staticmethod
    def _keep_routed(batch: List[Request], routed: Optional[list], reset: bool) -> None:
        """Append each request's routing of this forward (a prefill, or a re-prefill after a
        retraction, recomputes every position: it replaces what was kept)."""
        if routed is None:
            return
        for req, rows in zip(batch, routed):
            if req.return_routed_experts:
                if reset:
                    req.routed = []
                req.routed.append(rows)

    def _input_logprobs(self, req: Request, rows: torch.Tensor) -> None:
        """Prompt log-probs from ``logprob_start_len`` (the first position has none)."""
        t = req.params.temperature or 1.0
        lps = torch.log_softmax(rows[:-1] / t, -1)
        ids = torch.tensor(req.input_ids[1:])
        values = [None] + lps.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        req.input_logprobs = values[req.logprob_start_len:]
        if req.top_logprobs_num > 0:
            top = torch.topk(lps, min(req.top_logprobs_num, lps.shape[-1]), -1)
            rows_top = [None] + [list(zip(v.tolist(), i.tolist())) for v, i in zip(*top)]
            req.input_top_logprobs = rows_top[req.logprob_start_len:]

    def _decode(self) -> None:
        # One new slot per running request; out of memory, retract the newest (SGLang).
        while len(self.running) > self.pool.available:
            if len(self.running) == 1:
                self._finish(self.running[0], {"type": "abort", "message":
                             "the KV cache cannot hold this request; raise --kv-capacity-tokens"})
                return
            self._retract(self.running.pop())
            self.retractions += 1
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        batch = list(self.running)
        for req in batch:
            req.slots = torch.cat([req.slots, self.pool.allocate(1)])
        routed = self._routed_out(batch)
        logits = self.model.forward([[r.prefix[-1]] for r in batch], [r.slots for r in batch],
                                    [r.cached_len for r in batch], self.kv, routed_out=routed)
        self._keep_routed(batch, routed, reset=False)
        for req in batch:
            req.cached_len += 1
        self.new_token_ratio = max(0.1, self.new_token_ratio - 0.001)
        self._sample_and_emit(batch, logits)

    def _stopped(self, req: Request, token: int) -> Optional[dict]:
        p = req.params
        if len(req.output_ids) < p.min_new_tokens:
            return None
        if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
            return {"type": "stop", "matched": token}
        if p.stop:
            longest = max(len(x) for x in p.stop)
            tail = self.decode(req.output_ids[-(longest + 8):])
            for stop in p.stop:
                at = tail.find(stop)
                if at >= 0:
                    req.stop_trim = 0 if p.no_stop_trim else len(tail) - at
                    return {"type": "stop", "matched": stop}
        return None

    def _sample_and_emit(self, batch: List[Request], logits: torch.Tensor) -> None:
        for req, row in zip(batch, logits):
            token, logprob, top = self._sample(req, row)
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            if top is not None:
                req.output_top_logprobs.append(top)
            n = len(req.output_ids)
            if req.spans and req.spans[-1][0] == self.weight_version and req.spans[-1][2] == n - 1:
                req.spans[-1][2] = n
            else:
                req.spans.append([self.weight_version, n - 1, n])
            self.generated_tokens += 1
            stop = self._stopped(req, token)
            if stop is not None:
                self._finish(req, stop)
            elif req.remaining <= 0:
                self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
            else:
                req.on_event(req, False)  # its KV is written by the next decode step

    def _sample(self, req: Request, logits: torch.Tensor):
        p = req.params
        t = p.temperature if p.temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits / t, -1)
        top = None
        if req.top_logprobs_num > 0:
            values, ids = torch.topk(logprobs, min(req.top_logprobs_num, logprobs.numel()))
            top = list(zip(values.tolist(), ids.tolist()))
        if p.temperature == 0:
            token = int(torch.argmax(logits))
            return token, float(logprobs[token]), top
        probs = logprobs.exp()
        if p.top_k < probs.numel():
            kth = torch.topk(probs, p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, 0)
            drop = cum - sorted_probs > p.top_p * cum[-1]
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0:
            probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        token = int(torch.multinomial(probs, 1, generator=req.generator or self.generator))
        # The behaviour log-prob of the sampling distribution at this temperature (before top-k
        # / top-p truncation, as SGLang reports it).
        return token, float(logprobs[token]), top

    def _release_kv(self, req: Request) -> None:
        if req.slots is not None:
            self.pool.release(req.slots)
            req.slots = None
        req.cached_len = 0

    def _retract(self, req: Request) -> None:
        """Free a running request's KV; it waits at the head of the queue and recomputes."""
        self._release_kv(req)
        self.waiting.appendleft(req)

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
