"""Training checkpoints: a run resumed at step k matches the uninterrupted run's next steps
(weights and Adam's moments, with Megatron's distributed optimizer); the DP size may change;
an interrupted save is never picked; a TP change is refused with a clear message."""

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from laminar_mcore.data.checkpoints import latest_complete, resolve_resume
from laminar_mcore.testing.dist import rank_output_path, run_torchrun

from .conftest import WORKERS

SCRIPT = os.path.join(WORKERS, "resume.py")


@pytest.mark.multiprocess
def test_resume_matches_the_uninterrupted_run(tmp_path):
    """The distributed optimizer at DP2: three steps, save, resume, two steps equal the
    uninterrupted run -- losses, weights and Adam's moments; a resume at DP1 from the DP2
    checkpoint trains on; a resume at another TP is refused, naming the fix, unless the
    optimizer was saved fully_reshardable."""
    ckpt = str(tmp_path / "ckpt")
    out = {name: tmp_path / name for name in ("full", "resumed", "dp1", "tp2")}
    for path in out.values():
        path.mkdir()
    common = ["--tp", "1", "--steps", "5", "--ckpt", ckpt]
    anywhere = str(tmp_path / "fully_reshardable")
    full = run_torchrun(SCRIPT, 2, common + ["--save-at", "3", "--also-fully-reshardable", anywhere],
                        out_dir=str(out["full"]))
    assert latest_complete(ckpt).endswith("step_00000003")
    saved = os.listdir(latest_complete(ckpt))
    assert {"model", "optimizer", "rng", "trainer_state.json"} <= set(saved)
    assert not [n for n in saved if n.endswith(".pt")]  # no pickles
    # A later save that was interrupted: its directory exists, its completion marker does not.
    shutil.copytree(latest_complete(ckpt), os.path.join(ckpt, "step_00000004.partial"))
    os.makedirs(os.path.join(ckpt, "step_00000005"))
    # Three resumes in one launch, each building its actor anew in the same world: at DP2 as
    # saved; where Megatron picks TE's FusedAdam; at TP2 (below).
    (tmp_path / "te").mkdir()
    run_torchrun(SCRIPT, 2, common + [
        "--resume", "auto", "--out", str(out["resumed"]), "--next",
        *common, "--resume", "auto", "--optimizer", "te", "--out", str(tmp_path / "te"), "--next",
        "--tp", "2", "--steps", "5", "--ckpt", anywhere, "--resume", "auto", "--sharding",
        "fully_reshardable", "--refused", ckpt], out_dir=str(out["tp2"]))
    resumed = _rank_results(out["resumed"])
    r = resumed[0]
    assert r["resumed_from"].endswith("step_00000003") and r["start"] == 3
    assert r["extra"] == {"prompt_pool_position": 9} and r["version"] == 5
    for step in ("4", "5"):
        a, b = full[0]["losses"][step], r["losses"][step]
        assert abs(a["loss"] - b["loss"]) <= 1e-6, step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        assert a["lr"] == pytest.approx(b["lr"])
    assert full[0]["losses"]["4"]["lr"] > 0  # step 4 moves the weights
    wa, wb = load_file(out["full"] / "final.safetensors"), load_file(out["resumed"] / "final.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)
    for rank in (0, 1):  # each DP rank's shard of Adam's state
        ma = load_file(out["full"] / f"adam_rank{rank}.safetensors")
        mb = load_file(out["resumed"] / f"adam_rank{rank}.safetensors")
        assert ma.keys() == mb.keys() and any(k.endswith("exp_avg_sq") for k in ma)
        for key in ma:
            torch.testing.assert_close(ma[key], mb[key], atol=1e-7, rtol=1e-5, msg=key)

    # The same checkpoint resumed where Megatron picks TE's FusedAdam (its TE extension was
    # broken when the run started): the step saved by torch's Adam (a float) becomes the
    # group's int step, which TE's kernel binding requires.
    for rank in _rank_results(tmp_path / "te"):
        assert rank["start"] == 3 and rank["optimizer_class"] == ["TEFusedAdamTwin"]
        assert set(rank["group_steps"]) == {5}
        assert abs(rank["losses"]["4"]["loss"] - full[0]["losses"]["4"]["loss"]) <= 1e-5

    dp1 = run_torchrun(SCRIPT, 1, common + ["--resume", "auto"], out_dir=str(out["dp1"]))[0]
    _assert_continues(full[0], wa, dp1, out["dp1"])

    # At TP2 the dp_reshardable checkpoint is refused (before anything is loaded: the same
    # process then resumes); saved fully_reshardable, the optimizer state reshards over TP as
    # well: TP1 x DP2 -> TP2.
    tp2 = _rank_results(out["tp2"])[0]
    assert "reshards over DP only" in tp2["refused"][ckpt]
    _assert_continues(full[0], wa, tp2, out["tp2"])


@pytest.mark.multiprocess
def test_bf16_resume_matches_the_uninterrupted_run(tmp_path):
    """What every checkpoint save on a GPU hit: a bf16 model (Qwen2 with its QKV bias, Qwen3
    with its QK norms) under the distributed optimizer at DP2, saved in both formats and
    resumed: the next two steps equal the uninterrupted run bit for bit -- losses, weights,
    Adam's moments. (Before every parameter was cast, the norms stayed fp32, the no-weight-decay
    group mixed dtypes and the save asserted.)"""
    runs = [(family, sharding) for family in ("qwen2", "qwen3")
            for sharding in ("dp_reshardable", "fully_reshardable")]
    full, resumed = [], []
    for family, sharding in runs:
        common = ["--tp", "1", "--steps", "5", "--dtype", "bf16", "--family", family,
                  "--sharding", sharding, "--ckpt", str(tmp_path / f"ckpt_{family}_{sharding}")]
        for kind, extra, argv in (("full", ["--save-at", "3"], full),
                                  ("resumed", ["--resume", "auto"], resumed)):
            out = tmp_path / f"{kind}_{family}_{sharding}"
            out.mkdir()
            argv += [*common, *extra, "--out", str(out), "--next"]
    # (run_torchrun adds --out of its own: the last run's)
    last = runs[-1]
    run_torchrun(SCRIPT, 2, full[:-3], out_dir=str(tmp_path / f"full_{last[0]}_{last[1]}"))
    run_torchrun(SCRIPT, 2, resumed[:-3], out_dir=str(tmp_path / f"resumed_{last[0]}_{last[1]}"))
    for family, sharding in runs:
        full_dir = tmp_path / f"full_{family}_{sharding}"
        resumed_dir = tmp_path / f"resumed_{family}_{sharding}"
        for a, b in zip(_rank_results(full_dir), _rank_results(resumed_dir)):
            assert b["resumed_from"].endswith("step_00000003") and b["start"] == 3
            assert [b["losses"][s]["loss"] for s in ("4", "5")] == \
                [a["losses"][s]["loss"] for s in ("4", "5")], (family, sharding)
        wa = load_file(full_dir / "final.safetensors")
        wb = load_file(resumed_dir / "final.safetensors")
        assert {t.dtype for t in wa.values()} == {torch.bfloat16}
        assert any("layernorm" in name or "norm" in name for name in wa)
        for name in wa:
            assert torch.equal(wa[name], wb[name]), (family, sharding, name)
        for rank in (0, 1):
            ma = load_file(full_dir / f"adam_rank{rank}.safetensors")
            mb = load_file(resumed_dir / f"adam_rank{rank}.safetensors")
            assert ma.keys() == mb.keys() and any(k.endswith("exp_avg_sq") for k in ma)
            for key in ma:
                assert torch.equal(ma[key], mb[key]), (family, sharding, key)


def _assert_continues(full, full_weights, resumed, resumed_dir):
    """A run resumed at another layout from step 3 continues the uninterrupted one (1e-5)."""
    assert resumed["start"] == 3 and resumed["version"] == 5
    for step in ("4", "5"):
        assert abs(full["losses"][step]["loss"] - resumed["losses"][step]["loss"]) <= 1e-5, step
    weights = load_file(resumed_dir / "final.safetensors")
    for name in full_weights:
        torch.testing.assert_close(full_weights[name], weights[name], atol=1e-5, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_resume_at_ep2_matches_the_uninterrupted_run(tmp_path):
    """Qwen3-MoE at EP2 (4 experts per rank, the experts' Adam state on their own ranks): save
    at step 3, resume, steps 4-5 equal the uninterrupted run (losses, weights with every
    expert, Adam's moments); a resume at EP1 from the dp_reshardable checkpoint is refused
    naming the EP it was saved at; so is one saved fully_reshardable, whose optimizer state
    Megatron-Core keeps in two chained optimizers (dense, experts) at EP2 and one at EP1."""
    ckpt, anywhere = str(tmp_path / "ckpt"), str(tmp_path / "anywhere")
    out = {name: tmp_path / name for name in ("full", "resumed", "ep1")}  # ep1: refused
    for path in out.values():
        path.mkdir()
    common = ["--family", "qwen3_moe", "--tp", "1", "--steps", "5"]
    full = run_torchrun(SCRIPT, 2, common + ["--ep", "2", "--ckpt", ckpt, "--save-at", "3",
                                             "--also-fully-reshardable", anywhere],
                        out_dir=str(out["full"]))
    # the resume, then (in the same world, its actor built anew) the refused ones at EP1
    run_torchrun(SCRIPT, 2, common + [
        "--ep", "2", "--ckpt", ckpt, "--resume", "auto", "--out", str(out["resumed"]), "--next",
        *common, "--ep", "1", "--no-train", "--ckpt", str(tmp_path / "none"), "--refused",
        f"{ckpt},{anywhere}"], out_dir=str(out["ep1"]))
    r = _rank_results(out["resumed"])[0]
    assert r["start"] == 3 and r["version"] == 5
    for step in ("4", "5"):
        assert abs(full[0]["losses"][step]["loss"] - r["losses"][step]["loss"]) <= 1e-6, step
    wa, wb = load_file(out["full"] / "final.safetensors"), load_file(out["resumed"] / "final.safetensors")
    assert sum("local_experts" in n for n in wa) == 4 * 8 * 2
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0, msg=name)
    for rank in (0, 1):
        ma = load_file(out["full"] / f"adam_rank{rank}.safetensors")
        mb = load_file(out["resumed"] / f"adam_rank{rank}.safetensors")
        assert ma.keys() == mb.keys()
        for key in ma:
            torch.testing.assert_close(ma[key], mb[key], atol=1e-7, rtol=1e-5, msg=key)
    for rank in _rank_results(out["ep1"]):
        assert re.search(r"ep=2 \(any DP size\)", rank["refused"][ckpt])
        assert re.search(r"2 chained optimizers .* this run has 1 \(ep=1\)",
                         rank["refused"][anywhere])


def test_resume_setting_is_checked(tmp_path):
    assert resolve_resume("none", str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path / "missing")) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path), str(tmp_path))


@pytest.mark.multiprocess
def test_resume_with_the_fused_adam_megatron_picks_on_gpu_machines(tmp_path):
    """With Transformer Engine (or Apex) importable, Megatron's Adam is that package's FusedAdam,
    which keeps its step in the param groups and (TE) refuses any other state key. The DP2
    save/resume round trip with a CPU twin of that optimizer, selected as Megatron selects it,
    equals the uninterrupted run bit for bit: losses, weights, moments and the groups' step; and
    TE's checkpoint resumes on torch's Adam. (Both kinds' runs share one launch, their resumes
    another: each run builds its actor anew in the same world.)"""
    dirs = {}
    full, resumed = [], []
    for kind in ("te", "apex"):
        ckpt = str(tmp_path / f"ckpt_{kind}")
        dirs[kind] = (tmp_path / f"full_{kind}", tmp_path / f"resumed_{kind}")
        for d in dirs[kind]:
            d.mkdir()
        common = ["--tp", "1", "--steps", "5", "--ckpt", ckpt, "--optimizer", kind]
        full += [*common, "--save-at", "3", "--out", str(dirs[kind][0]), "--next"]
        resumed += [*common, "--resume", "auto", "--out", str(dirs[kind][1]), "--next"]
    (tmp_path / "torch").mkdir()  # TE's checkpoint resumed on torch's Adam: every parameter's own step
    resumed += ["--tp", "1", "--steps", "5", "--ckpt", str(tmp_path / "ckpt_te"), "--resume",
                "auto", "--out", str(tmp_path / "torch")]
    # (run_torchrun adds --out of its own: the last run's)
    run_torchrun(SCRIPT, 2, full[:-1], out_dir=str(dirs["apex"][0]))
    run_torchrun(SCRIPT, 2, resumed, out_dir=str(tmp_path / "torch"))
    for kind in ("te", "apex"):
        full_dir, resumed_dir = dirs[kind]
        twin = {"te": "TEFusedAdamTwin", "apex": "ApexFusedAdamTwin"}[kind]
        for a, b in zip(_rank_results(full_dir), _rank_results(resumed_dir)):
            assert a["optimizer_class"] == b["optimizer_class"] == [twin]
            assert b["start"] == 3 and b["version"] == 5
            assert a["group_steps"] == b["group_steps"] and set(a["group_steps"]) == {5}
            assert [b["losses"][s]["loss"] for s in ("4", "5")] == \
                [a["losses"][s]["loss"] for s in ("4", "5")]
        wa = load_file(full_dir / "final.safetensors")
        wb = load_file(resumed_dir / "final.safetensors")
        assert wa.keys() == wb.keys()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name
        for rank in (0, 1):
            ma = load_file(full_dir / f"adam_rank{rank}.safetensors")
            mb = load_file(resumed_dir / f"adam_rank{rank}.safetensors")
            assert ma.keys() == mb.keys() and not any(k.endswith(".step") for k in ma)
            for key in ma:
                assert torch.equal(ma[key], mb[key]), key
    back = _rank_results(tmp_path / "torch")
    assert back[0]["start"] == 3 and back[0]["optimizer_class"] == ["AdamW"]
    for rank in (0, 1):
        steps = {k: v for k, v in load_file(tmp_path / "torch" / f"adam_rank{rank}"
                                            ".safetensors").items() if k.endswith(".step")}
        assert steps and all(v.item() == 5 for v in steps.values())


def _rank_results(out_dir, nproc=2):
    import json

    return [json.loads(rank_output_path(out_dir, r).read_text()) for r in range(nproc)]


def test_the_te_twin_refuses_a_step_in_parameter_state_as_te_does():
    """The twin is faithful where the old resume broke: TE's FusedAdam looks every state key up
    in name_to_dtype_map, so a torch-style per-parameter ``step`` is a KeyError both ways."""
    from laminar_mcore.testing.fused_adam import TEFusedAdamTwin

    p = torch.nn.Parameter(torch.ones(3))
    opt = TEFusedAdamTwin([p], lr=0.1)
    p.grad = torch.full((3,), 0.5)
    opt.step()
    assert opt.param_groups[0]["step"] == 1 and set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}
    sd = opt.state_dict()
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.0)
    ref.param_groups[0]["params"][0].grad = torch.full((3,), 0.5)
    ref.step()  # the same arithmetic as torch's AdamW at weight decay 0
    torch.testing.assert_close(p.data, ref.param_groups[0]["params"][0].data, rtol=0, atol=1e-7)
    opt.state[p]["step"] = torch.tensor(1.0)
    with pytest.raises(KeyError, match="step"):
        opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(1.0)
    with pytest.raises(KeyError, match="step"):
        opt.load_state_dict(sd)
