"""Attention over packed sequences without Transformer Engine (trainer.attention): equal to
Megatron's dense-mask path (log-probs and gradients, GQA, several sequences per row), O(T)
memory (no [T, T] tensor kept for backward, bytes per token flat as T grows), and the kernel
choice made from facts (device, dtype, torch's varlen signature)."""

import pytest
import torch

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
from laminar_mcore.parallel import device
from laminar_mcore.testing.synthetic import random_trajectories
from laminar_mcore.trainer import attention
from laminar_mcore.trainer.packing import pack_trajectories

pytestmark = pytest.mark.gpu  # the model is where the trainer's is: the GPU when one is visible
TOL = 2e-5 if not torch.cuda.is_available() else 1e-4


@pytest.fixture(scope="module")
def megatron_world():
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=0)
    yield
    destroy_trainer_parallel()


def _model(family, **overrides):
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state

    cfg = tiny_hf_config(family, **overrides)
    model = build_gpt_model(cfg)
    load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(
        cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 4)))
    return cfg, model


def _logprobs_and_grads(model, packed, **inputs):
    from laminar_mcore.trainer.logprobs import vocab_parallel_logprobs

    model.zero_grad(set_to_none=True)
    logits = model(packed.tokens, packed.position_ids, **inputs)
    lp, _ = vocab_parallel_logprobs(logits[0], packed.labels[0])
    w = torch.linspace(-1, 1, lp.numel(), device=lp.device)
    (lp * w * packed.loss_mask[0]).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),   # GQA, QKV bias
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1)),   # MQA, QK norms
])
def test_packed_attention_equals_the_dense_mask_path(family, overrides, megatron_world):
    cfg, model = _model(family, **overrides)
    assert type(model.decoder.layers[0].self_attention.core_attention).__name__ == \
        "PackedDotProductAttention"
    trajs = random_trajectories(5, 2, cfg.vocab_size, seed=3)  # ten sequences in one row
    packed = pack_trajectories(trajs, [0.5] * 10, list(range(10)), tp=2).to(device())
    assert len(packed.cu_seqlens) == 11 and packed.num_tokens > 60
    lp_mask, g_mask = _logprobs_and_grads(model, packed, attention_mask=packed.attention_mask())
    real = packed.seq_ids[0] >= 0
    # the row as the trainer passes it without TE (sbhd: RoPE over the row's positions, one
    # op) and in THD (RoPE restarting at every sequence, as Transformer Engine takes it)
    for params in (packed.local_packed_seq_params(), packed.packed_seq_params()):
        lp, g = _logprobs_and_grads(model, packed, attention_mask=None, packed_seq_params=params)
        torch.testing.assert_close(lp[real], lp_mask[real], atol=TOL, rtol=0)
        assert g.keys() == g_mask.keys()
        for name in g:
            torch.testing.assert_close(g[name], g_mask[name], atol=TOL, rtol=1e-4, msg=name)
    # not vacuous: the sequences' boundaries matter (one causal row attends across them)
    lp_causal, _ = _logprobs_and_grads(model, packed, attention_mask=None)
    assert (lp_causal[real] - lp_mask[real]).abs().max() > 1e-2


def _saved_bytes(model, tokens, lengths):
    """Bytes autograd keeps for backward in one layer: every tensor, and those shaped [.., T, T]."""
    from megatron.core.packed_seq_params import PackedSeqParams

    layer = model.decoder.layers[0]
    h = layer.config.hidden_size
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device())
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=tokens, max_seqlen_kv=tokens)  # as the trainer's
    x = torch.randn(tokens, 1, h, device=device(), requires_grad=True)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {"all": 0, "square": 0}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.data_ptr() != x.data_ptr():
            seen.add(key)
            saved["all"] += t.untyped_storage().nbytes()
            if t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] >= max(lengths):
                saved["square"] += t.untyped_storage().nbytes()
        return t

    rope = model.rotary_pos_emb(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=params)
    return saved


def test_activation_memory_grows_linearly_with_tokens(megatron_world):
    """Packed rows of 512-token sequences: 4x the tokens keep 4x the bytes (no T^2 term), and
    no [.., T, T] tensor is kept. The dense-mask path would keep heads * T^2 scores."""
    cfg, model = _model("qwen2", num_hidden_layers=1)
    small = _saved_bytes(model, 1024, [512, 512])
    large = _saved_bytes(model, 4096, [512] * 8)
    assert small["square"] == large["square"] == 0
    assert large["all"] / small["all"] == pytest.approx(4.0, rel=0.05)
    per_token = large["all"] / 4096
    dense_scores = cfg.num_attention_heads * 4096 * 4  # one fp32 score row per token and head
    assert per_token < dense_scores / 4  # far below what the dense path would add


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention needs CUDA")
@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2)])
def test_varlen_equals_per_sequence_sdpa_on_the_gpu(heads, groups):
    """The one-call kernel against the per-sequence one, bf16, forward and backward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 512, 1, 300, 1200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    t = sum(lengths)
    q = torch.randn(t, heads, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(t, groups, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    outs, grads = [], []
    for kernel in ("varlen", "sdpa"):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention.packed_attention(*xs, params, scale=0.125, kernel=kernel)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([x.grad.float() for x in xs])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_dropout_runs_on_the_kernel_that_has_it():
    """torch's varlen attention has no dropout: asked for with dropout, the per-sequence SDPA
    runs instead (here on CPU, where varlen could not run at all)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=7, max_seqlen_kv=7)
    q, k, v = (torch.randn(12, 2, 8) for _ in range(3))
    torch.manual_seed(0)
    out = attention.packed_attention(q, k, v, params, scale=0.3, dropout_p=0.5, kernel="varlen")
    torch.manual_seed(0)
    ref = attention.packed_attention(q, k, v, params, scale=0.3, dropout_p=0.5, kernel="sdpa")
    assert torch.equal(out, ref)


def test_grouped_query_sdpa_repeats_kv_heads_where_cuda_would_fall_back_to_math():
    """CUDA's memory-efficient SDPA has no GQA mode (an fp32 GQA call ran the math kernel and
    kept [heads, L, L] scores on the H200): there the K/V heads are repeated before the call.
    Both ways give the same output and gradients (checked here on CPU)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    assert attention.sdpa_expands_groups("cuda") and not attention.sdpa_expands_groups("cpu")
    cu = torch.tensor([0, 9, 10, 31], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=21, max_seqlen_kv=21)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(31, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(31, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    outs, grads = [], []
    for expand in (True, False):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attention.packed_attention(*xs, params, scale=0.3, kernel="sdpa",
                                         expand_groups=expand)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad for x in xs])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # not vacuous: a different grouping (heads 0-2 on K/V head 1) changes the output
    swapped = attention.packed_attention(q, k.flip(1), v.flip(1), params, scale=0.3,
                                         kernel="sdpa", expand_groups=True)
    assert (swapped - outs[0]).abs().max() > 1e-2


def _fake_varlen(kind):
    def new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False):
        pass

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
            return_aux=None, scale=None):
        pass

    def unusable(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        pass

    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                  return_aux=None):
        pass

    return {"new": new, "old": old, "unusable": unusable, "2.9": torch_2_9}[kind]


@pytest.mark.parametrize("device,dtype,varlen,expected", [
    ("cuda", torch.bfloat16, "new", "varlen"),
    ("cuda", torch.float16, "old", "varlen"),
    ("cuda", torch.float32, "new", "sdpa"),     # flash kernels take half precision only
    ("cuda", torch.bfloat16, "unusable", "sdpa"),  # no causal mode in this torch's varlen
    ("cuda", torch.bfloat16, "2.9", "sdpa"),    # no scale argument
    ("cpu", torch.bfloat16, "new", "sdpa"),     # varlen_attn has no CPU kernel
])
def test_the_kernel_is_chosen_from_the_facts(device, dtype, varlen, expected):
    fn = _fake_varlen(varlen)
    assert attention.choose_kernel(device_type=device, dtype=dtype, varlen=fn) == expected
    causal = attention.varlen_causal_kwargs(fn)
    assert causal == {"new": {"window_size": (-1, 0)}, "old": {"is_causal": True},
                      "unusable": None, "2.9": None}[varlen]


def test_this_torch_has_a_varlen_attention_with_a_causal_mode():
    """The torch pinned here (and 2.11 on the GPU machines) offers the one-call kernel."""
    assert attention.varlen_causal_kwargs(attention._varlen_fn()) is not None
