"""Pulls of each engine rank's own shard: a leased version served in SGLang's per-rank layout.

A lease asked with ``shard: {tp_size, heads, tied, ep_size}`` (an engine of TP ``tp_size`` and
expert parallel size ``ep_size`` whose model has ``heads`` attention heads) is served as
SGLang's fused per-rank parameters (``weights/engine_layout.py``) instead of whole Hugging Face
tensors: the version's parameters in groups of about one stored bucket's size per rank, each
``/bucket`` one group with one payload per rank holding only that rank's slices, for
``/update_weights_from_tensor`` with ``load_format="direct"``. An engine GPU then receives its
shard (about 1/TP of the model, plus the replicated norms and key/value heads) instead of every
tensor whole. The relay holds the version whole as before; each rank's tensors are cut from it
as its group is served, directly into the transport's buffer (shared memory, or the rank's GPU
for CUDA IPC).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Dict, List, Tuple

import torch

from ..weights.bucket import dtype_from_name, layout, read_bucket
from ..weights.engine_layout import Layout


class ShardPlan:
    """A version in the per-rank layout of TP ``tp``: ``tensors`` maps each Hugging Face name to
    (shape, dtype, a callable returning a view of the whole tensor); ``groups`` are the pulls,
    about ``bucket_bytes`` per rank each. ``of_version`` plans a relay's leased version."""

    def __init__(self, tensors: Dict[str, Tuple[tuple, torch.dtype, Callable[[], torch.Tensor]]],
                 tp: int, heads: int, bucket_bytes: int, ep: int = 1):
        self._get = {name: get for name, (_, _, get) in tensors.items()}
        self.layout = Layout({n: t[0] for n, t in tensors.items()}, heads, tp,
                             {n: t[1] for n, t in tensors.items()}, ep=ep)
        self.groups: List[List[str]] = self.layout.groups(max(int(bucket_bytes), 1))

    @classmethod
    def of_version(cls, store, sv, tp: int, heads: int, tied: bool = False,
                   ep: int = 1) -> "ShardPlan":
        """Lease ``sv`` (a ``StoredVersion`` of ``store``): each whole tensor read from the
        bucket a whole pull would get (``store.served``, mapped once per lease), in groups of
        about its largest bucket. ``tied``: the engine's output layer is its embedding (SGLang
        has no ``lm_head.weight`` parameter then): an ``lm_head.weight`` in the version is
        not served."""
        entries = (sv.whole if sv.whole is not None
                   else [[(m.name, m.dtype, m.shape) for m in b.metas] for b in sv.ordered()])
        views: Dict[int, Dict[str, torch.Tensor]] = {}
        lock = threading.Lock()

        def view(i: int, name: str) -> torch.Tensor:
            with lock:  # /bucket serves in worker threads
                if i not in views:
                    bucket = store.served(sv, i)
                    views[i] = read_bucket(bucket.shm.buffer, bucket.metas)
                return views[i][name]

        tensors, sizes = {}, {}
        for i, entry in enumerate(entries):
            for t in entry:
                name, dtype, shape = (t.name, t.dtype, t.shape) if sv.whole is not None else t
                if tied and name == "lm_head.weight":
                    continue
                dtype = dtype_from_name(dtype)
                tensors[name] = (tuple(shape), dtype, functools.partial(view, i, name))
                sizes[i] = sizes.get(i, 0) + torch.Size(shape).numel() * dtype.itemsize
        return cls(tensors, tp, heads, max(sizes.values(), default=1), ep)

    @classmethod
    def of_tensors(cls, named: Dict[str, torch.Tensor], tp: int, heads: int,
                   bucket_bytes: int, ep: int = 1) -> "ShardPlan":
        """Whole tensors in memory (``bench.gpu``)."""
        return cls({n: (tuple(t.shape), t.dtype, functools.partial(named.__getitem__, n))
                    for n, t in named.items()}, tp, heads, bucket_bytes, ep)

    def tensor(self, hf: str) -> torch.Tensor:
        """A view of whole Hugging Face tensor ``hf`` (valid for the lease)."""
        return self._get[hf]()

    def group_layout(self, index: int) -> Tuple[list, int]:
        """(metas, bytes) of one rank's payload of group ``index`` (64-byte aligned)."""
        return layout({n: torch.empty(self.layout.shapes[n], dtype=self.layout.dtypes[n],
                                      device="meta") for n in self.groups[index]})

    def fill(self, index: int, rank: int, views: Dict[str, torch.Tensor]) -> None:
        """Write rank ``rank``'s parameters of group ``index`` into ``views`` (name -> tensor
        of the rank's shape, on any device)."""
        for name in self.groups[index]:
            self.layout.fill(name, rank, self.tensor, views[name])

    def rank_bytes(self, index: int) -> int:
        return sum(self.layout.nbytes(n) for n in self.groups[index])

    @property
    def nbytes(self) -> int:
        """What an engine pulls in all: every rank's payloads."""
        return self.layout.tp * sum(self.rank_bytes(i) for i in range(len(self.groups)))


__all__ = ["ShardPlan"]
