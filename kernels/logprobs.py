"""Log-probs and entropy of target tokens from (vocab-parallel) logits, without materialising a
[tokens, vocab] fp32 log-softmax.

Two implementations with one signature, ``(logits, targets, vocab_start, group, chunk_size)
-> (logprobs fp32, entropy fp32)``, both differentiable w.r.t. ``logits``:

* ``logprobs_entropy_triton``: one Triton pass over each row's vocabulary slice computes the
  local max, sum of exponentials, sum of exp*logit and the target's logit (online rescaling);
  the tensor-parallel exchange (max, then sums) happens between kernel passes on [tokens]-sized
  tensors; the backward is one more pass that writes the gradient row by row.
* ``logprobs_entropy_torch``: the same algorithm chunked over tokens in plain torch, so memory
  is bounded by ``chunk_size x vocab/tp`` fp32 (the CPU path and the reference).

``logprobs_entropy`` dispatches: Triton on CUDA tensors, torch otherwise. The Triton entry
points (``logprobs_entropy_triton``, ``local_stats_triton``) refuse host tensors unless Triton's
interpreter runs the kernels (``_device.check_devices``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

try:  # Triton is a dependency, but keep the torch path importable without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from ._device import check_devices, is_interpreted

DEFAULT_CHUNK = None  # None: as many tokens as fit CHUNK_BYTES of fp32 logits
CHUNK_BYTES = 32 * 2**20


def auto_chunk(v_local: int, chunk_size: Optional[int]) -> int:
    """Tokens per chunk: ``chunk_size`` if given, else what keeps a chunk's fp32 logits within
    ``CHUNK_BYTES`` (peak memory then does not grow with tokens x vocab)."""
    if chunk_size:
        return int(chunk_size)
    return max(1, CHUNK_BYTES // (4 * max(v_local, 1)))


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _global_stats(m_loc, s_loc, t_loc, target, group):
    """Combine per-rank (max, sum exp, sum exp*z, target logit) into log Z and E[z]."""
    m = _all_reduce(m_loc.clone(), dist.ReduceOp.MAX, group)
    scale = torch.exp(m_loc - m)
    packed = torch.stack([s_loc * scale, t_loc * scale, target])
    packed = _all_reduce(packed, dist.ReduceOp.SUM, group)
    log_z = m + torch.log(packed[0])
    mean_z = packed[1] / packed[0]
    return log_z, mean_z, packed[2]


# ---------------------------------------------------------------------- torch reference
class _TorchLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk):
        n, v_local = logits.shape
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < v_local)
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        m_loc = torch.empty(n, dtype=torch.float32, device=logits.device)
        s_loc, t_loc, target = torch.empty_like(m_loc), torch.empty_like(m_loc), torch.empty_like(m_loc)
        for s in range(0, n, chunk):
            z = logits[s:s + chunk].float()
            m = z.max(dim=-1).values
            e = (z - m.unsqueeze(-1)).exp_()  # the one [chunk, vocab] temporary
            m_loc[s:s + chunk] = m
            s_loc[s:s + chunk] = e.sum(-1)
            t_loc[s:s + chunk] = torch.bmm(e.unsqueeze(1), z.unsqueeze(-1)).view(-1)
            picked = z.gather(-1, safe_t[s:s + chunk].unsqueeze(-1)).squeeze(-1)
            target[s:s + chunk] = torch.where(owned[s:s + chunk], picked, torch.zeros_like(picked))
        log_z, mean_z, target = _global_stats(m_loc, s_loc, t_loc, target, group)
        ctx.save_for_backward(logits, safe_t, owned, log_z, mean_z)
        ctx.chunk = chunk
        return target - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, safe_t, owned, log_z, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g_lp = grad_lp if grad_lp is not None else torch.zeros_like(log_z)
        g_h = grad_h if grad_h is not None else torch.zeros_like(log_z)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = slice(s, s + ctx.chunk)
            z = logits[e].float()
            p = (z - log_z[e].unsqueeze(-1)).exp_()
            # d logp/dz = onehot - p ;  d H/dz = -p (z - E_p[z]); in place: two temporaries
            g = (z - mean_z[e].unsqueeze(-1)).mul_(g_h[e].unsqueeze(-1))
            g.add_(g_lp[e].unsqueeze(-1)).mul_(p).neg_()
            del p
            rows = torch.nonzero(owned[e]).squeeze(-1)
            g[rows, safe_t[e][rows]] += g_lp[e][rows]
            grad[e] = g.to(logits.dtype)
        return grad, None, None, None, None


def logprobs_entropy_torch(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                           group=None, chunk_size: Optional[int] = DEFAULT_CHUNK
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = auto_chunk(flat.shape[-1], chunk_size)
    lp, ent = _TorchLogProbs.apply(flat, targets.reshape(-1), vocab_start, group, chunk)
    return lp.view(shape), ent.view(shape)


# ---------------------------------------------------------------------- Triton kernels
if triton is not None:

    @triton.jit
    def _stats_kernel(logits_ptr, stride_row, targets_ptr, vocab_start, v_local,
                      m_ptr, s_ptr, t_ptr, target_ptr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride_row passes 2**31 at 16k x 152k
        base = logits_ptr + row * stride_row
        tgt = tl.load(targets_ptr + row) - vocab_start
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        t = tl.zeros([], tl.float32)
        picked = tl.zeros([], tl.float32)
        for start in range(0, v_local, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < v_local
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            rescale = tl.exp(m - m_new)
            e = tl.where(valid, tl.exp(z - m_new), 0.0)
            s = s * rescale + tl.sum(e, axis=0)
            t = t * rescale + tl.sum(e * tl.where(valid, z, 0.0), axis=0)
            picked += tl.sum(tl.where((cols == tgt) & valid, z, 0.0), axis=0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        tl.store(target_ptr + row, picked)

    @triton.jit
    def _grad_kernel(logits_ptr, stride_row, grad_ptr, targets_ptr, vocab_start, v_local,
                     log_z_ptr, mean_z_ptr, g_lp_ptr, g_h_ptr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride_row passes 2**31 at 16k x 152k
        base = logits_ptr + row * stride_row
        out = grad_ptr + row * stride_row
        tgt = tl.load(targets_ptr + row) - vocab_start
        log_z = tl.load(log_z_ptr + row)
        mean_z = tl.load(mean_z_ptr + row)
        g_lp = tl.load(g_lp_ptr + row)
        g_h = tl.load(g_h_ptr + row)
        for start in range(0, v_local, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < v_local
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
            p = tl.exp(z - log_z)
            g = -p * (g_lp + g_h * (z - mean_z)) + tl.where(cols == tgt, g_lp, 0.0)
            tl.store(out + cols, g.to(out.dtype.element_ty), mask=valid)


def _block_v(v_local: int) -> int:
    return min(4096, triton.next_power_of_2(max(v_local, 16)))


_INTERPRETED = triton is not None and is_interpreted(_stats_kernel)


def _local_stats(logits, targets, vocab_start):
    """One ``_stats_kernel`` pass over contiguous [n, v_local] logits: this slice's max, sum of
    exponentials, sum of exp*logit (both relative to that max) and target logit, fp32 [n]."""
    n, v_local = logits.shape
    m_loc = torch.empty(n, dtype=torch.float32, device=logits.device)
    s_loc, t_loc, target = torch.empty_like(m_loc), torch.empty_like(m_loc), torch.empty_like(m_loc)
    if n:
        _stats_kernel[(n,)](logits, logits.stride(0), targets, vocab_start, v_local,
                            m_loc, s_loc, t_loc, target, BLOCK_V=_block_v(v_local))
    return m_loc, s_loc, t_loc, target


def local_stats_triton(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0):
    """(max, sum exp, sum exp*z, target logit) of one vocabulary slice [n, v_local], fp32 [n]
    each: what a tensor-parallel rank contributes before the exchange (no autograd)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    check_devices("local_stats_triton", _INTERPRETED, logits=logits, targets=targets)
    return _local_stats(logits.contiguous(), targets.contiguous(), vocab_start)


class _TritonLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk):
        logits = logits.contiguous()
        log_z, mean_z, target = _global_stats(*_local_stats(logits, targets, vocab_start), group)
        ctx.save_for_backward(logits, targets, log_z, mean_z)
        ctx.vocab_start = vocab_start
        return target - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, grad_lp, grad_h):
        logits, targets, log_z, mean_z = ctx.saved_tensors
        n, v_local = logits.shape
        g_lp = (grad_lp if grad_lp is not None else torch.zeros_like(log_z)).float().contiguous()
        g_h = (grad_h if grad_h is not None else torch.zeros_like(log_z)).float().contiguous()
        grad = torch.empty_like(logits)
        if n:
            _grad_kernel[(n,)](logits, logits.stride(0), grad, targets, ctx.vocab_start, v_local,
                               log_z, mean_z, g_lp, g_h, BLOCK_V=_block_v(v_local))
        return grad, None, None, None, None


def logprobs_entropy_triton(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                            group=None, chunk_size: Optional[int] = DEFAULT_CHUNK
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton path (``chunk_size`` is unused: rows are streamed one program each)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    check_devices("logprobs_entropy_triton", _INTERPRETED, logits=logits, targets=targets)
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = _TritonLogProbs.apply(flat, targets.reshape(-1).contiguous(), vocab_start, group,
                                    chunk_size)
    return lp.view(shape), ent.view(shape)


def logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                     group=None, chunk_size: Optional[int] = DEFAULT_CHUNK
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors, the chunked torch path elsewhere."""
    if logits.is_cuda and triton is not None:
        return logprobs_entropy_triton(logits, targets, vocab_start, group, chunk_size)
    return logprobs_entropy_torch(logits, targets, vocab_start, group, chunk_size)
