"""An asyncio client for SGLang's HTTP protocol (SGLang servers and the built-in CPU engine).

Speaks SGLang 0.5.23 as its own source defines it (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``): weight updates from tensors or a distributed group run inside
``begin_weight_update()`` ... ``end_weight_update()`` and flush the cache by default (SGLang's
default, so no prompt KV of old weights survives an update); the version is read from
``/model_info`` and the load from ``/v1/loads``; streams are read as the server sends them
(cumulative, SGLang's default, or ``--incremental-streaming-output``) and an error chunk is an
``EngineError``. Every call names its endpoint in errors. Timeouts are explicit per call kind;
retries apply only to idempotent reads (GETs). Weight updates never abort in-flight requests
unless the caller asks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import aiohttp

from ..netutil import EngineError


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
                 retry_backoff_s: float = 0.2, incremental_stream: bool = False):
        """``incremental_stream``: the server runs with ``--incremental-streaming-output``
        (each chunk carries only new tokens); otherwise chunks are cumulative."""
        self.base_url = base_url.rstrip("/")
        self.incremental_stream = incremental_stream
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.weight_update_timeout_s = weight_update_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers())
        return self._session

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
                        raise EngineError(endpoint, resp.status, _message(text))
                    if not expect_json:
                        return text
                    try:
                        return json.loads(text) if text else {}
                    except json.JSONDecodeError:
                        raise EngineError(endpoint, resp.status, f"not JSON: {text[:200]}") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if attempt >= retries:
                    kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else "unreachable"
                    raise EngineError(endpoint, None, f"{kind} at {self.base_url}: {exc!r}") from None
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
        ``finish_reason``. An error chunk (HTTP 200, ``{"error": ...}``) raises ``EngineError``.
        ``extra``: more GenerateReqInput fields (e.g. ``return_routed_experts``)."""
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, True, extra)
        try:
            async with self._sess().post(
                    self.base_url + "/generate", json=body,
                    timeout=aiohttp.ClientTimeout(total=self.generate_timeout_s)) as resp:
                if resp.status >= 400:
                    raise EngineError("/generate", resp.status, _message(await resp.text()))
                async for raw in resp.content:
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        raise EngineError("/generate", err.get("code") if isinstance(err, dict)
                                          else None, _message(json.dumps(chunk)))
                    yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineError("/generate", None, f"stream broken at {self.base_url}: {exc!r}") from None

    async def stream_tokens(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None,
                            *, rid: Optional[str] = None,
                            extra: Optional[dict] = None) -> AsyncIterator[StreamChunk]:
        """Only what each chunk adds (tokens and log-probs), in both stream styles; a stream that
        ends without a finish reason raises ``EngineError``. With an incremental server each
        chunk is parsed once, so a response of L tokens costs O(L)."""
        seen = 0
        finished = False
        async for chunk in self.generate_stream(input_ids, sampling_params, rid=rid, extra=extra):
            meta = chunk.get("meta_info") or {}
            ids = chunk.get("output_ids") or []
            lps = [e[0] for e in meta.get("output_token_logprobs") or []]
            if not self.incremental_stream:
                ids, lps = ids[seen:], lps[seen:]
            if len(ids) != len(lps):
                raise EngineError("/generate", None, f"stream chunk has {len(ids)} tokens but "
                                  f"{len(lps)} log-probs (was it started with "
                                  f"--incremental-streaming-output={self.incremental_stream}?)")
            seen += len(ids)
            finished = meta.get("finish_reason") is not None
            yield StreamChunk(list(ids), lps, meta)
        if not finished:
            raise EngineError("/generate", None, "stream ended without a finish reason")

    # ------------------------------------------------------------------ weights
    async def begin_weight_update(self) -> dict:
        """Open SGLang's weight-update session (required around tensor/distributed updates)."""
        return await self._checked("/begin_weight_update", {}, self.weight_update_timeout_s)

    async def end_weight_update(self) -> dict:
        return await self._checked("/end_weight_update", {}, self.weight_update_timeout_s)

    async def _checked(self, endpoint: str, body: dict, timeout: float) -> dict:
        out = await self._request("POST", endpoint, body, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(endpoint, None, str(out.get("message")))
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
        return await self._request("POST", "/pause_generation", {"mode": mode}, timeout=self.timeout_s)

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/continue_generation", {}, timeout=self.timeout_s)

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
        try:
            await self._request("GET", "/health", timeout=self.timeout_s, expect_json=False)
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.health():
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError("/health", None, f"{self.base_url} not healthy after {timeout_s}s")
            await asyncio.sleep(poll_s)

    async def get_load(self) -> EngineLoad:
        """Running/waiting requests and KV-cache usage from SGLang's ``/v1/loads`` (summed over
        DP ranks); the weight version is ``get_weight_version``'s."""
        raw = await self._request("GET", "/v1/loads?include=core", timeout=self.timeout_s,
                                  retries=self.retries)
        loads = raw.get("loads") if isinstance(raw, dict) else None
        if not loads:
            raise EngineError("/v1/loads", None, f"no per-rank loads in {str(raw)[:200]}")
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
