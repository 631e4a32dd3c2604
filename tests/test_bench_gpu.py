"""The GPU check's CPU rehearsal: every check of ``bench.gpu`` runs its logic here (gloo for
NCCL, the Triton interpreter at small shapes, the CPU twin of IPC), with Hydra, OmegaConf,
aiohttp, SGLang and Transformer Engine made unimportable -- as on a bare GPU machine -- so that
a run on a GPU can fail only for GPU reasons."""

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
    proc = _run("--cpu-rehearsal", "--json", str(out), env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    names = ("kernels", "train_step", "checkpoint", "publish", "staging", "cuda_ipc", "plan")
    assert all(figures[f"{n}_passed"] for n in names) and figures["all_passed"]
    assert figures["mode"] == "cpu_rehearsal" and figures["cuda_ipc_peak_buckets"] == 2
    assert figures["checkpoint_adam_err"] == 0.0 and figures["train_step_weight_change"] > 0
    assert figures["world_backend"] == "gloo" and figures["cuda_ipc_classes"] == "stand-in"
    for n in names:
        assert f"[PASS] {n}" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_2_saying_so():
    proc = _run()
    assert proc.returncode == 2
    assert "no GPU on this machine" in proc.stderr and "--cpu-rehearsal" in proc.stderr
