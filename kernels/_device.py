"""Device checks at the Triton entry points.

A compiled Triton kernel dereferences raw device pointers: handed a host (CPU) tensor it fails
deep in its launcher, or reads garbage. Under ``TRITON_INTERPRET=1`` (decided when the kernels
are defined, at import) Triton's interpreter runs the same kernels on host tensors. Each entry
point calls ``check_devices`` first, which refuses, with the argument's name and device:

* arguments on different devices;
* host tensors when the kernel is compiled (not interpreted);
* in strict device mode (``LAMINAR_KERNEL_STRICT_DEVICE=<device>``, read at import; the CPU
  tests use it), any tensor not on that declared device. The kernel tests then run with
  ``torch.set_default_device("meta")`` (tests/conftest.py), so a tensor a test created without
  ``device=`` -- host memory on a GPU machine -- is refused here on CPU machines too.

Only ``.device`` is read: the checks cost nothing next to a kernel launch.
"""

from __future__ import annotations

import os

import torch

STRICT_ENV = "LAMINAR_KERNEL_STRICT_DEVICE"
_STRICT = torch.device(os.environ[STRICT_ENV]) if os.environ.get(STRICT_ENV) else None


class KernelDeviceError(RuntimeError):
    """A tensor argument of a Triton entry point is on the wrong device."""


def is_interpreted(kernel) -> bool:
    """Whether a ``triton.jit`` kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when it
    was defined) rather than compiled for the GPU."""
    return type(kernel).__name__ == "InterpretedFunction"


def _matches(dev: torch.device, want: torch.device) -> bool:
    return dev.type == want.type and (want.index is None or dev.index == want.index)


def check_devices(where: str, interpreted: bool, **tensors) -> None:
    """Raise ``KernelDeviceError`` unless every tensor in ``tensors`` (name=tensor; None is
    skipped) is on one device that ``where``'s kernel can read."""
    first_name, first = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        dev = t.device
        if _STRICT is not None and not _matches(dev, _STRICT):
            raise KernelDeviceError(
                f"{where}: argument '{name}' is on {dev}, but strict device mode "
                f"({STRICT_ENV}={_STRICT}) declares {_STRICT}: it was created without "
                f"device= (host memory on a GPU machine); create it on the test's device "
                f"fixture (device=kernel_device) or move it there with .to(kernel_device)")
        if first is None:
            first_name, first = name, dev
        elif dev != first:
            raise KernelDeviceError(
                f"{where}: arguments are on different devices: '{first_name}' on {first}, "
                f"'{name}' on {dev}; put every tensor argument on one device (the GPU's)")
    if first is not None and not interpreted and first.type != "cuda":
        raise KernelDeviceError(
            f"{where}: argument '{first_name}' is on {first}, but this Triton kernel is compiled "
            f"for the GPU and cannot read host memory; move the arguments to the GPU (e.g. "
            f"{first_name}.cuda(), or create them with device='cuda'), or set TRITON_INTERPRET=1 "
            f"before importing laminar_mcore.kernels to run Triton's interpreter on the CPU")
