"""Attention over packed sequences in O(T) memory without Transformer Engine.

Megatron-Core's local layer spec computes attention as a dense ``[b, heads, T, T]`` score tensor
plus a ``T x T`` mask: at the 7B recipe's 16k-token micro-batches at TP4 that is ~11.5 GB per
layer, and its fused softmax (Apex) would ignore the block-diagonal mask of packed sequences.
:class:`PackedDotProductAttention` replaces the local spec's core attention: it takes packed
rows with their boundaries (``PackedSeqParams`` with ``cu_seqlens``) and runs one of two kernels,
neither of which materialises scores:

- ``varlen``: torch's ``torch.nn.attention.varlen.varlen_attn`` (flash attention over the whole
  packed row in one call) on CUDA in bf16/fp16, where the torch version has it with a scale and
  a causal mode (2.10+: ``window_size=(-1, 0)``; GQA by ``enable_gqa`` from 2.12, by repeating
  the K/V heads before);
- ``sdpa``: ``scaled_dot_product_attention`` per sequence with ``is_causal`` (flash or memory-
  efficient kernels on GPUs, the flash CPU kernel on CPU), GQA through ``enable_gqa`` on CPU and
  by repeating the K/V heads on CUDA (:func:`sdpa_expands_groups`).

It takes Megatron's THD layout, or -- what the trainer passes without TE -- the row in
``sbhd`` layout with ``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=...)``: RoPE is then
applied in one vectorised op over the row's positions (Megatron's unfused THD RoPE splits the
row per sequence and syncs the host in every layer: 2x the step time of the tiny demo model
on CPU), and since attention stays within a sequence, which depends only on relative
positions, the result is the same. Calls without ``PackedSeqParams`` keep Megatron's own path.
Transformer Engine's attention stays the first choice where it is installed.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F

KERNELS = ("varlen", "sdpa")


def _varlen_fn() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> frozenset:
    """``fn``'s parameter names, read once (every layer of every micro-batch asks)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def varlen_causal_kwargs(fn: Optional[Callable]) -> Optional[dict]:
    """How this torch's ``varlen_attn`` is asked for a causal mask (its signature changed between
    versions), or None when it cannot be."""
    if fn is None:
        return None
    params = _parameters(fn)
    if "scale" not in params:  # torch 2.9's first version: no scale, so no QK-layer scaling
        return None
    if "window_size" in params:  # torch 2.10+
        return {"window_size": (-1, 0)}
    if "is_causal" in params:
        return {"is_causal": True}
    return None


def choose_kernel(*, device_type: str, dtype: torch.dtype, varlen=None) -> str:
    """``varlen`` on CUDA in half precision where torch's varlen attention has a causal mode,
    ``sdpa`` otherwise (flash attention's kernels take only fp16/bf16; CPU has none)."""
    varlen = _varlen_fn() if varlen is None else varlen
    if (device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and varlen_causal_kwargs(varlen) is not None):
        return "varlen"
    return "sdpa"


def sdpa_expands_groups(device_type: str) -> bool:
    """Whether the per-sequence SDPA repeats the K/V heads itself for grouped-query attention.

    On CUDA, torch's memory-efficient SDPA kernel has no ``enable_gqa`` mode, so an fp32 GQA
    call falls back to the math kernel, which keeps every sequence's ``[heads, L, L]`` scores for
    backward (found by the H200 run of 2026-11-28: 4 MiB per 512-token sequence in a tiny
    layer). Repeating K/V costs O(T) and keeps the memory-efficient kernel. The CPU's flash
    kernel takes ``enable_gqa`` and keeps no scores."""
    return device_type == "cuda"


def _device_bounds(params, device) -> torch.Tensor:
    """The boundaries as int32 on ``device`` (varlen's ``cu_seq``), made once per micro-batch."""
    cached = getattr(params, "_laminar_device_bounds", None)
    if cached is None or cached.device != device:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        cached = params._laminar_device_bounds = cu.to(device=device, dtype=torch.int32)
    return cached


def _sequence_bounds(params) -> list:
    """The packed row's sequence boundaries (the padded layout when given), read from the device
    once per micro-batch and kept on the ``PackedSeqParams`` for the other layers."""
    cached = getattr(params, "_laminar_bounds", None)
    if cached is None:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        cached = [int(x) for x in cu.tolist()]
        params._laminar_bounds = cached
    return cached


def packed_attention(query, key, value, params, *, scale: float, dropout_p: float = 0.0,
                     kernel: Optional[str] = None,
                     expand_groups: Optional[bool] = None) -> torch.Tensor:
    """Causal attention within each packed sequence: ``query`` [T, heads, d], ``key``/``value``
    [T, groups, d] -> [T, heads, d]. ``expand_groups``: repeat the K/V heads before the ``sdpa``
    kernel (default :func:`sdpa_expands_groups` of the device)."""
    heads, groups = query.shape[1], key.shape[1]
    kernel = kernel or choose_kernel(device_type=query.device.type, dtype=query.dtype)
    if kernel == "varlen" and dropout_p > 0:
        kernel = "sdpa"  # torch's varlen attention has no dropout
    if kernel == "varlen":
        fn = _varlen_fn()
        cu = _device_bounds(params, query.device)
        bounds = _sequence_bounds(params)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        kwargs = dict(varlen_causal_kwargs(fn), scale=scale)
        if heads != groups:
            if "enable_gqa" in _parameters(fn):
                kwargs["enable_gqa"] = True
            else:  # an older varlen_attn: one K/V head per query head (O(T) either way)
                key = key.repeat_interleave(heads // groups, dim=1)
                value = value.repeat_interleave(heads // groups, dim=1)
        return fn(query, key, value, cu, cu, longest, longest, **kwargs)
    if kernel != "sdpa":
        raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if expand_groups is None:
        expand_groups = sdpa_expands_groups(query.device.type)
    if heads != groups and expand_groups:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
        groups = heads
    bounds = _sequence_bounds(params)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            continue
        q, k, v = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                           scale=scale, enable_gqa=heads != groups)
        out.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(out, dim=0)


def _dot_product_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` (its scale, heads per TP rank, dropout) whose
        packed (THD) calls run :func:`packed_attention`."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if config.context_parallel_size > 1:
                raise ValueError("context parallelism needs Transformer Engine's attention")
            softmax = self.scale_mask_softmax
            self._packed_ok = (getattr(softmax, "window_size", None) is None
                               and getattr(config, "softmax_type", "vanilla") == "vanilla")
            # query-key layer scaling divides the score scale by the layer number and the
            # softmax multiplies it back: the product is the attention's scale
            self._scale = self.softmax_scale * (getattr(softmax, "scale", None) or 1.0)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **kwargs):
            fmt = getattr(packed_seq_params, "qkv_format", None)
            if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None or \
                    fmt not in ("thd", "sbhd"):
                return super().forward(query, key, value, attention_mask,
                                       attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias,
                                       packed_seq_params=packed_seq_params, **kwargs)
            if not self._packed_ok or attention_bias is not None:
                raise ValueError("packed attention without Transformer Engine supports causal "
                                 "full attention with vanilla softmax only (no sliding window, "
                                 "attention bias or learnable softmax offsets): install "
                                 "transformer-engine for this model")
            p = self.attention_dropout.p if self.training else 0.0
            if fmt == "sbhd":  # [T, 1, heads, d]: one packed row
                if query.shape[1] != 1:
                    raise ValueError("packed sequences come as one row (batch size 1)")
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
            out = packed_attention(query, key, value, packed_seq_params,
                                   scale=self._scale, dropout_p=p)
            return out.reshape(out.shape[0], -1) if fmt == "thd" else \
                out.reshape(out.shape[0], 1, -1)

    return PackedDotProductAttention


_CLASS = None


def packed_dot_product_attention():
    """The class (built once: it subclasses a Megatron class imported on first use)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _dot_product_attention_class()
    return _CLASS


def with_packed_attention(spec):
    """A copy of a local layer spec (a layer's ``ModuleSpec`` or a block's
    ``TransformerBlockSubmodules``) whose self-attention cores are
    :class:`PackedDotProductAttention`. Specs of other attention classes are left as they are."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = copy.deepcopy(spec)
    cls = packed_dot_product_attention()
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = cls
    return spec
