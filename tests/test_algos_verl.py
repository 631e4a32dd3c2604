"""Our advantage estimators, policy losses, loss aggregations and KL estimators against verl
0.9.1's own functions (``verl/trainer/ppo/core_algos.py`` from the pinned wheel, downloaded once
and cached under .venv, loaded without importing verl: laminar_mcore/testing/verl_source.py).

Every estimator, loss and aggregation mode runs on 32 random batches in float64 -- masked tokens
(holes and padding), groups of one, all-equal rewards, extreme ratios -- and must give verl's
value, every statistic verl reports and verl's gradient w.r.t. the log-probs. verl's batches are
[B, L] with one row per sequence; ours are the same tokens flattened, with sequence ids (some
cases give padding its own id, -1, as the packer does). Skipped, saying why, when the wheel
cannot be had."""

import numpy as np
import pytest
import torch

from laminar_mcore.algos import (advantage_fn, agg_loss, aggregate_terms, batch_counts,
                                 denominator, kl_penalty, policy_loss, policy_loss_fn,
                                 regularized_sums)
from laminar_mcore.algos.kl import KL_ESTIMATORS
from laminar_mcore.algos.spec import FIXED_AGGREGATION, LOSS_AGG_MODES, POLICY_LOSSES
from laminar_mcore.testing import verl_source

CASES = 32
F64 = dict(rtol=1e-7, atol=1e-7)  # float64 against float64
# verl's stats -> ours (finalize_stats keys)
STATS = {"actor/pg_clipfrac": "clip_frac", "actor/pg_clipfrac_lower": "clip_frac_lower",
         "actor/ppo_kl": "ppo_kl"}


@pytest.fixture(scope="module")
def verl():
    try:
        return verl_source.load()
    except Exception as exc:  # noqa: BLE001 - no registry, no wheel: say why and skip
        pytest.skip(f"verl {verl_source.VERSION}'s wheel is not available: {exc}")


def _layout(g, *, rows=(1, 9), cols=(1, 24), full_rows=False):
    """A [B, L] response mask with padding and holes (at least one loss token in all)."""
    b = int(torch.randint(rows[0], rows[1] + 1, (), generator=g))
    width = int(torch.randint(cols[0], cols[1] + 1, (), generator=g))
    lengths = torch.randint(0 if not full_rows else 1, width + 1, (b,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    mask *= (torch.rand(b, width, generator=g) > 0.15).double()  # holes
    if full_rows:
        mask[torch.arange(b), (lengths - 1).clamp(min=0)] = 1.0
    if mask.sum() == 0:
        mask[0, 0] = 1.0
    return mask


def _seq_ids(g, mask):
    """Row index per token; in half of the cases padding (after a row's last loss token) gets
    -1, as the packer gives it."""
    b, width = mask.shape
    seq = torch.arange(b)[:, None].expand(b, width).clone()
    if torch.rand((), generator=g) < 0.5:
        last = torch.where(mask > 0, torch.arange(width)[None, :], -1).max(dim=1).values
        seq[torch.arange(width)[None, :] > last[:, None]] = -1
    return seq.reshape(-1)


def _case(seed, name):
    """Inputs of one loss case: 2-D tensors, our options and verl's config fields."""
    g = torch.Generator().manual_seed(seed)
    mask = _layout(g, full_rows=name == "geo_mean")  # verl's geo_mean averages over every row
    b, width = mask.shape
    behav = -torch.rand(b, width, generator=g, dtype=torch.float64) * 4
    decoupled = seed % 4 != 0
    prox = behav + torch.randn(b, width, generator=g, dtype=torch.float64) * 0.6 if decoupled \
        else behav.clone()
    spread = (0.05, 0.3, 1.0, 6.0)[seed % 4]  # seed % 4 == 3: extreme ratios (e^+-20 and more)
    lp = prox + torch.randn(b, width, generator=g, dtype=torch.float64) * spread
    if seed % 8 == 3:
        lp[0] = prox[0] + 12.0  # beyond gspo's clamp of the sequence log-ratio at 10
        lp[0, 0] = prox[0, 0] + 30.0  # far beyond verl's +-20 clamps
        lp[-1, -1] = prox[-1, -1] - 30.0
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, width).clone()
    if seed % 3 == 1:
        adv += 0.5 * torch.randn(b, width, generator=g, dtype=torch.float64)  # token-level
    if seed % 5 == 2:
        adv[0] = 0.0
    if name == "decoupled_ppo":  # it computes in float32: feed it float32-exact values
        lp, prox, behav, adv = (t.float().double() for t in (lp, prox, behav, adv))
        lp = torch.minimum(torch.maximum(lp, prox - 18.0), prox + 18.0)  # verl clamps at +-20
    low = (0.2, 0.1, 0.3)[seed % 3]
    high = (None, 0.28, 0.2)[seed % 3 if name != "geo_mean" else 1]
    opts, config = {}, dict(clip_ratio=low, clip_ratio_low=low,
                            clip_ratio_high=high if high is not None else low)
    if name in ("decoupled_ppo", "gspo", "cispo", "geo_mean", "clip_cov"):
        opts.update(eps_clip=low, eps_clip_high=high)
    if name == "decoupled_ppo":
        dual = (None, 3.0, 1.5)[seed % 3]
        opts["dual_clip"] = dual
        config["clip_ratio_c"] = dual if dual is not None else 1e30  # verl always dual-clips
    if name == "sapo":
        opts.update(sapo_tau_pos=(1.0, 2.0)[seed % 2], sapo_tau_neg=(1.05, 3.0)[seed % 2])
        config.update(tau_pos=opts["sapo_tau_pos"], tau_neg=opts["sapo_tau_neg"])
    if name == "clip_cov":
        opts.update(clip_cov_ratio=(0.0002, 0.2)[seed % 2], clip_cov_lb=(1.0, 0.1)[seed % 2],
                    clip_cov_ub=5.0)
        config.update(clip_cov_ratio=opts["clip_cov_ratio"], clip_cov_lb=opts["clip_cov_lb"],
                      clip_cov_ub=5.0)
    if name == "kl_cov":
        opts.update(kl_cov_ratio=(0.0002, 0.3)[seed % 2], kl_cov_coef=(0.1, 1.0)[seed % 2])
        config.update(kl_cov_ratio=opts["kl_cov_ratio"], ppo_kl_coef=opts["kl_cov_coef"])
    cap = None
    if decoupled and seed % 3 != 0:
        level = "sequence" if name == "geo_mean" or seed % 2 else "token"
        cap = dict(behav_imp_weight_cap=(1.1, 2.0)[(seed // 4) % 2],
                   cap_mode=("mask", "clamp")[(seed // 2) % 2], cap_level=level)
        opts.update(cap)
    return dict(mask=mask, lp=lp, prox=prox, behav=behav, adv=adv, opts=opts, config=config,
                cap=cap, seq=_seq_ids(g, mask), decoupled=decoupled)


def _weights(c):
    """pi_prox / pi_behav with the case's cap, by hand (verl's rollout_is_weights)."""
    mask, log_w = c["mask"], c["prox"] - c["behav"]
    cap = c["cap"]
    if cap and cap["cap_level"] == "sequence":
        log_w = ((log_w * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
                 ).expand_as(log_w)
    w = torch.exp(log_w)
    if cap:
        over = w > cap["behav_imp_weight_cap"]
        w = torch.where(over, torch.zeros_like(w) if cap["cap_mode"] == "mask"
                        else torch.full_like(w, cap["behav_imp_weight_cap"]), w)
    return w


def _compare_loss(verl, name, mode, seed):
    c = _case(seed, name)
    factor = float(c["mask"].shape[1]) if seed % 2 else 7.5
    info = {"loss_scale_factor": factor} if mode == "seq-mean-token-sum-norm" else {}
    torch.manual_seed(seed)  # clip_cov draws its tokens from torch's global generator
    x = c["lp"].reshape(-1).clone().requires_grad_()
    ours, stats = policy_loss(name, x, c["prox"].reshape(-1), c["behav"].reshape(-1),
                              c["adv"].reshape(-1), c["mask"].reshape(-1), seq_ids=c["seq"],
                              loss_agg_mode=mode, loss_scale_factor=factor, **c["opts"])
    ours.backward()

    torch.manual_seed(seed)
    y = c["lp"].clone().requires_grad_()
    fn = verl.get_policy_loss_fn("vanilla" if name == "decoupled_ppo" else name)
    ref, metrics = fn(c["prox"], y, c["adv"], c["mask"], loss_agg_mode=mode,
                      config=verl_source.actor_config(**c["config"], global_batch_info=info),
                      rollout_is_weights=_weights(c) if c["decoupled"] else None)
    ref.backward()

    tol = dict(rtol=1e-5, atol=1e-6) if name == "decoupled_ppo" else F64  # float32 inside
    where = f"{name} {mode} seed {seed}"
    torch.testing.assert_close(ours.detach().double(), ref.detach(), **tol, msg=where)
    torch.testing.assert_close(x.grad.double(), y.grad.reshape(-1), **tol, msg=where)
    for key, value in metrics.items():
        torch.testing.assert_close(stats[STATS[key]], value, rtol=1e-6, atol=1e-6,
                                   msg=f"{where}: {key}")


LOSS_MODES = [(name, mode) for name in POLICY_LOSSES
              for mode in ([FIXED_AGGREGATION[name]] if name in FIXED_AGGREGATION
                           else LOSS_AGG_MODES)]


@pytest.mark.parametrize("name, mode", LOSS_MODES, ids=[f"{n}-{m}" for n, m in LOSS_MODES])
def test_policy_loss_equals_verl(verl, name, mode):
    for seed in range(CASES):
        _compare_loss(verl, name, mode, seed)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_equals_verl_agg_loss(verl, mode):
    for seed in range(CASES):
        g = torch.Generator().manual_seed(100 + seed)
        mask = _layout(g)
        terms = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 3
        factor = 11.0 if seed % 2 else None  # None: verl's horizon, the padded width
        x = terms.reshape(-1).clone().requires_grad_()
        ours = agg_loss(x * mask.reshape(-1), mask.reshape(-1), _seq_ids(g, mask), mode,
                        loss_scale_factor=factor or float(mask.shape[1]))
        ours.backward()
        y = terms.clone().requires_grad_()
        ref = verl.agg_loss(y, mask, mode, loss_scale_factor=factor)
        ref.backward()
        torch.testing.assert_close(ours.detach(), ref.detach(), **F64)
        torch.testing.assert_close(x.grad, y.grad.reshape(-1), **F64)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_entropy_bonus_and_kl_penalty_compose_as_verl_ppo_loss(verl, mode):
    """The actor's loss with algo.entropy_coef and algo.kl_coef (``regularized_sums`` over the
    policy loss's numerator, one denominator) against verl's ``ppo_loss``
    (verl/workers/utils/losses.py): ``pg_loss - entropy_coeff * agg_loss(entropy) +
    kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type))``, value and
    gradient w.r.t. the log-probs and the entropy."""
    kinds = ("k1", "k2", "k3", "k3+", "low_var_kl", "abs")
    for seed in range(CASES):
        name = ("gspo", "cispo", "clip_cov", "kl_cov")[seed % 4] if mode != \
            "seq-mean-token-mean" else ("gspo", "sapo", "geo_mean", "cispo")[seed % 4]
        c = _case(400 + seed, name)
        g = torch.Generator().manual_seed(500 + seed)
        entropy = torch.rand(c["mask"].shape, generator=g, dtype=torch.float64) * 5
        ref_lp = c["lp"] + torch.randn(c["mask"].shape, generator=g, dtype=torch.float64) * (
            0.05, 0.5, 4.0)[seed % 3]
        ec, kc, kind = (0.0, 0.01, 0.3)[seed % 3], (0.001, 0.5, 2.0)[seed % 3], kinds[seed % 6]
        factor = 9.0
        flat = {k: c[k].reshape(-1) for k in ("lp", "prox", "behav", "adv", "mask")}
        mask, seq = flat["mask"], c["seq"]

        torch.manual_seed(seed)
        x = flat["lp"].clone().requires_grad_()
        h = entropy.reshape(-1).clone().requires_grad_()
        terms, _ = policy_loss_fn(name)(x, flat["prox"], flat["behav"], flat["adv"], mask,
                                        seq_ids=seq, **c["opts"])
        numerator, parts = regularized_sums(
            aggregate_terms(terms, mask, seq, mode), x, h, ref_lp.reshape(-1), mask, seq, mode,
            entropy_coef=ec, kl_coef=kc, kl_estimator=kind)
        ours = numerator / denominator(mode, *batch_counts(mask, seq), factor)
        ours.backward()

        torch.manual_seed(seed)
        y, e = c["lp"].clone().requires_grad_(), entropy.clone().requires_grad_()
        info = {"loss_scale_factor": factor} if mode == "seq-mean-token-sum-norm" else {}
        config = verl_source.actor_config(**c["config"], global_batch_info=info)
        pg, _ = verl.get_policy_loss_fn(name)(
            c["prox"], y, c["adv"], c["mask"], loss_agg_mode=mode, config=config,
            rollout_is_weights=_weights(c) if c["decoupled"] else None)
        # verl/workers/utils/losses.py, ppo_loss: the entropy and KL terms, as written there
        entropy_loss = verl.agg_loss(loss_mat=e, loss_mask=c["mask"], loss_agg_mode=mode, **info)
        kld = verl.kl_penalty(logprob=y, ref_logprob=ref_lp, kl_penalty=kind)
        kl_loss = verl.agg_loss(loss_mat=kld, loss_mask=c["mask"], loss_agg_mode=mode, **info)
        ref = pg - ec * entropy_loss + kl_loss * kc
        ref.backward()
        where = f"{name} {mode} {kind} seed {seed}"
        torch.testing.assert_close(ours.detach(), ref.detach(), **F64, msg=where)
        torch.testing.assert_close(x.grad, y.grad.reshape(-1), **F64, msg=where)
        h_grad = h.grad if h.grad is not None else torch.zeros_like(h)  # entropy_coef 0
        torch.testing.assert_close(h_grad, e.grad.reshape(-1), **F64, msg=where)
        d = denominator(mode, *batch_counts(mask, seq), factor)
        torch.testing.assert_close(parts["kl_loss"] / d, kl_loss.detach(), **F64, msg=where)
        if ec:
            torch.testing.assert_close(parts["entropy_loss"] / d, entropy_loss.detach(), **F64)
        else:
            assert "entropy_loss" not in parts


@pytest.mark.parametrize("kind", KL_ESTIMATORS + ("k1+", "k3+", "low_var_kl+"))
def test_kl_penalty_equals_verl(verl, kind):
    for seed in range(CASES):
        g = torch.Generator().manual_seed(200 + seed)
        ref_lp = -torch.rand(40, generator=g, dtype=torch.float64) * 5
        lp = ref_lp + torch.randn(40, generator=g, dtype=torch.float64) * (0.1, 2.0, 15.0)[seed % 3]
        x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        ours, ref = kl_penalty(x, ref_lp, kind), verl.kl_penalty(y, ref_lp, kind)
        (ours * torch.arange(40)).sum().backward()
        (ref * torch.arange(40)).sum().backward()
        torch.testing.assert_close(ours.detach(), ref.detach(), **F64)
        torch.testing.assert_close(x.grad, y.grad, **F64)


# ---------------------------------------------------------------------------- advantages
def _rewards_case(seed, *, min_group=1):
    """Rewards, group ids and a [B, L] mask of one batch: groups of one (unless min_group),
    all-equal groups, binary or continuous rewards, holes in the responses."""
    g = torch.Generator().manual_seed(300 + seed)
    n_groups = int(torch.randint(1, 6, (), generator=g))
    sizes = torch.randint(min_group, 6, (n_groups,), generator=g).tolist()
    ids = [f"p{k}" for k, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(len(ids), generator=g).tolist()  # groups interleaved in the batch
    ids = [ids[i] for i in order]
    if seed % 3 == 0:
        rewards = torch.randint(0, 2, (len(ids),), generator=g).double()
    else:
        rewards = torch.randn(len(ids), generator=g, dtype=torch.float64) * 2
    if seed % 4 == 1:
        rewards[:] = 1.0  # all equal
    elif seed % 4 == 2:
        for gid in set(ids[: len(ids) // 2]):  # some groups all equal
            rewards[[i for i, x in enumerate(ids) if x == gid]] = 0.5
    mask = _layout(g, rows=(len(ids), len(ids)), cols=(2, 16), full_rows=True)
    while mask.sum() < 2:
        mask[0, : mask.shape[1]] = 1.0
    return rewards, ids, mask


def _verl_advantages(verl, name, rewards, ids, mask, **kw):
    """verl's estimator on token-level rewards: each reward at its row's last loss token."""
    b, width = mask.shape
    last = torch.where(mask > 0, torch.arange(width)[None, :], -1).max(dim=1).values
    token_rewards = torch.zeros(b, width, dtype=torch.float64)
    token_rewards[torch.arange(b), last] = rewards
    adv, _ = verl.get_adv_estimator_fn(name)(
        token_level_rewards=token_rewards, response_mask=mask, index=np.array(ids, dtype=object),
        **kw)
    return adv


ESTIMATORS = {  # ours -> (verl's name, verl's keywords), with our std_normalize
    "rloo": ("rloo", {}),
    "reinforce_plus_plus": ("reinforce_plus_plus", {"config": verl_source.algo_config(gamma=1.0)}),
    "reinforce_plus_plus_baseline": ("reinforce_plus_plus_baseline", {}),
    "opo": ("opo", {}),
    "gpg": ("gpg", {}),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_advantages_equal_verl(verl, name):
    verl_name, kw = ESTIMATORS[name]
    for seed in range(CASES):
        rewards, ids, mask = _rewards_case(seed)
        ours = advantage_fn(name)(rewards, ids, lengths=mask.sum(1).tolist())
        ref = _verl_advantages(verl, verl_name, rewards, ids, mask, **kw)
        torch.testing.assert_close(ours.double()[:, None] * mask, ref, rtol=1e-6, atol=1e-6,
                                   msg=f"{name} seed {seed}")


@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_and_passk_equal_verl(verl, std_normalize):
    for seed in range(CASES):
        rewards, ids, mask = _rewards_case(seed)
        single = torch.tensor([ids.count(i) == 1 for i in ids])
        ours = advantage_fn("grpo")(rewards, ids, std_normalize=std_normalize)
        ref = _verl_advantages(verl, "grpo", rewards, ids, mask,
                               norm_adv_by_std_in_grpo=std_normalize)
        full = ours.double()[:, None] * mask
        torch.testing.assert_close(full[~single], ref[~single], rtol=1e-6, atol=1e-6)
        # groups of one: verl's baseline is 0 (r / (1 + eps) or r), ours gives 0 (unchanged)
        assert (ours[single] == 0).all()
        scale = 1 / (1 + 1e-6) if std_normalize else 1.0
        torch.testing.assert_close(ref[single], rewards[single, None] * scale * mask[single])
        # Dr. GRPO's leave-one-out is verl's rloo, groups of one aside
        if not std_normalize:
            loo = advantage_fn("grpo")(rewards, ids, std_normalize=False, leave_one_out=True)
            ref = _verl_advantages(verl, "rloo", rewards, ids, mask)
            torch.testing.assert_close((loo.double()[:, None] * mask)[~single], ref[~single],
                                       rtol=1e-6, atol=1e-6)
        rewards, ids, mask = _rewards_case(seed, min_group=2)
        ours = advantage_fn("grpo_passk")(rewards, ids, std_normalize=std_normalize)
        config = verl_source.algo_config(norm_adv_by_std_in_grpo=std_normalize)
        ref = _verl_advantages(verl, "grpo_passk", rewards, ids, mask, config=config)
        torch.testing.assert_close(ours.double()[:, None] * mask, ref, rtol=1e-6, atol=1e-6)


def test_remax_is_refused_with_the_reason(verl):
    assert "remax" in verl.ADV_ESTIMATOR_REGISTRY
    with pytest.raises(ValueError, match="greedy"):
        advantage_fn("remax")
