"""Training checkpoints: a run resumed at step k matches the uninterrupted run's next steps;
an interrupted save is never picked; a layout change is refused with a clear message."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from laminar_mcore.testing.dist import TorchrunError, run_torchrun
from laminar_mcore.trainer.checkpoint import latest_complete, resolve_resume

from .conftest import WORKERS

SCRIPT = os.path.join(WORKERS, "resume.py")


@pytest.mark.multiprocess
def test_resume_matches_the_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full_out, resumed_out = tmp_path / "full", tmp_path / "resumed"
    full_out.mkdir(), resumed_out.mkdir()
    full = run_torchrun(SCRIPT, 2, ["--ckpt", ckpt, "--save-at", "2"], out_dir=str(full_out))
    assert latest_complete(ckpt).endswith("step_00000002")
    # A later save that was interrupted: its directory exists, its completion marker does not.
    shutil.copytree(latest_complete(ckpt), os.path.join(ckpt, "step_00000003.partial"))
    os.makedirs(os.path.join(ckpt, "step_00000004"))
    resumed = run_torchrun(SCRIPT, 2, ["--ckpt", ckpt, "--resume", "auto"], out_dir=str(resumed_out))
    r = resumed[0]
    assert r["resumed_from"].endswith("step_00000002") and r["start"] == 2
    assert r["extra"] == {"prompt_pool_position": 6} and r["version"] == 4
    for step in ("3", "4"):
        a, b = full[0]["losses"][step], r["losses"][step]
        assert abs(a["loss"] - b["loss"]) <= 1e-5, step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["lr"] == pytest.approx(b["lr"])
    wa, wb = load_file(full_out / "final.safetensors"), load_file(resumed_out / "final.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0)

    with pytest.raises(TorchrunError, match="saved at layout"):
        run_torchrun(SCRIPT, 1, ["--tp", "1", "--ckpt", ckpt, "--resume", "auto"],
                     out_dir=str(tmp_path))


def test_resume_setting_is_checked(tmp_path):
    assert resolve_resume("none", str(tmp_path)) is None
    assert resolve_resume("auto", str(tmp_path / "missing")) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path), str(tmp_path))
