"""Per-token decoupled-PPO loss terms, given the behaviour importance weights.

``ppo_terms(logprobs, prox_logprobs, weights, advantages, loss_mask, eps_clip, eps_clip_high,
dual_clip) -> terms`` with ``terms = mask * w * max(-A u, -A clip(u))`` (dual clip: at most
``c |A|`` for A < 0), ``u = exp(logprobs - prox)``; differentiable w.r.t. ``logprobs``. The
Triton kernel computes the terms and their derivative in one elementwise pass; the torch
reference is the same formula. Weights (the capped pi_prox / pi_behav, token or sequence level)
come from ``laminar_mcore.algos.ppo``, which needs segment reductions. ``ppo_terms_triton``
refuses host tensors unless Triton's interpreter runs the kernel (``_device.check_devices``).
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from ._device import check_devices, is_interpreted


def ppo_terms_torch(logprobs, prox_logprobs, weights, advantages, loss_mask,
                    eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
                    dual_clip: Optional[float] = None) -> torch.Tensor:
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs.float() - prox_logprobs.float())
    adv = advantages.float()
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, dual_clip * adv.abs()), pg)
    return torch.where(loss_mask > 0, pg * weights.float(), torch.zeros_like(pg))


if triton is not None:

    @triton.jit
    def _ppo_kernel(lp_ptr, prox_ptr, w_ptr, adv_ptr, mask_ptr, out_ptr, dout_ptr, n,
                    eps_low, eps_high, dual, HAS_DUAL: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64 offsets
        valid = offs < n
        lp = tl.load(lp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        prox = tl.load(prox_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        mask = tl.load(mask_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        ratio = tl.exp(lp - prox)
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        l1 = -adv * ratio
        l2 = -adv * clipped
        use1 = l1 >= l2
        pg = tl.where(use1, l1, l2)
        d = tl.where(use1, -adv * ratio, 0.0)  # d l1 / d lp; the clipped branch is constant
        if HAS_DUAL:
            l3 = dual * tl.abs(adv)
            cap = (adv < 0) & (l3 < pg)
            pg = tl.where(cap, l3, pg)
            d = tl.where(cap, 0.0, d)
        keep = mask > 0
        tl.store(out_ptr + offs, tl.where(keep, pg * w, 0.0), mask=valid)
        tl.store(dout_ptr + offs, tl.where(keep, d * w, 0.0), mask=valid)


_INTERPRETED = triton is not None and is_interpreted(_ppo_kernel)


class _TritonPPO(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, prox, weights, adv, mask, eps_low, eps_high, dual):
        flat = [t.reshape(-1).contiguous().float() for t in (logprobs, prox, weights, adv, mask)]
        n = flat[0].numel()
        out = torch.empty(n, dtype=torch.float32, device=logprobs.device)
        dout = torch.empty_like(out)
        if n:
            block = 1024
            _ppo_kernel[(triton.cdiv(n, block),)](*flat, out, dout, n, eps_low, eps_high,
                                                  0.0 if dual is None else dual,
                                                  HAS_DUAL=dual is not None, BLOCK=block)
        ctx.save_for_backward(dout)
        ctx.shape, ctx.dtype = logprobs.shape, logprobs.dtype
        return out.view(logprobs.shape)

    @staticmethod
    def backward(ctx, grad):
        (dout,) = ctx.saved_tensors
        g = (grad.reshape(-1).float() * dout).view(ctx.shape).to(ctx.dtype)
        return g, None, None, None, None, None, None, None


def ppo_terms_triton(logprobs, prox_logprobs, weights, advantages, loss_mask,
                     eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
                     dual_clip: Optional[float] = None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    check_devices("ppo_terms_triton", _INTERPRETED, logprobs=logprobs, prox_logprobs=prox_logprobs,
                  weights=weights, advantages=advantages, loss_mask=loss_mask)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    return _TritonPPO.apply(logprobs, prox_logprobs.detach(), weights.detach(),
                            advantages.detach(), loss_mask.detach(), float(eps_clip),
                            float(eps_high), dual_clip)


def ppo_terms(logprobs, prox_logprobs, weights, advantages, loss_mask, eps_clip: float = 0.2,
              eps_clip_high: Optional[float] = None, dual_clip: Optional[float] = None):
    """Triton on CUDA tensors, torch elsewhere."""
    fn = ppo_terms_triton if (logprobs.is_cuda and triton is not None) else ppo_terms_torch
    return fn(logprobs, prox_logprobs, weights, advantages, loss_mask, eps_clip, eps_clip_high,
              dual_clip)
