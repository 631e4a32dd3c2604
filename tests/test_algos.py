"""The decoupled PPO loss and GRPO advantages against hand-written per-token references; the
registries and the checks of the algo section; every aggregation mode independent of how the
batch is split over micro-batches and DP ranks (the actor's arithmetic, emulated). verl's own
functions are the reference of the other estimators and losses: tests/test_algos_verl.py."""

import math

import pytest
import torch

from laminar_mcore.algos import (advantage_fn, aggregate_terms, algo_problems, batch_counts,
                                 decoupled_ppo_loss, decoupled_ppo_token_terms, denominator,
                                 get_advantage_fn, grpo_advantages, policy_loss, policy_loss_fn,
                                 policy_loss_options)
from laminar_mcore.config.schema import AlgoConfig


def reference_loss(lp, prox, behav, adv, mask, eps, eps_high, dual, cap, cap_mode, cap_level, seq):
    """Token by token, in float64 Python, straight from AReaL's formula."""
    n = len(lp)
    weights = [math.exp(prox[i] - behav[i]) for i in range(n)]
    if cap_level == "sequence":
        by_seq = {}
        for i in range(n):
            if mask[i]:
                by_seq.setdefault(seq[i], []).append(prox[i] - behav[i])
        weights = [math.exp(sum(by_seq[seq[i]]) / len(by_seq[seq[i]])) if seq[i] in by_seq else 1.0
                   for i in range(n)]
    total, count, clipped = 0.0, 0, 0
    for i in range(n):
        if not mask[i]:
            continue
        count += 1
        u = math.exp(lp[i] - prox[i])
        l1, l2 = -adv[i] * u, -adv[i] * min(max(u, 1 - eps), 1 + eps_high)
        clipped += l2 > l1
        term = max(l1, l2)
        if dual is not None and adv[i] < 0:
            term = min(term, dual * abs(adv[i]))
        w = weights[i]
        if cap is not None and w > cap:
            w = 0.0 if cap_mode == "mask" else cap
        total += term * w
    return (total / count if count else 0.0), (clipped / count if count else 0.0)


def _inputs(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    prox = behav + torch.randn(n, generator=g, dtype=torch.float64) * 0.8
    lp = prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.25).double()
    seq = torch.div(torch.arange(n), 17, rounding_mode="floor")
    return lp, prox, behav, adv, mask, seq


CASES = [
    dict(),
    dict(eps_clip_high=0.28),
    dict(dual_clip=3.0),
    dict(behav_imp_weight_cap=2.0, cap_mode="mask"),
    dict(behav_imp_weight_cap=2.0, cap_mode="clamp"),
    dict(behav_imp_weight_cap=1.1, cap_mode="mask", cap_level="sequence"),
    dict(behav_imp_weight_cap=1.1, cap_mode="clamp", cap_level="sequence", dual_clip=2.0,
         eps_clip_high=0.3),
]


@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_loss_equals_the_reference(kw):
    lp, prox, behav, adv, mask, seq = _inputs()
    loss, stats = decoupled_ppo_loss(lp.float(), prox.float(), behav.float(), adv.float(), mask,
                                     seq_ids=seq, **kw)
    ref, clip_frac = reference_loss(
        lp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(),
        0.2, kw.get("eps_clip_high") or 0.2, kw.get("dual_clip"), kw.get("behav_imp_weight_cap"),
        kw.get("cap_mode", "mask"), kw.get("cap_level", "token"), seq.tolist())
    assert abs(loss.item() - ref) < 1e-5
    assert abs(stats["clip_frac"] - clip_frac) < 1e-9
    assert stats["n_tokens"] == mask.sum().item()
    if kw.get("behav_imp_weight_cap") and kw.get("cap_mode") == "mask":
        assert stats["behav_masked_frac"] > 0  # the case really exercises the cap


def test_gradient_matches_autograd_of_the_reference_formula():
    lp, prox, behav, adv, mask, _ = _inputs(64, seed=3)
    x = lp.clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(x, prox, behav, adv, mask, eps_clip_high=0.28)
    loss.backward()
    y = lp.clone().requires_grad_()
    u = torch.exp(y - prox)
    pg = torch.maximum(-adv * u, -adv * torch.clamp(u, 0.8, 1.28))
    ref = (pg * torch.exp(prox - behav) * mask).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=1e-5)


def test_plain_ppo_when_prox_is_behaviour():
    lp, _, behav, adv, mask, _ = _inputs(50, seed=1)
    loss, stats = decoupled_ppo_loss(lp, behav, behav, adv, mask)
    assert stats["imp_weight_mean"] == pytest.approx(1.0)
    ref, _ = reference_loss(lp.tolist(), behav.tolist(), behav.tolist(), adv.tolist(),
                            mask.tolist(), 0.2, 0.2, None, None, "mask", "token", None)
    assert loss.item() == pytest.approx(ref, abs=1e-6)


def test_all_masked_batch_gives_zero_not_nan():
    lp, prox, behav, adv, _, _ = _inputs(20)
    x = lp.clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(x, prox, behav, adv, torch.zeros(20), behav_imp_weight_cap=5.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(x.grad).all() and x.grad.abs().sum() == 0
    assert stats["n_tokens"] == 0 and all(math.isfinite(v) for v in stats.values())


def test_masked_tokens_do_not_change_the_normaliser_of_capped_tokens():
    # Capped (masked-by-cap) tokens still count in the denominator, as in AReaL.
    lp = torch.zeros(4)
    behav = torch.tensor([0.0, 0.0, -5.0, -5.0])  # tokens 2, 3: weight e^5 > cap
    adv = torch.ones(4)
    loss, stats = decoupled_ppo_loss(lp, lp, behav, adv, torch.ones(4), behav_imp_weight_cap=5.0)
    assert loss.item() == pytest.approx(-2.0 / 4)
    assert stats["behav_masked_frac"] == pytest.approx(0.5)


def test_bad_arguments_are_refused():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="cap_mode"):
        decoupled_ppo_loss(x, x, x, x, x, cap_mode="drop")
    with pytest.raises(ValueError, match="seq_ids"):
        decoupled_ppo_loss(x, x, x, x, x, cap_level="sequence")
    with pytest.raises(ValueError, match="one shape"):
        decoupled_ppo_loss(x, x, x, torch.zeros(4), x)
    with pytest.raises(ValueError, match="dual_clip"):
        decoupled_ppo_loss(x, x, x, x, x, dual_clip=0.5)


def _ref_grpo(rewards, groups, std_normalize, loo):
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        base = (sum(members) - r) / (len(members) - 1) if loo else mean
        a = r - base
        if std_normalize:
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            a /= std + 1e-6
        out.append(a)
    return out


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("loo", [False, True])
def test_grpo_advantages_equal_the_reference(std_normalize, loo):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randint(0, 3, (23,), generator=g).float().tolist()
    groups = ["a"] * 8 + ["b"] * 8 + ["c"] * 6 + ["solo"]
    adv = grpo_advantages(rewards, groups, std_normalize=std_normalize, leave_one_out=loo)
    ref = _ref_grpo(rewards, groups, std_normalize, loo)
    assert adv.shape == (23,) and adv[-1] == 0.0
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float32), atol=1e-5, rtol=1e-5)


def test_grpo_constant_group_gives_zero_and_bad_input_is_refused():
    adv = grpo_advantages([1.0, 1.0, 1.0, 0.0, 1.0], [0, 0, 0, 1, 1])
    assert torch.equal(adv[:3], torch.zeros(3)) and adv[3] < 0 < adv[4]
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([float("nan"), 1.0], [0, 0])
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        grpo_advantages([0.0, 1.0], [0, 0, 1])


# ------------------------------------------------------------------ registries and splits
def test_registries_hold_exactly_the_names_of_the_spec():
    from laminar_mcore.algos.advantages import registered_advantages
    from laminar_mcore.algos.losses import registered_policy_losses
    from laminar_mcore.algos.spec import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    assert registered_advantages() == ADVANTAGE_ESTIMATORS
    assert registered_policy_losses() == POLICY_LOSSES
    for name in ADVANTAGE_ESTIMATORS:
        assert advantage_fn(name) is get_advantage_fn(name)
    with pytest.raises(ValueError, match="extra greedy"):
        advantage_fn("remax")
    with pytest.raises(KeyError, match="registered"):
        policy_loss_fn("ppo2")


def test_the_default_section_selects_todays_loss_with_todays_options():
    opts = policy_loss_options(AlgoConfig(behav_imp_weight_cap=5.0, dual_clip=3.0))
    assert opts == dict(eps_clip=0.2, eps_clip_high=0.28, dual_clip=3.0, behav_imp_weight_cap=5.0,
                        cap_mode="mask", cap_level="token")
    lp, prox, behav, adv, mask, seq = _inputs(120, seed=7)
    terms, stats = policy_loss_fn("decoupled_ppo")(lp.float(), prox.float(), behav.float(),
                                                   adv.float(), mask, seq_ids=seq, **opts)
    ref_terms, ref_stats = decoupled_ppo_token_terms(lp.float(), prox.float(), behav.float(),
                                                     adv.float(), mask, seq_ids=seq, **opts)
    assert torch.equal(terms, ref_terms) and all(torch.equal(stats[k], v)
                                                 for k, v in ref_stats.items())
    assert AlgoConfig().loss_agg_mode == "token-mean"


@pytest.mark.parametrize("kw, message", [
    (dict(advantage="remax"), "greedy"),
    (dict(advantage="vapo"), "not one of grpo, rloo"),
    (dict(policy_loss="ppo2"), "not one of decoupled_ppo, gspo"),
    (dict(loss_agg_mode="mean"), "not one of token-mean, token-sum"),
    (dict(advantage="rloo", leave_one_out=True), "leave_one_out=true is GRPO's"),
    (dict(advantage="opo", std_normalize=False), "std_normalize=false applies to grpo"),
    (dict(advantage="grpo_passk", n_samples_per_prompt=1), "n_samples_per_prompt >= 2"),
    (dict(policy_loss="sapo"), "set algo.loss_agg_mode=seq-mean-token-mean"),
    (dict(policy_loss="gspo", dual_clip=3.0), "dual_clip bounds"),
    (dict(policy_loss="geo_mean", loss_agg_mode="seq-mean-token-mean",
          behav_imp_weight_cap=5.0), "set algo.cap_level=sequence"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm"), "set algo.loss_scale_factor"),
    (dict(policy_loss="clip_cov", clip_cov_lb=6.0), "clip_cov_lb"),
    (dict(kl_coef=0.1, kl_estimator="k4"), "not one of k1, kl, abs, k2, mse, k3, low_var_kl"),
    (dict(kl_coef=-0.1), "algo.kl_coef=-0.1 must be >= 0"),
    (dict(ref_offload=True), "set algo.kl_coef or algo.ref_offload=false"),
    (dict(entropy_coef=float("nan")), "algo.entropy_coef=nan must be a finite number"),
])
def test_invalid_combinations_are_refused_with_the_fix(kw, message):
    assert any(message in p for p in algo_problems(AlgoConfig(**kw)))
    with pytest.raises(ValueError, match="invalid algo section"):
        policy_loss_options(AlgoConfig(**kw))


def test_estimators_refuse_options_they_do_not_have():
    with pytest.raises(ValueError, match="leave_one_out"):
        advantage_fn("rloo")([0.0, 1.0], [0, 0], leave_one_out=True)
    with pytest.raises(ValueError, match="std_normalize"):
        advantage_fn("gpg")([0.0, 1.0], [0, 0], std_normalize=False)
    with pytest.raises(ValueError, match="lengths"):
        advantage_fn("opo")([0.0, 1.0], [0, 0])
    with pytest.raises(ValueError, match="at least 2 samples"):
        advantage_fn("grpo_passk")([0.0, 1.0, 1.0], [0, 0, 1])


def _sequences(seed, n=9):
    """Per-sequence token tensors as the packer lays them out: a prompt (no loss), a response
    (loss tokens, some holes), a per-sequence advantage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = int(torch.randint(1, 5, (), generator=g))
        response = int(torch.randint(1, 14, (), generator=g))
        t = prompt + response
        mask = torch.cat([torch.zeros(prompt), (torch.rand(response, generator=g) > 0.1).float()])
        behav = -torch.rand(t, generator=g, dtype=torch.float64) * 3
        prox = behav + torch.randn(t, generator=g, dtype=torch.float64) * 0.4
        lp = prox + torch.randn(t, generator=g, dtype=torch.float64) * 0.3
        adv = torch.full((t,), float(torch.randn((), generator=g)), dtype=torch.float64)
        out.append(dict(lp=lp, prox=prox, behav=behav, mask=mask.double(), adv=adv))
    return out


def _emulate_actor(name, mode, seqs, split, leaves, opts, factor):
    """The actor's arithmetic: global counts summed over every micro-batch of every rank, each
    micro-batch's aggregate_terms * num_mb * dp / D, Megatron's schedule dividing by num_mb, DDP
    averaging over DP. Returns (the loss whose gradient the step takes, the reported loss)."""
    fn = policy_loss_fn(name)

    def pack(idxs):  # one micro-batch: its sequences back to back, then 3 padding tokens
        cat = {k: torch.cat([seqs[i][k] for i in idxs] + [torch.zeros(3, dtype=torch.float64)])
               for k in ("prox", "behav", "mask", "adv")}
        cat["lp"] = torch.cat([leaves[i] for i in idxs] + [torch.zeros(3, dtype=torch.float64)])
        cat["seq"] = torch.cat([torch.full((len(seqs[i]["mask"]),), i) for i in idxs]
                               + [torch.full((3,), -1)])
        return cat

    mbs = [[pack(idxs) for idxs in rank] for rank in split]
    tokens = sum(batch_counts(mb["mask"], mb["seq"])[0] for rank in mbs for mb in rank)
    sequences = sum(batch_counts(mb["mask"], mb["seq"])[1] for rank in mbs for mb in rank)
    norm = denominator(mode, tokens, sequences, factor)
    dp, total, reported = len(mbs), 0.0, 0.0
    for rank in mbs:
        num_mb = len(rank)
        for mb in rank:
            terms, _ = fn(mb["lp"], mb["prox"], mb["behav"], mb["adv"], mb["mask"],
                          seq_ids=mb["seq"], **opts)
            loss_sum = aggregate_terms(terms, mb["mask"], mb["seq"], mode)
            total = total + loss_sum * (num_mb * dp / norm) / num_mb / dp
            reported += float(loss_sum) * (1.0 if mode == "token-mean" else tokens / norm)
    return total, reported / tokens


SPLIT_LOSSES = [(n, m) for n in ("decoupled_ppo", "gspo", "cispo", "sapo", "geo_mean")
                for m in (["seq-mean-token-mean"] if n in ("sapo", "geo_mean") else
                          ["token-mean", "token-sum", "seq-mean-token-sum",
                           "seq-mean-token-mean", "seq-mean-token-sum-norm"])]


@pytest.mark.parametrize("name, mode", SPLIT_LOSSES, ids=[f"{n}-{m}" for n, m in SPLIT_LOSSES])
def test_micro_batch_and_dp_split_do_not_change_loss_or_gradient(name, mode):
    seqs = _sequences(11)
    opts = dict(behav_imp_weight_cap=1.5, cap_mode="clamp",
                cap_level="sequence" if name == "geo_mean" else "token")
    opts.update({"sapo": dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05)}.get(
        name, dict(eps_clip=0.2, eps_clip_high=0.28)))
    splits = {"one micro-batch": [[list(range(9))]],
              "nine micro-batches": [[[i] for i in range(9)]],
              "two DP ranks": [[[0, 1], [2, 3, 4]], [[5], [6, 7], [8]]]}
    results = {}
    for label, split in splits.items():
        leaves = [s["lp"].clone().requires_grad_() for s in seqs]
        loss, reported = _emulate_actor(name, mode, seqs, split, leaves, opts, 9.0)
        loss.backward()
        results[label] = (loss.detach(), reported, torch.cat([x.grad for x in leaves]))
    # the whole batch in one call, as verl computes it (tests/test_algos_verl.py)
    flat = {k: torch.cat([s[k] for s in seqs]) for k in ("lp", "prox", "behav", "mask", "adv")}
    seq = torch.cat([torch.full((len(s["mask"]),), i) for i, s in enumerate(seqs)])
    x = flat["lp"].clone().requires_grad_()
    whole, _ = policy_loss(name, x, flat["prox"], flat["behav"], flat["adv"], flat["mask"],
                           seq_ids=seq, loss_agg_mode=mode, loss_scale_factor=9.0, **opts)
    whole.backward()
    assert x.grad.abs().sum() > 0
    for label, (loss, reported, grad) in results.items():
        torch.testing.assert_close(loss.double(), whole.detach().double(), rtol=1e-6, atol=1e-7,
                                   msg=label)
        assert reported == pytest.approx(float(whole), rel=1e-6, abs=1e-7), label
        torch.testing.assert_close(grad.double(), x.grad.double(), rtol=1e-5, atol=1e-7, msg=label)


@pytest.mark.parametrize("name", ["decoupled_ppo", "gspo", "cispo", "sapo", "geo_mean",
                                  "clip_cov", "kl_cov"])
def test_every_loss_gives_zero_not_nan_on_an_all_masked_batch(name):
    lp, prox, behav, adv, _, seq = _inputs(20)
    x = lp.clone().requires_grad_()
    mode = "seq-mean-token-mean" if name in ("sapo", "geo_mean") else "token-mean"
    loss, stats = policy_loss(name, x, prox, behav, adv, torch.zeros(20), seq_ids=seq,
                              loss_agg_mode=mode)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(x.grad).all() and x.grad.abs().sum() == 0
    assert stats["n_tokens"] == 0 and all(math.isfinite(v) for v in stats.values())


def test_validate_config_checks_the_algo_keys():
    from hydra import compose, initialize_config_dir

    from laminar_mcore.config import ConfigError, register_configs, validate_config
    from laminar_mcore.config.paths import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        good = compose(config_name="config", overrides=[
            "algo.advantage=rloo", "algo.policy_loss=gspo",
            "algo.loss_agg_mode=seq-mean-token-mean"])
        bad = compose(config_name="config", overrides=["algo.advantage=remax",
                                                       "algo.policy_loss=sapo"])
    validate_config(good)
    with pytest.raises(ConfigError) as err:
        validate_config(bad)
    assert "extra greedy" in str(err.value) and "set algo.loss_agg_mode=seq-mean" in str(err.value)


def test_demo_aggregation_does_not_scale_an_update_by_the_zero_advantage_tokens_beside_it():
    """The CPU demo's loss (conf/experiment/cpu_demo.yaml): with token-mean, the same two
    learning trajectories give a smaller loss (and gradient) when the zero-advantage
    trajectories sharing their batch are long: the long tail, which laminar's completion-order
    batches get in clumps, dilutes the step. Dr. GRPO's seq-mean-token-sum-norm divides by the
    batch's trajectories times a constant, so the step is the same whatever their length."""
    from hydra import compose, initialize_config_dir

    from laminar_mcore.algos import agg_loss
    from laminar_mcore.config import register_configs
    from laminar_mcore.config.paths import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        algo = compose(config_name="config", overrides=["experiment=cpu_demo"]).algo
    assert algo.loss_agg_mode == "seq-mean-token-sum-norm" and algo.loss_scale_factor == 8

    def batch(tail_len):
        learning = [torch.tensor([0.5, -0.25, 1.0]), torch.tensor([-1.0, 0.75])]
        tail = [torch.zeros(tail_len), torch.zeros(tail_len)]  # zero advantage: loss 0
        seqs = learning + tail
        terms = torch.cat(seqs).requires_grad_()
        ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
        return terms, torch.ones_like(terms, dtype=torch.bool), ids

    def loss(mode, tail_len):
        terms, mask, ids = batch(tail_len)
        return float(agg_loss(terms, mask, ids, mode, loss_scale_factor=8))

    short, long_ = loss("token-mean", 3), loss("token-mean", 150)
    assert short / long_ == pytest.approx((5 + 300) / (5 + 6), rel=1e-6)  # diluted by the tail
    assert loss(algo.loss_agg_mode, 3) == loss(algo.loss_agg_mode, 150) == pytest.approx(1 / 32)
