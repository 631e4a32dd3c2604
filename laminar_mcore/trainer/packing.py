"""Pack trajectories into Megatron's THD layout and plan micro-batches by token budget.

A packed micro-batch is one row of concatenated sequences (prompt + response), each padded to a
multiple of TP (x 2*CP when CP > 1), with ``cu_seqlens`` marking the boundaries. Position ids
restart at every sequence. Position ``i`` of a sequence predicts token ``i+1``; its loss mask is
1 exactly when token ``i+1`` is a response token, and it carries that token's behaviour
log-prob and its trajectory's advantage.

With Transformer-Engine attention the boundaries travel as ``PackedSeqParams`` (qkv_format
"thd"); the local attention of the CPU path gets the equivalent block-diagonal causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..data.trajectory import Trajectory


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [1, T] int64 input ids
    labels: torch.Tensor  # [1, T] int64 next-token ids (0 where there is none)
    position_ids: torch.Tensor  # [1, T]
    loss_mask: torch.Tensor  # [1, T] float32
    behav_logprobs: torch.Tensor  # [1, T] float32 (0 where masked)
    advantages: torch.Tensor  # [1, T] float32 (0 where masked)
    seq_ids: torch.Tensor  # [1, T] int64: index of the trajectory in the whole batch, -1 padding
    cu_seqlens: torch.Tensor  # [n+1] int32, real lengths
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, padded lengths (the layout)
    traj_indices: List[int]
    prox_logprobs: Optional[torch.Tensor] = None  # [1, T] float32, filled by the trainer
    extras: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())

    def packed_seq_params(self):
        """Megatron ``PackedSeqParams`` for Transformer-Engine attention (THD)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def local_packed_seq_params(self):
        """Megatron ``PackedSeqParams`` for the local spec's packed attention
        (``trainer.attention``): the row stays in ``sbhd`` layout, so RoPE is applied in one
        vectorised op over the row's positions (attention within a sequence depends only on
        relative positions), and the core attention takes the boundaries from ``cu_seqlens``."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="sbhd", cu_seqlens_q=self.cu_seqlens_padded,
            cu_seqlens_kv=self.cu_seqlens_padded, cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded, max_seqlen_q=self.num_tokens,
            max_seqlen_kv=self.num_tokens)

    def attention_mask(self) -> torch.Tensor:
        """[1, 1, T, T] bool, True where attention is *not* allowed (Megatron's convention)."""
        dev = self.tokens.device  # built where the batch is (the model's device)
        bounds = self.cu_seqlens_padded.to(dev)
        segment = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=dev),
                                          (bounds[1:] - bounds[:-1]).long())
        same = segment.unsqueeze(0) == segment.unsqueeze(1)
        causal = torch.ones(len(segment), len(segment), dtype=torch.bool, device=dev).tril()
        return ~(same & causal).view(1, 1, len(segment), len(segment))

    def to(self, device) -> "PackedMicroBatch":
        for name in ("tokens", "labels", "position_ids", "loss_mask", "behav_logprobs",
                     "advantages", "seq_ids", "cu_seqlens", "cu_seqlens_padded", "prox_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device, non_blocking=True))
        return self


def pad_multiple(tp: int = 1, cp: int = 1) -> int:
    return tp * (2 * cp if cp > 1 else 1)


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def pack_trajectories(trajectories: Sequence[Trajectory], advantages: Sequence[float],
                      traj_indices: Sequence[int], *, tp: int = 1, cp: int = 1,
                      device=None) -> PackedMicroBatch:
    """One packed micro-batch from ``trajectories`` (and one advantage per trajectory), built on
    ``device``: the per-sequence columns are laid out as a padded batch and packed into THD by
    ``kernels.packing.pack`` -- its Triton kernel on GPUs, its torch reference on CPU."""
    from ..kernels.packing import cu_seqlens, pack

    if len(trajectories) != len(advantages) or len(trajectories) != len(traj_indices):
        raise ValueError("pack_trajectories needs one advantage and one index per trajectory")
    if not trajectories:
        raise ValueError("cannot pack an empty micro-batch")
    multiple = pad_multiple(tp, cp)
    lengths = [t.num_tokens for t in trajectories]
    # Columns: input id, next-token id, loss mask, behaviour log-prob, advantage. float64 holds
    # token ids exactly (< 2**53) and the float32 columns without rounding: one pack for all.
    padded = torch.zeros(len(trajectories), max(lengths), 5, dtype=torch.float64)
    for b, (traj, adv) in enumerate(zip(trajectories, advantages)):
        n, p = lengths[b], len(traj.prompt_ids)
        ids = torch.tensor(list(traj.prompt_ids) + list(traj.response_ids), dtype=torch.float64)
        padded[b, :n, 0] = ids
        padded[b, :n - 1, 1] = ids[1:]
        # position i predicts token i+1: the response's tokens are predicted at p-1 .. n-2
        # (a multi-turn episode's tool outputs and template tokens are context, not trained)
        padded[b, p - 1:n - 1, 2] = torch.tensor(traj.sampled_mask, dtype=torch.float64) \
            if traj.loss_mask else 1.0
        padded[b, p - 1:n - 1, 3] = torch.tensor(traj.behav_logprobs, dtype=torch.float32).double()
        padded[b, p - 1:n - 1, 4] = float(torch.tensor(float(adv), dtype=torch.float32))
    lens = torch.tensor(lengths, dtype=torch.int64)
    if device is not None:
        padded, lens = padded.to(device), lens.to(device)
    packed = pack(padded, lens, multiple)  # [T, 5]
    cu, cu_pad = cu_seqlens(lens, multiple)
    spans = (cu_pad[1:] - cu_pad[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(len(lengths), device=lens.device), spans)
    pos = torch.arange(int(cu_pad[-1]), device=lens.device) - cu_pad[:-1].long()[seq_of]
    index = torch.tensor(list(traj_indices), dtype=torch.long, device=lens.device)
    seq = torch.where(pos < lens[seq_of], index[seq_of], torch.full_like(pos, -1))

    def row(column, dtype):
        return packed[:, column].to(dtype).unsqueeze(0)

    return PackedMicroBatch(
        tokens=row(0, torch.long), labels=row(1, torch.long), position_ids=pos.unsqueeze(0),
        loss_mask=row(2, torch.float32), behav_logprobs=row(3, torch.float32),
        advantages=row(4, torch.float32), seq_ids=seq.unsqueeze(0), cu_seqlens=cu,
        cu_seqlens_padded=cu_pad, traj_indices=list(traj_indices))


def routed_experts_rows(traj: Trajectory, layers: int, topk: int) -> torch.Tensor:
    """The engine's routing of every position of ``traj`` as int64 [num_tokens, layers, topk];
    the last position (which the engine never ran: it was sampled last) routes to experts
    0..topk-1, which only its own unused logits see."""
    import base64

    import numpy as np

    if not traj.routed_experts:
        raise ValueError(f"LMC-E332: trajectory {traj.uid} carries no routed experts; "
                         "algo.routing_replay=true needs engines started with "
                         "--enable-return-routed-experts (the launcher adds it) and trajectories "
                         "generated since")
    flat = np.concatenate([np.frombuffer(base64.b64decode(seg), dtype=np.int32)
                           for seg in traj.routed_experts])
    want = (traj.num_tokens - 1) * layers * topk
    if flat.size != want:
        raise ValueError(f"trajectory {traj.uid}: {flat.size} routed-expert entries, expected "
                         f"(num_tokens - 1) x layers x top-k = {traj.num_tokens - 1} x {layers} "
                         f"x {topk} = {want}")
    rows = torch.from_numpy(flat.astype(np.int64)).view(traj.num_tokens - 1, layers, topk)
    last = torch.arange(topk, dtype=torch.int64).expand(1, layers, topk)
    return torch.cat([rows, last])


def pack_routed_experts(trajectories: Sequence[Trajectory], layers: int, topk: int,
                        cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """[T, layers, topk] in the packed layout of ``pack_trajectories`` (padding routes to
    experts 0..topk-1)."""
    bounds = cu_seqlens_padded.tolist()
    out = torch.arange(topk, dtype=torch.int64).expand(int(bounds[-1]), layers, topk).clone()
    for traj, start in zip(trajectories, bounds):
        rows = routed_experts_rows(traj, layers, topk)
        out[start:start + len(rows)] = rows
    return out


def partition_balanced(lengths: Sequence[int], parts: int) -> List[List[int]]:
    """Split item indices into ``parts`` groups of near-equal total length (greedy LPT; each
    item goes to the currently lightest group, longest items first)."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if len(lengths) < parts:
        raise ValueError(f"LMC-E331: {len(lengths)} trajectories cannot be spread over {parts} "
                         "data-parallel ranks; make the batch larger")
    groups: List[List[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # Lightest group; among equals the one with fewer items, so every group gets one.
        g = min(range(parts), key=lambda k: (loads[k], len(groups[k]), k))
        groups[g].append(i)
        loads[g] += lengths[i]
    return [sorted(g) for g in groups]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Bins of item indices whose total length is at most ``capacity`` (an item longer than
    ``capacity`` gets a bin of its own). Bins are returned in a deterministic order."""
    if capacity < 1:
        raise ValueError("max_tokens_per_microbatch must be >= 1")
    bins: List[List[int]] = []
    loads: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def plan_microbatches(lengths: Sequence[int], max_tokens_per_microbatch: int,
                      dp_size: int = 1) -> List[List[List[int]]]:
    """For each DP rank, its micro-batches as lists of trajectory indices.

    Token counts are balanced across DP ranks; within a rank, micro-batches are bins of at most
    ``max_tokens_per_microbatch`` (padded) tokens.
    """
    plan = []
    for rank_items in partition_balanced(lengths, dp_size):
        bins = first_fit_decreasing([lengths[i] for i in rank_items], max_tokens_per_microbatch)
        plan.append([[rank_items[j] for j in b] for b in bins])
    return plan
