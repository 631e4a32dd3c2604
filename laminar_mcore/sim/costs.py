"""Costs from first principles: every constant in one table, with its source.

Decode: one step of a continuous batch of ``b`` requests holding ``C`` context tokens on an
engine of ``tp`` GPUs reads the weights once and every request's KV cache, and computes
2·N·b FLOPs plus attention; its time is the larger of bytes over achieved HBM bandwidth and
FLOPs over achieved peak (a roofline), plus a per-step overhead (scheduling, kernel launches
under CUDA graphs) and, for tp > 1, two all-reduces per layer. Prefill: 2·N FLOPs per prompt
token at the prefill efficiency. Trainer: 8·N FLOPs per token (6 for forward and backward, 2
for recomputing the proximal log-probs) over the layout's achieved FLOP/s (its MFU times the
pipeline bubble of its PP layout), each optimizer step lasting as long as its busiest
data-parallel rank, plus the step's own costs: the distributed optimizer's gradient
reduce-scatter and parameter all-gather over the trainer's NICs (NVLink inside one machine),
the Adam step over HBM and a fixed per-step cost (``TRAINER``). Weights: publish
(trainer -> master relay), Laminar's chain T(p, k), pulls (relay host memory -> engine GPUs
over PCIe); ``relay_sync_seconds``: a whole sync through the relay tier, whole or as a delta.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from ..relay.chain import chain_time, optimal_chunks
from ..weights.delta import APPLY_BYTES_S, ENCODE_BYTES_S, bytes_ratio_for_lr

# ---------------------------------------------------------------- the table (value, source)
HARDWARE: Dict[str, dict] = {
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB; H800 is the
    # same chip with NVLink cut to 400 GB/s (the compute and HBM figures are equal).
    "H800": {"peak_flops": 989e12, "hbm_bytes_s": 3.35e12, "hbm_bytes": 80e9,
             "nvlink_bytes_s": 400e9},
    "H100": {"peak_flops": 989e12, "hbm_bytes_s": 3.35e12, "hbm_bytes": 80e9,
             "nvlink_bytes_s": 900e9},
}

EFFICIENCY = {
    # achieved / peak HBM bandwidth of decode GEMVs and paged attention (SGLang/vLLM decode
    # kernels reach 70-85% of HBM bandwidth on H100: FlashInfer and vLLM's published numbers)
    "decode_bandwidth": 0.75,
    # achieved / peak FLOP/s of decode at large batch (small GEMMs)
    "decode_compute": 0.5,
    # achieved / peak FLOP/s of prefill (large GEMMs: FlashAttention-3's ~60% of peak)
    "prefill_compute": 0.6,
    # trainer MFU of a dense model in Megatron-Core at moderate TP inside one node (Megatron-
    # LM's published 40-47% MFU on H100 for 7B-70B); the layout's bubble multiplies it
    "trainer_mfu": 0.42,
    # per-step host overhead of a decode step under CUDA graphs (SGLang: ~1-2 ms)
    "step_overhead_s": 1.5e-3,
    # one NVLink all-reduce of a decode step's activations (latency-bound: ~8 us each)
    "allreduce_s": 8e-6,
    # GPU memory SGLang gives to weights + KV cache (--mem-fraction-static default ~0.88)
    "mem_fraction_static": 0.88,
}

LINKS = {
    # trainer -> master relay publish. Laminar's measured actor stall: 0.64 s for 32B (65.5 GB)
    # and 1.40 s for 72B (145 GB), both ~103 GB/s: 8 x 400 Gbps NICs (400 GB/s nominal) at
    # 26%, the only constant here taken from the paper's own measurement.
    "publish_bytes_s": 103e9,
    # relay -> relay (host memory over RDMA, 8 x 400 Gbps per machine at 50%) and the start-up
    # cost of one chunk's transfer (RDMA verbs post + completion: ~1 ms with software overhead)
    "chain_bytes_s": 200e9,
    "chain_start_s": 1e-3,
    # relay host memory -> one engine GPU over PCIe Gen5 x16 (64 GB/s nominal, ~40 achieved
    # for pinned host memory), plus SGLang's weight loading per update (~0.3 s)
    "pull_bytes_s": 40e9,
    "pull_fixed_s": 0.3,
    # verl's colocated weight sync: reshard trainer -> rollout inside one GPU's memory over
    # NVLink (all-gather of TP/PP shards), plus waking the rollout engine (~2 s, verl's logs)
    "colocated_sync_fixed_s": 2.0,
}

PROTOCOL = {
    # The global NCCL weight update of verl (disaggregated), one-step, stream and AReaL: the
    # trainer broadcasts every bucket to every rollout GPU while all of them stop (a barrier:
    # the collective needs every rank). verl's checkpoint engine, the only published figure
    # for such a broadcast at these sizes: Qwen3-30B-A3B (61 GB bf16) to 30 rollout replicas
    # in about 7 s, 8.25 GB/s (REFERENCES.md, "Other systems"); AReaL's
    # update_weights_from_distributed broadcasts 1 GiB buckets the same way (AReaL's code).
    "nccl_broadcast_bytes_s": 8.25e9,
    # forming the NCCL group for the update and the barrier before it (every rank joins,
    # SGLang's /init_weights_update_group rendezvous): ~1 s (an assumption: no published figure)
    "nccl_barrier_s": 1.0,
}

# Every machine's NICs, shared by the transfers that cross them (publish, chain, a relay
# re-joining after a failure, the trainer's data-parallel collectives): 8 x 400 Gbps per
# machine, each direction (the paper's testbed), one NIC per GPU.
NETWORK = {"nic_bytes_s": 8 * 400e9 / 8}

TRAINER = {
    # Achieved fraction of a link (a GPU's NIC across machines, NVLink inside one) by the
    # data-parallel reduce-scatter and all-gather: the relay chain's achieved fraction of the
    # same NICs (LINKS.chain_bytes_s / NETWORK.nic_bytes_s = 200 / 400 GB/s), the one rate of
    # bulk RDMA the link table holds.
    "dp_link_fraction": 0.5,
    # Fraction of those collectives not hidden behind compute: all of it. This repository's
    # trainer builds DistributedDataParallelConfig(overlap_grad_reduce=False) (trainer/actor.py)
    # and leaves overlap_param_gather at Megatron-Core's default (False); verl's Megatron
    # workers keep the same defaults.
    "dp_exposed": 1.0,
    # Achieved / peak HBM bandwidth of the optimizer step (a fused multi-tensor Adam streams
    # its states: the decode kernels' 75%, EFFICIENCY.decode_bandwidth's sources).
    "optimizer_bandwidth": 0.75,
    # Per optimizer step, whatever the layout: the gradient-norm all-reduce and clip, zeroing
    # the gradient buffers, the micro-batch schedule's launches (an assumption: ~0.1 s, no
    # published figure at these sizes).
    "step_fixed_s": 0.1,
}
# Bytes per element of the data-parallel collectives: gradients reduce-scattered in fp32
# (trainer/actor.py: grad_reduce_in_fp32=True; config/plan.py counts 4 bytes a gradient), the
# updated bf16 parameters all-gathered (BYTES_PER_PARAM). The Adam step of the distributed
# optimizer moves 30 bytes per parameter of its shard: reads fp32 main parameter, gradient,
# exp_avg, exp_avg_sq (16), writes the three fp32 (12) and the bf16 parameter (2).
GRAD_REDUCE_BYTES = 4
ADAM_BYTES_PER_PARAM = 30

# A rollout machine killed (sim --fail): the controller notices after SGLang's health-check
# timeout (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s: REFERENCES.md), then the machine is replaced and
# its engines launched: a node re-initialised plus an SGLang start-up with CUDA-graph capture,
# ~3 minutes at these sizes (an assumption; the paper reports only the whole recovery, ~252 s).
FAILURE = {"detect_s": 20.0, "restart_s": 180.0}

# The paper's run settings (Laminar section 7): concurrent requests per rollout replica, the
# mini-batch steps of one iteration (one weight version per iteration).
CONCURRENCY_PER_REPLICA = 1024
MINIBATCH_STEPS = 16

MODELS: Dict[str, dict] = {
    # Qwen2.5 configs (Hugging Face config.json): parameters, layers, hidden size, attention
    # heads, KV heads, head dim. KV bytes per token = 2 (K, V) x layers x kv_heads x head_dim x 2.
    "7B": {"params": 7.62e9, "layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4,
           "head_dim": 128, "engine_tp": 1, "trainer_tp": 2, "trainer_pp": 1},
    "32B": {"params": 32.8e9, "layers": 64, "hidden": 5120, "heads": 40, "kv_heads": 8,
            "head_dim": 128, "engine_tp": 2, "trainer_tp": 8, "trainer_pp": 1},
    "72B": {"params": 72.7e9, "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
            "head_dim": 128, "engine_tp": 4, "trainer_tp": 8, "trainer_pp": 2},
}
BYTES_PER_PARAM = 2  # BF16 weights in the engines, in the relays and on the wire

# Engine TP per system and model as the paper ran them (Laminar App. A.2, as issue 54 quotes
# it): 7B at TP 2 for verl, one-step and stream and TP 1 for Laminar and AReaL; 32B at TP 4 and
# 72B at TP 8 for every system. ``MODELS``' engine_tp is the default of a CostModel built
# without a system (calibration, the tests' small runs).
ENGINE_TP_PAPER: Dict[str, Dict[str, int]] = {
    "7B": {"sync": 2, "one_step": 2, "stream": 2, "areal": 1, "laminar": 1},
    "32B": {"sync": 4, "one_step": 4, "stream": 4, "areal": 4, "laminar": 4},
    "72B": {"sync": 8, "one_step": 8, "stream": 8, "areal": 8, "laminar": 8},
}


def system_of(mode: str) -> str:
    """The system a simulator mode runs (``laminar_norepack`` is laminar, ``areal_eta4``
    AReaL)."""
    return {"laminar_norepack": "laminar", "areal_eta4": "areal"}.get(mode, mode)


def paper_engine_tp(model: str, mode: str) -> int:
    """The engine TP the paper ran ``mode``'s system with at ``model`` (``ENGINE_TP_PAPER``;
    ``MODELS``' default for a model or system it does not list)."""
    return ENGINE_TP_PAPER.get(model, {}).get(system_of(mode), MODELS[model]["engine_tp"])


def cost_for(model: str, mode: str, engine_tp: Optional[int] = None) -> "CostModel":
    """The cost model of ``mode``'s system at ``model``: engines at ``engine_tp`` (None: the
    paper's, ``paper_engine_tp``)."""
    return CostModel(model, tp=engine_tp or paper_engine_tp(model, mode))

# Delta publication (weights/delta.py): a version travels as the changed bf16 positions
# (gap-coded) and their bits XOR the old (zstd). Measured by `python -m laminar_mcore.bench.delta`
# (2026-11-24, Qwen2-0.5B shape, AdamW at lr 1e-6 for 10 steps, the 2-core development VM):
# bytes_ratio = delta_bytes_ratio 93.6 (1.6% of the elements changed per step); encode_bytes_s
# = encode_gb_per_s 0.51 GB/s (a stage lead compares, encodes and hashes its buckets in its
# sender thread, beside training and two relays on two cores); apply_bytes_s =
# rebuild_gb_per_s 6.2 GB/s (a relay copies the base bucket, applies the delta and checks its
# XXH3 digest). host_bytes_s: what a many-core host's memory allows either to reach with the
# work spread over its cores (one pass of ~100 GB/s), for the *_at_memory_bandwidth figures.
# (The measured figures are weights/delta.py's, which weight_sync.delta=auto weighs too.)
DELTA = {"bytes_ratio": bytes_ratio_for_lr(1e-6), "encode_bytes_s": ENCODE_BYTES_S,
         "apply_bytes_s": APPLY_BYTES_S, "host_bytes_s": 100e9}
BUCKET_BYTES = 512 * 2**20  # weight_sync.bucket_mb: the unit the publish pipelines over

# MoE shapes for the weight-sync figures (bf16, BYTES_PER_PARAM): total and active parameters,
# layers, hidden size, routed experts (active per token); trainer_pp: the trainer's pipeline
# stages, each with one stage lead publishing (and delta-encoding) its stage's weights
# (Megatron-Bridge's Qwen3-235B-A22B recipe: TP4 PP16 EP8; Kimi K2's report: PP16 EP16);
# relays: one per rollout machine (8 GPUs, one relay each), the first the master.
MOE_MODELS: Dict[str, dict] = {
    "235b": {"params": 235e9, "active": 22e9, "layers": 94, "hidden": 4096, "experts": 128,
             "experts_active": 8, "trainer_pp": 16, "relays": 32},  # Qwen3-235B-A22B
    "1t": {"params": 1.04e12, "active": 32e9, "layers": 61, "hidden": 7168, "experts": 384,
           "experts_active": 8, "trainer_pp": 16, "relays": 64},  # Kimi-K2's shape
}


def relay_sync_stages(params: float, relays: int, delta: bool, pp: int = 16,
                      bytes_ratio: Optional[float] = None, encode_bytes_s: Optional[float] = None,
                      apply_bytes_s: Optional[float] = None,
                      bucket_bytes: int = BUCKET_BYTES) -> Dict[str, float]:
    """The stages of one weight sync through the relay tier and its total (``total_s``): from
    the trainer's publish start until every one of ``relays`` relays (the master first, then a
    chain of ``relays - 1``) holds the version. Defaults from ``DELTA`` and ``LINKS``.

    With B = params x 2 bytes, wire bytes W = B / bytes_ratio with a delta (B without), and
    b = one 512 MiB bucket, every stage works bucket by bucket, so they overlap:

    * encode  E = (B / pp) / encode_bytes_s: the pp stage leads encode their shards at once
      (delta only);
    * publish P = W / publish_bytes_s: all stage leads into the master relay, the link the
      publish stall is fitted to (``publish_s``);
    * chain   Laminar's T(p, k) = (p + k - 2)(W/k t_byte + t_start) with p - 1 = relays - 1
      hops after the master and k = k* (``chain_s``); relays forward the delta as it arrives,
      not the rebuilt bucket. Its throughput part C = k (W/k t_byte + t_start) is a stage; its
      fill (p - 2)(W/k t_byte + t_start) is latency;
    * rebuild A = B / apply_bytes_s: every relay rebuilds every bucket (copy the base,
      decompress, apply, verify its digest), all relays at once (delta only).

    total = max(E, P, C, A) + one bucket through encode, publish and rebuild
            (b / encode_bytes_s + (b / ratio) / publish_bytes_s + b / apply_bytes_s)
            + the chain's fill,
    i.e. the slowest stage plus the pipeline's latency, not the sum of the stages. Without a
    delta there is no encode or rebuild (buckets are forwarded and pulled as they are)."""
    ratio = (DELTA["bytes_ratio"] if bytes_ratio is None else bytes_ratio) if delta else 1.0
    enc = (DELTA["encode_bytes_s"] if encode_bytes_s is None else encode_bytes_s) if delta \
        else math.inf
    app = (DELTA["apply_bytes_s"] if apply_bytes_s is None else apply_bytes_s) if delta \
        else math.inf
    full = params * BYTES_PER_PARAM
    wire = full / ratio
    bucket = min(bucket_bytes, full)
    t_byte, t_start = 1 / LINKS["chain_bytes_s"], LINKS["chain_start_s"]
    chunk_s, k = 0.0, 1
    if relays > 1:
        k = optimal_chunks(relays - 1, int(wire), t_byte, t_start)
        chunk_s = wire / k * t_byte + t_start
    st = {"bytes": full, "wire_bytes": wire, "encode_s": full / pp / enc,
          "publish_s": wire / LINKS["publish_bytes_s"], "chain_s": k * chunk_s if relays > 1
          else 0.0, "rebuild_s": full / app, "chain_chunks": float(k),
          "chain_fill_s": max(relays - 2, 0) * chunk_s}
    st["bucket_latency_s"] = bucket / enc + bucket / ratio / LINKS["publish_bytes_s"] + \
        bucket / app
    st["total_s"] = max(st["encode_s"], st["publish_s"], st["chain_s"], st["rebuild_s"]) + \
        st["bucket_latency_s"] + st["chain_fill_s"]
    return st


def relay_sync_seconds(params: float, relays: int, delta: bool, **kw) -> float:
    """Seconds from the trainer's publish start until every relay holds the version
    (``relay_sync_stages``' total)."""
    return relay_sync_stages(params, relays, delta, **kw)["total_s"]


@dataclass(frozen=True)
class CostModel:
    """The costs of one model on one GPU kind. Every method returns seconds (or tokens)."""

    model: str
    gpu: str = "H800"
    # measured costs (sim.calibrate); a negative value takes the roofline and the tables
    decode_fixed_s: float = -1.0  # per-step time independent of batch (-1: from the roofline)
    decode_per_request_s: float = -1.0
    decode_per_context_token_s: float = -1.0
    prefill_per_token_s: float = -1.0
    trainer_per_token_s: float = -1.0  # on the whole trainer, per GPU-second: see train_s
    publish_seconds: float = -1.0  # the trainer's stall per publish (-1: from LINKS)
    pull_seconds: float = -1.0  # an engine's pull (-1: from LINKS)
    engine_capacity: int = 0  # requests an engine may run at once (0: from KV capacity)
    kv_capacity: int = 0  # KV tokens per engine (0: from memory)
    tp: int = 0  # engine TP (0: MODELS' engine_tp; cost_for gives each system the paper's)

    # ------------------------------------------------------------- shape
    @property
    def spec(self) -> dict:
        return MODELS[self.model]

    @property
    def hw(self) -> dict:
        return HARDWARE[self.gpu]

    @property
    def weight_bytes(self) -> float:
        return self.spec["params"] * BYTES_PER_PARAM

    @property
    def kv_bytes_per_token(self) -> float:
        s = self.spec
        return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * BYTES_PER_PARAM

    @property
    def engine_tp(self) -> int:
        return self.tp or self.spec["engine_tp"]

    def kv_tokens(self) -> int:
        """KV-cache tokens one engine holds: its GPUs' static memory less the weights."""
        if self.kv_capacity:
            return self.kv_capacity
        free = self.engine_tp * self.hw["hbm_bytes"] * EFFICIENCY["mem_fraction_static"] \
            - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model} does not fit on {self.engine_tp} x {self.gpu}")
        return int(free / self.kv_bytes_per_token)

    def capacity(self, mean_context: float, group: int, cap: int = 512) -> int:
        """Concurrent requests per engine: what its KV cache holds at the mean context,
        a multiple of the GRPO group (the manager admits whole groups), at most ``cap``."""
        if self.engine_capacity:
            return self.engine_capacity
        fits = int(self.kv_tokens() / max(mean_context, 1.0))
        return max(group, min(cap, fits) // group * group)

    # ------------------------------------------------------------- engines
    def decode_step_s(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` requests holding ``context`` KV tokens in all."""
        if self.decode_fixed_s >= 0:  # measured (calibration): a linear fit
            return self.decode_fixed_s + self.decode_per_request_s * batch + \
                self.decode_per_context_token_s * context
        s, hw, tp = self.spec, self.hw, self.engine_tp
        bytes_ = self.weight_bytes + context * self.kv_bytes_per_token
        t_mem = bytes_ / (tp * hw["hbm_bytes_s"] * EFFICIENCY["decode_bandwidth"])
        flops = 2 * s["params"] * batch + 4 * s["layers"] * s["heads"] * s["head_dim"] * context
        t_compute = flops / (tp * hw["peak_flops"] * EFFICIENCY["decode_compute"])
        comm = 2 * s["layers"] * EFFICIENCY["allreduce_s"] if tp > 1 else 0.0
        return max(t_mem, t_compute) + EFFICIENCY["step_overhead_s"] + comm

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        if self.prefill_per_token_s >= 0:
            return self.prefill_per_token_s * tokens
        return 2 * self.spec["params"] * tokens / (
            self.engine_tp * self.hw["peak_flops"] * EFFICIENCY["prefill_compute"])

    # ------------------------------------------------------------- trainer
    def trainer_efficiency(self) -> float:
        """MFU of the trainer's layout: the table's MFU times the pipeline bubble of 1F1B
        with as many micro-batches as fit (4 per stage at least)."""
        pp = self.spec["trainer_pp"]
        micro = max(4 * pp, 1)
        return EFFICIENCY["trainer_mfu"] * micro / (micro + pp - 1)

    def train_s(self, tokens: int, gpus: int) -> float:
        """One optimizer step on ``tokens`` tokens with ``gpus`` trainer GPUs."""
        if self.trainer_per_token_s >= 0:
            return self.trainer_per_token_s * tokens
        flops = 8 * self.spec["params"] * tokens
        return flops / (gpus * self.hw["peak_flops"] * self.trainer_efficiency())

    def data_parallel(self, gpus: int) -> int:
        """The trainer's data-parallel ranks: its GPUs over one model replica's TP x PP."""
        return max(gpus // self.min_trainer_gpus(), 1)

    def sequence_flops(self, tokens: int) -> float:
        """Training FLOPs of one packed sequence of ``tokens`` tokens: 8·N per token (as
        ``train_s``) plus causal attention, 2·layers·hidden·L² forward, four passes' worth
        (forward, backward = 2 forwards, the proximal log-probs' forward); +21% for a 16K
        sequence of 7B, +3% at the workload's mean."""
        s = self.spec
        return 8 * s["params"] * tokens + 8 * s["layers"] * s["hidden"] * float(tokens) ** 2

    # ------------------------------------------------------------- the trainer's step costs
    def dp_sync_bytes(self, gpus: int) -> float:
        """Bytes each trainer GPU sends (and receives) per optimizer step in the distributed
        optimizer's collectives: a ring reduce-scatter of its fp32 gradient shard and an
        all-gather of the bf16 parameters, each (d - 1)/d of its model-parallel shard
        (params / (TP x PP)) over d data-parallel ranks; 0 with one rank."""
        d = self.data_parallel(gpus)
        shard = self.spec["params"] / min(self.min_trainer_gpus(), max(gpus, 1))
        return (d - 1) / d * shard * (GRAD_REDUCE_BYTES + BYTES_PER_PARAM)

    def dp_link_bytes_s(self, gpus: int) -> float:
        """One trainer GPU's achieved rate in those collectives: its NIC (a machine's NICs over
        its 8 GPUs) when the trainer spans machines, NVLink inside one machine; at
        ``TRAINER["dp_link_fraction"]``."""
        link = NETWORK["nic_bytes_s"] / 8 if gpus > 8 else self.hw["nvlink_bytes_s"]
        return link * TRAINER["dp_link_fraction"]

    def dp_sync_s(self, gpus: int) -> float:
        """The exposed seconds of one step's data-parallel collectives (``dp_sync_bytes`` over
        ``dp_link_bytes_s``, times ``TRAINER["dp_exposed"]``)."""
        return self.dp_sync_bytes(gpus) / self.dp_link_bytes_s(gpus) * TRAINER["dp_exposed"]

    def optimizer_s(self, gpus: int) -> float:
        """The Adam step on one GPU's shard (params / (TP x PP x DP)) over its HBM."""
        shard = self.spec["params"] / (min(self.min_trainer_gpus(), max(gpus, 1)) *
                                       self.data_parallel(gpus))
        return shard * ADAM_BYTES_PER_PARAM / (self.hw["hbm_bytes_s"] *
                                               TRAINER["optimizer_bandwidth"])

    def step_overhead_s(self, gpus: int, network: bool = True) -> float:
        """What one optimizer step costs beyond its compute: the optimizer step, the fixed
        per-step cost and (``network``) the exposed data-parallel collectives. A measured
        trainer cost (calibration) already holds them: 0."""
        if self.trainer_per_token_s >= 0:
            return 0.0
        return self.optimizer_s(gpus) + TRAINER["step_fixed_s"] + (
            self.dp_sync_s(gpus) if network else 0.0)

    def train_step_s(self, sequences: Sequence[int], gpus: int) -> float:
        """One optimizer step: its compute (``train_step_compute_s``) plus
        ``step_overhead_s``."""
        return self.train_step_compute_s(sequences, gpus) + self.step_overhead_s(gpus)

    def train_step_compute_s(self, sequences: Sequence[int], gpus: int) -> float:
        """One optimizer step (a mini-batch) of ``sequences`` (tokens per trajectory) on
        ``gpus`` trainer GPUs: the sequences are balanced over the data-parallel ranks by
        tokens, longest first onto the least loaded rank (verl's and Megatron's sequence
        balancing do as well or no better), and the step lasts as long as its busiest rank's
        model-parallel group computes. A rank holds whole sequences (no context parallelism),
        so with a fixed global batch the step cannot be shorter than the longest sequence,
        however many GPUs train: at 7B on 192 trainer GPUs a 512-trajectory mini-batch is 5
        sequences per rank and its 16K tail sets the pace."""
        if self.trainer_per_token_s >= 0:  # measured (calibration): linear in tokens
            return self.train_s(int(sum(sequences)), gpus)
        ranks = [0.0] * self.data_parallel(gpus)
        for flops in sorted((self.sequence_flops(n) for n in sequences), reverse=True):
            heapq.heapreplace(ranks, ranks[0] + flops)
        group = min(self.min_trainer_gpus(), max(gpus, 1))  # fewer GPUs than a replica: all
        return max(ranks) / (group * self.hw["peak_flops"] * self.trainer_efficiency())

    def min_trainer_gpus(self) -> int:
        s = self.spec
        return s["trainer_tp"] * s["trainer_pp"]

    # ------------------------------------------------------------- weights
    def publish_s(self) -> float:
        """The trainer's stall per publish (to the master relay)."""
        if self.publish_seconds >= 0:
            return self.publish_seconds
        return self.weight_bytes / LINKS["publish_bytes_s"]

    def _chain_chunks(self, relays: int) -> int:
        return optimal_chunks(relays - 1, int(self.weight_bytes), 1 / LINKS["chain_bytes_s"],
                              LINKS["chain_start_s"])

    def chain_s(self, relays: int) -> float:
        """Laminar's T(p, k) = (p + k - 2)(M/k T_byte + T_start) at the best k (the relay
        chain's own model, relay/chain.py), from the master to the last of ``relays``."""
        if relays <= 1:
            return 0.0
        return chain_time(relays - 1, int(self.weight_bytes), self._chain_chunks(relays),
                          1 / LINKS["chain_bytes_s"], LINKS["chain_start_s"])

    def chain_hop_s(self, relays: int, position: int) -> float:
        """When the relay at ``position`` (0: the master) holds the whole version: the chain
        is pipelined, so hop i is done (i + k - 1) chunk times after the start."""
        if position <= 0:
            return 0.0
        k = self._chain_chunks(relays)
        return (position + k - 1) * (self.weight_bytes / k / LINKS["chain_bytes_s"] +
                                     LINKS["chain_start_s"])

    def pull_s(self) -> float:
        """An engine takes a version from its relay: each GPU its shard over its own PCIe."""
        if self.pull_seconds >= 0:
            return self.pull_seconds
        return self.weight_bytes / self.engine_tp / LINKS["pull_bytes_s"] + LINKS["pull_fixed_s"]

    def broadcast_s(self) -> float:
        """A global NCCL update (verl disaggregated, one-step, stream, AReaL): the barrier
        and the broadcast of the whole model at the published rate (``PROTOCOL``); the trainer
        and every engine are stopped for all of it."""
        return PROTOCOL["nccl_barrier_s"] + self.weight_bytes / PROTOCOL["nccl_broadcast_bytes_s"]

    def colocated_sync_s(self) -> float:
        """verl's update in place: reshard over NVLink inside each node and wake the engine."""
        return self.weight_bytes / self.hw["nvlink_bytes_s"] + LINKS["colocated_sync_fixed_s"]
