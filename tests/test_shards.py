"""Versions published as per-rank shards (weights/shards.py): slices put back together bit for
bit, slices that do not tile their tensor refused by name, and a relay store that refuses such
a version while it keeps serving the previous one."""

import pytest
import torch

from laminar_mcore.relay.store import VersionStore
from laminar_mcore.weights.bucket import (BucketPacker, checked_metas, layout, metas_from_dicts,
                                          read_bucket)
from laminar_mcore.weights.shards import assemble, served_layout, whole_plan

FULL = {"embed": torch.randn(12, 5, dtype=torch.float64).to(torch.bfloat16),
        "qkv": torch.randn(6, 8).to(torch.bfloat16),
        "norm": torch.randn(8).to(torch.bfloat16)}


def _rank_items(rank, tp=2, skip=()):
    """What TP rank ``rank`` publishes: its rows of embed, its columns of qkv, norm on rank 0."""
    out = []
    for name, dim in (("embed", 0), ("qkv", 1)):
        if name in skip:
            continue
        n = FULL[name].shape[dim] // tp
        out.append((name, FULL[name].narrow(dim, rank * n, n),
                    (tuple(FULL[name].shape), dim, rank * n)))
    if rank == 0 and "norm" not in skip:
        out.append(("norm", FULL["norm"]))
    return out


def _packed(items, bucket_bytes=64):
    """Per-rank buckets through the publisher's packer (tiny buckets: a tensor each); their
    metas go through JSON as they do on the wire."""
    packer = BucketPacker(bucket_bytes)
    return [(metas_from_dicts([m.to_dict() for m in b.metas]), b.buffer.clone())
            for b in packer.pack(iter(items))]


def test_slices_from_every_rank_assemble_into_the_whole_tensors_bit_for_bit():
    stored = _packed(_rank_items(0)) + _packed(_rank_items(1))
    for metas, buf in stored:  # the wire form is checked as a handle's would be
        assert checked_metas([m.to_dict() for m in metas], buf.numel()) == metas
    plan = whole_plan([metas for metas, _ in stored])
    assert sum(len(entry) for entry in plan) == 3  # every tensor served once
    got = {}
    for entry in plan:
        metas, nbytes = served_layout(entry)
        out = torch.zeros(nbytes, dtype=torch.uint8)
        assert assemble(entry, [buf for _, buf in stored], out) == metas
        got.update({k: v.clone() for k, v in read_bucket(out, metas).items()})
    assert set(got) == set(FULL)
    for name, t in FULL.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("case,match", [
    ("missing rank", "cover 6 of 12"),
    ("sent twice", "an overlap"),
    ("whole twice", "arrived whole and also"),
])
def test_slices_that_do_not_tile_their_tensor_are_refused_by_name(case, match):
    ranks = {"missing rank": [0], "sent twice": [0, 0, 1]}.get(case, [0, 1])
    stored = [metas for r in ranks for metas, _ in _packed(_rank_items(r))]
    if case == "whole twice":
        stored += [metas for metas, _ in _packed([("norm", FULL["norm"])])]
    with pytest.raises(ValueError, match=f"LMC-E517: .*{match}"):
        whole_plan(stored)


def test_a_slice_of_another_shape_is_refused_by_the_plan():
    stored = [metas for r in (0, 1) for metas, _ in _packed(_rank_items(r))]
    bad = [dict(m.to_dict(), dim=5) if m.dim is not None else m.to_dict() for m in stored[0]]
    with pytest.raises(ValueError, match="LMC-E517: .*is not a slice of"):
        whole_plan([metas_from_dicts(bad)] + stored[1:])


def test_a_slice_outside_its_full_shape_is_refused_in_a_handle():
    (metas, buf), *_ = _packed(_rank_items(1))
    raw = [dict(m.to_dict(), start=m.full_shape[m.dim]) for m in metas]
    with pytest.raises(ValueError, match="is not a slice of"):
        checked_metas(raw, buf.numel())


def _store_version(store, version, ranks):
    sv = store.begin(version, len(ranks), owner="t")
    for part, rank in enumerate(ranks):
        stored = _packed(_rank_items(rank), bucket_bytes=10**6)
        for index, (metas, buf) in enumerate(stored):
            b = store.add_bucket(sv, (part, index), buf.numel(), metas,
                                 last_of_stage=index == len(stored) - 1)
            b.shm.buffer.copy_(buf)
            store.progress(sv, b, buf.numel())
    return sv


def test_the_store_refuses_a_version_whose_shards_do_not_tile_and_keeps_the_previous():
    store = VersionStore()
    try:
        assert store.try_complete(_store_version(store, 1, [0, 1]))
        assert store.latest.whole is not None and store.latest.num_served == 1
        bad = _store_version(store, 2, [0, 0])  # rank 1's part came from rank 0 again
        assert not store.try_complete(bad)
        assert "LMC-E517" in bad.failed and store.latest_version == 1
        assert store.versions_failed == 1
    finally:
        store.close()


def test_whole_tensors_keep_the_stored_buckets_order_and_layout():
    metas, nbytes = layout({"a": torch.ones(3), "b": torch.zeros(2, 2)})
    plan = whole_plan([metas])  # nothing sliced: one served bucket, the same layout
    assert served_layout(plan[0]) == (metas, nbytes)


def test_the_store_serves_whole_tensors_once_per_version_in_reused_buffers():
    """``VersionStore.served``: the whole tensors, made once per version (a second pull gets
    the same buffer), counted in the held bytes, and the next version's made in the same
    buffer (a registered transport's address stays valid)."""
    store = VersionStore()
    try:
        assert store.try_complete(_store_version(store, 1, [0, 1]))
        v1 = store.latest
        made = store.served(v1, 0)
        assert store.served(v1, 0) is made
        got = read_bucket(made.shm.buffer, made.metas)
        assert all(torch.equal(got[name], t) for name, t in FULL.items())
        with store.cond:
            assert store.held_bytes >= v1.nbytes + made.nbytes
        path = made.shm.path
        assert store.try_complete(_store_version(store, 2, [0, 1]))  # v1 recycled: no lease
        assert store.served(store.latest, 0).shm.path == path
    finally:
        store.close()
