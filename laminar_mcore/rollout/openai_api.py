"""The CPU engine's OpenAI-compatible routes, as SGLang 0.5.23 serves them: /v1/models,
/v1/completions and /v1/chat/completions (the tokenizer's chat template; ``n``; ``stop``;
log-probs), so that the ``openai`` Python client works unchanged. Streaming answers are not
served here (a 400 says so); multi-turn and agentic rollouts use the non-streaming forms.

Each choice is one engine request through the same path as /generate (reader lock, pause,
KV admission), so everything /generate guarantees holds here too.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import List, Optional

from aiohttp import web

from .engine_core import Request, SamplingParams
from .engine_http import HTTPError


def add_openai_routes(server) -> None:
    api = OpenAIRoutes(server)
    server.app.router.add_get("/v1/models", api.models)
    server.app.router.add_post("/v1/completions", api.completions)
    server.app.router.add_post("/v1/chat/completions", api.chat_completions)


def _finish(reason: Optional[dict]) -> str:
    kind = (reason or {}).get("type")
    return {"stop": "stop", "length": "length"}.get(kind, "abort")


class OpenAIRoutes:
    def __init__(self, server):
        self.server = server

    async def _open(self, request: web.Request, route: str):
        """The request body and the tokenizer, or a 400 saying what is missing."""
        body = await self.server._json(request)
        if self.server.tokenizer is None:
            raise HTTPError(400, f"{route} needs a tokenizer and this checkpoint has none; use "
                                 "/generate with input_ids")
        if body.get("stream"):
            raise HTTPError(400, "stream=true is not served by the CPU engine's OpenAI routes")
        return body, self.server.tokenizer

    async def models(self, request: web.Request):
        s = self.server
        return web.json_response({"object": "list", "data": [{
            "id": s.served_model_name, "object": "model", "created": int(s.started),
            "owned_by": "sglang", "root": s.served_model_name, "parent": None,
            "max_model_len": s.context_length}]})

    def _params(self, body: dict, prompt_len: int, default_max: Optional[int]) -> SamplingParams:
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
        if max_new is None:
            max_new = self.server.context_length - prompt_len
        raw = {"max_new_tokens": max_new, "temperature": body.get("temperature"),
               "top_p": body.get("top_p"), "stop": body.get("stop"),
               "min_p": body.get("min_p"), "top_k": body.get("top_k"),
               "min_new_tokens": body.get("min_tokens"), "ignore_eos": body.get("ignore_eos"),
               "sampling_seed": body.get("seed"), "stop_token_ids": body.get("stop_token_ids"),
               "frequency_penalty": body.get("frequency_penalty"),
               "presence_penalty": body.get("presence_penalty")}
        params = SamplingParams.from_request({k: v for k, v in raw.items() if v is not None})
        self.server._check_length(prompt_len, params.max_new_tokens)
        return params

    async def _run(self, prompts: List[List[int]], params: SamplingParams, n: int,
                   top: int) -> List[Request]:
        if n < 1:
            raise HTTPError(400, "n must be >= 1")
        reqs = [Request(rid=uuid.uuid4().hex, input_ids=list(p), params=params,
                        on_event=lambda *_: None, top_logprobs_num=top)
                for p in prompts for _ in range(n)]
        async with contextlib.aclosing(self.server.run_requests(reqs)) as events:
            async for _ in events:
                pass
        return reqs

    def _text(self, req: Request) -> str:
        text = self.server.decode(req.output_ids)
        return text[:len(text) - req.stop_trim] if req.stop_trim else text

    @staticmethod
    def _usage(reqs: List[Request], prompts: List[List[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def completions(self, request: web.Request):
        body, tok = await self._open(request, "/v1/completions")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            raise HTTPError(400, "prompt must be a string, a list of strings or a list of token ids")
        ids = [p if isinstance(p, list) else tok.encode(p, add_special_tokens=False) for p in prompts]
        params = self._params(body, max(len(p) for p in ids), 16)
        top = int(body.get("logprobs") or 0)
        reqs = await self._run(ids, params, int(body.get("n") or 1), top)
        choices = []
        for i, req in enumerate(reqs):
            logprobs = None
            if body.get("logprobs") is not None:
                tokens = [self.server.decode([t]) for t in req.output_ids]
                offsets, at = [], 0
                for t in tokens:
                    offsets.append(at)
                    at += len(t)
                logprobs = {"tokens": tokens, "token_logprobs": list(req.output_logprobs),
                            "top_logprobs": [{self.server.decode([t]): lp for lp, t in row}
                                             for row in req.output_top_logprobs] if top else None,
                            "text_offset": offsets}
            choices.append({"index": i, "text": self._text(req), "logprobs": logprobs,
                            "finish_reason": _finish(req.finish_reason),
                            "matched_stop": (req.finish_reason or {}).get("matched")})
        return web.json_response({"id": uuid.uuid4().hex, "object": "text_completion",
                                  "created": int(time.time()), "model": self.server.served_model_name,
                                  "choices": choices, "usage": self._usage(reqs, ids)})

    async def chat_completions(self, request: web.Request):
        body, tok = await self._open(request, "/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m for m in messages):
            raise HTTPError(400, "messages must be a non-empty list of {role, content} objects")
        if getattr(tok, "chat_template", None) is None:
            raise HTTPError(400, "the checkpoint's tokenizer has no chat template")
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        params = self._params(body, len(ids), None)
        top = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
        if body.get("logprobs") and top == 0:
            top = 1  # the chosen token's own entry; top_logprobs stays empty below
        reqs = await self._run([ids], params, int(body.get("n") or 1), top)
        choices = []
        for i, req in enumerate(reqs):
            logprobs = None
            if body.get("logprobs"):
                k = int(body.get("top_logprobs") or 0)
                content = []
                for lp, tid, row in zip(req.output_logprobs, req.output_ids,
                                        req.output_top_logprobs):
                    text = self.server.decode([tid])
                    content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                                    "top_logprobs": [
                                        {"token": self.server.decode([t]), "logprob": v,
                                         "bytes": list(self.server.decode([t]).encode())}
                                        for v, t in row[:k]]})
                logprobs = {"content": content}
            choices.append({"index": i, "message": {"role": "assistant", "content": self._text(req),
                                                    "reasoning_content": None, "tool_calls": None},
                            "logprobs": logprobs, "finish_reason": _finish(req.finish_reason),
                            "matched_stop": (req.finish_reason or {}).get("matched")})
        return web.json_response({"id": uuid.uuid4().hex, "object": "chat.completion",
                                  "created": int(time.time()), "model": self.server.served_model_name,
                                  "choices": choices, "usage": self._usage(reqs, [ids])})
