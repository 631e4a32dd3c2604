"""The controller watches the trainer nodes of a multi-node run, so a trainer node that dies
stops the whole run instead of leaving every other role waiting.

Local rank 0 of every trainer node (``job=trainer``) reports ``POST /trainer_alive`` every
couple of seconds: its global rank, torchrun's node index (``GROUP_RANK``), its host name. A
node that has reported and then falls silent for half of ``trainer.collective_timeout_s`` is
taken for dead (its host gone, its link cut, or the process hung): the controller stops the
run with a message naming the node, and says so to the surviving ranks in its answer to their next report (they stop
their torchrun agents, trainer/watch.py). Half the time-out: the run stops before the
survivors' own collectives would time out, and a torchrun restart of the world (a crashed
rank: every rank restarts and its node reports again within seconds) is far inside it.

Mixed into ``Controller`` (controller/server.py), which provides ``cfg`` and ``_fault``.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from aiohttp import web

from ..netutil import Field, read_json

TRAINER_ALIVE = {"rank": Field("int", required=True, low=0, high=1 << 20),
                 "node": Field("int", required=True, low=0, high=1 << 20),
                 "host": Field("str", required=True, max_len=255),
                 "restarts": Field("int", low=0, high=1 << 20)}


class TrainerWatch:
    def _init_trainer_watch(self) -> None:
        # node index -> {"host", "rank", "restarts", "last"}; only nodes that reported are
        # watched
        self.trainer_nodes: Dict[int, dict] = {}
        self.trainer_stop: Optional[str] = None  # why the run was stopped, for the survivors

    def _add_trainer_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/trainer_alive", self._trainer_alive)

    async def _trainer_alive(self, request: web.Request):
        body = await read_json(request, TRAINER_ALIVE)
        node, host = int(body["node"]), body["host"]
        # torchrun may renumber the nodes when it restarts the world: a host reports under
        # one node index at a time
        for other in [n for n, r in self.trainer_nodes.items() if r["host"] == host and n != node]:
            del self.trainer_nodes[other]
        self.trainer_nodes[node] = {"host": host, "rank": int(body["rank"]),
                                    "restarts": int(body.get("restarts", 0)),
                                    "last": time.time()}
        return web.json_response({"ok": True, "stop": self.trainer_stop})

    def trainer_silence_limit_s(self) -> float:
        return float(self.cfg.trainer.collective_timeout_s) / 2

    def silent_trainer_node(self, now: Optional[float] = None) -> Optional[str]:
        """A message naming the first trainer node that reported and then fell silent for
        longer than ``trainer_silence_limit_s``, the longest silent first (None: every node
        reports)."""
        now = time.time() if now is None else now
        limit = self.trainer_silence_limit_s()
        # the node silent the longest: the one lost first (the others may have stopped
        # reporting because of it)
        for node, r in sorted(self.trainer_nodes.items(), key=lambda item: item[1]["last"]):
            if now - r["last"] > limit:
                return (f"LMC-E605: trainer node {node} (host {r['host']}, rank {r['rank']} and "
                        f"its node's other ranks) has been silent for {now - r['last']:.0f} s, "
                        f"more than half of trainer.collective_timeout_s="
                        f"{self.cfg.trainer.collective_timeout_s:g}: it died, lost its network "
                        "or hung, and the run stops (start it again with trainer.resume=auto "
                        "once the node is back)")
        return None

    def stop_for_trainers(self, why: str) -> None:
        """Stop the run because of a trainer node: the surviving ranks are told (their next
        ``/trainer_alive`` answer), and the fault recorded."""
        if self.trainer_stop is None:
            self.trainer_stop = why
            self._fault("trainer", "node_lost", reason=why)
