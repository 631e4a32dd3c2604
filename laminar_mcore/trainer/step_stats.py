"""The statistics of one train step: per-micro-batch sums of the train/inference mismatch
(|log pi_engine - log pi_trainer| over the tokens both computed with the same weights), their
reduction over DP and PP, and the step's finished figures (loss parts per loss token, entropy,
clip fractions, importance weights, mismatch mean / p99 / max / fraction above threshold).

It only reports: it never changes the loss, the gradient or the model. ``reduce_step_stats`` is
collective (every rank of the stage calls it); the rest is local.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..algos import finalize_stats

# |log pi_engine - log pi_trainer| histogram: log-spaced edges from 1e-8 to 100 (25 per decade);
# bin 0 holds everything below 1e-8, the last bin everything above 100.
MISMATCH_EDGES = torch.logspace(-8, 2, 251, dtype=torch.float64)


def mismatch_terms(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor,
                   threshold: float) -> Dict[str, torch.Tensor]:
    """Per-micro-batch sums of the train/inference mismatch over the tokens of ``mask``."""
    d = (trainer_lp.double() - engine_lp.double()).abs()
    keep = mask > 0
    d = d[keep]
    hist = torch.bincount(torch.bucketize(d.cpu(), MISMATCH_EDGES),
                          minlength=len(MISMATCH_EDGES) + 1).double()
    return {"mismatch_sum": d.sum(), "mismatch_count": torch.tensor(float(d.numel())),
            "mismatch_above": (d > threshold).sum().double(),
            "mismatch_max": d.max() if d.numel() else torch.zeros((), dtype=torch.float64),
            "mismatch_hist": hist}


def mismatch_summary(sums: Dict[str, float], max_value: float, hist: torch.Tensor) -> Dict[str, float]:
    """mean, p99 (the upper edge of the histogram bin that holds it), max and the fraction
    above the threshold; ``mismatch_tokens`` counts the tokens they are over (0: no token of
    this step came from the trainer's own version, and the others are 0 too)."""
    n = sums["mismatch_count"]
    if n <= 0:
        return {"mismatch_tokens": 0.0, "mismatch_mean": 0.0, "mismatch_p99": 0.0,
                "mismatch_max": 0.0, "mismatch_frac_above": 0.0}
    cum = torch.cumsum(hist, 0)
    b = int(torch.searchsorted(cum, torch.tensor([0.99 * n], dtype=cum.dtype)).item())
    p99 = float(MISMATCH_EDGES[min(b, len(MISMATCH_EDGES) - 1)]) if b < len(MISMATCH_EDGES) \
        else max_value
    return {"mismatch_tokens": n, "mismatch_mean": sums["mismatch_sum"] / n,
            "mismatch_p99": min(p99, max_value), "mismatch_max": max_value,
            "mismatch_frac_above": sums["mismatch_above"] / n}


def reduce_step_stats(sums: Dict[str, torch.Tensor], ps, skipped_tokens: float, *,
                      entropy_coef: float, has_reference: bool) -> Dict[str, float]:
    """Sum the per-micro-batch stats over DP on the last stage, then share them over PP
    (``ps``: Megatron's parallel_state). ``skipped_tokens``: the loss tokens of trajectories
    not run (zero advantage), which count in the loss's denominator."""
    keys = ["loss", "pg_loss", "entropy_loss", "kl_loss", "entropy", "n_tokens", "clip_frac", "dual_clip_frac", "imp_weight_mean",
            "behav_masked_frac", "approx_kl", "ppo_kl", "clip_frac_lower", "mismatch_sum",
            "mismatch_count", "mismatch_above"]
    maxes = ["imp_weight_max", "mismatch_max"]
    vec = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64)
    vmax = torch.tensor([float(sums.get(k, 0.0)) for k in maxes], dtype=torch.float64)
    hist = sums.get("mismatch_hist", torch.zeros(len(MISMATCH_EDGES) + 1, dtype=torch.float64))
    if ps.is_pipeline_last_stage():
        dist.all_reduce(vec, group=ps.get_data_parallel_group())
        dist.all_reduce(hist, group=ps.get_data_parallel_group())
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        both = torch.cat([vec, vmax, hist])
        dist.broadcast(both, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        vec, vmax, hist = both[:len(keys)], both[len(keys):len(keys) + 2], both[len(keys) + 2:]
    raw = dict(zip(keys, vec.tolist()))
    mismatch = {k: raw.pop(k) for k in ("mismatch_sum", "mismatch_count", "mismatch_above")}
    raw["imp_weight_max"] = float(vmax[0].item())
    out = finalize_stats({k: torch.tensor(v) for k, v in raw.items()})
    n = raw["n_tokens"]
    # the loss over every loss token of the batch (a skipped zero-advantage trajectory adds
    # 0 to it); entropy over the tokens it was measured on
    total = n + float(skipped_tokens)
    for key in ("loss", "pg_loss", "entropy", "entropy_loss", "kl_loss"):
        d = n if key == "entropy" else total
        out[key] = raw[key] / d if d > 0 else 0.0
    if not entropy_coef:
        out.pop("entropy_loss")
    if not has_reference:
        out.pop("kl_loss")
    out.update(mismatch_summary(mismatch, float(vmax[1].item()), hist))
    return out
