"""The Triton entry points' device checks (kernels/_device.py), and strict device mode: CPU CI
runs the kernel tests under the compiled launcher's rule -- every tensor on the device -- so a
test that would hand host memory to a compiled kernel on a GPU machine fails here too.

In strict mode (``LAMINAR_KERNEL_STRICT_DEVICE=cpu``, see tests/conftest.py) the
``kernel_device`` fixture is the CPU, tensors created without ``device=`` land on "meta", and
the entry points refuse any tensor that is not on the declared device."""

import os
import subprocess
import sys

import pytest
import torch

from laminar_mcore.kernels import _device
from laminar_mcore.kernels import logprobs as klp
from laminar_mcore.kernels import packing as kpack
from laminar_mcore.kernels import ppo as kppo

from .conftest import ROOT

BAD_TEST = '''
import torch

from laminar_mcore.kernels import ppo as kppo


def test_made_on_the_device(kernel_device):
    x = torch.randn(8, device=kernel_device)
    kppo.ppo_terms_triton(x, x, x.abs(), x, torch.ones_like(x))


def test_forgot_device(kernel_device):
    x = torch.randn(8)  # no device=: host memory on a GPU machine
    y = torch.zeros(8, device=kernel_device)
    kppo.ppo_terms_triton(x, y, y, y, y)
'''


def _strict_pytest(args, cwd=ROOT, timeout=180):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")}
    env.update(LAMINAR_KERNEL_STRICT_DEVICE="cpu", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_kernel_tests_pass_in_strict_device_mode():
    out = _strict_pytest(["tests/test_kernels.py"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


def test_strict_device_mode_fails_a_test_that_forgot_device(tmp_path):
    """The check can fail: a kernel test whose input was created without ``device=``."""
    path = tmp_path / "test_bad_kernel_device.py"
    path.write_text(BAD_TEST)
    out = _strict_pytest(["-p", "tests.conftest", "--rootdir", str(tmp_path), str(path)])
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    assert "1 failed, 1 passed" in out.stdout, text[-4000:]
    assert "KernelDeviceError: ppo_terms_triton: argument 'logprobs' is on meta" in text, \
        text[-4000:]
    assert "device=kernel_device" in text


def test_compiled_kernels_refuse_host_tensors():
    x = torch.zeros(4)
    _device.check_devices("f", True, a=x, b=x)  # the interpreter runs on host memory
    with pytest.raises(_device.KernelDeviceError) as err:
        _device.check_devices("f", False, a=x, b=None)
    msg = str(err.value)
    assert "f: argument 'a' is on cpu" in msg and "move" in msg and "TRITON_INTERPRET=1" in msg


def test_arguments_on_mixed_devices_are_refused():
    with pytest.raises(_device.KernelDeviceError, match="'a' on cpu, 'b' on meta"):
        _device.check_devices("f", True, a=torch.zeros(2), b=torch.zeros(2, device="meta"))


def test_every_entry_point_checks_its_arguments(monkeypatch):
    """With compiled kernels (as on a GPU), each entry point refuses host tensors before any
    launch."""
    for mod in (klp, kppo, kpack):
        monkeypatch.setattr(mod, "_INTERPRETED", False)
    x, t, lengths = torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), torch.tensor([2, 1])
    calls = {"logprobs_entropy_triton": lambda: klp.logprobs_entropy_triton(x, t),
             "local_stats_triton": lambda: klp.local_stats_triton(x, t),
             "ppo_terms_triton": lambda: kppo.ppo_terms_triton(t.float(), *[t.float()] * 4),
             "pack_triton": lambda: kpack.pack(torch.zeros(2, 2), lengths, use_triton=True),
             "unpack_triton": lambda: kpack.unpack(torch.zeros(3), lengths, 2, use_triton=True)}
    for name, call in calls.items():
        with pytest.raises(_device.KernelDeviceError, match=f"^{name}: argument '.*' is on cpu"):
            call()
