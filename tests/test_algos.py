"""The decoupled PPO loss and GRPO advantages against hand-written per-token references."""

import math

import pytest
import torch

from laminar_mcore.algos import decoupled_ppo_loss, grpo_advantages


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
