"""AReaL's decoupled PPO objective over flat per-token tensors (the torch reference).

    u_t   = pi_theta / pi_prox                 clipped to [1 - eps_clip, 1 + eps_clip_high]
    w_t   = pi_prox / pi_behav                 optionally capped (mask or clamp, token or seq)
    loss  = sum_t mask_t * w_t * max(-A_t u_t, -A_t clip(u_t))  [dual clip: min(., c |A_t|)]
            / (number of tokens with mask_t = 1)

The denominator is the *original* loss-mask count: tokens dropped by the cap still count, as in
AReaL. With ``prox_logprobs is behav_logprobs`` (``use_decoupled_loss=false``) w_t = 1 and this is
plain PPO/GRPO. ``decoupled_ppo_token_terms`` gives the un-normalised per-token terms so that the
trainer can divide by a global token count, which makes the result independent of how tokens are
split over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .aggregation import segment_sum, sequence_index

Tensor = torch.Tensor


def _sequence_mean(values: Tensor, mask: Tensor, seq_ids: Tensor) -> Tensor:
    """Per-token value of the masked mean of ``values`` over the token's sequence."""
    seq, n = sequence_index(seq_ids)
    return (segment_sum(values * mask, seq, n) / segment_sum(mask, seq, n).clamp(min=1))[seq]


def check_inputs(logprobs: Tensor, prox_logprobs: Tensor, behav_logprobs: Tensor,
                 advantages: Tensor, loss_mask: Tensor, *, cap_mode: str, cap_level: str,
                 seq_ids: Optional[Tensor]) -> None:
    """The argument checks every policy loss shares (shapes and the behaviour-weight cap)."""
    if cap_mode not in ("mask", "clamp"):
        raise ValueError(f"cap_mode must be 'mask' or 'clamp', got {cap_mode!r}")
    if cap_level not in ("token", "sequence"):
        raise ValueError(f"cap_level must be 'token' or 'sequence', got {cap_level!r}")
    if cap_level == "sequence" and seq_ids is None:
        raise ValueError("cap_level='sequence' needs seq_ids (the sequence of every token)")
    shapes = {t.shape for t in (logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"all per-token inputs must have one shape, got {sorted(map(tuple, shapes))}")


def behaviour_weights(prox: Tensor, behav: Tensor, mask: Tensor, *,
                      behav_imp_weight_cap: Optional[float] = None, cap_mode: str = "mask",
                      cap_level: str = "token", seq_ids: Optional[Tensor] = None
                      ) -> Tuple[Tensor, Tensor]:
    """AReaL's behaviour importance weight w = pi_prox / pi_behav per token (with
    ``cap_level='sequence'`` the geometric mean over the token's sequence), capped: tokens over
    ``behav_imp_weight_cap`` get 0 (mask) or the cap (clamp). Returns (weight, capped), capped
    1.0 where the cap applied. In the dtype of ``prox``; no gradient."""
    behav_log_w = prox - behav
    if cap_level == "sequence":
        behav_log_w = _sequence_mean(behav_log_w, mask, seq_ids)  # geometric mean per sequence
    weight = torch.exp(behav_log_w)
    capped = torch.zeros_like(weight)
    if behav_imp_weight_cap is not None:
        over = weight > behav_imp_weight_cap
        capped = over.to(weight.dtype)
        if cap_mode == "mask":
            weight = torch.where(over, torch.zeros_like(weight), weight)
        else:
            weight = torch.clamp(weight, max=behav_imp_weight_cap)
    return weight, capped


def decoupled_ppo_token_terms(
    logprobs: Tensor, prox_logprobs: Tensor, behav_logprobs: Tensor, advantages: Tensor,
    loss_mask: Tensor, *, eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None, behav_imp_weight_cap: Optional[float] = None,
    cap_mode: str = "mask", cap_level: str = "token", seq_ids: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per-token loss terms (zero where masked) and per-token stat numerators (all summed)."""
    check_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask,
                 cap_mode=cap_mode, cap_level=cap_level, seq_ids=seq_ids)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")

    mask = loss_mask.to(torch.float32)
    lp = logprobs.float()
    prox = prox_logprobs.detach().float()
    behav = behav_logprobs.detach().float()
    adv = advantages.detach().float()
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high

    log_ratio = lp - prox
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    loss1, loss2 = -adv * ratio, -adv * clipped
    clip_hit = (loss2 > loss1).float()
    pg = torch.maximum(loss1, loss2)
    dual_hit = torch.zeros_like(pg)
    if dual_clip is not None:
        loss3 = dual_clip * adv.abs()
        dual_hit = ((loss3 < pg) & (adv < 0)).float()
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)

    weight, capped = behaviour_weights(prox, behav, mask, behav_imp_weight_cap=behav_imp_weight_cap,
                                       cap_mode=cap_mode, cap_level=cap_level, seq_ids=seq_ids)

    from ..kernels.ppo import ppo_terms

    # The differentiable part: the Triton kernel on GPUs, the same formula in torch on CPU.
    terms = ppo_terms(lp, prox, weight, adv, mask, eps_clip, eps_high, dual_clip)
    stats = {
        "n_tokens": mask.sum(),
        "clip_frac": (clip_hit * mask).sum(),
        "dual_clip_frac": (dual_hit * mask).sum(),
        "imp_weight_mean": (weight * mask).sum(),
        "imp_weight_max": torch.where(mask > 0, weight, torch.zeros_like(weight)).max()
        if weight.numel() else torch.zeros(()),
        "behav_masked_frac": (capped * mask).sum(),
        # k3 estimator of KL(pi_prox || pi_theta), non-negative
        "approx_kl": (((ratio - 1.0) - log_ratio).detach() * mask).sum(),
    }
    return terms, stats


# Summed over tokens, reported as means over the loss tokens. ``ppo_kl`` and
# ``clip_frac_lower`` are verl's ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` (see losses.py).
_MEAN_STATS = ("clip_frac", "dual_clip_frac", "imp_weight_mean", "behav_masked_frac", "approx_kl",
               "ppo_kl", "clip_frac_lower")


def finalize_stats(sums: Dict[str, Tensor]) -> Dict[str, float]:
    """Turn summed stat numerators into means over the loss tokens (those of ``sums``)."""
    n = float(sums["n_tokens"])
    out = {"n_tokens": n, "imp_weight_max": float(sums["imp_weight_max"])}
    for key in _MEAN_STATS:
        if key in sums:
            out[key] = float(sums[key]) / n if n > 0 else 0.0
    return out


def decoupled_ppo_loss(
    logprobs: Tensor, prox_logprobs: Tensor, behav_logprobs: Tensor, advantages: Tensor,
    loss_mask: Tensor, *, eps_clip: float = 0.2, eps_clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None, behav_imp_weight_cap: Optional[float] = None,
    cap_mode: str = "mask", cap_level: str = "token", seq_ids: Optional[Tensor] = None,
) -> Tuple[Tensor, Dict[str, float]]:
    """The decoupled PPO loss (a scalar with gradient w.r.t. ``logprobs``) and its stats.

    All tensors are per token and of one shape; ``advantages`` is per token too (broadcast a
    trajectory's advantage over its response tokens). An all-masked input gives loss 0, not NaN.
    """
    terms, sums = decoupled_ppo_token_terms(
        logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, eps_clip=eps_clip,
        eps_clip_high=eps_clip_high, dual_clip=dual_clip,
        behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode, cap_level=cap_level,
        seq_ids=seq_ids)
    loss = terms.sum() / sums["n_tokens"].clamp(min=1.0)
    return loss, finalize_stats(sums)
