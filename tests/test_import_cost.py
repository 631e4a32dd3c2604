"""Megatron-Core's timers import wandb at module level; laminar answers that one import with
ImportError (2 of the 6 CPU-seconds every trainer process spends importing Megatron), and
leaves every other ``import wandb`` -- the run's own wandb logger -- as it was."""

import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json, laminar_mcore, megatron.core.timers as t, wandb; "
         "print(json.dumps([t.wandb is None, wandb.__name__, hasattr(wandb, 'init')]))")


@pytest.mark.parametrize("opt_out", [False, True])
def test_megatron_timers_skip_wandb_and_the_run_still_imports_it(opt_out):
    pytest.importorskip("wandb")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("LAMINAR_MEGATRON_WANDB", None)
    if opt_out:
        env["LAMINAR_MEGATRON_WANDB"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    timers_without_wandb, name, usable = json.loads(out.stdout.strip().splitlines()[-1])
    assert timers_without_wandb is (not opt_out)
    assert name == "wandb" and usable  # the real package, for trainer.loggers=[wandb]
