"""Payloads SGLang accepts (issue #28, point 6): the ``/update_weights_from_distributed``
flattened bucket (back to back, as SGLang's receiver computes it) over a real two-process gloo
group, and the CUDA-IPC flattened bucket of ``/update_weights_from_tensor`` (16-byte starts,
explicit start/end), with mixed dtypes and odd sizes, bit for bit."""

import datetime
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from laminar_mcore.relay.transports.cuda_ipc import (IPC_ALIGN, CudaIpcExporter, ipc_layout,
                                                     reconstruct_tensors,
                                                     standin_bucket_classes)
from laminar_mcore.weights.update_group import (flattened_layout, flattened_order,
                                                receive_tensors, send_tensors)


def _mixed(device="cpu"):
    """Odd sizes and every element size: bf16 of 3 elements (6 bytes), fp32, int64, fp16 of 1,
    bool and uint8 (1 byte), a 0-dim fp64 and a non-contiguous fp32; NaN payloads in floats."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (1 << 12,), dtype=torch.uint8, generator=g)

    def bits(dtype, shape):
        n = torch.Size(shape).numel() * dtype.itemsize
        return raw[:n].clone().view(dtype).view(shape)

    out = {
        "a.bf16": bits(torch.bfloat16, (3,)),
        "b.fp32": bits(torch.float32, (5, 3)),
        "c.i64": bits(torch.int64, (7,)),
        "d.fp16": bits(torch.float16, (1,)),
        "e.bool": torch.tensor([True, False, True]),
        "f.u8": bits(torch.uint8, (2, 5)),
        "g.fp64": bits(torch.float64, ()),
        "h.fp32t": bits(torch.float32, (3, 4)).t(),  # not contiguous
    }
    return {k: v.to(device) for k, v in out.items()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.detach().cpu().contiguous().view(-1).view(torch.uint8),
                        b.detach().cpu().contiguous().view(-1).view(torch.uint8)))


def test_flattened_layout_is_back_to_back_and_refuses_what_sglang_refuses():
    named = _mixed()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in named.items()]
    with pytest.raises(ValueError, match="Unaligned received tensor b.fp32: byte offset 6"):
        flattened_layout(specs)  # bf16[3] is 6 bytes: SGLang's receiver refuses fp32 at 6
    with pytest.raises(ValueError, match="Unaligned"):  # and the sender refuses before sending
        send_tensors(None, named, "flattened_bucket")
    with pytest.raises(ValueError, match="Unaligned"):
        receive_tensors(None, specs, "flattened_bucket")
    ordered = flattened_order(named)
    ranges, total = flattened_layout([(n, t.dtype, tuple(t.shape)) for n, t in ordered.items()])
    offset = 0
    for (a, n), t in zip(ranges, ordered.values()):
        assert a == offset and a % t.element_size() == 0 and n == t.numel() * t.element_size()
        offset += n
    assert total == offset == sum(t.numel() * t.element_size() for t in named.values())
    with pytest.raises(ValueError, match="empty tensor bucket"):
        flattened_layout([])
    mixed = {"x": torch.zeros(2), "y": torch.zeros(2, device="meta")}
    with pytest.raises(ValueError, match="one buffer on one device"):
        send_tensors(None, mixed, "flattened_bucket")


_RECEIVER = textwrap.dedent("""
    import datetime, gc, sys, torch
    from laminar_mcore.weights.update_group import (destroy_update_group,
                                                    init_custom_process_group, receive_tensors)
    port, out, specs = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "payloads",
                                   datetime.timedelta(seconds=60))
    got = {fmt: receive_tensors(pg, specs, fmt, device="cpu") for fmt in (None, "flattened_bucket")}
    destroy_update_group(pg)
    # drop the group while the interpreter lives: left to the exit's teardown, its gloo threads
    # abort the process about once in 30 runs ("terminate called without an active exception")
    del pg
    gc.collect()
    torch.save(got, out)
""")


def test_mixed_dtypes_round_trip_bit_for_bit_over_a_two_process_gloo_group(tmp_path):
    from laminar_mcore.rollout.launcher import free_port
    from laminar_mcore.weights.update_group import destroy_update_group, init_custom_process_group

    named = flattened_order(_mixed())
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in named.items()]
    torch.save(specs, tmp_path / "specs.pt")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, str(port), str(tmp_path / "got.pt"),
                             str(tmp_path / "specs.pt")], env=env)
    try:
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "payloads",
                                       datetime.timedelta(seconds=60))
        for fmt in (None, "flattened_bucket"):
            send_tensors(pg, named, fmt)
        # rank 0 serves the group's TCP store: it goes last, once the receiver has left (a
        # store gone under a peer's gloo threads aborts that peer: "terminate called ...")
        assert proc.wait(timeout=120) == 0
        destroy_update_group(pg)
    finally:
        if proc.poll() is None:
            proc.kill()
    got = torch.load(tmp_path / "got.pt")
    for fmt in (None, "flattened_bucket"):
        assert list(got[fmt]) == list(named)
        for name, t in named.items():
            assert got[fmt][name].device.type == "cpu"
            assert _same_bits(got[fmt][name], t), (fmt, name)


class _Capture:
    """A serializer that keeps the payload object (the layout, not the pickling, is tested)."""

    @staticmethod
    def serialize(obj, output_str=False):
        _Capture.last = obj
        return "captured"


def _ipc_payload(named, device):
    bucket_cls, meta_cls, _ = standin_bucket_classes()
    exporter = CudaIpcExporter(classes=(bucket_cls, meta_cls, _Capture), require_cuda=False)
    assert exporter.payload("lease", 0, named, [device]) == ["captured"]
    payload = _Capture.last
    exporter.release("lease")
    return payload


def test_cuda_ipc_bucket_has_16_byte_starts_and_explicit_ends():
    named = _mixed()  # in the given order: no reordering needed with explicit offsets
    metadata, total = ipc_layout(named)
    assert [m.name for m in metadata] == list(named)
    for m, t in zip(metadata, named.values()):
        nbytes = t.numel() * t.element_size()
        assert m.start_idx % IPC_ALIGN == 0 and m.end_idx - m.start_idx == nbytes == m.numel
        assert m.dtype == t.dtype and tuple(m.shape) == tuple(t.shape)
    assert total == metadata[-1].end_idx
    payload = _ipc_payload(named, "cpu")
    flat = payload["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.numel() == total
    assert [(m.start_idx, m.end_idx) for m in payload["metadata"]] == \
        [(m.start_idx, m.end_idx) for m in metadata]
    rebuilt = dict(reconstruct_tensors(flat, payload["metadata"]))
    assert list(rebuilt) == list(named)
    for name, t in named.items():
        assert _same_bits(rebuilt[name], t), name
    ends = [0] + [m.end_idx for m in metadata]
    for end, m in zip(ends, metadata):  # padding is zeroed, not stale memory
        assert not flat[end:m.start_idx].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sends CUDA tensors: needs a GPU")
def test_flattened_buckets_of_cuda_tensors_are_built_on_the_gpu(monkeypatch):
    import torch.distributed as dist

    named = flattened_order(_mixed("cuda"))
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: sent.append(t.clone()))
    send_tensors(None, named, "flattened_bucket")
    (flat,) = sent
    assert flat.device.type == "cuda" and flat.dtype == torch.uint8
    ranges, _ = flattened_layout([(n, t.dtype, tuple(t.shape)) for n, t in named.items()])
    for (a, n), t in zip(ranges, named.values()):
        assert _same_bits(flat[a:a + n].view(t.dtype).view(t.shape), t)
    payload = _ipc_payload(named, "cuda:0")
    assert payload["flattened_tensor"].device.type == "cuda"
    for name, t in reconstruct_tensors(payload["flattened_tensor"], payload["metadata"]):
        assert _same_bits(t, named[name])
