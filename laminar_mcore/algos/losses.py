"""Policy losses over flat per-token tensors, in a registry with verl's names.

Every loss has one signature::

    fn(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
       behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", **options)
        -> (terms, stat_sums)

``logprobs`` (pi_theta, with gradient), ``prox_logprobs`` (pi_prox: verl's ``old_log_prob``),
``behav_logprobs`` (pi_behav, the engine's), ``advantages`` and ``loss_mask`` are per token and
of one shape; ``seq_ids`` names every token's sequence (the sequence-level losses need it).
``terms`` are the per-token losses (0 where masked) *before* aggregation: ``aggregation.py``
turns them into the batch's loss. ``stat_sums`` are per-token sums (``finalize_stats`` makes
means of them): ``n_tokens``, ``clip_frac``, ``clip_frac_lower``, ``ppo_kl`` (verl's
``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``), ``dual_clip_frac``,
``approx_kl`` (k3 of pi_prox || pi_theta), ``imp_weight_mean``/``imp_weight_max``,
``behav_masked_frac``. ``options`` are the loss's own ``algo.*`` keys (``policy_loss_options``).

The decoupled behaviour weight w = pi_prox / pi_behav (capped as ``behaviour_weights`` says)
multiplies every loss's per-token term where verl multiplies its ``rollout_is_weights``: the
clipping ratio of every loss is pi_theta / pi_prox. ``geo_mean`` uses the geometric mean of w
over each sequence, as verl does. With pi_prox = pi_behav (``use_decoupled_loss=false``) w = 1.

  decoupled_ppo  AReaL's decoupled PPO (ppo.py), clip-higher and dual clip
  gspo           GSPO: the sequence's geometric-mean ratio (token-level gradient), clipped
  cispo          CISPO: -sg(clip(ratio)) A log pi_theta; every token keeps its gradient
  sapo           SAPO: a sigmoid gate (4/tau) sigmoid(tau (ratio - 1)) instead of the clip
  geo_mean       GMPO: the geometric mean of token-clipped ratios of each sequence
  clip_cov       Clip-Cov: the gradient of a few high-covariance tokens is cut
  kl_cov         KL-Cov: a |log ratio| penalty on the highest-covariance tokens

``clip_cov`` and ``kl_cov`` choose their tokens among the tokens of one call (one micro-batch),
as verl does: their loss depends on the micro-batch split, unlike the others.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .aggregation import agg_loss, segment_sum, sequence_index
from .ppo import behaviour_weights, check_inputs, decoupled_ppo_token_terms, finalize_stats
from .spec import FIXED_AGGREGATION, algo_problems

Tensor = torch.Tensor
PolicyLossFn = Callable[..., Tuple[Tensor, Dict[str, Tensor]]]
_LOSSES: Dict[str, PolicyLossFn] = {}
# the algo.* keys each loss takes as keyword options, besides the behaviour-weight cap's
_OPTIONS: Dict[str, Tuple[str, ...]] = {}
_CAP_KEYS = ("behav_imp_weight_cap", "cap_mode", "cap_level")
_CLIP_KEYS = ("eps_clip", "eps_clip_high")


def register_policy_loss(name: str, options: Tuple[str, ...] = ()
                         ) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register ``fn`` as ``name``; ``options``: the ``algo.*`` keys it takes as keywords."""
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _LOSSES[name], _OPTIONS[name] = fn, tuple(options)
        return fn

    return wrap


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered as ``name`` (signature in the module docstring)."""
    if name not in _LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(_LOSSES)}")
    return _LOSSES[name]


def registered_policy_losses() -> Tuple[str, ...]:
    return tuple(_LOSSES)


def policy_loss_options(algo: Any) -> Dict[str, Any]:
    """The keyword options of ``algo.policy_loss`` from an ``algo`` section (dataclass or
    DictConfig). Raises ``ValueError`` listing every problem of the section's combination."""
    problems = algo_problems(algo)
    if problems:
        raise ValueError("invalid algo section:\n  - " + "\n  - ".join(problems))
    policy_loss_fn(algo.policy_loss)
    return {key: getattr(algo, key) for key in _OPTIONS[algo.policy_loss] + _CAP_KEYS}


def policy_loss(name: str, logprobs: Tensor, prox_logprobs: Tensor, behav_logprobs: Tensor,
                advantages: Tensor, loss_mask: Tensor, *, seq_ids: Optional[Tensor] = None,
                loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
                **options) -> Tuple[Tensor, Dict[str, float]]:
    """One whole batch's loss (a scalar with gradient w.r.t. ``logprobs``) and its stats: the
    loss ``name`` aggregated by ``loss_agg_mode``, as verl's ``compute_policy_loss_<name>``."""
    fixed = FIXED_AGGREGATION.get(name)
    if fixed and loss_agg_mode != fixed:
        raise ValueError(f"policy loss {name} aggregates per sequence ({fixed}); got "
                         f"loss_agg_mode={loss_agg_mode}")
    terms, sums = policy_loss_fn(name)(logprobs, prox_logprobs, behav_logprobs, advantages,
                                       loss_mask, seq_ids=seq_ids, **options)
    loss = agg_loss(terms, loss_mask, seq_ids, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, finalize_stats(sums)


# ------------------------------------------------------------------------------- helpers
class _Tokens:
    """One call's inputs in a common float dtype (float32, or float64 if given), the behaviour
    weights, and the stats every loss reports."""

    def __init__(self, logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *,
                 seq_ids, behav_imp_weight_cap, cap_mode, cap_level, need_sequences=False,
                 name=""):
        check_inputs(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask,
                     cap_mode=cap_mode, cap_level=cap_level, seq_ids=seq_ids)
        if need_sequences and seq_ids is None:
            raise ValueError(f"policy loss {name} is sequence-level: it needs seq_ids (the "
                             "sequence of every token)")
        dt = torch.promote_types(logprobs.dtype, torch.float32)
        self.lp = logprobs.to(dt)
        self.prox = prox_logprobs.detach().to(dt)
        self.adv = advantages.detach().to(dt)
        self.mask = loss_mask.detach().to(dt)
        self.weight, self.capped = behaviour_weights(
            self.prox, behav_logprobs.detach().to(dt), self.mask,
            behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode, cap_level=cap_level,
            seq_ids=seq_ids)
        self.index, self.n_seq = sequence_index(seq_ids) if need_sequences else (None, 0)

    def seq_sum(self, values: Tensor) -> Tensor:
        return segment_sum(values, self.index, self.n_seq)

    def masked(self, values: Tensor) -> Tensor:
        """``values`` where the loss mask is set, exactly 0 elsewhere (verl's masked_sum)."""
        return torch.where(self.mask > 0, values, torch.zeros_like(values))

    def msum(self, values: Tensor) -> Tensor:
        return (self.masked(values.detach()) * self.mask).sum()

    def stats(self, clip_hit: Optional[Tensor], clip_lower: Optional[Tensor],
              ppo_kl: Tensor) -> Dict[str, Tensor]:
        log_ratio = (self.lp - self.prox).detach()
        zero = torch.zeros((), dtype=self.mask.dtype, device=self.mask.device)
        w = self.weight
        return {
            "n_tokens": self.mask.sum(),
            "clip_frac": self.msum(clip_hit.to(w.dtype)) if clip_hit is not None else zero,
            "clip_frac_lower": self.msum(clip_lower.to(w.dtype))
            if clip_lower is not None else zero,
            "ppo_kl": self.msum(ppo_kl),
            "dual_clip_frac": zero,
            "imp_weight_mean": self.msum(w),
            "imp_weight_max": torch.where(self.mask > 0, w, torch.zeros_like(w)).max()
            if w.numel() else zero,
            "behav_masked_frac": self.msum(self.capped),
            "approx_kl": self.msum(torch.exp(log_ratio) - 1.0 - log_ratio),  # k3, >= 0
        }


def _clip_range(eps_clip: float, eps_clip_high: Optional[float]) -> Tuple[float, float]:
    return eps_clip, eps_clip if eps_clip_high is None else eps_clip_high


# ------------------------------------------------------------------------------- losses
@register_policy_loss("decoupled_ppo", options=_CLIP_KEYS + ("dual_clip",))
def decoupled_ppo(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *,
                  seq_ids=None, behav_imp_weight_cap=None, cap_mode="mask", cap_level="token",
                  eps_clip=0.2, eps_clip_high=None, dual_clip=None):
    """AReaL's decoupled PPO (``ppo.decoupled_ppo_token_terms``, unchanged) plus verl's stats:
    ``clip_frac_lower`` (the dual-clip hits, verl's pg_clipfrac_lower) and ``ppo_kl``."""
    terms, stats = decoupled_ppo_token_terms(
        logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, eps_clip=eps_clip,
        eps_clip_high=eps_clip_high, dual_clip=dual_clip,
        behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode, cap_level=cap_level,
        seq_ids=seq_ids)
    log_ratio = (logprobs.detach().float() - prox_logprobs.detach().float()).clamp(-20.0, 20.0)
    stats["ppo_kl"] = (-log_ratio * loss_mask.float()).sum()
    stats["clip_frac_lower"] = stats["dual_clip_frac"]
    return terms, stats


@register_policy_loss("gspo", options=_CLIP_KEYS)
def gspo(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
         behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", eps_clip=0.2,
         eps_clip_high=None):
    """GSPO (arXiv 2507.18071): every token of sequence i uses the ratio
    s_i = exp(mean_t log(pi_theta / pi_prox)) (with the token's own gradient), clipped."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level, need_sequences=True, name="gspo")
    low, high = _clip_range(eps_clip, eps_clip_high)
    log_ratio = x.lp - x.prox
    seq_log_ratio = (x.seq_sum(log_ratio * x.mask) / x.seq_sum(x.mask).clamp(min=1))[x.index]
    log_s = torch.clamp(x.lp - x.lp.detach() + seq_log_ratio.detach(), max=10.0)
    s = torch.exp(log_s)
    loss1, loss2 = -x.adv * s, -x.adv * torch.clamp(s, 1 - low, 1 + high)
    terms = x.masked(torch.maximum(loss1, loss2) * x.weight)
    return terms, x.stats(loss2 > loss1, None, -log_ratio)


@register_policy_loss("cispo", options=_CLIP_KEYS)
def cispo(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
          behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", eps_clip=0.2,
          eps_clip_high=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio)) A log pi_theta; the clip bounds
    the weight, never the gradient."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level)
    low, high = _clip_range(eps_clip, eps_clip_high)
    log_ratio = torch.clamp(x.lp - x.prox, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - low, 1 + high).detach()
    terms = x.masked(-clipped * x.adv * x.lp * x.weight)
    return terms, x.stats(ratio != clipped, None, -log_ratio)


@register_policy_loss("sapo", options=("sapo_tau_pos", "sapo_tau_neg"))
def sapo(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
         behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", sapo_tau_pos=1.0,
         sapo_tau_neg=1.05):
    """SAPO (arXiv 2511.20347): -f(ratio) A with the soft gate f(r) = (4/tau) sigmoid(tau (r-1))
    (tau_pos for A > 0, tau_neg otherwise). Aggregated by seq-mean-token-mean, as verl fixes."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level)
    log_ratio = torch.clamp(x.lp - x.prox, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(sapo_tau_pos, dtype=x.adv.dtype, device=x.adv.device)
    tau_neg = torch.as_tensor(sapo_tau_neg, dtype=x.adv.dtype, device=x.adv.device)
    tau = torch.where(x.adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    terms = x.masked(-gate * x.adv * x.weight)
    return terms, x.stats(None, None, -log_ratio)


@register_policy_loss("geo_mean", options=_CLIP_KEYS)
def geo_mean(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
             behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", eps_clip=0.2,
             eps_clip_high=None):
    """GMPO (arXiv 2507.20673): sequence i's loss -A_i exp(mean_t clip(log ratio)) (each token's
    log-ratio clipped against the sign of its advantage), times the geometric mean of its
    behaviour weights; every loss token of i carries that value (aggregate it with
    seq-mean-token-mean for verl's mean over sequences)."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level, need_sequences=True, name="geo_mean")
    low, high = _clip_range(eps_clip, eps_clip_high)
    log_ratio = x.lp - x.prox
    sign = torch.sign(x.adv)
    log_ratio_clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)
    n = x.seq_sum(x.mask) + 1e-8
    ratio = torch.exp(x.seq_sum(x.masked(log_ratio_min) * x.mask) / n)
    adv = x.seq_sum(x.masked(x.adv) * x.mask) / n
    seq_weight = torch.exp(x.seq_sum(x.masked(torch.log(x.weight + 1e-10)) * x.mask) / n)
    terms = x.masked((-adv * ratio * seq_weight)[x.index])
    clipped = log_ratio.detach() != log_ratio_clamped.detach()
    return terms, x.stats(clipped & (x.adv > 0), clipped & (x.adv < 0), -log_ratio)


@register_policy_loss("clip_cov", options=_CLIP_KEYS + ("clip_cov_ratio", "clip_cov_lb",
                                                        "clip_cov_ub"))
def clip_cov(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
             behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", eps_clip=0.2,
             eps_clip_high=None, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0):
    """Clip-Cov (arXiv 2505.22617): the clipped PPO loss, with the gradient
    cut on ``max(int(clip_cov_ratio * tokens), 1)`` tokens drawn at random (torch's global RNG,
    verl's draw) among the unclipped ones whose (A - mean A)(log pi - mean log pi) lies in
    (clip_cov_lb, clip_cov_ub). ``clip_frac``: the fraction of tokens cut."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level)
    low, high = _clip_range(eps_clip, eps_clip_high)
    log_ratio = x.lp - x.prox
    ratio = torch.exp(log_ratio)
    loss1, loss2 = -x.adv * ratio, -x.adv * torch.clamp(ratio, 1 - low, 1 + high)
    valid = x.mask > 0
    n_tokens = x.mask.sum()
    lp = x.lp.detach()
    cov = (x.adv - x.msum(x.adv) / (n_tokens + 1e-8)) * (lp - x.msum(lp) / (n_tokens + 1e-8))
    cov = torch.where(valid & ~((loss2 > loss1) & valid), cov, torch.full_like(cov, -torch.inf))
    # candidates in row-major order, as verl's torch.nonzero lists them
    candidates = torch.nonzero(((cov < clip_cov_ub) & (cov > clip_cov_lb) & valid).reshape(-1))
    cut = torch.zeros_like(valid).reshape(-1)
    if candidates.numel():
        count = min(max(int(clip_cov_ratio * n_tokens.item()), 1), candidates.numel())
        perm = torch.randperm(candidates.numel())  # verl's draw: CPU, the global generator
        cut[candidates.flatten()[perm[:count].to(candidates.device)]] = True
    cut = cut.view(valid.shape)
    corr = (~cut).to(x.lp.dtype)
    terms = x.masked(torch.maximum(loss1, loss2) * corr * x.weight)
    return terms, x.stats(cut, None, -log_ratio)


@register_policy_loss("kl_cov", options=("kl_cov_ratio", "kl_cov_coef"))
def kl_cov(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *, seq_ids=None,
           behav_imp_weight_cap=None, cap_mode="mask", cap_level="token", kl_cov_ratio=0.0002,
           kl_cov_coef=0.1):
    """KL-Cov (arXiv 2505.22617): the unclipped loss -A ratio, plus
    ``kl_cov_coef * |log ratio|`` on the ``max(1, int(kl_cov_ratio * tokens))`` tokens of
    largest (A - mean A)(log pi - mean log pi). ``ppo_kl`` is the mean |log ratio| (verl's
    report); ``clip_frac`` the fraction of tokens penalised."""
    x = _Tokens(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, seq_ids=seq_ids,
                behav_imp_weight_cap=behav_imp_weight_cap, cap_mode=cap_mode,
                cap_level=cap_level)
    log_ratio = x.lp - x.prox
    ratio = torch.exp(log_ratio)
    loss1 = -x.adv * ratio
    loss_kl = loss1 + kl_cov_coef * log_ratio.abs()
    flat_valid = (x.mask > 0).reshape(-1)
    positions = torch.nonzero(flat_valid, as_tuple=True)[0]
    penalised = torch.zeros_like(flat_valid)
    # verl's selection, on the CPU as verl does it (the same top-k among ties)
    adv = x.adv.reshape(-1)[flat_valid].cpu()
    lp = x.lp.detach().reshape(-1)[flat_valid].cpu()
    if min(kl_cov_ratio, adv.numel()) != 0:
        cov = (adv - adv.mean()) * (lp - lp.mean())
        top = torch.topk(cov, max(1, int(cov.numel() * kl_cov_ratio)), largest=True).indices
        penalised[positions[top.to(positions.device)]] = True
    penalised = penalised.view(x.mask.shape)
    terms = x.masked(torch.where(penalised, loss_kl, loss1) * x.weight)
    return terms, x.stats(penalised, None, log_ratio.abs())
