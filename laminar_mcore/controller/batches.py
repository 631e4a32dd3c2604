"""The trainer's side of the controller's API: batches out, steps in.

Trainer rank 0 takes whole GRPO groups with ``GET /batch?timeout=`` (a long poll: 204 when none
is ready in time, 503 once the controller stops, ``{"stop": true}`` when a stop file asks the
run to end after the step it finished), reports each step with ``POST /trained`` (its step,
version, stats and the seconds it waited or was blocked publishing) and the end with
``POST /done``. Each consumed trajectory is recorded with its version and staleness, traced
(data/trace.py) and logged; a step's record is one ``train`` line of metrics.jsonl. Every body
and query is checked field by field (a bad one is a 400 naming the field).

Mixed into ``Controller`` (controller/server.py), which provides the pools, the manager, the
metrics, ``cfg`` and the run's counters. It never touches the engines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from aiohttp import web

from ..netutil import Field, error_response, read_json, read_query

logger = logging.getLogger(__name__)

COUNT = Field("int", low=0)
SECONDS = Field("number", low=0, high=1e7)
# what an agent episode's trajectory reports (agents/gateway.py Session.counts)
AGENT_COUNTS = ("turns", "tool_calls", "tool_errors", "malformed_tool_calls")
BATCH_QUERY = {"timeout": Field("number", low=0, high=3600)}
TRAINED = {"step": Field("int", required=True, low=0), "version": Field("int", required=True, low=0),
           "stats": Field("dict", max_len=1024), "publish_blocked_s": SECONDS, "wait_s": SECONDS}
DONE = {"steps": COUNT, "version": Field("int", required=True, low=0)}
REFUSED = {"version": Field("int", required=True, low=0),
           "reason": Field("str", max_len=2000)}


class TrainerAPI:
    """``/batch``, ``/trained`` and ``/done`` (see the module docstring)."""

    def _add_batch_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/batch", self._batch)
        router.add_post("/trained", self._trained)
        router.add_post("/done", self._done)
        router.add_post("/refused", self._refused)

    async def _refused(self, request: web.Request):
        """A trainer stage lead: the master relay refused version ``version`` (all its
        buffers held past weight_sync.relay_full_wait_s). No engine can get that version:
        barrier modes generate with the newest the relays hold instead of waiting for it."""
        body = await read_json(request, REFUSED)
        self.manager.refused_versions.add(int(body["version"]))
        logger.warning("the master relay refused version %d (%s): barrier modes generate with "
                       "the newest version the relays hold", body["version"],
                       body.get("reason") or "no reason given")
        self.manager.notify()
        return web.json_response({"ok": True})

    async def _done(self, request: web.Request):
        """Trainer rank 0: training finished (``{"steps", "version"}``)."""
        body = await read_json(request, DONE)
        self.trainer_done = body
        self.trainer_done_event.set()
        return web.json_response({"ok": True})

    async def _batch(self, request: web.Request):
        timeout = read_query(request, BATCH_QUERY).get("timeout", 30.0)
        if self.first_request is None:
            self.first_request = time.time()
        if self.manager is not None and not self.manager.admitting:
            self.manager.admitting = True  # rollout.generate_before_trainer=false: start now
            self.manager.notify()
        if self.stop_file and os.path.exists(self.stop_file):
            # a graceful stop: the trainer ends after the step it finished (summary as usual)
            return web.json_response({"stop": True})
        batch = await asyncio.to_thread(self._take, self.batch_prompts, timeout)
        if self.closing and batch is None:
            return error_response(503, "LMC-E402", "shutting down")
        if batch is None:
            return web.Response(status=204)
        self.manager.notify()  # the buffer has room again
        now = time.time()
        staleness = [self.trainer_version - t.weight_version for t in batch]
        for t in batch:
            t.timings["consumed"] = now
            seen = t.versions_seen()
            if seen and seen != [str(t.weight_version)]:
                self.mixed_version_consumed += 1
            record = {"uid": t.uid, "version": t.weight_version,
                      "staleness": self.trainer_version - t.weight_version,
                      "reward": t.reward, "tokens": len(t.response_ids)}
            if seen:  # by its newest token too (areal: an interrupted one's tokens span versions)
                record["staleness_newest"] = self.trainer_version - max(int(v) for v in seen)
            record.update({k: t.metadata[k] for k in AGENT_COUNTS if k in t.metadata})
            self.consumed.append(record)
        self.max_staleness_observed = max([self.max_staleness_observed] + staleness)
        for s in staleness:
            self.staleness.observe(s)
        # thousands of records a step at scale: written off the loop that drives the engines
        await asyncio.to_thread(self.trace.consumed, batch, self.trainer_version)
        return web.json_response({"trajectories": [t.to_dict() for t in batch],
                                  "staleness": staleness})

    def _take(self, groups: int, timeout: float):
        """``buffer.take``, woken by a stop (``_wake_long_polls``): then None at once."""
        with self.buffer.cond:
            self.buffer.cond.wait_for(
                lambda: self.closing or self.buffer.ready_groups >= groups, timeout=timeout)
            if self.closing:
                return None
            return self.buffer.take(groups, 0)

    async def _trained(self, request: web.Request):
        body = await read_json(request, TRAINED)
        step, version = body["step"], body["version"]
        self.trainer_version = max(self.trainer_version, version)
        self.manager.drop_stale()  # laminar: what is now more than eta behind is never trained
        self.manager.notify()  # barrier modes follow the trainer; admission grows with it
        self.trainer_wait_s += float(body.get("wait_s", 0.0))
        now = time.time()
        elapsed, self.last_step_time = now - self.last_step_time, now
        batch = self.consumed[-self.batch_prompts * self.n_samples:]
        tokens = sum(c["tokens"] for c in batch)
        self.step_marks.append((now, tokens, float(body.get("wait_s", 0.0))))
        self.version_times[version] = now
        interval = self.cfg.trainer.eval_interval
        if interval and step % interval == 0 and step < self.cfg.trainer.total_steps \
                and not self.cfg.trainer.eval_offline:  # offline: after training (role.py)
            self._eval_tasks.append(asyncio.create_task(self._evaluate_version(step, version)))
        # the engines' idle seconds at the first and the latest step: their idle share over
        # the trainer's own window (not the shutdown after the last step)
        self._idle_last = (now, self.manager.engine_idle_seconds(now),
                           self.manager.quiet_seconds(now))
        if len(self.step_marks) == 1:
            self._idle_mark = self._idle_last
        stats = {k: v for k, v in dict(body.get("stats", {})).items()
                 if isinstance(v, (int, float)) and k not in ("version", "step")}
        self.metrics.log(
            "train", step=step, version=version, reward_mean=sum(c["reward"] for c in batch) / max(len(batch), 1),
            staleness_mean=sum(c["staleness"] for c in batch) / max(len(batch), 1),
            staleness_max=max((c["staleness"] for c in batch), default=0),
            tokens_per_s=tokens / max(elapsed, 1e-9), step_seconds=elapsed,
            buffered=self.buffer.buffered, generated=self.manager.stats.generated,
            engine_pulls=self.manager.stats.pulls, repacked=self.manager.stats.repacked, publish_blocked_s=body.get("publish_blocked_s", 0.0),
            **stats)
        return web.json_response({"ok": True})
