"""The built-in CPU engine: an HTTP server that speaks SGLang 0.5.23's protocol.

    python -m laminar_mcore.rollout.cpu_engine --model DIR --port P [--api-key KEY] [--host H]

It is SGLang's twin in every test, so it serves what SGLang 0.5.23 serves and refuses what it
refuses (README: "The CPU engine and SGLang"): /generate (token or text prompts, batches,
cumulative or ``--incremental-streaming-output`` streams every ``--stream-interval`` tokens,
log-probs of output and prompt, top log-probs, stop strings, weight-version spans); weight
updates from shared-memory bucket handles or a gloo group only inside
``/begin_weight_update`` ... ``/end_weight_update``, and from disk; updates wait for running
requests unless generation is paused; ``flush_cache`` honoured; pause / continue / abort;
/model_info, /server_info, /v1/loads, /health, /health_generate, /ready, /metrics and the
OpenAI-compatible /v1/models, /v1/completions, /v1/chat/completions. Malformed requests get a
4xx with a message and the server keeps serving. ``--api-key`` works as SGLang's. It binds
127.0.0.1 unless ``--host`` says otherwise. It never imports trainer code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from aiohttp import web

from .engine_contract import contract_error
from .engine_core import EngineCore, Request, RequestError, SamplingParams
from .engine_http import (HTTPError, RWLock, auth_allowed, error_response, generate_result,
                          unauthorized, waiting_abort_result)
from .engine_control import ControlRoutes
from .engine_weights import WeightUpdateRoutes, rank_layout
from .model import DecoderLM, load_decoder

logger = logging.getLogger("laminar_mcore.cpu_engine")
# SGLang's SGLANG_FORCE_STREAM_INTERVAL: a non-stream request's outputs reach the tokenizer
# manager every this many tokens
FORCE_STREAM_INTERVAL = int(os.environ.get("SGLANG_FORCE_STREAM_INTERVAL", 50))
SHUTDOWN_S = 1.0  # how long pending handlers get to finish after SIGTERM


def load_tokenizer(model_path: str):
    """The checkpoint's tokenizer, or None when it has none (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(model_path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


@dataclass
class ServerArgs:
    """The CPU engine's share of SGLang's ``ServerArgs`` (same names and meanings)."""

    model_path: str
    api_key: Optional[str] = None
    max_total_tokens: int = 16384  # the KV cache, in tokens
    max_running_requests: int = 64
    weight_version: str = "default"
    random_seed: int = 0
    context_length: Optional[int] = None  # prompt + max_new_tokens; None: the model's
    enable_deterministic_inference: bool = False
    incremental_streaming_output: bool = False
    stream_interval: int = 1
    served_model_name: Optional[str] = None
    enable_return_routed_experts: bool = False
    tp_size: int = 1  # TP ranks: weight payloads per rank (engine_weights); one CPU computes
    ep_size: int = 1  # expert parallel size: which experts a rank's payload holds
    # Twin knobs (not SGLang flags): a big model's start-up (503 "Starting" on /health,
    # /health_generate, /ready this long); a slower GPU's decode step (each this much longer).
    startup_delay_s: float = 0.0
    decode_delay_s: float = 0.0


class CpuEngineServer(ControlRoutes, WeightUpdateRoutes):
    def __init__(self, model: DecoderLM, args: ServerArgs, tokenizer: Any = None):
        eos = getattr(model.config, "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.tokenizer = tokenizer
        self.decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) \
            if tokenizer is not None else None
        self.core = EngineCore(model, kv_capacity_tokens=args.max_total_tokens,
                               max_running_requests=args.max_running_requests, eos_token_ids=eos,
                               weight_version=args.weight_version, seed=args.random_seed,
                               deterministic=args.enable_deterministic_inference,
                               decode=self.decode, decode_delay_s=args.decode_delay_s)
        self.model_path = args.model_path
        # /model_info's version: SGLang's tokenizer side, set only by an update that succeeds
        self.served_version = args.weight_version
        self.tp_size, self.layout = rank_layout(model, args.tp_size, args.ep_size)
        self.served_model_name = args.served_model_name or args.model_path
        self.context_length = int(args.context_length or model.config.max_position_embeddings)
        self.incremental = args.incremental_streaming_output
        self.stream_interval = max(1, int(args.stream_interval))
        self.api_key = args.api_key
        self.started = time.time()
        self.startup_delay_s = float(args.startup_delay_s)
        # SGLang's ServerStatus: Starting until start-up is done, then Up; UnHealthy after a
        # failed health check (until one succeeds again); gracefully_exit on shutdown.
        self.server_status = "Starting"
        self.gracefully_exit = False
        self.last_receive = 0.0  # when the scheduler last reported progress of any request
        self.health_window_s = float(int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)))
        self.health_generation = os.environ.get(
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("true", "1", "yes", "y")
        # what /server_info reports (the key never leaves the server)
        self.server_args = dict(asdict(args), api_key=None, context_length=self.context_length,
                                stream_interval=self.stream_interval,
                                served_model_name=self.served_model_name)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.dist_group: Optional[dict] = None
        self.session_open = False  # a weight-update session (begin ... end)
        self.paused = False
        self.model_update_lock: Optional[RWLock] = None
        self.pause_cond: Optional[asyncio.Condition] = None
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 2**20)
        r = self.app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        for path in ("begin_weight_update", "end_weight_update", "update_weights_from_tensor",
                     "update_weights_from_disk", "init_weights_update_group",
                     "update_weights_from_distributed", "destroy_weights_update_group",
                     "update_weight_version", "pause_generation", "continue_generation",
                     "abort_request"):
            r.add_post("/" + path, getattr(self, path))
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        for path, handler in {"model_info": self.model_info, "server_info": self.server_info,
                              "get_model_info": self.model_info,  # deprecated aliases, still
                              "get_server_info": self.server_info,  # served by 0.5.23
                              "v1/loads": self.loads, "health": self.health,
                              "health_generate": self.health, "ready": self.ready,
                              "metrics": self.metrics}.items():
            r.add_get("/" + path, handler)
        from .openai_api import add_openai_routes

        add_openai_routes(self)
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)
        self.app.on_cleanup.append(self._on_cleanup)

    # ------------------------------------------------------------------ plumbing
    async def _on_startup(self, app):
        self.loop = asyncio.get_running_loop()
        self.model_update_lock = RWLock()
        self.pause_cond = asyncio.Condition()
        self.core.start()
        if self.startup_delay_s > 0:
            async def up_later():
                await asyncio.sleep(self.startup_delay_s)
                self.server_status = "Up"

            self._startup_task = asyncio.get_running_loop().create_task(up_later())
        else:
            self.server_status = "Up"

    async def _on_shutdown(self, app):
        """SIGTERM: /health answers 503 from now on, requests waiting at the pause gate are
        refused, running ones are aborted (a stream ends with an error chunk saying why) --
        so the server exits within ``SHUTDOWN_S`` whatever is pending."""
        self.gracefully_exit = True
        async with self.pause_cond:
            self.pause_cond.notify_all()
        for _ in range(3):  # and any that got past the gate just before
            self.core.submit("abort", (None, True), lambda *_: None)
            await asyncio.sleep(0.1)

    async def _on_cleanup(self, app):
        self.core.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if not auth_allowed(request.path, request.method, request.headers.get("Authorization"),
                            self.api_key):
            return unauthorized()
        try:
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message)
        except RequestError as exc:
            return error_response(400, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - the server must keep serving
            logger.exception("error in %s", request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}")

    async def _json(self, request: web.Request, empty_ok: bool = False) -> dict:
        if empty_ok and not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any parse failure is a client error
            raise HTTPError(400, "request body must be a JSON object") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    async def _command(self, name: str, *args):
        future = self.loop.create_future()

        def done(result, error):
            self.last_receive = time.time()  # a reply of the scheduler, as SGLang counts it

            def settle():
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            self.loop.call_soon_threadsafe(settle)

        self.core.submit(name, args, done)
        return await future

    # ------------------------------------------------------------------ generation
    def encode(self, text: str) -> List[int]:
        if self.tokenizer is None:
            raise HTTPError(400, "text prompts need a tokenizer and this checkpoint has none; "
                                 "send input_ids")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _per_prompt(self, value, n: int, name: str) -> list:
        if isinstance(value, list) and (n > 1 or (value and isinstance(value[0], (dict, list)))):
            if len(value) != n:
                raise HTTPError(400, f"{name} has {len(value)} entries for {n} prompts")
            return value
        return [value] * n

    def parse_generate(self, body: dict) -> Tuple[List[Request], bool]:
        """SGLang's GenerateReqInput: ``input_ids`` or ``text`` (one or a batch), rid (a list,
        or a string that batch entries extend with ``_i``), per-prompt options. Returns the
        requests and whether the body was a batch (answered with a list)."""
        if (body.get("input_ids") is None) == (body.get("text") is None):
            raise HTTPError(400, "Either text or input_ids should be provided.")
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
            prompts = ids if batch else [ids]
        else:
            text = body["text"]
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise HTTPError(400, "text must be a string or a list of strings")
            prompts = [self.encode(t) for t in texts]
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                  for p in prompts):
            raise HTTPError(400, "input_ids must be a non-empty list of ints (or a list of such lists)")
        n = len(prompts)
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif isinstance(rid, str):
            rids = [rid] if not batch else [f"{rid}_{i}" for i in range(n)]
        elif isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
            rids = rid
        else:
            raise HTTPError(400, "The rid should be a string or a list of strings (one per prompt).")
        raws = self._per_prompt(body.get("sampling_params") or {}, n, "sampling_params")
        starts = self._per_prompt(body.get("logprob_start_len"), n, "logprob_start_len")
        tops = self._per_prompt(body.get("top_logprobs_num"), n, "top_logprobs_num")
        # SGLang captures routings only when started with --enable-return-routed-experts (and
        # then silently returns none otherwise); the flag is per request, not per prompt
        routed = bool(body.get("return_routed_experts")) and \
            bool(self.server_args.get("enable_return_routed_experts"))
        routed_start = body.get("routed_experts_start_len", 0)
        if not isinstance(routed_start, int):
            raise HTTPError(400, "routed_experts_start_len must be an integer")
        reqs = []
        for rid_i, prompt, raw, start, top in zip(rids, prompts, raws, starts, tops):
            if not isinstance(raw, dict):
                raise HTTPError(400, "sampling_params must be an object (or one per prompt)")
            params = SamplingParams.from_request(raw)
            if params.n != 1:
                raise HTTPError(400, "sampling_params.n > 1 is not supported by the CPU engine's "
                                     "/generate; send a batch (the OpenAI routes take n)")
            self._check_length(len(prompt), params.max_new_tokens)
            start = -1 if start is None else int(start)
            if start >= len(prompt):
                raise HTTPError(400, f"logprob_start_len ({start}) is not inside the prompt "
                                     f"({len(prompt)} tokens)")
            reqs.append(Request(rid=rid_i, input_ids=list(prompt), params=params,
                                on_event=lambda *_: None, logprob_start_len=start,
                                top_logprobs_num=int(top or 0), return_routed_experts=routed,
                                routed_experts_start_len=routed_start))
        return reqs, batch

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """SGLang's context-length checks (tokenizer_manager._validate_one_request)."""
        if prompt_len >= self.context_length:
            raise HTTPError(400, f"The input ({prompt_len} tokens) is longer than the model's "
                                 f"context length ({self.context_length} tokens).")
        if prompt_len + max_new_tokens > self.context_length:
            raise HTTPError(400, "Requested token count exceeds the model's maximum context length "
                                 f"of {self.context_length} tokens. You requested a total of "
                                 f"{prompt_len + max_new_tokens} tokens: {prompt_len} tokens from "
                                 f"the input messages and {max_new_tokens} tokens for the "
                                 "completion. Please reduce the number of tokens in the input "
                                 "messages or the completion to fit within the limit.")

    async def run_requests(self, reqs: List[Request], count: bool = True):
        """Submit ``reqs`` (holding the model-update reader lock, as SGLang) and yield
        ``(index, request, tokens so far, finished)`` as they progress. ``count=False``: not in
        the request counters (health checks, as SGLang's ``log_metrics=False``)."""
        self._refuse_when_exiting()
        async with self.pause_cond:
            await self.pause_cond.wait_for(lambda: not self.paused or self.gracefully_exit)
        self._refuse_when_exiting()
        async with self.model_update_lock.reader():
            events: asyncio.Queue = asyncio.Queue()
            for i, req in enumerate(reqs):
                def on_event(r, finished, i=i):
                    self.last_receive = time.time()
                    self.loop.call_soon_threadsafe(events.put_nowait, (i, len(r.output_ids), finished))

                req.on_event = on_event
            added = []
            try:
                for req in reqs:
                    await self._command("add", req)
                    added.append(req)
                    if count:
                        self.counters["requests"] += 1
                        self.counters["prompt_tokens"] += len(req.input_ids)
                pending = len(reqs)
                while pending:
                    i, n, finished = await events.get()
                    if finished:
                        pending -= 1
                        if count:
                            self.counters["generation_tokens"] += n
                    yield i, reqs[i], n, finished
            finally:  # client gone or an error: free the engine's work
                for req in added:
                    if req.finish_reason is None:
                        self.core.submit("abort", (req.rid, False), lambda *_: None)

    def _refuse_when_exiting(self) -> None:
        if self.gracefully_exit:
            raise HTTPError(503, "The server is shutting down; send the request to another "
                                 "engine")

    def result(self, req: Request, upto: int, since: int, finished: bool, body: dict,
               stream: bool = False, sent: Optional[int] = None) -> dict:
        """``sent``: the output tokens the scheduler has already sent for a stream; SGLang's
        tokenizer manager knows only those (a non-stream request's, every
        ``SGLANG_FORCE_STREAM_INTERVAL`` = 50 tokens), and answers a waiting-queue abort
        from them: tokens generated since are dropped."""
        if finished and req.aborted_waiting:
            if sent is None:
                sent = len(req.output_ids) - len(req.output_ids) % FORCE_STREAM_INTERVAL
            return waiting_abort_result(
                req, upto=sent, version=self.core.weight_version,
                return_logprob=bool(body.get("return_logprob")),
                return_text=bool(body.get("return_text_in_logprobs")), decode=self.decode,
                incremental_stream=stream and self.incremental)
        return generate_result(req, upto=upto, since=since, version=self.core.weight_version,
                               return_logprob=bool(body.get("return_logprob")),
                               return_text=bool(body.get("return_text_in_logprobs")),
                               decode=self.decode, finished=finished)

    async def generate(self, request: web.Request):
        body = await self._json(request)
        problem = contract_error(body)
        if problem is not None:  # SGLang's schema gate (api_contract): 400, stream or not
            raise HTTPError(400, problem)
        try:
            reqs, batch = self.parse_generate(body)
            if body.get("stream") and len(reqs) > 1:
                raise HTTPError(400, "stream=true takes a single prompt in the CPU engine")
        except (RequestError, HTTPError) as exc:
            if not body.get("stream"):
                raise
            # refused past the gate (SGLang: a ValueError of generate_request): a stream
            # answers HTTP 200, one error chunk, [DONE]
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_error_chunk(exc) + b"data: [DONE]\n\n")
            return response
        if body.get("stream"):
            return await self._stream(request, reqs[0], body)
        done: Dict[int, dict] = {}
        async with contextlib.aclosing(self.run_requests(reqs)) as events:
            async for i, req, n, finished in events:
                if finished:
                    done[i] = self.result(req, n, 0, True, body)
        if self.gracefully_exit and any(d["meta_info"]["finish_reason"].get("type") == "abort"
                                        for d in done.values()):
            self._refuse_when_exiting()  # ended by the shutdown
        return web.json_response([done[i] for i in range(len(reqs))] if batch else done[0])

    async def _stream(self, request: web.Request, req: Request, body: dict):
        """SSE: cumulative chunks (SGLang's default) or, with --incremental-streaming-output,
        only what is new; every stream_interval tokens and at the end; ``[DONE]`` last. An
        error after the stream started is a ``data: {"error": ...}`` chunk, as in SGLang."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        interval = req.params.stream_interval or self.stream_interval
        sent = 0
        try:
            async with contextlib.aclosing(self.run_requests([req])) as events:
                async for _, _, n, finished in events:
                    # SGLang's output streamer: every token at interval 1, else the first
                    # token at once and then whenever ``interval`` tokens are unsent
                    if not finished and not (interval == 1 or n - sent >= interval
                                             or (sent == 0 and n > 0)):
                        continue
                    if finished and self.gracefully_exit and req.finish_reason and \
                            req.finish_reason.get("type") == "abort":
                        self._refuse_when_exiting()  # ended by the shutdown: an error chunk
                    since = sent if self.incremental else 0
                    chunk = self.result(req, n, since, finished, body, stream=True, sent=sent)
                    sent = n
                    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        except (RequestError, HTTPError) as exc:
            await response.write(_error_chunk(exc))
        await response.write(b"data: [DONE]\n\n")
        return response


def _error_chunk(exc: Exception) -> bytes:
    """SGLang's in-stream error chunk (``http_server.serve_generate_request``)."""
    code = exc.status if isinstance(exc, HTTPError) else 400
    error = {"error": {"message": str(exc), "type": "invalid_request_error"
                       if code == 400 else "service_unavailable",
                       "code": code, "retryable": code == 503}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "--model-path", dest="model", required=True,
                    help="Hugging Face checkpoint directory (Qwen2, Llama or Qwen3)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default=os.environ.get("LAMINAR_ENGINE_API_KEY"))
    ap.add_argument("--kv-capacity-tokens", type=int, default=16384)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1, help="TP ranks")
    ap.add_argument("--ep-size", "--expert-parallel-size", "--ep", dest="ep_size", type=int,
                    default=1, help="expert parallel size (SGLang's; divides --tp-size)")
    ap.add_argument("--weight-version", default="default",
                    help="the version /model_info reports until an update sets one (SGLang's)")
    ap.add_argument("--context-length", type=int, default=None,
                    help="prompt + max_new_tokens limit (default: max_position_embeddings)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="stream a chunk every N tokens (SGLang's --stream-interval)")
    ap.add_argument("--incremental-streaming-output", action="store_true",
                    help="stream chunks carry only new tokens (SGLang's flag; default cumulative)")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="honour sampling_params.sampling_seed (ignored otherwise, as in SGLang)")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="capture MoE routings so /generate can return them (SGLang's flag)")
    ap.add_argument("--startup-delay-s", type=float, default=0.0,
                    help="answer 503 on /health and /ready for this long after binding, as a big "
                         "model's start-up does (a twin knob for tests; not an SGLang flag)")
    ap.add_argument("--decode-delay-s", type=float, default=0.0,
                    help="sleep this long after each decode step (a twin knob for tests)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not os.path.isdir(args.model):
        ap.error(f"--model {args.model!r} is not a directory")
    model = load_decoder(args.model)
    same = {k: v for k, v in vars(args).items() if k in ServerArgs.__dataclass_fields__}
    server = CpuEngineServer(model, ServerArgs(
        model_path=args.model, max_total_tokens=args.kv_capacity_tokens, random_seed=args.seed,
        **same),
        tokenizer=load_tokenizer(args.model))
    # Bind first so that --port 0 works: the chosen port is printed for launchers to read.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    print(f"LAMINAR_ENGINE_PORT={port}", flush=True)
    logger.info("serving %s on http://%s:%d", args.model, args.host, port)
    # SIGINT/SIGTERM: stop listening, end every pending request (_on_shutdown), give handlers
    # SHUTDOWN_S to write their last chunk, exit
    web.run_app(server.app, sock=sock, access_log=None, print=None, shutdown_timeout=SHUTDOWN_S)


if __name__ == "__main__":
    main()
