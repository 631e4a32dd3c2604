"""The GPU check's CPU rehearsal: every check of ``bench.gpu`` runs its logic here (gloo for
NCCL, the Triton interpreter at small shapes, the CPU twin of IPC), with Hydra, OmegaConf,
aiohttp, SGLang and Transformer Engine made unimportable -- as on a bare GPU machine -- so that
a run on a GPU can fail only for GPU reasons. Every check says what it exercised and what it did
not (issue 31, item 5)."""

import json
import os
import subprocess
import sys

import pytest
import torch

BLOCKED = ("omegaconf", "hydra", "aiohttp", "sglang", "transformer_engine")
RUN = ("import sys, runpy; "
       f"[sys.modules.__setitem__(m, None) for m in {BLOCKED!r}]; "
       "sys.argv = ['bench.gpu'] + sys.argv[1:]; "
       "runpy.run_module('laminar_mcore.bench.gpu', run_name='__main__')")


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))


@pytest.mark.multiprocess
def test_cpu_rehearsal_runs_every_check_without_hydra_or_sglang(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run("--cpu-rehearsal", "--pytest", "--json", str(out), env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    names = ("kernels", "train_step", "checkpoint", "publish", "staging", "cuda_ipc", "plan",
             "loop")
    assert all(figures[f"{n}_passed"] for n in names) and figures["all_passed"]
    assert figures["mode"] == "cpu_rehearsal" and figures["cuda_ipc_peak_buckets"] == 2
    # --pytest: the tests that compute on the GPU where there is one (pytest -m gpu)
    assert figures["pytest_passed"] and " passed" in figures["pytest_summary"]
    assert "[PASS] pytest -m gpu" in proc.stdout
    assert figures["checkpoint_adam_err"] == 0.0 and figures["train_step_weight_change"] > 0
    # the publisher's delta encoder on the device: the host encoder's bytes (issue 52, item 3)
    assert figures["delta_kernel_equal"] and figures["delta_encoder_device_gb_per_s"] > 0
    assert figures["world_backend"] == "gloo" and figures["cuda_ipc_classes"] == "stand-in"
    for n in names:
        assert f"[PASS] {n}" in proc.stdout
    _assert_coverage(figures, proc.stdout)


CHECKS = ("kernels", "train_step", "checkpoint", "publish", "staging", "cuda_ipc", "plan", "moe",
          "loop")


def _entry(entries, what):
    """The one entry of ``entries`` about ``what`` ("what: how/why")."""
    found = [e for e in entries if e.startswith(f"{what}: ")]
    assert len(found) == 1, (what, entries)
    return found[0]


def _assert_coverage(figures, stdout):
    missed = []
    for n in CHECKS:
        done, nots = figures[f"{n}_exercised"], figures[f"{n}_not_exercised"]
        assert done and all(isinstance(e, str) and ": " in e for e in done + nots), n
        assert figures["coverage"]["checks"][n] == \
            f"exercised {len(done)} / not exercised {len(nots)}"
        for e in done:
            assert f"    exercised: {e}\n" in stdout
        for e in nots:
            assert f"not exercised: {e}\n" in stdout
            assert f"    [{n}] {e}\n" in stdout  # in the closing summary too
        missed += [f"[{n}] {e}" for e in nots]
    # the summary lists every entry not exercised, and nothing else
    assert figures["coverage"]["not_exercised"] == missed and missed
    # the rehearsal is a world of one, on gloo, with one rank holding every optimizer shard
    nots = figures["train_step_not_exercised"]
    assert "world of 1 rank" in _entry(nots, "nccl_multi_rank")
    assert "DP=1" in _entry(nots, "distributed_optimizer_sharding")
    assert "gloo" in _entry(nots, "nccl_backend")
    assert not any(e.startswith("nccl_multi_rank") for e in figures["train_step_exercised"])
    # the reference model (algo.kl_coef): KL 0 on the first step, positive on the second
    assert "k3 KL" in _entry(figures["train_step_exercised"], "reference_model")
    assert "no GPU" in _entry(nots, "reference_offload")
    assert figures["reference_kl_step1"] < 1e-3 < figures["reference_kl_step2"]
    # a second process rebuilt every bucket from the payloads, byte for byte
    assert figures["cuda_ipc_second_process_equal"] is True
    # a shard pull's direct payloads (each rank's own parameters), opened in the engine process
    assert figures["shard_pull_equal"] is True and figures["shard_pull_groups_checked"] == 2
    assert 0.5 <= figures["shard_pull_rank_fraction"] < 0.55
    assert figures["shard_pull_moe_equal"] is True  # an MoE layer's experts at TP2 EP2
    assert 0.5 <= figures["shard_pull_moe_rank_fraction"] < 0.55
    assert figures["cuda_ipc_second_process_buckets"] == figures["publish_buckets"] > 1
    assert figures["cuda_ipc_second_process_device"] == "cpu"
    opened = _entry(figures["cuda_ipc_exercised"], "second_process_open")
    assert f"rebuilt {figures['publish_buckets']} of {figures['publish_buckets']} buckets" in \
        opened and "CPU shared memory" in opened and "bytes equal" in opened
    assert "no GPU" in _entry(figures["cuda_ipc_not_exercised"], "cuda_ipc_handles")
    assert "SGLang not importable" in \
        _entry(figures["cuda_ipc_not_exercised"], "sglang_format_and_patched_reductions")
    # the checkpoint names the Adam Megatron picked (torch's: TE is blocked), and the TE state
    # contract ran on its CPU twin
    optimizer = figures["checkpoint_optimizer_class"]
    assert optimizer in ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")
    assert f"optimizer_class: {optimizer}" in figures["checkpoint_exercised"]
    assert "not importable" in _entry(figures["checkpoint_not_exercised"], "te_fused_adam")
    twin = "laminar_mcore.testing.fused_adam.TEFusedAdamTwin"
    assert figures["checkpoint_te_twin_optimizer_class"] == twin
    assert f"te_fused_adam_state_contract: CPU twin ({twin})" in figures["checkpoint_exercised"]
    assert figures["checkpoint_te_twin_adam_err"] == 0.0
    assert figures["checkpoint_te_twin_next_step_err"] <= 1e-6
    # the publish channel went to a second process over gloo, not NCCL
    assert figures["staging_channel_backend"] == "gloo" and figures["staging_channel_equal"]
    assert "bytes equal" in _entry(figures["staging_exercised"], "publish_channel")
    assert "no GPU" in _entry(figures["staging_not_exercised"], "nccl_publish_channel")
    assert "EP=1" in _entry(figures["moe_not_exercised"], "moe_all_to_all")
    # the plan measured packed attention that keeps no [s, s] scores
    assert figures["measured_unfused_attention_bytes"] == 0 and figures["plan_attention"] == "sdpa"
    # the whole loop (the launcher's processes import Hydra; this one still does not): bf16,
    # saved, resumed from the checkpoint before the last, engines at the trained version
    assert figures["loop_trainer"].startswith("model on cpu in bfloat16, attention sdpa")
    steps = figures["loop_steps"]
    assert figures["loop_books_balance"] and figures["loop_final_version"] == steps
    assert figures["loop_resumed_steps"] == list(range(steps // 2 + 1, steps + 1))
    assert set(figures["loop_final_engine_versions"].values()) == {steps}
    assert len(figures["loop_final_engine_versions"]) == 2
    assert figures["loop_trainer_tokens_per_s"] > 0 and figures["loop_weights_sent_bytes_max"] > 0
    assert figures["loop_publish_channel"] == "shm"  # publish_backend=auto, nothing forced
    assert "shared memory" in _entry(figures["loop_not_exercised"], "nccl_publish_channel")


@pytest.mark.multiprocess
def test_the_two_rank_train_step_rehearses_on_gloo():
    """What ``train_step`` runs with two GPUs (a second world: DP=2 with the distributed
    optimizer), here on gloo: both ranks step, each holds half the optimizer, weights agree."""
    code = ("import json; from laminar_mcore.bench.gpu_checks import train as gpu; "
            "r = gpu._two_rank_train_step(timeout_s=500); "
            "print('RESULT', json.dumps([r, gpu._ranks_agree(r)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore",
                                                TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    ranks, (agree, note) = json.loads(line[len("RESULT "):])
    assert [r["rank"] for r in ranks] == [0, 1] and agree, note
    assert {r["backend"] for r in ranks} == {"gloo"} and {r["dp"] for r in ranks} == {2}
    assert len({r["digest"] for r in ranks}) == 1 and all(r["moved"] > 0 for r in ranks)
    assert sum(r["optimizer_numel"] for r in ranks) >= ranks[0]["model_numel"] > \
        max(r["optimizer_numel"] for r in ranks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_2_saying_so():
    proc = _run()
    assert proc.returncode == 2
    assert "no GPU on this machine" in proc.stderr and "--cpu-rehearsal" in proc.stderr
