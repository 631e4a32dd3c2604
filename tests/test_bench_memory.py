"""The capacity plan against the trainer's real Megatron-Core model traced on fake tensors
(bench/memory.py): the MoE recipe's peak stage (the last one, rank 64 of 128, TP4 PP2 EP32) at its
per-rank shapes -- weights, gradients, optimizer state and activations per layer within 15%."""

import json
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
@pytest.mark.parametrize("overrides", [[], ["parallel.expert_tp=2"]], ids=["etp1", "etp2"])
def test_the_moe_recipe_plan_matches_its_traced_model(tmp_path, overrides):
    """As shipped (expert TP 1), and with expert TP 2, where Megatron's dispatcher gathers the
    routed rows over expert TP and reduce-scatters the experts' outputs back."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "laminar_mcore.bench.memory", "--experiment",
                           "qwen3_235b_a22b_math", "--json", str(out), *overrides],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    f = json.loads(out.read_text())
    p = "qwen3_235b_"
    assert (f[f"{p}world"], f[f"{p}rank"], f[f"{p}stage"]) == (128, 64, "last")
    for item in ("weights_gb", "grads_gb", "optimizer_gb", "activation_gb_per_layer"):
        assert f[f"{p}traced_{item}"] > 0 and f[f"{p}error_{item}"] <= 0.15, item
    assert f[f"{p}plan_vs_traced_max_error"] <= 0.15
    # the CPU-only term is measured apart: heads x s x s scores, far above the rest of a layer
    assert f[f"{p}traced_attention_core_gb_per_layer"] > 10 * f[f"{p}traced_activation_gb_per_layer"]
    assert "activation_gb_per_layer" in proc.stdout and "measured apart" in proc.stdout
