"""Versions published as per-rank shards, read as whole Hugging Face tensors (issue 52).

With ``weight_sync.export=per_rank`` every trainer rank of the first data-parallel replica
publishes what it holds of its pipeline stage (``trainer.export.iter_rank_hf_shards``), with
no gather: a tensor cut by tensor parallelism arrives as slices, each ``TensorMeta`` naming the
full shape, the dim and where the slice starts. The version is still one named set of Hugging
Face tensors to whoever reads it whole: :func:`whole_plan` says, from the stored buckets' metas
alone, which whole tensors each served bucket holds and where every slice goes, refusing a
version whose slices do not tile their tensors exactly once; :func:`assemble` fills a served
bucket from the stored ones (the relay does it as an engine pulls, ``relay/pulls.py``).

A served bucket holds the whole tensors first met in one stored bucket (in (part, index)
order: the slices of TP rank 0's bucket bring in their tensors, whose other slices sit in the
other ranks' buckets), so their sizes follow the trainer's ``weight_sync.bucket_mb`` times TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .bucket import TensorMeta, dtype_from_name, layout, slice_fits

__all__ = ["EXPORTS", "WholeTensor", "is_sharded", "publish_parts", "relay_copies",
           "check_stripes", "stripes_for", "run_stripes", "stripe_parts", "stripe_of",
           "whole_plan", "served_layout", "assemble"]

EXPORTS = ("stage_lead", "per_rank")  # weight_sync.export


def publish_parts(pp: int, tp: int, export: str, ep: int = 1) -> int:
    """How many parts publish a version (a relay's ``--trainer-stages``): a stage lead per
    pipeline stage, or with ``per_rank`` every rank of the first data-parallel replica (TP
    parts per stage; a mixture-of-experts model, at TP1, one part per EP rank of the first
    expert-data-parallel replica)."""
    return pp * (tp * ep if export == "per_rank" else 1)


def check_stripes(stripes: int, pp: int) -> None:
    """A striped relay tier (``weight_sync.master_relays``): each of ``stripes`` master relays
    receives whole pipeline stages, so each stripe's relays can serve whole tensors on their
    own; ``ValueError`` (LMC-E127) unless ``stripes`` divides the trainer's ``pp``."""
    if stripes < 1 or pp % stripes:
        raise ValueError(f"LMC-E127: {stripes} master relays (weight_sync.master_relays) must "
                         f"divide the trainer's {pp} pipeline stages (parallel.pp): each stripe "
                         "holds whole stages; use a divisor of parallel.pp (1: one master "
                         "relay)")


def stripes_for(master_relays: Optional[int], pp: int, trainer_nodes: int = 1) -> int:
    """How many stripes (master relays) a run's versions take: ``weight_sync.master_relays``
    (checked: it divides ``pp``, LMC-E127), or, when it is null, one per trainer node where
    that divides the pipeline stages -- the largest divisor of ``pp`` that is at most the
    trainer's nodes and divides their number (1 on one trainer node)."""
    if master_relays is None:
        return math.gcd(max(1, int(trainer_nodes)), max(1, int(pp)))
    check_stripes(int(master_relays), pp)
    return int(master_relays)


def run_stripes(cfg) -> int:
    """The stripes of a run (``cfg``: its config): ``stripes_for`` of its
    ``weight_sync.master_relays``, parallel.pp and trainer nodes -- except that the null
    default stays 1 where engines read one relay (``rollout.relay=remote``,
    ``weight_sync.engine_transport=mooncake``), which a striped tier cannot serve."""
    ws = cfg.weight_sync
    value = getattr(ws, "master_relays", None)
    if value is None and (cfg.rollout.relay == "remote" or ws.engine_transport == "mooncake"):
        return 1
    return stripes_for(value, int(cfg.parallel.pp), int(cfg.cluster.trainer.nnodes))


def stripe_parts(stripe: int, stripes: int, parts: int) -> range:
    """The publishing parts (``publish_parts``, numbered ``stage * TP + TP rank`` or by stage)
    that master relay ``stripe`` of ``stripes`` receives: a block of whole pipeline stages,
    ``parts / stripes`` of them in a row."""
    if not 0 <= stripe < stripes or parts % stripes:
        raise ValueError(f"LMC-E127: stripe {stripe} of {stripes} over {parts} publishing "
                         "parts: the stripe must be one of 0..stripes-1 and stripes divide "
                         "the parts (weight_sync.master_relays divides parallel.pp)")
    per = parts // stripes
    return range(stripe * per, (stripe + 1) * per)


def stripe_of(part: int, stripes: int, parts: int) -> int:
    """The stripe (master relay) publishing part ``part`` of ``parts`` goes to."""
    if not 0 <= part < parts:
        raise ValueError(f"LMC-E127: part {part} is not one of the {parts} publishing parts")
    stripe_parts(0, stripes, parts)  # (checks that stripes divide the parts)
    return part // (parts // stripes)


def relay_copies(export: str, tp: int = 2) -> int:
    """Copies of a version a relay holds: the stored buckets, and for ``per_rank`` with tensors
    cut by TP (``tp`` > 1) also the whole tensors it puts together for pulls (at TP1 every part
    holds whole tensors -- a mixture-of-experts' EP ranks too -- served as they are)."""
    return 2 if export == "per_rank" and tp > 1 else 1


@dataclass
class WholeTensor:
    """One whole tensor of a served bucket and the slices it is made of: (position of the
    stored bucket in the list given to :func:`whole_plan`, that slice's meta)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    pieces: List[Tuple[int, TensorMeta]] = field(default_factory=list)


def is_sharded(metas_lists: Sequence[Sequence[TensorMeta]]) -> bool:
    """Whether any stored bucket holds a slice (a per-rank publication)."""
    return any(m.dim is not None for metas in metas_lists for m in metas)


def whole_plan(metas_lists: Sequence[Sequence[TensorMeta]]) -> List[List[WholeTensor]]:
    """The served buckets of a version whose stored buckets (in pull order) have these metas.
    Raises ``ValueError`` saying which tensor is wrong when a tensor's pieces do not tile it:
    two whole copies, a whole copy and slices, slices along different dims, of different
    dtypes or full shapes, a gap or an overlap."""
    tensors: Dict[str, WholeTensor] = {}
    served: List[List[WholeTensor]] = []
    for pos, metas in enumerate(metas_lists):
        fresh = []
        for m in metas:
            if not slice_fits(m):
                raise ValueError(f"LMC-E517: {m.name}: shape {list(m.shape)} along dim {m.dim} "
                                 f"is not a slice of {list(m.full_shape)}")
            full = m.full_shape if m.dim is not None else m.shape
            t = tensors.get(m.name)
            if t is None:
                t = tensors[m.name] = WholeTensor(m.name, m.dtype, tuple(full))
                fresh.append(t)
            elif t.dtype != m.dtype or t.shape != tuple(full):
                raise ValueError(f"LMC-E517: {m.name}: a piece of dtype {m.dtype} and full shape "
                                 f"{list(full)} beside one of {t.dtype} and {list(t.shape)}")
            t.pieces.append((pos, m))
        if fresh:
            served.append(fresh)
    for t in tensors.values():
        _check_tiling(t)
    return served


def _check_tiling(t: WholeTensor) -> None:
    dims = {m.dim for _, m in t.pieces}
    if None in dims:
        if len(t.pieces) != 1:
            raise ValueError(f"LMC-E517: {t.name} arrived whole and also as {len(t.pieces) - 1} "
                             "other piece(s): every trainer rank but one must leave a tensor it "
                             "does not cut to the others")
        return
    if len(dims) != 1:
        raise ValueError(f"LMC-E517: {t.name}: slices along dims {sorted(dims)}; a tensor is cut "
                         "along one dim")
    dim = dims.pop()
    at = 0
    for _, m in sorted(t.pieces, key=lambda p: p[1].start):
        if m.start != at:
            raise ValueError(f"LMC-E517: {t.name}: along dim {dim}, a slice starts at {m.start} "
                             f"where {at} was expected ({'an overlap' if m.start < at else 'a gap'}"
                             "): a trainer rank's shard is missing or sent twice")
        at += m.shape[dim]
    if at != t.shape[dim]:
        raise ValueError(f"LMC-E517: {t.name}: its slices cover {at} of {t.shape[dim]} along dim "
                         f"{dim}: a trainer rank's shard is missing")


def served_layout(entry: Sequence[WholeTensor]) -> Tuple[List[TensorMeta], int]:
    """The metas (whole tensors) and byte size of one served bucket."""
    return layout({t.name: torch.empty(t.shape, dtype=dtype_from_name(t.dtype), device="meta")
                   for t in entry})


def assemble(entry: Sequence[WholeTensor], sources: Sequence[torch.Tensor],
             out: torch.Tensor) -> List[TensorMeta]:
    """Fill ``out`` (uint8, at least ``served_layout``'s size) with ``entry``'s whole tensors
    from the stored buckets' buffers (``sources[pos]``, uint8); returns its metas."""
    metas, _ = served_layout(entry)
    for t, meta in zip(entry, metas):
        dtype = dtype_from_name(t.dtype)
        dst = out[meta.offset:meta.offset + meta.nbytes].view(dtype).view(t.shape)
        for pos, piece in t.pieces:
            src = sources[pos][piece.offset:piece.offset + piece.nbytes].view(dtype)
            src = src.view(piece.shape)
            if piece.dim is None:
                dst.copy_(src)
            else:
                dst.narrow(piece.dim, piece.start, piece.shape[piece.dim]).copy_(src)
    return metas
