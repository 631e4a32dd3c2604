"""The Megatron actor's decoupled-PPO step: the same updated weights at (TP1,PP1,DP1), TP2, PP2
and DP2, whatever the micro-batch split; vocab-parallel log-probs; NaN steps skipped, then a stop."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, tiny_hf_config
from laminar_mcore.testing.dist import run_torchrun

from .conftest import WORKERS

pytestmark = pytest.mark.multiprocess
SCRIPT = os.path.join(WORKERS, "actor_step.py")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("actor1"))
    results = run_torchrun(SCRIPT, 1, ["--layouts", "1x1,1x1-full,1x1-selective,1x1-gspo,1x1-kl,"
                                       "1x1-kl-offload,1x1-zeroadv,1x1-skip,1x1-zeroall,"
                                       "1x1-skipall,1x1-gspo-zeroadv,1x1-gspo-skip",
                                       "--budgets", "4096,40",
                                          "--nan-fault"],
                           out_dir=out, timeout=600)
    return out, results[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("actor2"))
    results = run_torchrun(SCRIPT, 2, ["--layouts", "2x1,1x2,1x1,2x1-sp,1x1-gspo,1x1-kl,1x2-kl,"
                                       "1x1-skip,1x2-skip,1x1-skipall",
                                       "--budgets", "60"],
                           out_dir=out, timeout=600)
    return out, results


def _weights(out, key):
    tensors = {}
    for path in glob.glob(os.path.join(out, f"weights_{key}_pp*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _initial():
    cfg = tiny_hf_config("qwen2")
    return get_adapter(cfg).hf_to_mcore(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 3))


def test_one_step_changes_the_weights_and_reports_stats(single):
    out, result = single
    stats = result["stats"]["1x1@4096"]
    assert stats["skipped"] == 0.0 and stats["version"] == 1.0 and stats["num_microbatches"] == 1
    assert stats["n_tokens"] == stats["global_tokens"] > 0
    assert 0.0 < stats["imp_weight_mean"] and stats["imp_weight_max"] <= 5.0  # cap = 5 (mask)
    assert 0.0 < stats["behav_masked_frac"] < 0.5 and stats["entropy"] > 3.0
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-9)  # pi_theta == pi_prox before the step
    initial, updated = _initial(), _weights(out, "1x1@4096")
    assert set(updated) == set(initial)
    assert max((updated[k] - initial[k]).abs().max().item() for k in initial) > 5e-4


@pytest.mark.parametrize("layout", ["1x1", "1x1-gspo", "1x1-kl"])
def test_microbatch_split_does_not_change_the_update(single, layout):
    """Also for a verl loss aggregated per sequence (GSPO, RLOO, seq-mean-token-mean): the
    sequence count is the whole batch's, so the split does not change the loss; and with the
    entropy bonus and the KL penalty against the reference (two steps)."""
    out, result = single
    a, b = result["stats"][f"{layout}@4096"], result["stats"][f"{layout}@40"]
    assert b["num_microbatches"] > 3
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    ref, split = _weights(out, f"{layout}@4096"), _weights(out, f"{layout}@40")
    for name in ref:
        torch.testing.assert_close(split[name], ref[name], atol=1e-5, rtol=0)
    if layout == "1x1-gspo":  # a different objective from the default's
        assert a["grad_norm"] != pytest.approx(result["stats"]["1x1@4096"]["grad_norm"], rel=1e-3)


def test_a_verl_loss_gives_the_same_update_at_dp2(single, pair):
    out1, result1 = single
    out2, results2 = pair
    ref = _weights(out1, "1x1-gspo@4096")
    updated = _weights(out2, "1x1-gspo@60")
    for name in ref:
        torch.testing.assert_close(updated[name], ref[name], atol=1e-5, rtol=0)
    for r in results2:
        assert r["stats"]["1x1-gspo@60"]["loss"] == pytest.approx(
            result1["stats"]["1x1-gspo@4096"]["loss"], abs=1e-6)


def test_kl_penalty_and_entropy_bonus_against_the_frozen_reference(single):
    """algo.kl_coef=0.5 (k3) and algo.entropy_coef=0.01: the first step's KL is 0 (the policy
    is the reference), the second's is the token mean of k3(pi_theta, pi_ref) over the batch,
    computed outside the actor from the reference pass and a fresh actor on the initial
    weights; the loss is pg_loss - 0.01 entropy + 0.5 KL; offloading changes nothing."""
    _, result = single
    for lever in ("kl", "kl-offload"):
        for budget in (4096, 40):
            key = f"1x1-{lever}@{budget}"
            first, second = result["stats"][key + "#1"], result["stats"][key]
            check = result[f"ref_check_{key}"]
            assert check["ref_equal_initial"] is True and check["ref_params_frozen"] is True
            assert first["kl_loss"] == pytest.approx(0.0, abs=1e-9)
            assert second["kl_loss"] > 1e-3
            assert second["kl_loss"] == pytest.approx(check["kl_sum"] / check["n_tokens"],
                                                      rel=1e-5)
            for stats in (first, second):
                assert stats["entropy_loss"] == pytest.approx(stats["entropy"], rel=1e-12)
                assert stats["loss"] == pytest.approx(
                    stats["pg_loss"] - 0.01 * stats["entropy_loss"] + 0.5 * stats["kl_loss"],
                    rel=1e-6, abs=1e-9)  # fp32 sums
    assert "kl_loss" not in result["stats"]["1x1@4096"]
    assert "entropy_loss" not in result["stats"]["1x1@4096"]
    # on CPU the offloaded reference is where the actor is: the same numbers, bit for bit
    out = single[0]
    a, b = _weights(out, "1x1-kl@4096"), _weights(out, "1x1-kl-offload@4096")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kl_penalty_gives_the_same_update_at_dp2_and_pp2(single, pair):
    out1, result1 = single
    out2, results2 = pair
    ref = _weights(out1, "1x1-kl@4096")
    for layout in ("1x1-kl", "1x2-kl"):  # DP2, PP2
        updated = _weights(out2, f"{layout}@60")
        for name in ref:
            torch.testing.assert_close(updated[name], ref[name], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{layout} {name}: {m}")
        for r in results2:
            assert r["stats"][f"{layout}@60"]["kl_loss"] == pytest.approx(
                result1["stats"]["1x1-kl@4096"]["kl_loss"], rel=1e-5)


def test_tp2_pp2_dp2_give_the_same_update(single, pair):
    out1, result1 = single
    out2, results2 = pair
    ref = _weights(out1, "1x1@4096")
    ref_stats = result1["stats"]["1x1@4096"]
    # In a world of 2, "1x1" is DP=2 (Megatron's distributed optimizer shards Adam over it).
    # "2x1-sp": sequence parallelism, on CPU through the compatibility layer's SP norm.
    for layout in ("2x1", "1x2", "1x1", "2x1-sp"):
        updated = _weights(out2, f"{layout}@60")
        assert set(updated) == set(ref), layout
        for name in ref:
            torch.testing.assert_close(updated[name], ref[name], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{layout} {name}: {m}")
        for r in results2:
            stats = r["stats"][f"{layout}@60"]
            assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
            assert stats["n_tokens"] == ref_stats["n_tokens"]


def test_skipping_zero_advantage_trajectories_gives_the_whole_batchs_update(single, pair):
    """trainer.skip_zero_advantage: two of four groups got one reward for every sample, so
    their advantage is 0 and they are not run; the update, the loss and the gradient norm are
    the whole batch's (their tokens stay in the denominator), at DP1, DP2 and PP2 and at any
    micro-batch split; also with GSPO's per-sequence aggregation, whose denominator counts the
    skipped sequences. A batch with no advantage anywhere still makes its optimizer step, at DP1
    and DP2 (one trajectory kept per DP rank)."""
    out1, result1 = single
    out2, results2 = pair
    for loss in ("", "gspo-"):
        ref = _weights(out1, f"1x1-{loss}zeroadv@4096")
        ref_stats = result1["stats"][f"1x1-{loss}zeroadv@4096"]
        assert "skipped_tokens" not in ref_stats
        runs = [(_weights(out1, f"1x1-{loss}skip@{b}"), result1["stats"][f"1x1-{loss}skip@{b}"])
                for b in ((4096, 40) if not loss else (4096,))]
        runs += [(_weights(out2, f"{layout}@60"), r["stats"][f"{layout}@60"])
                 for layout in (("1x1-skip", "1x2-skip") if not loss else ()) for r in results2]
        for updated, stats in runs:
            for name in ref:  # Adam's normalised step: fp32 sums in another order, 1e-6
                torch.testing.assert_close(updated[name], ref[name], atol=1e-5, rtol=0)
            assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
            assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-7)
            assert stats["global_tokens"] == ref_stats["global_tokens"]
            assert 0 < stats["skipped_tokens"] < stats["global_tokens"]
            assert stats["n_tokens"] == ref_stats["n_tokens"] - stats["skipped_tokens"]
    assert result1["stats"]["1x1-skip@40"]["num_microbatches"] < \
        result1["stats"]["1x1-zeroadv@40"]["num_microbatches"]
    # no advantage anywhere: the gradient is 0, one trajectory per DP rank is run, the step is
    # taken (the version moves on, as it does for the whole batch)
    none = result1["stats"]["1x1-zeroall@4096"]
    assert none["version"] == 1.0 and none["grad_norm"] == 0.0
    for stats in [result1["stats"]["1x1-skipall@4096"]] + [r["stats"]["1x1-skipall@60"]
                                                           for r in results2]:
        assert stats["version"] == 1.0 and stats["skipped"] == 0.0 and stats["grad_norm"] == 0.0
        assert 0 < stats["n_tokens"] < none["n_tokens"]
        assert stats["n_tokens"] + stats["skipped_tokens"] == none["global_tokens"]


def test_an_evaluation_snapshot_holds_the_trained_weights_at_every_layout(single, pair):
    """trainer.eval_offline's snapshot (export.save_snapshot): a Hugging Face directory whose
    tensors, read back through the model family's adapter, are the trained weights bit for bit
    at TP1, TP2, PP2 and DP2, its stages' small shards gathered under one index."""
    import json

    from laminar_mcore.models.hf import SAFETENSORS_INDEX, load_hf_config, load_hf_state_dict
    from laminar_mcore.weights.snapshots import list_snapshots

    cfg = tiny_hf_config("qwen2")
    runs = [(single[0], "1x1@4096")] + [(pair[0], f"{k}@60") for k in ("2x1", "1x2", "1x1")]
    for out, key in runs:
        snap = os.path.join(out, f"snap_{key}")
        meta = json.load(open(os.path.join(snap, "laminar_snapshot.json")))
        assert meta == {"step": 1, "version": 1}
        index = json.load(open(os.path.join(snap, SAFETENSORS_INDEX)))
        assert len(set(index["weight_map"].values())) > 2  # 64 KiB shards, several per stage
        assert not [f for f in os.listdir(snap) if f.startswith("stage_")]
        assert load_hf_config(snap).num_hidden_layers == cfg.num_hidden_layers
        got = get_adapter(cfg).hf_to_mcore(cfg, load_hf_state_dict(snap))
        want = _weights(out, key)
        assert set(got) == set(want), key
        assert all(torch.equal(got[k], want[k]) for k in want), key
    assert not os.path.exists(os.path.join(pair[0], "snap_1x2@60.partial"))
    import shutil

    root = os.path.join(pair[0], "eval_snapshots")
    os.makedirs(os.path.join(root, "step_000007.partial"))  # being written: not listed
    shutil.copytree(os.path.join(pair[0], "snap_1x2@60"), os.path.join(root, "step_000001"))
    assert list_snapshots(pair[0]) == [(1, 1, os.path.abspath(os.path.join(root, "step_000001")))]


def test_activation_recompute_does_not_change_the_update(single):
    out, result = single
    ref = _weights(out, "1x1@4096")
    for lever in ("full", "selective"):
        updated = _weights(out, f"1x1-{lever}@4096")
        for name in ref:
            torch.testing.assert_close(updated[name], ref[name], atol=1e-6, rtol=0)
        assert result["stats"][f"1x1-{lever}@4096"]["grad_norm"] == pytest.approx(
            result["stats"]["1x1@4096"]["grad_norm"], rel=1e-6)


def test_vocab_parallel_logprobs_match_the_full_vocabulary(pair):
    _, results = pair
    for r in results:
        check = r["vocab_parallel_check"]
        assert check["lp"] < 1e-5 and check["entropy"] < 1e-5 and check["grad"] < 1e-5
        if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
            assert check["triton_lp"] < 1e-5 and check["triton_entropy"] < 1e-5
            assert check["triton_grad"] < 1e-5


def test_nonfinite_steps_are_skipped_then_stop_the_run(single):
    _, result = single
    assert result["nan_first"] == {"skipped": 1.0, "version": 0}
    assert result["nan_weights_unchanged"] is True
    assert "2 consecutive steps had a non-finite loss" in result["nan_error"]
    assert "trainer.max_consecutive_nonfinite" in result["nan_error"]
