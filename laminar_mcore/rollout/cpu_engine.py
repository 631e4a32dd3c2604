"""The built-in CPU engine: an HTTP server that speaks SGLang's protocol.

    python -m laminar_mcore.rollout.cpu_engine --model DIR --port P [--api-key KEY] [--host H]

Serves /generate (streaming or not, with ``output_token_logprobs``), the weight-update
endpoints (shared-memory bucket handles, disk, a gloo broadcast group), pause / continue /
abort, /flush_cache, /get_weight_version, /get_model_info, /get_load, /get_server_info and
/health. Malformed requests get a 4xx with a message and the server keeps serving. With
``--api-key`` every endpoint but /health needs ``Authorization: Bearer KEY``. It binds
127.0.0.1 unless ``--host`` says otherwise. It never imports trainer code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Dict, List, Optional

import torch
from aiohttp import web

from ..weights.bucket import decode_handle, open_handle
from .engine_core import EngineCore, Request, RequestError, SamplingParams
from .model import DecoderLM, load_decoder

logger = logging.getLogger("laminar_mcore.cpu_engine")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}, "success": False,
                              "message": message}, status=status)


class CpuEngineServer:
    def __init__(self, model: DecoderLM, model_path: str, *, api_key: Optional[str] = None,
                 kv_capacity_tokens: int = 16384, max_running_requests: int = 64,
                 weight_version: str = "0", seed: int = 0):
        eos = getattr(model.config, "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.core = EngineCore(model, kv_capacity_tokens=kv_capacity_tokens,
                               max_running_requests=max_running_requests, eos_token_ids=eos,
                               weight_version=weight_version, seed=seed)
        self.model_path = model_path
        self.api_key = api_key
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.dist_group: Optional[dict] = None
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 2**20)
        r = self.app.router
        r.add_post("/generate", self.generate)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/get_server_info", self.get_server_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    # ------------------------------------------------------------------ plumbing
    async def _on_startup(self, app):
        self.loop = asyncio.get_running_loop()
        self.core.start()

    async def _on_cleanup(self, app):
        self.core.stop()

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        try:
            return await handler(request)
        except HTTPError as exc:
            return _error(exc.status, exc.message)
        except RequestError as exc:
            return _error(400, str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001 - the server must keep serving
            logger.exception("error in %s", request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    async def _json(self, request: web.Request) -> dict:
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

    # ------------------------------------------------------------------ /generate
    def _result(self, req: Request) -> dict:
        meta = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": req.weight_versions[-1] if req.weight_versions else self.core.weight_version,
            "weight_versions": sorted(set(req.weight_versions)),
            "output_token_logprobs": [[lp, tok, None] for lp, tok in
                                      zip(req.output_logprobs, req.output_ids)],
            "e2e_latency": time.time() - req.created,
        }
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.created
        return {"text": None, "output_ids": list(req.output_ids), "meta_info": meta}

    def _parse_generate(self, body: dict) -> List[Request]:
        if "input_ids" not in body:
            raise HTTPError(400, "/generate needs input_ids (this engine has no tokenizer for text)")
        ids = body["input_ids"]
        batch = isinstance(ids, list) and ids and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                  for p in prompts):
            raise HTTPError(400, "input_ids must be a non-empty list of ints (or a list of such lists)")
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif not batch:
            rids = [rids]
        if not isinstance(rids, list) or len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
            raise HTTPError(400, "rid must be a string (a list of strings for a batch)")
        raw = body.get("sampling_params") or {}
        raws = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raws) != len(prompts) or not all(isinstance(r, dict) for r in raws):
            raise HTTPError(400, "sampling_params must be an object (or one per prompt)")
        return [Request(rid=rid, input_ids=list(p), params=SamplingParams.from_request(sp),
                        on_event=lambda *_: None)
                for rid, p, sp in zip(rids, prompts, raws)]

    async def generate(self, request: web.Request):
        body = await self._json(request)
        reqs = self._parse_generate(body)
        stream = bool(body.get("stream", False))
        if stream and len(reqs) > 1:
            raise HTTPError(400, "stream=true takes a single prompt")
        queues: List[asyncio.Queue] = []
        for req in reqs:
            q: asyncio.Queue = asyncio.Queue()
            queues.append(q)

            def on_event(r, finished, q=q):
                snapshot = self._result(r)
                self.loop.call_soon_threadsafe(q.put_nowait, (snapshot, finished))

            req.on_event = on_event
        for req in reqs:
            await self._command("add", req)
        if stream:
            return await self._stream(request, reqs[0], queues[0])
        results = []
        try:
            for q in queues:
                while True:
                    snapshot, finished = await q.get()
                    if finished:
                        results.append(snapshot)
                        break
        except asyncio.CancelledError:  # client went away: free the engine's work
            for req in reqs:
                self.core.submit("abort", (req.rid, False), lambda *_: None)
            raise
        return web.json_response(results if len(reqs) > 1 or isinstance(body["input_ids"][0], list)
                                 else results[0])

    async def _stream(self, request: web.Request, req: Request, q: asyncio.Queue):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                snapshot, finished = await q.get()
                await response.write(f"data: {json.dumps(snapshot)}\n\n".encode())
                if finished:
                    break
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.core.submit("abort", (req.rid, False), lambda *_: None)
            raise
        return response

    # ------------------------------------------------------------------ weights
    async def update_weights_from_tensor(self, request: web.Request):
        body = await self._json(request)
        fmt = body.get("load_format")
        if fmt != "flattened_bucket":
            raise HTTPError(400, f"load_format {fmt!r} is not supported by the CPU engine; "
                                 "use 'flattened_bucket'")
        serialized = body.get("serialized_named_tensors")
        if not isinstance(serialized, list) or len(serialized) != 1:
            raise HTTPError(400, "serialized_named_tensors must be a list with one entry per TP "
                                 "rank (the CPU engine has one)")
        try:
            handle = decode_handle(serialized[0])
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        abort_all = bool(body.get("abort_all_requests", False))
        version = body.get("weight_version")

        def load():
            if abort_all:
                self.core._cmd_abort(None, True)
            with open_handle(handle) as named:
                count = self.core.model.load_weights(named)
            if version is not None:
                self.core.weight_version = str(version)
            return count

        try:
            count = await self._command("call", load)
        except (ValueError, KeyError) as exc:
            raise HTTPError(400, f"weight update refused: {exc}") from None
        return web.json_response({"success": True, "message": f"updated {count} tensors",
                                  "weight_version": self.core.weight_version})

    async def update_weights_from_disk(self, request: web.Request):
        body = await self._json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise HTTPError(400, f"model_path {path!r} is not a directory")
        from ..models.hf import load_hf_config, load_hf_state_dict

        try:
            config = load_hf_config(path)
            if self.core.model.adapter.shape(config) != self.core.model.shape:
                raise ValueError("the checkpoint's architecture differs from the served model")
            state = await asyncio.to_thread(load_hf_state_dict, path)
        except ValueError as exc:
            raise HTTPError(400, f"cannot load {path}: {exc}") from None
        try:
            count = await self._command("update_weights", state, body.get("weight_version"),
                                        bool(body.get("abort_all_requests", False)))
        except ValueError as exc:
            raise HTTPError(400, f"weight update refused: {exc}") from None
        self.model_path = path
        return web.json_response({"success": True, "message": f"updated {count} tensors from {path}",
                                  "weight_version": self.core.weight_version})

    async def init_weights_update_group(self, request: web.Request):
        body = await self._json(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size",
                               "group_name") if k not in body]
        if missing:
            raise HTTPError(400, f"missing fields: {missing}")
        if self.dist_group is not None:
            raise HTTPError(409, f"weight update group {self.dist_group['name']!r} already exists")
        backend = body.get("backend", "gloo")
        if backend != "gloo":
            raise HTTPError(400, "the CPU engine joins weight update groups with backend 'gloo'")
        store_args = (str(body["master_address"]), int(body["master_port"]),
                      int(body["world_size"]), int(body["rank_offset"]))

        def join():
            import torch.distributed as dist

            host, port, world, rank = store_args
            store = dist.TCPStore(host, port, world, is_master=False,
                                  timeout=__import__("datetime").timedelta(seconds=60))
            pg = dist.ProcessGroupGloo(dist.PrefixStore(body["group_name"], store), rank, world)
            return {"name": body["group_name"], "pg": pg, "store": store, "rank": rank}

        try:
            self.dist_group = await asyncio.to_thread(join)
        except Exception as exc:  # noqa: BLE001 - a failed rendezvous is reported, not fatal
            raise HTTPError(400, f"cannot join weight update group: {exc}") from None
        return web.json_response({"success": True, "message": "joined"})

    async def update_weights_from_distributed(self, request: web.Request):
        body = await self._json(request)
        if self.dist_group is None or body.get("group_name") != self.dist_group["name"]:
            raise HTTPError(400, "no such weight update group; call /init_weights_update_group")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise HTTPError(400, "names, dtypes and shapes must be lists of one length")
        from ..weights.bucket import dtype_from_name

        try:
            tensors = [torch.empty(tuple(s), dtype=dtype_from_name(str(d).removeprefix("torch.")))
                       for d, s in zip(dtypes, shapes)]
        except (ValueError, TypeError) as exc:
            raise HTTPError(400, str(exc)) from None
        pg = self.dist_group["pg"]

        def receive():
            for t in tensors:  # the sender (rank 0 of the group) broadcasts in this order
                pg.broadcast(t, 0).wait()
            return dict(zip(names, tensors))

        named = await asyncio.to_thread(receive)
        try:
            count = await self._command("update_weights", named, body.get("weight_version"),
                                        bool(body.get("abort_all_requests", False)))
        except ValueError as exc:
            raise HTTPError(400, f"weight update refused: {exc}") from None
        return web.json_response({"success": True, "message": f"updated {count} tensors",
                                  "weight_version": self.core.weight_version})

    async def destroy_weights_update_group(self, request: web.Request):
        self.dist_group = None
        return web.json_response({"success": True})

    # ------------------------------------------------------------------ control
    async def pause_generation(self, request: web.Request):
        body = await self._json(request) if request.can_read_body else {}
        mode = await self._command("pause", body.get("mode", "abort"))
        return web.json_response({"success": True, "mode": mode})

    async def continue_generation(self, request: web.Request):
        await self._command("continue")
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request):
        body = await self._json(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if rid is None and not abort_all:
            raise HTTPError(400, "give rid or abort_all=true")
        count = await self._command("abort", rid, abort_all)
        return web.json_response({"success": True, "aborted": count})

    async def flush_cache(self, request: web.Request):
        try:
            await self._command("flush_cache")
        except RequestError as exc:
            return _error(400, str(exc))
        return web.Response(text="Cache flushed.")

    async def get_weight_version(self, request: web.Request):
        return web.json_response({"weight_version": self.core.weight_version})

    async def get_model_info(self, request: web.Request):
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "model_type": self.core.model.config.model_type,
                                  "weight_version": self.core.weight_version,
                                  "vocab_size": self.core.model.shape.vocab})

    async def get_load(self, request: web.Request):
        return web.json_response(self.core.stats())

    async def get_server_info(self, request: web.Request):
        info = {"model_path": self.model_path, "engine": "laminar-cpu",
                "internal_states": [self.core.stats()]}
        info.update(self.core.stats())
        return web.json_response(info)

    async def health(self, request: web.Request):
        return web.Response(text="ok")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "--model-path", dest="model", required=True,
                    help="Hugging Face checkpoint directory (Qwen2, Llama or Qwen3)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default=os.environ.get("LAMINAR_ENGINE_API_KEY"))
    ap.add_argument("--kv-capacity-tokens", type=int, default=16384)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not os.path.isdir(args.model):
        ap.error(f"--model {args.model!r} is not a directory")
    model = load_decoder(args.model)
    server = CpuEngineServer(model, args.model, api_key=args.api_key,
                             kv_capacity_tokens=args.kv_capacity_tokens,
                             max_running_requests=args.max_running_requests,
                             weight_version=args.weight_version, seed=args.seed)
    # Bind first so that --port 0 works: the chosen port is printed for launchers to read.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    print(f"LAMINAR_ENGINE_PORT={port}", flush=True)
    logger.info("serving %s on http://%s:%d", args.model, args.host, port)
    web.run_app(server.app, sock=sock, access_log=None, print=None)  # SIGINT/SIGTERM: clean exit


if __name__ == "__main__":
    main()
