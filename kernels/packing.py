"""Packing between padded batches [B, S, *F] and Megatron's THD layout [T, *F].

Each sequence b keeps its first ``lengths[b]`` positions and is padded with zeros to a multiple
of ``multiple`` (TP, x 2*CP with context parallelism); ``cu_seqlens_padded`` marks where each
begins. ``pack`` and ``unpack`` are each other's adjoints, so each one's backward is the other.
Triton kernels on CUDA (one program per sequence and block of positions), torch elsewhere; both
have the same signatures. ``pack_triton``/``unpack_triton`` refuse host tensors unless Triton's
interpreter runs the kernel (``_device.check_devices``).
"""

from __future__ import annotations

from typing import Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from ._device import check_devices, is_interpreted


def cu_seqlens(lengths: torch.Tensor, multiple: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens of the real lengths, cu_seqlens of the padded layout), int32."""
    lengths = lengths.to(torch.int64)
    padded = (lengths + multiple - 1) // multiple * multiple
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    return (torch.cat([zero, lengths.cumsum(0)]).to(torch.int32),
            torch.cat([zero, padded.cumsum(0)]).to(torch.int32))


def _positions(lengths: torch.Tensor, cu_padded: torch.Tensor):
    """(row, column) in the padded batch of every *real* token, and its THD index."""
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths.long())
    starts = torch.repeat_interleave(cu_padded[:-1].long(), lengths.long())
    first = torch.repeat_interleave(torch.cat([torch.zeros(1, dtype=torch.long, device=lengths.device),
                                               lengths.long().cumsum(0)[:-1]]), lengths.long())
    cols = torch.arange(int(lengths.sum()), device=lengths.device) - first
    return rows, cols, starts + cols


def pack_torch(padded: torch.Tensor, lengths: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    _, cu_pad = cu_seqlens(lengths, multiple)
    rows, cols, dest = _positions(lengths, cu_pad)
    out = padded.new_zeros((int(cu_pad[-1]),) + tuple(padded.shape[2:]))
    out[dest] = padded[rows, cols]
    return out


def unpack_torch(packed: torch.Tensor, lengths: torch.Tensor, max_len: int,
                 multiple: int = 1) -> torch.Tensor:
    _, cu_pad = cu_seqlens(lengths, multiple)
    rows, cols, src = _positions(lengths, cu_pad)
    out = packed.new_zeros((len(lengths), max_len) + tuple(packed.shape[1:]))
    out[rows, cols] = packed[src]
    return out


if triton is not None:

    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, lengths_ptr, cu_pad_ptr, max_len, feat,
                     PACK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # int64 offsets: (b * max_len + pos) * feat passes 2**31
        pos = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        length = tl.load(lengths_ptr + b)
        start = tl.load(cu_pad_ptr + b)
        padded_len = tl.load(cu_pad_ptr + b + 1) - start
        for f0 in range(0, feat, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            fmask = f < feat
            batch_off = (b * max_len + pos)[:, None] * feat + f[None, :]
            thd_off = (start + pos)[:, None] * feat + f[None, :]
            real = (pos < length)[:, None] & fmask[None, :]
            if PACK:
                x = tl.load(src_ptr + batch_off, mask=real, other=0.0)
                in_layout = (pos < padded_len)[:, None] & fmask[None, :]
                tl.store(dst_ptr + thd_off, x, mask=in_layout)  # zeros in the padding
            else:
                x = tl.load(src_ptr + thd_off, mask=real, other=0.0)
                in_batch = (pos < max_len)[:, None] & fmask[None, :]
                tl.store(dst_ptr + batch_off, x, mask=in_batch)


_INTERPRETED = triton is not None and is_interpreted(_copy_kernel)


def _launch(src, dst, lengths, cu_pad, max_len, feat, pack: bool, span: int):
    if len(lengths) == 0 or span == 0:
        return
    block_s = 64
    grid = (len(lengths), triton.cdiv(span, block_s))
    _copy_kernel[grid](src, dst, lengths.to(torch.int32).contiguous(), cu_pad.contiguous(),
                       max_len, feat, PACK=pack, BLOCK_S=block_s,
                       BLOCK_F=min(128, triton.next_power_of_2(max(feat, 1))))


def pack_triton(padded: torch.Tensor, lengths: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    check_devices("pack_triton", _INTERPRETED, padded=padded, lengths=lengths)
    _, cu_pad = cu_seqlens(lengths, multiple)
    feat_shape = tuple(padded.shape[2:])
    feat = 1
    for d in feat_shape:
        feat *= d
    src = padded.contiguous()
    out = torch.empty((int(cu_pad[-1]),) + feat_shape, dtype=padded.dtype, device=padded.device)
    span = int((cu_pad[1:] - cu_pad[:-1]).max()) if len(lengths) else 0
    _launch(src, out, lengths, cu_pad, padded.shape[1], feat, True, span)
    return out


def unpack_triton(packed: torch.Tensor, lengths: torch.Tensor, max_len: int,
                  multiple: int = 1) -> torch.Tensor:
    check_devices("unpack_triton", _INTERPRETED, packed=packed, lengths=lengths)
    _, cu_pad = cu_seqlens(lengths, multiple)
    feat_shape = tuple(packed.shape[1:])
    feat = 1
    for d in feat_shape:
        feat *= d
    out = torch.empty((len(lengths), max_len) + feat_shape, dtype=packed.dtype, device=packed.device)
    _launch(packed.contiguous(), out, lengths, cu_pad, max_len, feat, False, max_len)
    return out


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, lengths, multiple, use_triton):
        ctx.save_for_backward(lengths)
        ctx.max_len, ctx.multiple, ctx.use_triton = padded.shape[1], multiple, use_triton
        return (pack_triton if use_triton else pack_torch)(padded, lengths, multiple)

    @staticmethod
    def backward(ctx, grad):
        (lengths,) = ctx.saved_tensors
        fn = unpack_triton if ctx.use_triton else unpack_torch
        return fn(grad, lengths, ctx.max_len, ctx.multiple), None, None, None


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed, lengths, max_len, multiple, use_triton):
        ctx.save_for_backward(lengths)
        ctx.multiple, ctx.use_triton = multiple, use_triton
        return (unpack_triton if use_triton else unpack_torch)(packed, lengths, max_len, multiple)

    @staticmethod
    def backward(ctx, grad):
        (lengths,) = ctx.saved_tensors
        fn = pack_triton if ctx.use_triton else pack_torch
        return fn(grad, lengths, ctx.multiple), None, None, None, None


def pack(padded: torch.Tensor, lengths: torch.Tensor, multiple: int = 1,
         use_triton: bool = None) -> torch.Tensor:
    """[B, S, *F] -> [T, *F] (differentiable). Triton on CUDA unless told otherwise."""
    use_triton = (padded.is_cuda and triton is not None) if use_triton is None else use_triton
    return _Pack.apply(padded, lengths, multiple, use_triton)


def unpack(packed: torch.Tensor, lengths: torch.Tensor, max_len: int, multiple: int = 1,
           use_triton: bool = None) -> torch.Tensor:
    """[T, *F] -> [B, max_len, *F] (differentiable), zeros past each length."""
    use_triton = (packed.is_cuda and triton is not None) if use_triton is None else use_triton
    return _Unpack.apply(packed, lengths, max_len, multiple, use_triton)
