"""Log-probs and entropy of target tokens from vocab-parallel logits, chunked, in fp32.

Each tensor-parallel rank holds logits for a slice of the vocabulary. The log-partition is
reduced over the TP group (max, then sum of exponentials), the target's logit comes from the
rank that owns it, and nothing ever gathers the vocabulary on one rank. Tokens are processed in
chunks and the backward pass recomputes each chunk's softmax, so peak extra memory is
``chunk_size x vocab/tp`` fp32 whatever the number of tokens.

This is the torch path (CPU, and the reference of the Triton kernels in ``kernels/``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

DEFAULT_CHUNK = 1024


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, chunk):
        n, v_local = logits.shape
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
        log_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < v_local)
        safe_t = torch.where(owned, local_t, torch.zeros_like(local_t))
        for s in range(0, n, chunk):
            z = logits[s:s + chunk].float()
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            e = torch.exp(z - m.unsqueeze(-1))
            # [sum exp, sum exp*z, target logit] reduced in one collective
            packed = torch.stack([
                e.sum(-1), (e * z).sum(-1),
                torch.where(owned[s:s + chunk],
                            z.gather(-1, safe_t[s:s + chunk].unsqueeze(-1)).squeeze(-1),
                            torch.zeros_like(m)),
            ])
            packed = _all_reduce(packed, dist.ReduceOp.SUM, group)
            lz = m + torch.log(packed[0])
            ez = packed[1] / packed[0]
            log_z[s:s + chunk] = lz
            mean_z[s:s + chunk] = ez
            logprobs[s:s + chunk] = packed[2] - lz
            entropy[s:s + chunk] = lz - ez
        ctx.save_for_backward(logits, safe_t, owned, log_z, mean_z)
        ctx.chunk = chunk
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, safe_t, owned, log_z, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        g_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(log_z)
        g_h = grad_entropy if grad_entropy is not None else torch.zeros_like(log_z)
        for s in range(0, n, ctx.chunk):
            z = logits[s:s + ctx.chunk].float()
            p = torch.exp(z - log_z[s:s + ctx.chunk].unsqueeze(-1))
            # d logp / dz = onehot - p ;  d H / dz = -p * (z - E_p[z])
            g = -p * (g_lp[s:s + ctx.chunk].unsqueeze(-1)
                      + g_h[s:s + ctx.chunk].unsqueeze(-1) * (z - mean_z[s:s + ctx.chunk].unsqueeze(-1)))
            rows = torch.nonzero(owned[s:s + ctx.chunk]).squeeze(-1)
            g[rows, safe_t[s:s + ctx.chunk][rows]] += g_lp[s:s + ctx.chunk][rows]
            grad[s:s + ctx.chunk] = g.to(logits.dtype)
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *,
                            vocab_start: int = 0, group=None,
                            chunk_size: Optional[int] = DEFAULT_CHUNK
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) in fp32 of ``targets`` under ``logits`` [..., vocab/tp].

    ``vocab_start`` is the first vocabulary id of this rank's slice and ``group`` the tensor
    parallel group (None: the whole vocabulary is local). Differentiable w.r.t. ``logits``.
    """
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    chunk = chunk_size or flat.shape[0] or 1
    lp, ent = _VocabParallelLogProbs.apply(flat, targets.reshape(-1), vocab_start, group, chunk)
    return lp.view(shape), ent.view(shape)


def megatron_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                                     chunk_size: Optional[int] = DEFAULT_CHUNK):
    """The same, with this rank's vocab slice and TP group taken from Megatron's state."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    v_local = logits.shape[-1]
    return vocab_parallel_logprobs(logits, targets, vocab_start=tp_rank * v_local,
                                   group=parallel_state.get_tensor_model_parallel_group(),
                                   chunk_size=chunk_size)
