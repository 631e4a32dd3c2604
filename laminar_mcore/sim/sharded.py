"""Weight sync at trillion scale on issue 52's path: every trainer rank publishes its own shard
into a striped relay tier, and each rollout node takes only the share its engines serve.

Which parts of that path the code has (docs/weights.md): per-rank export (``weight_sync.export
=per_rank``: the trainer blocked for its local copy only), relays that put slices together for
engines, striped master relays on rollout nodes of their own (``weight_sync.master_relays``)
deltas found on the trainer's GPU (``kernels/delta.py`` in the publisher), and engine GPUs
copying only their own shard (``weight_sync.engine_pull``: dense models, and MoE engines whose
MoE runner keeps SGLang's default expert layout). Not yet: a node's relay taking only its
engines' share (every relay holds the whole version). The figures here model the design with
costs measured where the parts exist, each source named; ``costs.relay_sync_stages`` models the
path of stage leads into one master relay, whole versions to every relay.

The model, for B = params x 2 bytes (bf16) on 8-GPU nodes:

* **trainer stall** = one rank's shard (B / trainer GPUs: a mixture-of-experts' experts span the
  trainer's GPUs, so every rank holds a distinct 1/N) over ``EXPORT_BYTES_S``, or, with deltas,
  over ``DEVICE_ENCODE_BYTES_S`` (the kernel reads the shard and its base on the GPU, copies the
  compacted changes out and the host compresses them);
* **publish**: one stripe per trainer node (``stripes``), each mastered by a rollout node that
  serves it; a rollout node's ingress from the trainer is W / min(stripes, R) at the publish
  link (``LINKS["publish_bytes_s"]``, the paper's fitted 103 GB/s per node pair), W the wire
  bytes (B, or B / bytes_ratio as deltas);
* **spread**: each rollout node needs the share f = min(1, 8 / engine GPUs) of the version its
  GPUs serve (an engine over 4 nodes: a quarter each); what it did not get from the trainer
  comes from its peers at the chain link (``LINKS["chain_bytes_s"]``), on the same NICs, so
  ingress = publish part + peer part, in sequence; plus the pipeline's fill over the g - 1
  peers that share a stripe and a bucket's latency;
* **rebuild** (deltas only) = f x B / ``DELTA["apply_bytes_s"]`` per relay;
* **engine pause** = the engine GPU's shard (B / engine GPUs) through ``CostModel.pull_s``'s
  link and fixed cost; its bound, the same bytes over ``H2D_BYTES_S``.

A sync's time is the slowest of the stages that pipeline bucket by bucket (encode, trainer
egress, node ingress, rebuild) plus the fill and a bucket's latency, as in
``costs.relay_sync_stages``.
"""

from __future__ import annotations

import math
from typing import Dict

from ..weights.delta import DEVICE_COPY_BYTES_S, DEVICE_ENCODE_BYTES_S  # bench.gpu, H200
from .costs import BUCKET_BYTES, BYTES_PER_PARAM, DELTA, LINKS

# A trainer GPU's device -> pinned host copy (bench.gpu on an H200, docs/gpu.md).
EXPORT_BYTES_S = DEVICE_COPY_BYTES_S
# Host -> engine GPU for the pause's bound: the same PCIe copy the other way (an assumption:
# only device -> host was measured).
H2D_BYTES_S = EXPORT_BYTES_S
GPUS_PER_NODE = 8

# The anchors' GPU counts (issue 52): 1T as Perplexity's Kimi-K2 update, 256 trainer GPUs to
# 128 rollout GPUs, with 32-GPU engines; 235B (Qwen3-235B-A22B): one replica of Megatron-
# Bridge's TP4 PP16 recipe (64 GPUs) to the 32 rollout nodes of ``costs.MOE_MODELS`` with
# 16-GPU engines (an assumption: no anchor gives these).
ANCHORS: Dict[str, dict] = {
    "1t": {"params": 1.04e12, "trainer_gpus": 256, "rollout_gpus": 128, "engine_gpus": 32},
    "235b": {"params": 235e9, "trainer_gpus": 64, "rollout_gpus": 256, "engine_gpus": 16},
}


def sharded_sync_stages(params: float, trainer_gpus: int, rollout_gpus: int, engine_gpus: int,
                        delta: bool, stripes: int = 0, bytes_ratio: float = None,
                        apply_bytes_s: float = None) -> Dict[str, float]:
    """The stages of one sync on the striped path (module docstring) and ``total_s``;
    ``stripes`` 0: one per trainer node."""
    full = params * BYTES_PER_PARAM
    ratio = (DELTA["bytes_ratio"] if bytes_ratio is None else bytes_ratio) if delta else 1.0
    apply_s = (DELTA["apply_bytes_s"] if apply_bytes_s is None else apply_bytes_s) if delta \
        else math.inf
    wire = full / ratio
    trainer_nodes = max(1, trainer_gpus // GPUS_PER_NODE)
    nodes = max(1, rollout_gpus // GPUS_PER_NODE)
    stripes = stripes or trainer_nodes
    share = min(1.0, GPUS_PER_NODE / engine_gpus)
    shard = full / trainer_gpus
    encode_rate = DEVICE_ENCODE_BYTES_S if delta else EXPORT_BYTES_S
    direct = wire / min(stripes, nodes)  # what a node gets straight from the trainer
    direct = min(direct, share * wire)
    st = {"bytes": full, "wire_bytes": wire, "share": share, "stripes": float(stripes),
          "trainer_stall_s": shard / encode_rate,
          "trainer_egress_s": (wire / trainer_nodes) / LINKS["publish_bytes_s"],
          "node_ingress_s": direct / LINKS["publish_bytes_s"]
          + (share * wire - direct) / LINKS["chain_bytes_s"],
          "rebuild_s": share * full / apply_s}
    group = max(1, round(nodes * share))  # the nodes that need the same share
    chunk = min(BUCKET_BYTES / ratio, wire / stripes)  # a bucket's bytes on the wire
    st["fill_s"] = (group - 1) * (chunk / LINKS["chain_bytes_s"] + LINKS["chain_start_s"])
    bucket = min(BUCKET_BYTES, full)
    st["bucket_latency_s"] = bucket / encode_rate + bucket / ratio / LINKS["publish_bytes_s"] \
        + (bucket / apply_s if delta else 0.0)
    st["total_s"] = max(st["trainer_stall_s"], st["trainer_egress_s"], st["node_ingress_s"],
                        st["rebuild_s"]) + st["fill_s"] + st["bucket_latency_s"]
    engine_shard = full / engine_gpus
    st["engine_pause_s"] = engine_shard / LINKS["pull_bytes_s"] + LINKS["pull_fixed_s"]
    st["engine_pause_bound_s"] = engine_shard / H2D_BYTES_S
    return st


def sharded_figures() -> Dict[str, object]:
    """The report's keys for the striped path, per anchor ``m``: ``sync_s_<m>`` (what
    ``weight_sync.delta=auto`` would pick: deltas only where their sync is shorter),
    ``sync_s_<m>_full``, ``sync_s_<m>_delta`` (``_at_memory_bandwidth``: a relay rebuilding at
    a many-core host's memory bandwidth, ``DELTA["host_bytes_s"]``), ``delta_auto_<m>``, ``trainer_stall_s_<m>`` (of
    the chosen way), ``trainer_stall_s_<m>_stage_lead`` (a PP16 stage lead's copy of its stage,
    the path of today), ``engine_pause_s_<m>``, ``engine_pause_bound_s_<m>``."""
    out: Dict[str, object] = {}
    for name, a in ANCHORS.items():
        whole = sharded_sync_stages(a["params"], a["trainer_gpus"], a["rollout_gpus"],
                                    a["engine_gpus"], False)
        delta = sharded_sync_stages(a["params"], a["trainer_gpus"], a["rollout_gpus"],
                                    a["engine_gpus"], True)
        fast = sharded_sync_stages(a["params"], a["trainer_gpus"], a["rollout_gpus"],
                                   a["engine_gpus"], True, apply_bytes_s=DELTA["host_bytes_s"])
        on = delta["total_s"] < whole["total_s"]
        chosen = delta if on else whole
        out.update({f"sync_s_{name}": round(chosen["total_s"], 3),
                    f"sync_s_{name}_full": round(whole["total_s"], 3),
                    f"sync_s_{name}_delta": round(delta["total_s"], 3),
                    f"sync_s_{name}_delta_at_memory_bandwidth": round(fast["total_s"], 3),
                    f"delta_auto_{name}": on,
                    f"trainer_stall_s_{name}": round(chosen["trainer_stall_s"], 3),
                    f"trainer_stall_s_{name}_stage_lead": round(
                        a["params"] * BYTES_PER_PARAM / 16 / EXPORT_BYTES_S, 3),
                    f"engine_pause_s_{name}": round(whole["engine_pause_s"], 3),
                    f"engine_pause_bound_s_{name}": round(whole["engine_pause_bound_s"], 3)})
    return out
