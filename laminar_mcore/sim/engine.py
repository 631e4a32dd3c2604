"""A simulated SGLang engine: continuous batching with a KV-cache budget, on virtual time,
behind the subset of ``SGLangClient`` the rollout manager calls.

Every decode step advances each running request by one token and lasts
``CostModel.decode_step_s(batch, context)``; requests join when there is a slot and KV room
(after their prefill: the prompt once per GRPO group while the radix cache holds it, and the
whole context of a resumed, repacked or interrupted request -- the KV recompute), and leave
when they reach ``max_new_tokens`` or are aborted. A batch that outgrows the KV cache retracts
its newest requests until the rest have room for ``RETRACT_DECODE_STEPS`` more steps (SGLang's
``retract_decode``); they wait and re-prefill. Work is event-driven:
the engine computes when its next request finishes (or its cache fills) and sets one timer, so
a request costs O(log batch) per join or leave, never per token. Streams yield one chunk at
the end of a request (its tokens as a ``TokenCount``: the simulator never materialises ids).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Deque, Dict, Optional

from ..netutil import EngineError
from ..rollout.client import EngineLoad, StreamChunk
from .costs import CostModel

MAX_SEGMENT_STEPS = 2048  # re-evaluate the step time at least this often (context grows)
# SGLang's retract_decode (global_config.retract_decode_steps = 20): when decode runs out of
# KV, it retracts until the requests left have room for 20 more steps each; admission keeps the
# same headroom, so a full cache does not retract and re-admit one request every few steps
RETRACT_DECODE_STEPS = 20


class TokenCount:
    """A token list that only counts (``extend``, ``len``, ``+``): trajectories of the
    simulator carry lengths, not ids."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def extend(self, other) -> None:
        self.n += len(other)

    def __add__(self, other) -> "TokenCount":
        return TokenCount(self.n + len(other))

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"TokenCount({self.n})"


@dataclass(eq=False)
class _Request:
    rid: str
    group: str
    context0: int  # tokens it held when it (re)joined the batch
    target: int  # tokens to generate in this request
    done0: float = 0.0  # generated before it last joined the batch (retracted requests)
    start_steps: float = 0.0  # the engine's step counter when it joined
    seq: int = 0
    future: asyncio.Future = field(default=None)  # (tokens generated, finish reason)
    prefilled: bool = False
    prompt: int = 0  # its prompt's tokens (shared by its GRPO group in the radix cache)


class CpuShare:
    """Engines and a trainer sharing ``cores`` CPU cores (calibration on a CPU machine):
    while more of them are busy than there are cores, each runs ``busy / cores`` slower."""

    def __init__(self, cores: float):
        self.cores = cores
        self.busy: set = set()
        self.engines: list = []

    def factor(self) -> float:
        return max(1.0, len(self.busy) / self.cores)

    def set_busy(self, who, busy: bool) -> None:
        before = self.factor()
        (self.busy.add if busy else self.busy.discard)(who)
        if self.factor() != before:
            for e in self.engines:  # their steps change speed from now on
                e._advance()
                e._schedule()


class SimEngine:
    """One engine (``cost.engine_tp`` GPUs)."""

    def __init__(self, name: str, cost: CostModel, capacity: int, kv_capacity: int,
                 share: Optional[CpuShare] = None):
        self.name = name
        self.share = share
        if share is not None:
            share.engines.append(self)
        self.cost = cost
        self.capacity = capacity
        self.kv_capacity = kv_capacity
        self.loop = asyncio.get_running_loop()
        self.running: Dict[str, _Request] = {}
        self.waiting: Deque[_Request] = deque()
        self._finish_heap: list = []  # (finish step, seq, request)
        self._seq = itertools.count()
        self.steps = 0.0  # decode steps done so far (fractional between events)
        self._ctx0_sum = 0.0  # sum over running of (context0 - start_steps)
        self.t_last = 0.0
        self.stall_until = 0.0  # prefill or weight loading: no decode steps until then
        self.step_s = 0.0
        self._timer: Optional[asyncio.TimerHandle] = None
        self._flush_soon = False  # submissions wait for one admission pass (``_submitted``)
        self.paused = False
        self.frozen = False  # its machine died: nothing progresses (``freeze``)
        self.version = 0
        self._cached: "OrderedDict[str, None]" = OrderedDict()  # radix cache: group prompts
        # figures
        self.tokens = 0.0
        self.kv_token_seconds = 0.0  # integral of KV tokens in use over time
        self.busy_seconds = 0.0  # time with at least one request running
        self.retracted = 0
        self.prefill_tokens = 0

    # ------------------------------------------------------------------ state
    @property
    def kv_used(self) -> float:
        return self._ctx0_sum + len(self.running) * self.steps

    def _done(self, r: _Request) -> float:
        return r.done0 + self.steps - r.start_steps

    def _advance(self) -> None:
        now = self.loop.time()
        start = max(self.t_last, self.stall_until)
        if self.running and not self.frozen:
            self.kv_token_seconds += self.kv_used * (now - self.t_last)
            self.busy_seconds += now - self.t_last
            if now > start and self.step_s > 0:
                steps = (now - start) / self.step_s
                self.steps += steps
                self.tokens += steps * len(self.running)
        self.t_last = now

    def _schedule(self) -> None:
        if self.share is not None and (self in self.share.busy) != bool(self.running):
            self.share.set_busy(self, bool(self.running))  # (reschedules the others)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.running or self.frozen:
            return
        n = len(self.running)
        self.step_s = self.cost.decode_step_s(n, self.kv_used) * (
            self.share.factor() if self.share is not None else 1.0)
        while self._finish_heap and not self._current(self._finish_heap[0]):
            heapq.heappop(self._finish_heap)  # left already (aborted, retracted)
        to_finish = self._finish_heap[0][0] - self.steps if self._finish_heap else MAX_SEGMENT_STEPS
        to_full = (self.kv_capacity - self.kv_used) / n
        steps = max(min(to_finish, max(to_full, 1.0), MAX_SEGMENT_STEPS), 1e-6)
        start = max(self.t_last, self.stall_until)
        self._timer = self.loop.call_at(start + steps * self.step_s, self._tick)

    def _current(self, entry) -> bool:
        _, seq, r = entry
        return r.seq == seq and self.running.get(r.rid) is r

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        eps = 1e-6
        while self._finish_heap and self._finish_heap[0][0] <= self.steps + eps:
            entry = heapq.heappop(self._finish_heap)
            if self._current(entry):
                self._leave(entry[2], "stop")
        if self.kv_used > self.kv_capacity + eps:
            while len(self.running) > 1 and \
                    self.kv_used + len(self.running) * RETRACT_DECODE_STEPS > self.kv_capacity:
                # running is in join order (seq rises), so the newest is the last: O(1)
                self._retract(next(reversed(self.running.values())))
        self._admit()
        self._schedule()

    # ------------------------------------------------------------------ requests
    def _leave(self, r: _Request, reason: str) -> None:
        done = self._done(r)
        del self.running[r.rid]
        self._ctx0_sum -= r.context0 - r.start_steps
        if not r.future.done():
            r.future.set_result((int(round(done)), reason))

    def _retract(self, r: _Request) -> None:
        done = self._done(r)
        del self.running[r.rid]
        self._ctx0_sum -= r.context0 - r.start_steps
        r.context0 += int(done - r.done0)
        r.done0, r.prefilled = done, False
        self.retracted += 1
        self.waiting.appendleft(r)

    def _admit(self) -> None:
        if self.paused or self.frozen:
            return
        prefill = 0
        while self.waiting and len(self.running) < self.capacity:
            r = self.waiting[0]
            if self.running and self.kv_used + r.context0 + \
                    (len(self.running) + 1) * RETRACT_DECODE_STEPS > self.kv_capacity:
                break
            self.waiting.popleft()
            if not r.prefilled:
                prompt_cached = r.group in self._cached
                prefill += r.context0 - (r.prompt if prompt_cached else 0)
                self._cached[r.group] = None
                self._cached.move_to_end(r.group)
                while len(self._cached) > 4 * self.capacity:
                    self._cached.popitem(last=False)
                r.prefilled = True
            r.start_steps = self.steps
            r.seq = next(self._seq)
            self.running[r.rid] = r
            self._ctx0_sum += r.context0 - r.start_steps
            heapq.heappush(self._finish_heap, (r.start_steps + r.target - r.done0, r.seq, r))
        if prefill:
            self.prefill_tokens += prefill
            self.stall_until = max(self.stall_until, self.t_last) + self.cost.prefill_s(prefill)

    def submit(self, rid: str, context: int, max_new_tokens: int, prompt: int) -> _Request:
        r = _Request(rid, rid.rsplit("/", 1)[0], context, max(int(max_new_tokens), 0),
                     future=self.loop.create_future(), prompt=prompt)
        if r.target == 0:
            r.future.set_result((0, "length"))
            return r
        self.waiting.append(r)
        if not self._flush_soon:  # a GRPO group arrives as 16 submissions at one instant:
            self._flush_soon = True  # one admission pass and one timer for all of them
            self.loop.call_soon(self._submitted)
        return r

    def _submitted(self) -> None:
        self._flush_soon = False
        self._advance()
        self._admit()
        self._schedule()

    def abort(self, rid: str) -> bool:
        self._advance()
        r = self.running.get(rid)
        if r is not None:
            self._leave(r, "abort")
        else:
            r = next((w for w in self.waiting if w.rid == rid), None)
            if r is None:
                return False
            self.waiting.remove(r)
            if not r.future.done():
                r.future.set_result((int(round(r.done0)), "abort"))
        self._admit()
        self._schedule()
        return True

    def abort_all(self) -> None:
        self._advance()
        for r in list(self.running.values()):
            self._leave(r, "abort")
        while self.waiting:
            r = self.waiting.popleft()
            if not r.future.done():
                r.future.set_result((int(round(r.done0)), "abort"))
        self._schedule()

    def stall(self, seconds: float) -> None:
        """No decode step for ``seconds`` from now (a weight update)."""
        self._advance()
        self.stall_until = max(self.stall_until, self.t_last) + seconds
        self._schedule()

    def flush_cache(self) -> None:
        """New weights: the radix cache's prompts were computed with the old ones (SGLang's
        update flushes it by default, ``flush_cache=True``), so every prompt re-prefills."""
        self._cached.clear()

    def freeze(self) -> None:
        """Its machine died: nothing progresses; its streams hang until someone notices."""
        self._advance()
        self.frozen = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def kill(self) -> None:
        """Its machine died and that was noticed: every request ends with an error."""
        self._advance()
        for r in list(self.running.values()) + list(self.waiting):
            if not r.future.done():
                r.future.set_exception(EngineError("/generate", None,
                                                   f"{self.name}: machine failed"))
        self.running.clear()
        self.waiting.clear()
        self._ctx0_sum = 0.0
        self.paused = self.frozen = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        self._advance()
        self.paused = False
        self._admit()
        self._schedule()


class SimEngineClient:
    """What the rollout manager calls on an engine (``SGLangClient``'s methods it uses)."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.base_url = f"sim://{engine.name}"
        self.api_key = None

    async def stream_tokens(self, input_ids, sampling_params: Optional[dict] = None, *,
                            rid: Optional[str] = None,
                            extra: Optional[dict] = None) -> AsyncIterator[StreamChunk]:
        if extra:  # the simulator counts tokens; it has no routings to return
            raise ValueError(f"the simulated engine takes no GenerateReqInput extras: {sorted(extra)}")
        params = sampling_params or {}
        prompt = int(params.get("sim_prompt_tokens", 0))
        r = self.engine.submit(rid, len(input_ids), int(params.get("max_new_tokens", 0)), prompt)
        try:
            n, reason = await r.future
        except asyncio.CancelledError:
            self.engine.abort(rid)
            raise
        yield StreamChunk(TokenCount(n), TokenCount(n), {"finish_reason": {"type": reason}})

    async def abort_request(self, rid: Optional[str] = None, *, abort_all: bool = False) -> dict:
        if abort_all:
            self.engine.abort_all()
        elif rid is not None:
            self.engine.abort(rid)
        return {}

    async def pause_generation(self, mode: str = "abort") -> dict:
        self.engine.paused = True
        self.engine.abort_all()
        return {}

    async def continue_generation(self) -> dict:
        self.engine.resume()
        return {}

    async def get_load(self) -> EngineLoad:
        e = self.engine
        e._advance()
        used = int(e.kv_used)
        return EngineLoad(num_running=len(e.running), num_waiting=len(e.waiting),
                          kv_utilization=used / e.kv_capacity, kv_used_tokens=used,
                          kv_capacity_tokens=e.kv_capacity)

    def break_streams(self, why: str) -> int:
        """The manager's ``engine_lost``: end every stream open to this engine now."""
        n = len(self.engine.running) + len(self.engine.waiting)
        self.engine.kill()
        return n

    async def close(self) -> None:
        return None
