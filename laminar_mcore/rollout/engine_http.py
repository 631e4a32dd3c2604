"""HTTP plumbing the CPU engine shares with SGLang's server: API-key checks, the model-update
reader/writer lock, errors, and the /generate response shapes.

Everything here mirrors SGLang 0.5.23 (``srt/utils/auth.py``, ``srt/utils/aio_rwlock.py``,
``srt/managers/tokenizer_manager.py``), so that the CPU engine refuses and answers what SGLang
refuses and answers. It never imports trainer code.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
import time
from typing import Callable, List, Optional

from aiohttp import web

from .engine_core import Request

# SGLang serves these without a key, also when --api-key is set (k8s probes, Prometheus).
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def auth_allowed(path: str, method: str, authorization: Optional[str],
                 api_key: Optional[str]) -> bool:
    """SGLang's ``decide_request_auth`` for a server with ``--api-key`` (no admin key):
    ``Bearer`` case-insensitive, constant-time comparison, probes exempt."""
    if not api_key or method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], api_key)


def unauthorized() -> web.Response:
    return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's body


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}, "success": False,
                              "message": message}, status=status)


class RWLock:
    """SGLang's writer-preferring asyncio lock: generation holds the reader side for its whole
    life, a weight update the writer side, so an update waits for running requests and new
    requests wait for the update."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self):
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    @property
    def readers(self) -> int:
        return self._readers


def logprob_entries(pairs, decode: Optional[Callable[[List[int]], str]]) -> list:
    """SGLang's ``[logprob, token_id, text]`` entries (text only with return_text_in_logprobs)."""
    return [[lp, tok, decode([tok]) if decode is not None else None] for lp, tok in pairs]


def add_weight_versions(meta: dict, req: Request, upto: int, current: str) -> None:
    """SGLang's ``add_weight_versions_to_meta_info`` over ``compute_weight_version_spans``:
    the spans visible in ``upto`` output tokens (at least one: a request with no output has
    ``[{current, 0, 0}]``), and ``weight_version`` = the last one's."""
    spans = [dict(s) for s in req.weight_versions if s["start"] < upto or s["start"] == 0]
    for span in spans:
        span["end"] = min(span["end"], upto)
    if not spans:
        spans = [{"version": current, "start": 0, "end": 0}]
    meta["weight_versions"] = spans
    meta["weight_version"] = spans[-1]["version"]


def add_logprobs(meta: dict, req: Request, since: int, upto: int, text_of) -> None:
    """The log-prob fields of an answer: output positions ``[since, upto)``, the prompt's
    (from ``logprob_start_len``) and the top log-probs when asked for."""
    meta["output_token_logprobs"] = logprob_entries(
        zip(req.output_logprobs[since:upto], req.output_ids[since:upto]), text_of)
    if req.input_logprobs is not None:
        meta["input_token_logprobs"] = logprob_entries(
            zip(req.input_logprobs, req.input_ids[max(req.logprob_start_len, 0):]), text_of)
    if req.top_logprobs_num > 0:
        meta["output_top_logprobs"] = [logprob_entries(top, text_of)
                                       for top in req.output_top_logprobs[since:upto]]
        if req.input_top_logprobs is not None:
            meta["input_top_logprobs"] = [None if top is None else logprob_entries(top, text_of)
                                          for top in req.input_top_logprobs]


def waiting_abort_result(req: Request, *, upto: int, version: str, return_logprob: bool,
                         return_text: bool, decode, incremental_stream: bool) -> dict:
    """SGLang 0.5.23's answer for a request aborted in its waiting queue (never started, or
    retracted there under KV pressure or by ``pause_generation("retract")``), built by the
    tokenizer manager (``_handle_abort_req``), not by the scheduler's output path: the whole
    cumulative ``output_token_logprobs``, ``completion_tokens`` = every token, and, in an
    incremental stream, ``output_ids`` = only the last id, which was already streamed. Built
    from the first ``upto`` output tokens: those the tokenizer manager has received."""
    meta = {"id": req.rid, "finish_reason": req.finish_reason, "weight_version": version,
            "e2e_latency": time.time() - req.created}
    add_weight_versions(meta, req, upto, current=version)
    out_ids = req.output_ids[:upto]
    if return_logprob:
        add_logprobs(meta, req, 0, upto, decode if return_text else None)
        meta.setdefault("input_token_logprobs", [])
        meta["output_token_logprobs_length"] = upto
    meta["completion_tokens"] = upto
    ids = list(out_ids)
    if incremental_stream:
        ids = ids[-1:]
    text = decode(out_ids) if decode is not None else ""
    return {"text": text, "output_ids": ids, "meta_info": meta}


def generate_result(req: Request, *, upto: int, since: int = 0, version: str,
                    return_logprob: bool, return_text: bool, decode, finished: bool) -> dict:
    """One /generate answer for ``req``: output positions ``[since, upto)`` (``since`` > 0 for
    SGLang's incremental streaming chunks; log-prob lists are sliced alike)."""
    meta = {"id": req.rid, "finish_reason": req.finish_reason if finished else None,
            "prompt_tokens": len(req.input_ids), "completion_tokens": upto,
            "cached_tokens": 0, "weight_version": version,
            "e2e_latency": time.time() - req.created}
    if finished:  # SGLang computes the spans for finished outputs only (output_streamer.py)
        add_weight_versions(meta, req, upto, current=version)
    if finished and req.return_routed_experts:
        routed = req.routed_experts()
        if routed is not None:  # base64 of int32 [positions, layers, top-k], as SGLang sends it
            meta["routed_experts"] = base64.b64encode(
                routed.contiguous().numpy().tobytes()).decode("ascii")
    ids = req.output_ids[since:upto]
    if return_logprob:
        add_logprobs(meta, req, since, upto, decode if return_text else None)
    text = ""
    if decode is not None:
        # A delta chunk's text is the difference of decoded prefixes (multi-byte tokens).
        full = decode(req.output_ids[:upto])
        if finished and req.stop_trim:
            full = full[:len(full) - req.stop_trim]
        text = full[len(decode(req.output_ids[:since])):] if since else full
    return {"text": text, "output_ids": ids, "meta_info": meta}
