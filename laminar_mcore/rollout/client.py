"""An asyncio client for SGLang's HTTP protocol (SGLang servers and the built-in CPU engine).

Speaks SGLang 0.5.23 as its own source defines it (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``): weight updates from tensors or a distributed group run inside
``begin_weight_update()`` ... ``end_weight_update()`` and flush the cache by default (SGLang's
default, so no prompt KV of old weights survives an update); the version is read from
``/model_info`` and the load from ``/v1/loads``; streams are read as the server sends them
(cumulative, SGLang's default, or ``--incremental-streaming-output``). A request the engine
refuses (an error chunk or an abort with a 4xx code, an HTTP 4xx other than 401/403/404/429)
raises ``RequestError``; anything else that fails (connection lost, 5xx, a stream cut off, a
wrong key) an ``EngineError``, of which ``RequestError`` is the subclass that does not mean the
engine is at fault. Every call names its endpoint in errors. Timeouts are explicit per call kind;
retries apply only to idempotent reads (GETs). Weight updates never abort in-flight requests
unless the caller asks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import aiohttp

from ..netutil import EngineError, RequestError, is_request_error


class StreamProtocolError(EngineError):
    """One stream could not be read as SGLang's protocol (a chunk that is not JSON, a line
    over the size limit, token ids and log-probs that cannot be reconciled): an error of that
    request, not a sign that the engine is unhealthy."""


# The longest server-sent-events line read: SGLang sends a finished request's
# ``routed_experts`` (base64 of int32 [positions, layers, top-k]) on one line, about 66 MB for
# 94 layers x top-8 x 16K positions (Qwen3-235B-A22B); aiohttp's own line reader stops at
# 128 KiB. Over this a stream fails with a StreamProtocolError naming the size.
MAX_STREAM_LINE_BYTES = 512 * 2**20
# SGLang 0.5.23's health window (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) and a margin: a /health
# probe is not answered sooner than 1 s, and a 503 only after the window.
HEALTH_PROBE_TIMEOUT_S = 30.0
# rollout.pause_timeout_s's default: SGLang 0.5.23's abort-mode pause loops "abort all, sleep
# 1 s" (tokenizer_manager.pause_generation) until no request holds the update lock
PAUSE_TIMEOUT_S = 60.0


@dataclass
class StreamChunk:
    """What one stream chunk added: new token ids and their log-probs, the chunk's meta_info
    (``finish_reason`` set on the last)."""

    new_ids: List[int]
    new_logprobs: List[float]
    meta: dict

    @property
    def finished(self) -> bool:
        return self.meta.get("finish_reason") is not None


@dataclass
class EngineLoad:
    num_running: int
    num_waiting: int
    kv_utilization: float
    kv_used_tokens: int
    kv_capacity_tokens: int


class SGLangClient:
    def __init__(self, base_url: str, *, api_key: Optional[str] = None,
                 timeout_s: float = 30.0, generate_timeout_s: Optional[float] = None,
                 weight_update_timeout_s: float = 600.0, retries: int = 2,
                 retry_backoff_s: float = 0.2, incremental_stream: bool = False,
                 stream_connections: int = 0, control_connections: int = 16,
                 max_line_bytes: int = MAX_STREAM_LINE_BYTES,
                 pause_timeout_s: float = PAUSE_TIMEOUT_S):
        """``pause_timeout_s``: the budget of ``pause_generation`` / ``continue_generation``
        (``rollout.pause_timeout_s``), separate from ``timeout_s``: SGLang's abort-mode pause
        re-checks once a second until every request is gone.

        ``incremental_stream``: the server runs with ``--incremental-streaming-output``
        (each chunk carries only new tokens); otherwise chunks are cumulative.

        Connections: generation streams and control/weight calls use separate pools, so a
        ``pause_generation`` never waits for a connection behind the very streams it pauses.
        ``stream_connections``: the most concurrent streams (0: no cap; never set it below the
        engine's ``max_running_requests``); ``control_connections``: the control pool's size."""
        self.base_url = base_url.rstrip("/")
        self.incremental_stream = incremental_stream
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.stream_connections = int(stream_connections)
        self.control_connections = int(control_connections)
        self.max_line_bytes = int(max_line_bytes)
        self.pause_timeout_s = float(pause_timeout_s)
        self._session: Optional[aiohttp.ClientSession] = None  # control and weight calls
        self._stream_session: Optional[aiohttp.ClientSession] = None  # /generate streams
        self._live_streams: set = set()  # responses of the streams being read now

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for name in ("_session", "_stream_session"):
            session = getattr(self, name)
            if session is not None:
                await session.close()
                setattr(self, name, None)

    def _headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers(),
                connector=aiohttp.TCPConnector(limit=self.control_connections))
        return self._session

    def _streams(self) -> aiohttp.ClientSession:
        if self._stream_session is None or self._stream_session.closed:
            self._stream_session = aiohttp.ClientSession(
                headers=self._headers(),
                connector=aiohttp.TCPConnector(limit=self.stream_connections,
                                               limit_per_host=self.stream_connections))
        return self._stream_session

    async def _request(self, method: str, endpoint: str, body: Optional[dict] = None, *,
                       timeout: Optional[float], retries: int = 0, expect_json: bool = True) -> Any:
        url = self.base_url + endpoint
        attempt = 0
        while True:
            try:
                async with self._sess().request(
                        method, url, json=body,
                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        kind = RequestError if is_request_error(resp.status) else EngineError
                        raise kind(endpoint, resp.status, f"LMC-E601: {_message(text)}")
                    if not expect_json:
                        return text
                    try:
                        return json.loads(text) if text else {}
                    except json.JSONDecodeError:
                        raise EngineError(endpoint, resp.status,
                                          f"LMC-E601: not JSON: {text[:200]}") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if attempt >= retries:
                    kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else "unreachable"
                    raise EngineError(endpoint, None,
                                      f"LMC-E600: {kind} at {self.base_url}: {exc!r}") from None
                attempt += 1
                await asyncio.sleep(self.retry_backoff_s * attempt)

    # ------------------------------------------------------------------ generation
    def _generate_body(self, input_ids, sampling_params, return_logprob, rid, stream,
                       extra=None) -> dict:
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                "return_logprob": return_logprob, "stream": stream}
        if rid is not None:
            body["rid"] = rid
        body.update(extra or {})
        return body

    async def generate(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None, *,
                       return_logprob: bool = True, rid: Optional[str] = None) -> dict:
        """One completion: ``{"output_ids", "meta_info": {finish_reason, output_token_logprobs,
        weight_version, weight_versions, ...}}``."""
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, False)
        return await self._request("POST", "/generate", body, timeout=self.generate_timeout_s)

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None,
                              *, return_logprob: bool = True, rid: Optional[str] = None,
                              extra: Optional[dict] = None) -> AsyncIterator[dict]:
        """The chunks as the server sends them (cumulative or incremental); the last has a
        ``finish_reason``. An error chunk (HTTP 200, ``{"error": ...}``) raises ``EngineError``;
        a chunk that is not JSON, or a line longer than ``max_line_bytes``, raises
        ``StreamProtocolError``. Events are framed here from the byte stream, so a line of any
        size up to the limit is read (SGLang puts a whole routing table on one line).
        ``extra``: more GenerateReqInput fields (e.g. ``return_routed_experts``)."""
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, True, extra)
        resp = None
        try:
            async with self._streams().post(
                    self.base_url + "/generate", json=body,
                    timeout=aiohttp.ClientTimeout(total=self.generate_timeout_s)) as resp:
                self._live_streams.add(resp)
                if resp.status >= 400:
                    kind = RequestError if is_request_error(resp.status) else EngineError
                    raise kind("/generate", resp.status,
                               f"LMC-E601: {_message(await resp.text())}")
                async for line in self._lines(resp.content):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError as exc:
                        raise StreamProtocolError(
                            "/generate", None, f"LMC-E602: a stream chunk of {len(data)} bytes "
                            f"is not JSON: {exc}") from None
                    if not isinstance(chunk, dict):
                        raise StreamProtocolError("/generate", None,
                                                  f"LMC-E602: a stream chunk is not an object: "
                                                  f"{data[:200]!r}")
                    if "error" in chunk:  # SGLang: HTTP 200, then this chunk and [DONE]
                        err = chunk["error"]
                        code = err.get("code") if isinstance(err, dict) else None
                        kind = RequestError if is_request_error(code) else EngineError
                        raise kind("/generate", code if isinstance(code, int) else None,
                                   f"LMC-E601: {_message(json.dumps(chunk))}")
                    yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineError("/generate", None,
                              f"LMC-E600: stream broken at {self.base_url}: {exc!r}") from None
        finally:
            self._live_streams.discard(resp)

    def break_streams(self, why: str) -> int:
        """End every stream being read on this client now: each reader gets an
        ``EngineError`` saying ``why``; returns how many. For an engine known to be lost (its
        host silent): streams have no read timeout -- a request may wait long in the engine's
        queue before its first token -- so a stream from a host that went silent (no FIN, no
        RST) would otherwise wait forever; closing the session does not wake its reader."""
        streams = list(self._live_streams)
        for resp in streams:
            resp.content.set_exception(aiohttp.ClientConnectionError(why))
            resp.close()
        return len(streams)

    async def _lines(self, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
        """The stream's lines (without the newline), framed from raw reads: one pass over the
        bytes, whatever a line's size, up to ``max_line_bytes``."""
        buf = bytearray()
        scanned = 0  # bytes of buf already searched for a newline
        async for data in content.iter_any():
            buf += data
            start = 0
            while True:
                nl = buf.find(b"\n", max(scanned, start))
                if nl < 0:
                    break
                yield bytes(buf[start:nl]).rstrip(b"\r")
                start = scanned = nl + 1
            if start:
                del buf[:start]
                scanned = 0
            scanned = len(buf)
            if len(buf) > self.max_line_bytes:
                raise StreamProtocolError("/generate", None, f"LMC-E602: a stream line exceeds "
                                          f"{self.max_line_bytes} bytes (max_line_bytes)")
        if buf:
            yield bytes(buf)

    async def stream_tokens(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None,
                            *, rid: Optional[str] = None,
                            extra: Optional[dict] = None) -> AsyncIterator[StreamChunk]:
        """Only what each chunk adds (tokens and log-probs), in both stream styles; a stream that
        ends without a finish reason raises ``EngineError``.

        Chunks are reconciled by count: ``meta_info.completion_tokens`` (the tokens generated
        so far) says how many are new, and only those are taken -- the ids from the chunk's
        ``output_ids`` (new ones first; the whole list in cumulative streams) and the log-probs
        from ``output_token_logprobs`` (this chunk's, or, where the server sends the whole
        cumulative list, its tail). So SGLang 0.5.23's final chunk for a request aborted in
        its waiting queue after a retraction -- ``output_ids`` = the last id, already
        streamed, with the cumulative log-probs -- adds nothing, and coalesced chunks add each
        token once. A chunk that cannot be reconciled raises ``StreamProtocolError``. With an
        incremental server each chunk is parsed once, so a response of L tokens costs O(L)."""
        seen = 0
        async for chunk in self.generate_stream(input_ids, sampling_params, rid=rid, extra=extra):
            meta = chunk.get("meta_info") or {}
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort" \
                    and is_request_error(reason.get("status_code")):
                # the scheduler refused this request (SGLang's set_finish_with_abort: 400)
                raise RequestError("/generate", reason["status_code"],
                                   f"LMC-E601: {reason.get('message') or 'aborted'}")
            ids, lps = self._reconcile(chunk, meta, seen)
            seen += len(ids)
            yield StreamChunk(ids, lps, meta)
            if meta.get("finish_reason") is not None:
                return  # finished: what follows ([DONE], or a broken connection) changes nothing
        raise EngineError("/generate", None, "LMC-E602: stream ended without a finish reason")

    def _reconcile(self, chunk: dict, meta: dict, seen: int):
        """The ids and log-probs ``chunk`` adds to the ``seen`` already yielded (see
        ``stream_tokens``). Incremental chunks: ``output_ids`` holds exactly the new ids, except
        in SGLang's abort answers -- the waiting-queue abort repeats the last id (alone, or at
        the end of coalesced chunks) with the whole cumulative log-prob list; a request-level
        abort (``finish_reason.status_code`` >= 400: a prompt too long, a bad argument) carries
        a placeholder id and no log-probs -- whose extra ids are never taken."""
        ids = chunk.get("output_ids") or []
        lps = [e[0] for e in meta.get("output_token_logprobs") or []]
        reason = meta.get("finish_reason")
        abort = isinstance(reason, dict) and reason.get("type") == "abort"
        if abort and isinstance(reason.get("status_code"), int) and reason["status_code"] >= 400:
            return [], []  # refused by the server: nothing was generated (the reason says why)
        total = meta.get("completion_tokens")
        if not isinstance(total, int) or isinstance(total, bool):
            # a server that does not count: the chunk is what the stream style says it is
            total = seen + len(ids) if self.incremental_stream else len(ids)
        new = total - seen
        if new < 0:
            raise StreamProtocolError("/generate", None, f"LMC-E602: completion_tokens went back "
                                      f"from {seen} to {total}")
        if not self.incremental_stream:
            ok = len(ids) == total
            ids, lp_new = ids[seen:total], lps[seen:total]
        else:
            # the waiting-queue abort: [last id] alone (nothing new) or after the coalesced new
            ok = len(ids) == new or (abort and (len(ids) == new + 1 or (new == 0 and
                                                                        len(ids) <= 1)))
            ids = ids[:new]
            if abort and len(lps) >= total and len(lps) != new:
                lp_new = lps[len(lps) - total + seen:]  # the cumulative list is last
            else:  # this chunk's own
                lp_new = lps[:new] if len(lps) == new else []
        if not ok or len(ids) != new or len(lp_new) != new:
            raise StreamProtocolError(
                "/generate", None, f"LMC-E602: stream chunk cannot be reconciled: {new} new tokens "
                f"(completion_tokens {total}, {seen} already streamed) but "
                f"{len(chunk.get('output_ids') or [])} ids and {len(lps)} log-probs (was the "
                f"engine started with --incremental-streaming-output={self.incremental_stream}?)")
        return list(ids), lp_new

    # ------------------------------------------------------------------ weights
    async def begin_weight_update(self) -> dict:
        """Open SGLang's weight-update session (required around tensor/distributed updates)."""
        return await self._checked("/begin_weight_update", {}, self.weight_update_timeout_s)

    async def end_weight_update(self) -> dict:
        return await self._checked("/end_weight_update", {}, self.weight_update_timeout_s)

    async def _checked(self, endpoint: str, body: dict, timeout: float) -> dict:
        out = await self._request("POST", endpoint, body, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(endpoint, None, f"LMC-E601: {out.get('message')}")
        return out

    async def update_weights_from_tensor(self, serialized_named_tensors: List[str], *,
                                         load_format: str = "flattened_bucket",
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         weight_version: Optional[str] = None) -> dict:
        body = {"serialized_named_tensors": list(serialized_named_tensors),
                "load_format": load_format, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._checked("/update_weights_from_tensor", body, self.weight_update_timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                "backend": backend}
        return await self._checked("/init_weights_update_group", body, self.weight_update_timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._checked("/destroy_weights_update_group", {"group_name": group_name},
                                   self.timeout_s)

    async def update_weights_from_distributed(self, names: List[str], dtypes: List[str],
                                              shapes: List[List[int]],
                                              group_name: str = "weight_update_group", *,
                                              flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None) -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._checked("/update_weights_from_distributed", body,
                                   self.weight_update_timeout_s)

    async def update_weights_from_disk(self, model_path: str, *, load_format: Optional[str] = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       weight_version: Optional[str] = None) -> dict:
        """No session needed (SGLang 0.5.23 loads from disk outside one)."""
        body = {"model_path": model_path, "abort_all_requests": abort_all_requests,
                "flush_cache": flush_cache}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._checked("/update_weights_from_disk", body, self.weight_update_timeout_s)

    # ------------------------------------------------------------------ control
    async def pause_generation(self, mode: str = "abort") -> dict:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        return await self._request("POST", "/pause_generation", {"mode": mode},
                                   timeout=self.pause_timeout_s)

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/continue_generation", {},
                                   timeout=self.pause_timeout_s)

    async def abort_request(self, rid: Optional[str] = None, *, abort_all: bool = False) -> dict:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        return await self._request("POST", "/abort_request", body, timeout=self.timeout_s)

    async def flush_cache(self) -> str:
        return await self._request("POST", "/flush_cache", None, timeout=self.timeout_s,
                                   expect_json=False)

    async def get_weight_version(self) -> str:
        """The served version, from ``/model_info`` ("default" until one is set)."""
        return str((await self.get_model_info())["weight_version"])

    async def get_model_info(self) -> dict:
        return await self._request("GET", "/model_info", timeout=self.timeout_s,
                                   retries=self.retries)

    async def get_server_info(self) -> dict:
        return await self._request("GET", "/server_info", timeout=self.timeout_s,
                                   retries=self.retries)

    async def health(self) -> bool:
        """SGLang's ``/health``: a one-token generation that answers after at least 1 s, or 503
        after its health window (``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s) -- so this waits at
        least that long (``HEALTH_PROBE_TIMEOUT_S``) before calling the engine unhealthy."""
        try:
            await self._request("GET", "/health", timeout=max(self.timeout_s,
                                                               HEALTH_PROBE_TIMEOUT_S),
                                 expect_json=False)
        except EngineError:
            return False
        return True

    async def ready(self) -> bool:
        """SGLang's ``/ready`` (no generation): started, healthy and not paused."""
        try:
            await self._request("GET", "/ready", timeout=self.timeout_s, expect_json=False)
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Wait until the engine is ready (``/ready``: never a generating probe)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.ready():
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError("/ready", None,
                                  f"LMC-E603: {self.base_url} not ready after {timeout_s}s")
            await asyncio.sleep(poll_s)

    async def get_load(self) -> EngineLoad:
        """Running/waiting requests and KV-cache usage from SGLang's ``/v1/loads`` (summed over
        DP ranks); the weight version is ``get_weight_version``'s."""
        raw = await self._request("GET", "/v1/loads?include=core", timeout=self.timeout_s,
                                  retries=self.retries)
        loads = raw.get("loads") if isinstance(raw, dict) else None
        if not loads:
            raise EngineError("/v1/loads", None, f"LMC-E601: no per-rank loads in {str(raw)[:200]}")
        cap = sum(int(x.get("max_total_num_tokens") or 0) for x in loads)
        used = sum(int(x.get("num_used_tokens") or 0) for x in loads)
        if not used and any(x.get("token_usage") for x in loads):  # only a fraction reported
            used = round(sum(float(x.get("token_usage") or 0) * int(x.get("max_total_num_tokens") or 0)
                             for x in loads))
        return EngineLoad(num_running=sum(int(x.get("num_running_reqs") or 0) for x in loads),
                          num_waiting=sum(int(x.get("num_waiting_reqs") or 0) for x in loads),
                          kv_utilization=used / cap if cap else 0.0, kv_used_tokens=used,
                          kv_capacity_tokens=cap)


def _message(text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err or data.get("message") or data)
    return str(data)[:500]
