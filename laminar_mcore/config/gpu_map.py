"""The GPU map: which of a node's GPUs each role started there gets, as ``CUDA_VISIBLE_DEVICES``.

On one node the roles take disjoint GPUs: the trainer ranks first, then the engines (rollout
node by rollout node, engine by engine, ``rollout.engine_tp`` each; CPU engines take none),
then the relays take a GPU that is left (``weight_sync.relay_device``: ``auto`` takes a free one
if there is one, else none -- host staging; ``cpu`` none; ``cuda:N`` the node's GPU N, which no
other role may hold). Every process is started with its own mask: a trainer world sees the
trainers' GPUs (rank r on ``LOCAL_RANK % device_count()``), an engine its own (SGLang's
``--base-gpu-id`` 0), a relay its engines' GPUs in engine order -- where its CUDA-IPC exporter
places their buckets: engine i's rank r is the relay's ``cuda:i*engine_tp+r``, as
``rollout.launcher.engine_gpu_ids`` names it -- then its own GPU last. CUDA-IPC handles name
devices by UUID, so an engine opens what a relay with another mask exported.

``build_gpu_map`` is a pure function of the facts (the node's GPUs and the roles' counts);
``config_gpu_map`` takes the GPUs from ``cluster.gpus_per_node`` (validation and ``job=plan``),
``machine_gpu_map`` from ``torch.cuda`` and an inherited ``CUDA_VISIBLE_DEVICES`` (the launchers:
the masks then name the inherited entries). Without GPUs there is no map (None) and no process
gets a mask. A node whose roles cannot get disjoint GPUs is refused (``GpuMapError``, LMC-E126),
naming what each role needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

VISIBLE = "CUDA_VISIBLE_DEVICES"
FIX = ("lower cluster.trainer.nproc_per_node, rollout.num_engines or rollout.engine_tp, or give "
       "the roles nodes of their own (job=trainer and job=rollout: docs/multinode.md)")


class GpuMapError(ValueError):
    """The roles of a node cannot get disjoint GPUs (the message says what each needs)."""


@dataclass(frozen=True)
class NodeGpus:
    """What one rollout node's processes see: ``CUDA_VISIBLE_DEVICES`` values."""

    engines: Tuple[str, ...]  # engine i's mask ('' for a CPU engine)
    relay: str  # the relay's mask: its engines' GPUs in engine order, then its own
    relay_device: str  # its own GPU in that mask (cuda:K), or cpu (none: host staging)

    def engine_env(self, index: int) -> Dict[str, str]:
        return {VISIBLE: self.engines[index]}

    def relay_env(self) -> Dict[str, str]:
        return {VISIBLE: self.relay}

    def relay_weight_sync(self, ws):
        """The relay's ``weight_sync`` (a ``WeightSyncConfig``) with the map's device: its own
        GPU in its mask, or cpu (none: the publish channel then never stages on a GPU)."""
        return replace(ws, relay_device=self.relay_device)


@dataclass(frozen=True)
class GpuMap:
    """Positions in ``devices`` (the names ``CUDA_VISIBLE_DEVICES`` gives the node's GPUs)."""

    devices: Tuple[str, ...]
    source: str  # where the GPUs came from, for messages
    trainers: Tuple[int, ...]
    engines: Tuple[Tuple[Tuple[int, ...], ...], ...]  # per rollout node, per engine
    relays: Tuple[Optional[int], ...]  # per rollout node: its own GPU, or None
    has_relay: bool = True

    def names(self, positions: Sequence[int]) -> str:
        return ",".join(self.devices[p] for p in positions)

    def trainer_env(self) -> Dict[str, str]:
        return {VISIBLE: self.names(self.trainers)}

    def node(self, k: int = 0) -> NodeGpus:
        own = [g for engine in self.engines[k] for g in engine]
        relay = self.relays[k]
        return NodeGpus(engines=tuple(self.names(e) for e in self.engines[k]),
                        relay=self.names(own + ([relay] if relay is not None else [])),
                        relay_device=f"cuda:{len(own)}" if relay is not None else "cpu")

    @property
    def free(self) -> List[str]:
        held = set(self.trainers) | {g for node in self.engines for e in node for g in e} \
            | {r for r in self.relays if r is not None}
        return [d for i, d in enumerate(self.devices) if i not in held]

    def to_dict(self) -> dict:
        return {"gpus": list(self.devices), "source": self.source,
                "trainers": self.names(self.trainers),
                "rollout_nodes": [{
                    "engines": list(self.node(k).engines),
                    "relay": (self.devices[self.relays[k]] if self.relays[k] is not None
                              else None) if self.has_relay else "no relay",
                    "relay_visible": self.node(k).relay,
                    "relay_device": self.node(k).relay_device}
                    for k in range(len(self.engines))],
                "free": self.free}

    def describe(self) -> str:
        """One line: who holds which GPUs (``CUDA_VISIBLE_DEVICES`` names)."""
        return describe(self.to_dict())


def build_gpu_map(devices: Sequence[str], *, trainers: int = 0, rollout_nodes: int = 0,
                  engines: int = 0, engine_tp: int = 1, relay: bool = True,
                  relay_device: str = "auto", relay_needs_gpu: bool = False,
                  source: str = "", job: str = "train") -> GpuMap:
    """The map of a node with GPUs ``devices`` (their ``CUDA_VISIBLE_DEVICES`` names):
    ``trainers`` ranks, ``rollout_nodes`` x ``engines`` engines of ``engine_tp`` GPUs each (0:
    CPU engines), a relay per rollout node when ``relay`` (``relay_needs_gpu``: NCCL publishes,
    so each relay must get one). Raises ``GpuMapError`` when they do not fit."""
    n, tp = len(devices), max(int(engine_tp), 0)
    source = source or f"{n} GPUs"
    engine_gpus = rollout_nodes * engines * tp
    need = trainers + engine_gpus + (rollout_nodes if relay and relay_needs_gpu
                                     and relay_device == "auto" else 0)
    if need > n:
        parts = []
        if trainers:
            parts.append(f"{trainers} for the trainers (cluster.trainer.nproc_per_node={trainers})")
        if engine_gpus:
            nodes = f"cluster.rollout_nodes={rollout_nodes} x " if job == "train" else ""
            parts.append(f"{engine_gpus} for the engines ({nodes}rollout.num_engines={engines} x "
                         f"rollout.engine_tp={tp})")
        if need > trainers + engine_gpus:
            parts.append(f"{need - trainers - engine_gpus} for the relays (weight_sync."
                         "publish_backend=nccl stages on a GPU of their own; gloo needs none)")
        raise GpuMapError(f"LMC-E126: job={job} on one node gives each role GPUs of its own: "
                          f"{' + '.join(parts)} = {need} GPUs, but the node has {n} ({source}); "
                          + FIX)
    nxt = trainers
    placed = []
    for _ in range(rollout_nodes):
        node = []
        for _ in range(engines):
            node.append(tuple(range(nxt, nxt + tp)))
            nxt += tp
        placed.append(tuple(node))
    relays: List[Optional[int]] = []
    if relay and rollout_nodes and relay_device.startswith("cuda:"):
        index = int(relay_device[5:])
        names = [str(d) for d in devices]
        held = (f", which the trainers hold ({','.join(names[:trainers])})" if index < trainers
                else f", which an engine holds (engines: {','.join(names[trainers:nxt])})"
                if index < nxt else "")
        if index >= n or held:
            raise GpuMapError(
                f"LMC-E126: weight_sync.relay_device={relay_device} names GPU {index} of a node "
                f"with {n} ({source}){held}; no other role may share the relay's GPU: set "
                "weight_sync.relay_device=auto (a GPU no role holds, else none) or cpu")
        relays = [index] * rollout_nodes
    elif relay and relay_device == "auto":
        for k in range(rollout_nodes):
            relays.append(nxt if nxt < n else None)
            nxt += 1
    else:
        relays = [None] * rollout_nodes
    return GpuMap(tuple(str(d) for d in devices), source, tuple(range(trainers)),
                  tuple(placed), tuple(relays), has_relay=bool(relay))


def roles_on_node(cfg, job: str) -> Optional[dict]:
    """The roles ``job`` starts on one node (``build_gpu_map``'s keywords), or None for a job
    that starts no GPU role (or ``job=train`` with several trainer nodes, which the local
    launcher refuses: LMC-E203)."""
    r, ws, cl = cfg.rollout, cfg.weight_sync, cfg.cluster
    if job == "train" and cl.trainer.nnodes != 1:
        return None
    common = dict(engines=int(r.num_engines),
                  engine_tp=int(r.engine_tp) if r.backend == "sglang" else 0,
                  relay_device=str(ws.relay_device),
                  relay_needs_gpu=ws.publish_backend == "nccl", job=job)
    if job == "train":
        return dict(common, trainers=int(cl.trainer.nproc_per_node),
                    rollout_nodes=int(cl.rollout_nodes), relay=True)
    if job == "rollout":
        return dict(common, trainers=0, rollout_nodes=1, relay=r.relay == "local")
    if job == "trainer":
        return dict(common, trainers=int(cl.trainer.nproc_per_node), rollout_nodes=0)
    return None


def config_gpu_map(cfg, job: Optional[str] = None) -> Optional[GpuMap]:
    """The map of ``job`` (default ``cfg.job``) on a node of ``cluster.gpus_per_node`` GPUs;
    None without GPUs or GPU roles."""
    job = job or cfg.job
    roles = roles_on_node(cfg, job)
    n = int(cfg.cluster.gpus_per_node)
    if roles is None or n <= 0:
        return None
    return build_gpu_map([str(i) for i in range(n)],
                         source=f"cluster.gpus_per_node={n}", **roles)


def visible_gpus(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """This machine's GPUs as ``CUDA_VISIBLE_DEVICES`` names them for a child: the entries of
    an inherited mask (indices, UUIDs or MIG names), else ``0..device_count()-1``; [] without
    CUDA."""
    import torch

    environ = os.environ if environ is None else environ
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    mask = environ.get(VISIBLE)
    if mask is None:
        return [str(i) for i in range(count)]
    return [e.strip() for e in mask.split(",") if e.strip()][:count]


def machine_gpu_map(cfg, job: str, environ: Optional[Mapping[str, str]] = None
                    ) -> Optional[GpuMap]:
    """The map of ``job`` on this machine's GPUs (``visible_gpus``); None without CUDA (the
    CPU runs: no process gets a mask) or GPU roles."""
    environ = os.environ if environ is None else environ
    roles = roles_on_node(cfg, job)
    devices = visible_gpus(environ)
    if roles is None or not devices:
        return None
    mask = environ.get(VISIBLE)
    source = f"{VISIBLE}={mask}" if mask is not None else f"{len(devices)} visible GPUs"
    return build_gpu_map(devices, source=source, **roles)


def plan_gpu_maps(cfg) -> dict:
    """``plan.json``'s ``gpu_map``: ``job=train`` on one node and a trainer and a rollout node of
    a multi-node run, each a map (``GpuMap.to_dict``) or why there is none."""
    n = int(cfg.cluster.gpus_per_node)
    out: dict = {"gpus_per_node": n}
    for key, job in (("train", "train"), ("trainer_node", "trainer"),
                     ("rollout_node", "rollout")):
        if n <= 0:
            out[key] = {"none": "no GPUs (cluster.gpus_per_node=0)"}
            continue
        if job == "train" and cfg.cluster.trainer.nnodes != 1:
            out[key] = {"none": f"cluster.trainer.nnodes={cfg.cluster.trainer.nnodes}: job=train "
                                "runs one node; start the roles on nodes of their own"}
            continue
        try:
            out[key] = config_gpu_map(cfg, job).to_dict()
        except GpuMapError as exc:
            out[key] = {"refused": str(exc)}
    return out


def format_gpu_maps(maps: dict) -> List[str]:
    """``job=plan``'s lines for ``plan_gpu_maps``."""
    lines = [f"  GPU map (cluster.gpus_per_node={maps['gpus_per_node']}; each process sees its "
             f"GPUs through {VISIBLE}):"]
    for key, title in (("train", "job=train, every role on one node"),
                       ("trainer_node", "a trainer node (job=trainer)"),
                       ("rollout_node", "a rollout node (job=rollout)")):
        view = maps[key]
        if "gpus" in view:
            text = describe(view)
        else:
            text = f"refused: {view['refused']}" if "refused" in view else view["none"]
        lines.append(f"    {title}: {text}")
    return lines


def describe(view: dict) -> str:
    """One line of a map (``GpuMap.to_dict``): who holds which GPUs."""
    parts = [f"trainers {view['trainers']}"] if view["trainers"] else []
    for k, node in enumerate(view["rollout_nodes"]):
        engines = " | ".join(e or "cpu" for e in node["engines"]) or "none"
        relay = node["relay"]
        relay = ("no relay" if relay == "no relay" else
                 f"relay {relay} (sees {node['relay_visible']})" if relay else
                 "relay: no GPU (host staging)")
        prefix = f"node{k} " if len(view["rollout_nodes"]) > 1 else ""
        parts.append(f"{prefix}engines {engines}; {relay}")
    return "; ".join(parts) + f"; free: {','.join(view['free']) or 'none'}"
