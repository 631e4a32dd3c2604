"""The CPU engine's control and status routes, with SGLang 0.5.23's semantics
(``srt/entrypoints/http_server.py``, ``srt/managers/tokenizer_manager.py``): pause (``abort``,
``retract``, ``in_place``), continue, abort (an empty 200; by id prefix), the cache flush
(deferred with ``?timeout=``), ``/model_info``, ``/server_info``, ``/v1/loads``, ``/health``
and ``/health_generate`` (a one-token generation answered after at least 1 s; 503 while
starting, shutting down, or after the health window without progress), ``/ready`` and
``/metrics``.

Mixed into ``CpuEngineServer``; it never imports trainer code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiohttp import web

from .engine_core import Request, SamplingParams
from .engine_http import HTTPError

logger = logging.getLogger("laminar_mcore.cpu_engine")


# SGLang 0.5.23's abort-mode pause sleeps this long between "abort all" rounds while a request
# still holds the model-update lock (tokenizer_manager.pause_generation)
ABORT_RECHECK_S = 1.0

class ControlRoutes:
    """Control and status handlers; the server provides ``core``, ``paused``, ``pause_cond``,
    ``model_update_lock``, ``server_status``, ``gracefully_exit``, ``last_receive``,
    ``health_window_s``, ``health_generation``, ``counters``, ``run_requests``, ``_command``
    and ``_json``."""

    # ------------------------------------------------------------------ control
    async def pause_generation(self, request: web.Request):
        """SGLang's ``/pause_generation``: ``abort`` aborts every request and answers once none
        holds the model-update lock; ``retract`` moves running requests back to the waiting
        queue (their KV freed); ``in_place`` only stops stepping (a later update must not
        flush: see ``/flush_cache?timeout=``)."""
        body = await self._json(request, empty_ok=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPError(400, f"mode must be abort, retract or in_place, not {str(mode)[:40]!r}")
        async with self.pause_cond:
            self.paused = True
            if mode == "abort":  # SGLang: abort all, re-check the update lock once a second
                while True:
                    # fire and forget, as SGLang's tokenizer manager sends it to the scheduler
                    # (which it does not pause in this mode: new requests wait here)
                    self.core.submit("abort", (None, True), lambda *_: None)
                    if not self.model_update_lock.readers:
                        break
                    await asyncio.sleep(ABORT_RECHECK_S)
            await self._command("pause", mode)  # (the status the engine reports)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request):
        await self._json(request, empty_ok=True)
        async with self.pause_cond:
            self.paused = False
            await self._command("continue")
            self.pause_cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def abort_request(self, request: web.Request):
        """SGLang's ``/abort_request``: an empty 200 (requests whose id starts with ``rid``,
        or all of them, end with finish_reason abort)."""
        body = await self._json(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise HTTPError(400, "rid must be a string and abort_all a boolean")
        await self._command("abort", rid, abort_all)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request):
        """SGLang's ``/flush_cache?timeout=S``: refused (400) while requests run; with a
        timeout it waits until the engine is idle, up to S seconds."""
        raw = request.query.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = float("nan")
        if not timeout >= 0 or timeout == float("inf"):
            raise HTTPError(400, f"timeout must be a number >= 0 (seconds), not {raw[:40]!r}")
        success, message = await self._command("flush_cache", timeout)
        if success:
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                     "(When there are running or waiting requests, the operation "
                                     "will not be performed.)\n")
        return web.Response(text=message or "Flush cache failed.\n", status=400)

    # ------------------------------------------------------------------ status
    async def model_info(self, request: web.Request):
        cfg = self.core.model.config
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.served_version, "load_format": "auto",
            "model_type": cfg.model_type, "architectures": getattr(cfg, "architectures", None),
            "has_image_understanding": False, "has_audio_understanding": False})

    def load_snapshot(self) -> dict:
        """One DP rank's entry of SGLang's /v1/loads (LoadSnapshot core fields)."""
        st = self.core.stats()
        return {"timestamp": time.time(), "dp_rank": 0,
                "num_running_reqs": st["num_running_reqs"],
                "num_waiting_reqs": st["num_waiting_reqs"],
                "num_used_tokens": st["num_used_tokens"],
                "num_total_tokens": st["num_used_tokens"],
                "max_total_num_tokens": st["max_total_num_tokens"],
                "max_running_requests": st["max_running_requests"],
                "token_usage": st["token_usage"], "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": st["num_running_reqs"] / max(st["max_running_requests"], 1)}

    async def loads(self, request: web.Request):
        include = request.query.get("include")
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if include and not set(s.strip() for s in include.split(",")) <= valid:
            raise HTTPError(400, f"Invalid include sections: {include}. Valid options: {sorted(valid)}")
        load = self.load_snapshot()
        if not include or "queues" in include or "all" in include:
            st = self.core.stats()
            load["queues"] = {"waiting": st["num_waiting_reqs"], "grammar": 0,
                              "paused": st["num_running_reqs"] if st["paused"] == "in_place" else 0,
                              "retracted": 0, "prealloc_ready": 0}
        return web.json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "version": "0.5.23", "accelerator": None,
                                  "num_accelerators": 0, "loads": [load]})

    async def server_info(self, request: web.Request):
        st = self.core.stats()
        return web.json_response({**self.server_args, "startup_time": self.started,
                                  "internal_states": [st],
                                  "version": "0.5.23", "frontend": "laminar-cpu"})

    async def health(self, request: web.Request):
        """SGLang 0.5.23's ``/health`` and ``/health_generate`` (``http_server.health_generate``):
        503 while starting or shutting down; otherwise a one-token generation is submitted and
        the answer is 200 as soon as the scheduler has reported any progress since the probe
        began (checked every second, so never sooner than 1 s), or 503 after
        ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20) without any -- e.g. while generation is
        paused with nothing running, when the probe waits at the pause gate. A failed probe
        marks the server unhealthy (``/ready`` 503) until one succeeds.
        ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` makes ``/health`` a plain 200."""
        if self.gracefully_exit or self.server_status == "Starting":
            return web.Response(status=503)
        if request.path == "/health" and not self.health_generation:
            return web.Response(status=200)
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                      params=SamplingParams(max_new_tokens=1, temperature=0.0),
                      on_event=lambda *_: None)

        async def gen():
            async with contextlib.aclosing(self.run_requests([req], count=False)) as events:
                async for *_, finished in events:
                    if finished:
                        return

        task = asyncio.get_running_loop().create_task(gen())
        tic = time.time()
        try:
            while time.time() < tic + self.health_window_s:
                await asyncio.sleep(1)
                if self.last_receive > tic:
                    self.server_status = "Up"
                    return web.Response(status=200)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        logger.error("Health check failed: no scheduler output for %g s", self.health_window_s)
        self.server_status = "UnHealthy"
        return web.Response(status=503)


    async def ready(self, request: web.Request):
        """SGLang's ``/ready``: 200 when started, healthy and not paused (does not generate)."""
        up = self.server_status == "Up" and not self.gracefully_exit and not self.paused
        return web.Response(status=200 if up else 503)

    async def metrics(self, request: web.Request):
        """Prometheus text: SGLang's metric names for what this engine measures."""
        st = self.core.stats()
        gauges = {"sglang:num_running_reqs": st["num_running_reqs"],
                  "sglang:num_queue_reqs": st["num_waiting_reqs"],
                  "sglang:num_used_tokens": st["num_used_tokens"],
                  "sglang:token_usage": st["token_usage"],
                  "sglang:max_total_num_tokens": st["max_total_num_tokens"]}
        counters = {"sglang:prompt_tokens_total": self.counters["prompt_tokens"],
                    "sglang:generation_tokens_total": self.counters["generation_tokens"],
                    "sglang:num_requests_total": self.counters["requests"],
                    "sglang:num_retractions_total": st["retractions"]}
        lines = []
        label = f'{{model_name="{self.served_model_name}"}}'
        for kind, values in (("gauge", gauges), ("counter", counters)):
            for name, value in values.items():
                lines += [f"# TYPE {name} {kind}", f"{name}{label} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
