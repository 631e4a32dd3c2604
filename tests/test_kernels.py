"""Triton kernels (run by Triton's interpreter on CPU) against their torch references, forward
and backward, with non-power-of-two vocabularies, masked tokens and tensor-parallel slices.

Every tensor handed to a kernel is made on the ``kernel_device`` fixture (the GPU when there is
one: compiled kernels cannot read host memory); tests/test_kernel_devices.py runs this file in
strict device mode on CPU machines to catch a tensor created without ``device=``."""

import os

import pytest
import torch

from laminar_mcore.kernels import logprobs as klp
from laminar_mcore.kernels import packing as kpack
from laminar_mcore.kernels import ppo as kppo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1")]


@pytest.mark.parametrize("tokens,vocab", [(7, 50), (13, 1000), (5, 4099)])
def test_logprobs_entropy_kernel_matches_the_reference(tokens, vocab, kernel_device):
    dev = kernel_device
    g = torch.Generator(device=dev).manual_seed(vocab)
    logits = torch.randn(tokens, vocab, generator=g, device=dev) * 3
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=dev)
    w1, w2 = (torch.randn(tokens, generator=g, device=dev) for _ in range(2))
    results = []
    for fn in (klp.logprobs_entropy_triton, klp.logprobs_entropy_torch):
        x = logits.clone().requires_grad_()
        lp, ent = fn(x, targets, 0, None, 3)
        (lp * w1 + ent * w2).sum().backward()
        results.append((lp.detach(), ent.detach(), x.grad))
    (lp_t, ent_t, g_t), (lp_r, ent_r, g_r) = results
    torch.testing.assert_close(lp_t, lp_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_t, ent_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_t, g_r, atol=1e-5, rtol=1e-4)
    full = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(lp_t.double(), full.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0)


def test_vocab_slices_combine_like_tensor_parallel_ranks(kernel_device):
    """Two vocab slices, combined the way the TP exchange between kernel passes combines them."""
    dev = kernel_device
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(9, 301, generator=g, device=dev) * 2
    targets = torch.randint(0, 301, (9,), generator=g, device=dev)
    parts = [(logits[:, :150], 0), (logits[:, 150:], 150)]
    stats = [klp.local_stats_triton(part, targets, start) for part, start in parts]
    m = torch.maximum(stats[0][0], stats[1][0])
    s = sum(st[1] * torch.exp(st[0] - m) for st in stats)
    target = stats[0][3] + stats[1][3]
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(target - (m + torch.log(s)), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_terms_kernel_matches_the_reference(dual_clip, kernel_device):
    dev = kernel_device
    g = torch.Generator(device=dev).manual_seed(1)
    n = 1500
    prox = -torch.rand(n, generator=g, device=dev) * 3
    lp = prox + torch.randn(n, generator=g, device=dev) * 0.4
    weights = torch.rand(n, generator=g, device=dev) * 2
    adv = torch.randn(n, generator=g, device=dev)
    mask = (torch.rand(n, generator=g, device=dev) > 0.3).float()
    out = []
    for fn in (kppo.ppo_terms_triton, kppo.ppo_terms_torch):
        x = lp.clone().requires_grad_()
        terms = fn(x, prox, weights, adv, mask, 0.2, 0.28, dual_clip)
        terms.sum().backward()
        out.append((terms.detach(), x.grad))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-6, rtol=1e-5)
    assert out[0][0][mask == 0].abs().sum() == 0


@pytest.mark.parametrize("multiple,feat", [(1, ()), (2, (3,)), (4, (2, 5))])
def test_pack_and_unpack_kernels_match_the_reference(multiple, feat, kernel_device):
    dev = kernel_device
    g = torch.Generator(device=dev).manual_seed(multiple)
    lengths = torch.tensor([5, 1, 9, 3], device=dev)
    padded = torch.randn((4, 10) + feat, generator=g, device=dev)
    results = []
    for use_triton in (True, False):
        x = padded.clone().requires_grad_()
        packed = kpack.pack(x, lengths, multiple, use_triton=use_triton)
        weight = torch.randn(packed.shape, generator=torch.Generator(device=dev).manual_seed(7),
                             device=dev)
        (packed * weight).sum().backward()
        back = kpack.unpack(packed.detach(), lengths, 10, multiple, use_triton=use_triton)
        results.append((packed.detach(), x.grad, back))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    packed, grad, back = results[0]
    _, cu_pad = kpack.cu_seqlens(lengths, multiple)
    assert packed.shape[0] == int(cu_pad[-1]) and int(cu_pad[-1]) % multiple == 0
    assert torch.equal(packed[int(cu_pad[2]):int(cu_pad[2]) + 9], padded[2, :9])
    mask = (torch.arange(10, device=dev)[None, :] < lengths[:, None]).view((4, 10) + (1,) * len(feat))
    assert torch.equal(back, padded * mask)  # round trip keeps real tokens, zeros the rest
    assert torch.equal(grad == 0, ~mask.expand_as(grad))  # padding gets no gradient


def test_kernel_offsets_past_2_pow_31_elements(kernel_device):
    """Rows whose start lies past 2**31 elements (e.g. 16k tokens x 152k vocab): int32
    ``row * stride`` would wrap and read another row. A strided view keeps the memory small."""
    dev = kernel_device
    if dev.type != "cuda":
        pytest.skip("int32 offsets wrap only in compiled kernels (Triton's interpreter computes "
                    "in int64); bench.gpu checks the same at (16384, 152064)")
    vocab, stride, n = 1000, 2**20, 2**11 + 2  # row 2048 starts at element 2**31
    storage = torch.zeros(stride * n, dtype=torch.bfloat16, device=dev)
    logits = storage.as_strided((n, vocab), (stride, 1))
    g = torch.Generator(device=dev).manual_seed(0)
    logits[-2:] = (torch.randn(2, vocab, generator=g, device=dev) * 3).to(torch.bfloat16)
    targets = torch.arange(n, device=dev) % vocab
    with torch.no_grad():
        lp, _ = klp.logprobs_entropy_triton(logits, targets, 0, None, None)
    ref = torch.log_softmax(logits[-2:].float(), -1).gather(-1, targets[-2:, None])[:, 0]
    torch.testing.assert_close(lp[-2:].float(), ref, atol=1e-4, rtol=0)


def test_the_trainers_float64_pack_is_exact_in_the_kernel(kernel_device):
    """pack_trajectories packs token ids and float32 columns as one float64 batch; the Triton
    kernel (what GPUs run) moves them bit for bit like the torch reference."""
    dev = kernel_device
    g = torch.Generator(device=dev).manual_seed(3)
    lengths = torch.tensor([5, 1, 9, 4], device=dev)
    padded = torch.zeros(4, 9, 5, dtype=torch.float64, device=dev)
    for b, n in enumerate(lengths.tolist()):
        padded[b, :n, :2] = torch.randint(0, 151_000, (n, 2), generator=g, device=dev).double()
        padded[b, :n, 2:] = torch.randn(n, 3, generator=g, device=dev).float().double()
    out_t = kpack.pack(padded, lengths, 4, use_triton=True)
    out_r = kpack.pack(padded, lengths, 4, use_triton=False)
    assert torch.equal(out_t, out_r) and out_t.dtype == torch.float64


@pytest.mark.parametrize("unit,fraction", [(2, 0.01), (2, 0.3), (4, 0.01), (1, 0.01), (2, 0.0)])
def test_delta_compaction_on_the_device_makes_the_cpu_encoders_bytes(kernel_device, unit,
                                                                      fraction):
    """Issue 52, item 3: the changed elements of a bucket found and compacted where the bucket
    lives (Triton), then encoded: byte for byte the payload of the CPU encoder
    (weights/delta.py) of the same buckets, sparse (1% changed; 2-, 4- and 1-byte units), dense
    (30%) and empty; applied to the base it gives the new bucket bit for bit. An odd size
    (not a multiple of the block) and changes in the first and last element."""
    from laminar_mcore.kernels import delta as kdelta
    from laminar_mcore.weights import delta as wdelta

    dev = kernel_device
    n = kdelta.BLOCK * 3 + 77  # elements
    g = torch.Generator(device=dev).manual_seed(unit * 100 + int(fraction * 100))
    base = torch.randint(0, 256, (n * unit,), generator=g, device=dev, dtype=torch.uint8)
    new = base.clone()
    elems = new.view(kdelta._UNITS[unit])
    hit = torch.rand(n, generator=g, device=dev) < fraction
    if fraction:
        hit[0] = hit[-1] = True
    elems[hit] ^= 1  # a one-ulp-like change: the low bit
    positions, xor = kdelta.changes_triton(elems, base.view(kdelta._UNITS[unit]))
    ref_pos, ref_xor = kdelta.changes_torch(elems, base.view(kdelta._UNITS[unit]))
    assert torch.equal(positions, ref_pos) and torch.equal(xor, ref_xor)
    assert positions.numel() == int(hit.sum())
    payload, count = kdelta.encode(new, base, unit, use_triton=True)
    cpu_payload, cpu_count = wdelta.encode_counted(new.cpu(), base.cpu(), unit)
    assert payload == cpu_payload and count == cpu_count == int(hit.sum())
    target = base.cpu().clone()
    assert wdelta.apply(payload, target) == count
    assert torch.equal(target, new.cpu())


def test_a_publishers_delta_encoder_on_the_device_sends_the_hosts_bytes(kernel_device):
    """Issue 52, item 3, in the publisher's encoder: bases kept where the kernels run, each
    version's buckets compared there; over versions (the first whole, deltas, an anchor, a
    bucket that grows, a dense change) the device encoder's choices and payloads are the host
    encoder's, byte for byte, and its bases live on the device, never aliasing the host bucket
    that the next export overwrites."""
    import functools

    from laminar_mcore.kernels import delta as kdelta
    from laminar_mcore.weights.delta import DeltaEncoder

    dev = kernel_device
    host = DeltaEncoder(True, 2, anchor_interval=3)
    device = DeltaEncoder(True, 2, anchor_interval=3, device=dev,
                          kernel=functools.partial(kdelta.encode, use_triton=True))
    g = torch.Generator().manual_seed(5)
    host_mem = "cpu"  # the publisher's packed buckets are host memory, whatever the device
    buckets = {0: torch.randint(0, 256, (6000,), generator=g, dtype=torch.uint8,
                                device=host_mem),
               1: torch.randint(0, 256, (4002,), generator=g, dtype=torch.uint8,
                                device=host_mem)}
    for version in range(1, 7):
        if version > 1:
            for i, b in buckets.items():
                elems = b.view(torch.int16)
                hit = torch.rand(elems.numel(), generator=g, device=host_mem) < (
                    0.6 if version == 5 else 0.01)
                elems[hit] ^= 1
        if version == 4:  # bucket 1 grows: whole, a new base
            buckets[1] = torch.cat([buckets[1], buckets[1][:100]])
        base_ok = True
        assert host.begin(version, base_ok) == device.begin(version, base_ok)
        for i, b in buckets.items():
            out_host = host.encode(i, b)
            out_device = device.encode(i, b)
            assert out_device == out_host, (version, i)
            assert host.last_changed == device.last_changed
            assert device._base[i].device.type == torch.device(dev).type
            assert device._base[i].data_ptr() != b.data_ptr()
        host.end(list(buckets))
        device.end(list(buckets))
        if version == 2:
            assert out_host[0] == "delta"  # the sparse change went as a delta
    for i, b in buckets.items():  # the bases are the last version's bytes
        assert torch.equal(device._base[i].cpu(), b)


def test_where_deltas_are_found_is_decided_from_facts():
    """A rank publishing its own shard on a GPU with Triton: its GPU, with the kernels; without
    either, or a stage lead, the host."""
    from laminar_mcore.weights.delta import delta_placement

    gpu = torch.device("cuda", 3)
    assert delta_placement(True, True, gpu)[:2] == (gpu, True)
    assert delta_placement(True, False, gpu)[:2] == (None, False)
    assert "no Triton" in delta_placement(True, False, gpu)[2]
    assert delta_placement(False, True, None)[:2] == (None, False)
    assert "no GPU" in delta_placement(False, True, None)[2]
    # a stage lead would hold its whole stage a second time on its GPU: the host
    assert delta_placement(True, True, gpu, per_rank=False)[:2] == (None, False)
    assert "stage_lead" in delta_placement(True, True, gpu, per_rank=False)[2]
