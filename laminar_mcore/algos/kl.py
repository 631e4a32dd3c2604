"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3), as verl's
``kl_penalty``: ``k1``/``kl`` = log pi - log ref, ``abs`` = |k1|, ``k2``/``mse`` = k1^2 / 2,
``k3``/``low_var_kl`` = exp(-k1) + k1 - 1 (k1 clamped to [-20, 20], the result to [-10, 10]).
A ``+`` suffix (``k1+``, ``k3+``) keeps the value but takes the gradient of k2, which is the
unbiased gradient of KL (verl's straight-through trick).

``regularized_sums`` adds the entropy bonus and the KL penalty to a micro-batch's policy-loss
numerator, each aggregated with the policy loss's ``loss_agg_mode``, as verl's ``ppo_loss``
(``verl/workers/utils/losses.py``) does: ``pg - entropy_coef * agg(entropy) + kl_coef *
agg(kl_penalty(logprob, ref_logprob))``. The trainer's reference model gives ``ref_logprobs``
(``algo.kl_coef > 0``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .aggregation import aggregate_terms
from .spec import KL_ESTIMATORS

Tensor = torch.Tensor


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of ``kind`` (see the module docstring), differentiable."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)} "
                         "(each with an optional '+')")
    value = _forward(logprob, ref_logprob, base)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def _forward(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # k3, for stability
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)


def regularized_sums(pg_sum: Tensor, logprobs: Tensor, entropy: Tensor,
                     ref_logprobs: Optional[Tensor], loss_mask: Tensor,
                     seq_ids: Optional[Tensor], mode: str, *, entropy_coef: float = 0.0,
                     kl_coef: float = 0.0, kl_estimator: str = "k3"
                     ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """(loss numerator, stat numerators) of one micro-batch: ``pg_sum`` (``aggregate_terms`` of
    the policy loss's terms) minus ``entropy_coef`` times the aggregated entropy plus
    ``kl_coef`` times the aggregated KL estimate against ``ref_logprobs`` (required when
    ``kl_coef > 0``). Every numerator shares the policy loss's denominator (``denominator``),
    so the batch's loss is ``numerator / D`` whatever the split. Stats: ``pg_loss`` and, when
    their coefficient is set, ``entropy_loss`` and ``kl_loss`` (numerators, detached)."""
    mask = loss_mask.to(logprobs.dtype)
    loss = pg_sum
    stats: Dict[str, Tensor] = {"pg_loss": pg_sum.detach()}
    if entropy_coef:
        ent = aggregate_terms(entropy * mask, loss_mask, seq_ids, mode)
        loss = loss - entropy_coef * ent
        stats["entropy_loss"] = ent.detach()
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs (ref_logprobs)")
        kld = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        kld = torch.where(loss_mask > 0, kld, torch.zeros_like(kld))
        kl = aggregate_terms(kld, loss_mask, seq_ids, mode)
        loss = loss + kl_coef * kl
        stats["kl_loss"] = kl.detach()
    return loss, stats
