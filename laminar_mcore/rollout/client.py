"""An asyncio client for SGLang's HTTP protocol (SGLang servers and the built-in CPU engine).

Every call names its endpoint in errors (``EngineError``). Timeouts are explicit per call kind;
retries apply only to idempotent reads (GETs). Weight updates never abort in-flight requests
unless the caller asks (``abort_all_requests=False`` is sent explicitly: SGLang's own default
for some endpoints is to abort).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import aiohttp


class EngineError(RuntimeError):
    """An engine answered with an error or could not be reached."""

    def __init__(self, endpoint: str, status: Optional[int], message: str):
        super().__init__(f"{endpoint}: {message}" + (f" (HTTP {status})" if status else ""))
        self.endpoint, self.status, self.message = endpoint, status, message


@dataclass
class EngineLoad:
    num_running: int
    num_waiting: int
    kv_utilization: float
    kv_used_tokens: int
    kv_capacity_tokens: int
    weight_version: str
    paused: Optional[str] = None


class SGLangClient:
    def __init__(self, base_url: str, *, api_key: Optional[str] = None,
                 timeout_s: float = 30.0, generate_timeout_s: Optional[float] = None,
                 weight_update_timeout_s: float = 600.0, retries: int = 2,
                 retry_backoff_s: float = 0.2):
        self.base_url = base_url.rstrip("/")
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
    def _generate_body(self, input_ids, sampling_params, return_logprob, rid, stream) -> dict:
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                "return_logprob": return_logprob, "stream": stream}
        if rid is not None:
            body["rid"] = rid
        return body

    async def generate(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None, *,
                       return_logprob: bool = True, rid: Optional[str] = None) -> dict:
        """One completion: ``{"output_ids", "meta_info": {finish_reason, output_token_logprobs,
        weight_version, ...}}``."""
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, False)
        return await self._request("POST", "/generate", body, timeout=self.generate_timeout_s)

    async def generate_stream(self, input_ids: Sequence[int], sampling_params: Optional[dict] = None,
                              *, return_logprob: bool = True,
                              rid: Optional[str] = None) -> AsyncIterator[dict]:
        """Snapshots of the completion as it grows (cumulative ``output_ids``); the last one has
        a ``finish_reason``."""
        body = self._generate_body(input_ids, sampling_params, return_logprob, rid, True)
        try:
            async with self._sess().post(
                    self.base_url + "/generate", json=body,
                    timeout=aiohttp.ClientTimeout(total=self.generate_timeout_s)) as resp:
                if resp.status >= 400:
                    raise EngineError("/generate", resp.status, _message(await resp.text()))
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineError("/generate", None, f"stream broken at {self.base_url}: {exc!r}") from None

    # ------------------------------------------------------------------ weights
    async def update_weights_from_tensor(self, serialized_named_tensors: List[str], *,
                                         load_format: str = "flattened_bucket",
                                         flush_cache: bool = False, abort_all_requests: bool = False,
                                         weight_version: Optional[str] = None) -> dict:
        body = {"serialized_named_tensors": list(serialized_named_tensors),
                "load_format": load_format, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._request("POST", "/update_weights_from_tensor", body,
                                   timeout=self.weight_update_timeout_s)

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str = "nccl") -> dict:
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                "backend": backend}
        return await self._request("POST", "/init_weights_update_group", body,
                                   timeout=self.weight_update_timeout_s)

    async def update_weights_from_distributed(self, names: List[str], dtypes: List[str],
                                              shapes: List[List[int]], group_name: str, *,
                                              flush_cache: bool = False,
                                              abort_all_requests: bool = False,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None) -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._request("POST", "/update_weights_from_distributed", body,
                                   timeout=self.weight_update_timeout_s)

    async def update_weights_from_disk(self, model_path: str, *, load_format: Optional[str] = None,
                                       abort_all_requests: bool = False,
                                       weight_version: Optional[str] = None) -> dict:
        body = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._request("POST", "/update_weights_from_disk", body,
                                   timeout=self.weight_update_timeout_s)

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
        out = await self._request("GET", "/get_weight_version", timeout=self.timeout_s,
                                  retries=self.retries)
        return str(out["weight_version"])

    async def get_model_info(self) -> dict:
        return await self._request("GET", "/get_model_info", timeout=self.timeout_s,
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
        """Running/waiting requests and KV-cache usage, from /get_load (CPU engine) or
        /get_server_info's internal state (SGLang)."""
        try:
            raw = await self._request("GET", "/get_load", timeout=self.timeout_s, retries=self.retries)
        except EngineError as exc:
            if exc.status != 404:
                raise
            info = await self._request("GET", "/get_server_info", timeout=self.timeout_s,
                                       retries=self.retries)
            raw = (info.get("internal_states") or [{}])[0]
        if isinstance(raw, list):
            raw = raw[0] if raw else {}
        cap = int(raw.get("kv_capacity_tokens", raw.get("max_total_num_tokens", 0)) or 0)
        used = raw.get("kv_used_tokens", raw.get("num_used_tokens"))
        util = raw.get("kv_utilization", raw.get("token_usage"))
        if used is None:  # only a utilisation fraction reported
            used = round(float(util or 0.0) * cap)
        used = int(used)
        util = float(util) if util is not None else (used / cap if cap else 0.0)
        return EngineLoad(num_running=int(raw.get("num_running_reqs", raw.get("num_reqs", 0))),
                          num_waiting=int(raw.get("num_waiting_reqs", 0)), kv_utilization=util,
                          kv_used_tokens=used, kv_capacity_tokens=cap,
                          weight_version=str(raw.get("weight_version", "")),
                          paused=raw.get("paused"))


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
