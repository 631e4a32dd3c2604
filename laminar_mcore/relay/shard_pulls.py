"""Pulls of each engine rank's own shard: a leased version served in SGLang's per-rank layout.

A lease asked with ``shard: {tp_size, heads}`` (an engine of TP ``tp_size`` whose model has
``heads`` attention heads) is served as SGLang's fused per-rank parameters
(``weights/engine_layout.py``) instead of whole Hugging Face tensors: the version's parameters
in groups of about one stored bucket's size per rank, each ``/bucket`` one group with one
payload per rank holding only that rank's slices, for ``/update_weights_from_tensor`` with
``load_format="direct"``. An engine GPU then receives its shard (about 1/TP of the model, plus
the replicated norms and key/value heads) instead of every tensor whole. The relay holds the
version whole as before; each rank's tensors are cut from it as its group is served, directly
into the transport's buffer (shared memory, or the rank's GPU for CUDA IPC).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..weights.bucket import dtype_from_name, layout, read_bucket
from ..weights.engine_layout import Layout


class ShardPlan:
    """Lease ``sv`` (a ``StoredVersion`` of ``store``) in the per-rank layout of TP ``tp``."""

    def __init__(self, store, sv, tp: int, heads: int):
        self.store, self.sv = store, sv
        self.index: Dict[str, int] = {}
        shapes, dtypes, sizes = {}, {}, {}
        entries = (sv.whole if sv.whole is not None
                   else [[(m.name, m.dtype, m.shape) for m in b.metas] for b in sv.ordered()])
        for i, entry in enumerate(entries):
            for t in entry:
                name, dtype, shape = (t.name, t.dtype, t.shape) if sv.whole is not None else t
                self.index[name] = i
                shapes[name], dtypes[name] = tuple(shape), dtype_from_name(dtype)
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtypes[name]).element_size()
                sizes[i] = sizes.get(i, 0) + n
        self.layout = Layout(shapes, heads, tp, dtypes)
        self.groups: List[List[str]] = self.layout.groups(max(sizes.values(), default=1))
        self._views: Dict[int, Dict[str, torch.Tensor]] = {}

    def tensor(self, hf: str) -> torch.Tensor:
        """A view of whole Hugging Face tensor ``hf`` in the version (valid for the lease)."""
        i = self.index[hf]
        if i not in self._views:
            bucket = self.store.served(self.sv, i)
            self._views[i] = read_bucket(bucket.shm.buffer, bucket.metas)
        return self._views[i][hf]

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
