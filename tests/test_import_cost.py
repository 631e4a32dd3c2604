"""Megatron-Core's timers import wandb at module level; laminar answers that one import with
ImportError (2 of the 6 CPU-seconds every trainer process spends importing Megatron), and
leaves every other ``import wandb`` -- the run's own wandb logger -- as it was."""

import json
import os
import subprocess
import sys

import pytest

def _probe(code: str, opt_out_var: str, opt_out: bool):
    """Run ``code`` in a fresh interpreter, ``opt_out_var=1`` set or not; its last line as JSON."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop(opt_out_var, None)
    if opt_out:
        env[opt_out_var] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = ("import json, laminar_mcore, megatron.core.timers as t, wandb; "
         "print(json.dumps([t.wandb is None, wandb.__name__, hasattr(wandb, 'init')]))")


@pytest.mark.parametrize("opt_out", [False, True])
def test_megatron_timers_skip_wandb_and_the_run_still_imports_it(opt_out):
    pytest.importorskip("wandb")
    timers_without_wandb, name, usable = _probe(PROBE, "LAMINAR_MEGATRON_WANDB", opt_out)
    assert timers_without_wandb is (not opt_out)
    assert name == "wandb" and usable  # the real package, for trainer.loggers=[wandb]


LAZY_PROBE = """
import json, sys, torch
import laminar_mcore
from laminar_mcore.import_cost import lazy_compile
from laminar_mcore.trainer.model import build_gpt_model
import megatron.core.jit as jit, megatron.core.fusions.fused_bias_swiglu as swiglu
from megatron.core.transformer.moe.router import InferenceTopKRouter
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules,
                  "jit_fuser_lazy": jit.jit_fuser is lazy_compile,
                  "torch_compile_restored": torch.compile is not lazy_compile,
                  "swiglu_lazy": getattr(swiglu.bias_swiglu, "__laminar_lazy_compile__", False),
                  "router_lazy": getattr(InferenceTopKRouter._compiled_topk_routing,
                                         "__laminar_lazy_compile__", False)}))
"""


@pytest.mark.parametrize("opt_out", [False, True])
def test_megatron_compiles_its_fusions_at_first_call_not_at_import(opt_out):
    """Megatron's import-time ``torch.compile`` (jit_fuser, the MoE router) is deferred to the
    function's first call: importing the trainer pulls in neither TorchDynamo nor Inductor;
    ``LAMINAR_MEGATRON_EAGER_COMPILE=1`` leaves Megatron's imports as they are."""
    seen = _probe(LAZY_PROBE, "LAMINAR_MEGATRON_EAGER_COMPILE", opt_out)
    assert seen["torch_compile_restored"]  # only Megatron's own modules ran with the lazy one
    assert seen == {"dynamo": opt_out, "jit_fuser_lazy": not opt_out, "torch_compile_restored": True,
                    "swiglu_lazy": not opt_out, "router_lazy": not opt_out}


def test_lazy_compile_is_torch_compile_with_the_same_arguments_at_the_first_call():
    """The deferred function compiles once, through the backend and options it was given, and
    computes what the function computes."""
    import torch

    from laminar_mcore.import_cost import lazy_compile

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(len(example_inputs))
        return gm.forward

    def f(x, y):
        return torch.nn.functional.gelu(x + y) * 2

    lazy = lazy_compile(backend=backend, dynamic=False)(f)
    assert graphs == [] and lazy.__wrapped__ is f
    x, y = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(lazy(x, y), f(x, y)) and graphs == [2]
    assert torch.equal(lazy(x, y), f(x, y)) and graphs == [2]  # compiled once
    torch._dynamo.reset()
