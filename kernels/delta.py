"""Delta compaction where the weights live (issue 52, item 3): the elements of a weight bucket
that changed since the previous version -- their positions and their new bits XOR the old --
found and compacted on the accelerator, so that the host receives and compresses only those
(about 1% of the bytes at RL learning rates) instead of comparing two whole copies in host
memory (0.51 GB/s per stage lead on CPU: ``weights/delta.py``).

Two passes of one program per ``BLOCK`` elements: count each block's changed elements; then,
after an exclusive prefix sum of the counts on the device, each block writes its changed
positions and XORs at its offset, in order (``tl.cumsum`` inside the block). Positions are
int64 (a bucket may hold more than 2**31 elements). ``changes_torch`` is the reference of the
same signature; ``encode`` builds ``weights.delta``'s payload from either: the same bytes as
``weights.delta.encode`` of the same buckets on the host, which ``apply`` rebuilds bit for bit.
``changes_triton`` refuses host tensors unless Triton's interpreter runs it
(``_device.check_devices``).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

from ._device import check_devices, is_interpreted

BLOCK = 1024
_UNITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def changes_torch(new: torch.Tensor, base: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions int64, new ^ base at them) of the elements of ``new`` (an int16 or int32 view
    of a bucket) that differ from ``base``, in increasing order."""
    positions = torch.nonzero(new != base).flatten()
    return positions, new[positions] ^ base[positions]


if triton is not None:

    @triton.jit
    def _block(new_ptr, base_ptr, pid, n, BLOCK: tl.constexpr):
        """Block ``pid``'s (int64 offsets, new, base, changed)."""
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        a = tl.load(new_ptr + offs, mask=inside, other=0)
        b = tl.load(base_ptr + offs, mask=inside, other=0)
        return offs, a, b, (a != b) & inside

    @triton.jit
    def _count_kernel(new_ptr, base_ptr, counts_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        _, _, _, changed = _block(new_ptr, base_ptr, pid, n, BLOCK)
        tl.store(counts_ptr + pid, tl.sum(changed.to(tl.int32), axis=0))

    @triton.jit
    def _compact_kernel(new_ptr, base_ptr, starts_ptr, pos_ptr, xor_ptr, n,
                        BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs, a, b, changed = _block(new_ptr, base_ptr, pid, n, BLOCK)
        ones = changed.to(tl.int32)
        dest = tl.load(starts_ptr + pid) + (tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        tl.store(pos_ptr + dest, offs, mask=changed)
        tl.store(xor_ptr + dest, a ^ b, mask=changed)


_INTERPRETED = triton is not None and is_interpreted(_count_kernel)


def changes_triton(new: torch.Tensor, base: torch.Tensor, dense_above: Optional[int] = None
                   ) -> Tuple[Optional[torch.Tensor], Union[torch.Tensor, int]]:
    """``changes_torch`` by the two kernels (one host sync: the number of changes). With
    ``dense_above``: more changes than that are not compacted (a dense delta sends every
    element's XOR): (None, the count)."""
    if triton is None:
        raise RuntimeError("changes_triton needs Triton (pip install triton); changes_torch "
                           "computes the same on any device")
    check_devices("changes_triton", _INTERPRETED, new=new, base=base)
    if new.shape != base.shape or new.dtype != base.dtype or new.dim() != 1:
        raise ValueError(f"changes_triton needs two flat views of one dtype and size, got "
                         f"{tuple(new.shape)} {new.dtype} and {tuple(base.shape)} {base.dtype}")
    n = new.numel()
    if n == 0:
        return (torch.empty(0, dtype=torch.int64, device=new.device),
                torch.empty(0, dtype=new.dtype, device=new.device))
    blocks = triton.cdiv(n, BLOCK)
    new, base = new.contiguous(), base.contiguous()
    # Triton launches on the current CUDA device: make it the buckets' one
    with torch.cuda.device(new.device) if new.is_cuda else contextlib.nullcontext():
        counts = torch.empty(blocks, dtype=torch.int32, device=new.device)
        _count_kernel[(blocks,)](new, base, counts, n, BLOCK=BLOCK)
        ends = torch.cumsum(counts, 0, dtype=torch.int64)
        total = int(ends[-1])
        if dense_above is not None and total > dense_above:
            return None, total
        positions = torch.empty(total, dtype=torch.int64, device=new.device)
        xor = torch.empty(total, dtype=new.dtype, device=new.device)
        if total:
            _compact_kernel[(blocks,)](new, base, ends - counts, positions, xor, n, BLOCK=BLOCK)
    return positions, xor


def encode(new: torch.Tensor, base: torch.Tensor, unit: int = 2, level: int = 1,
           use_triton: bool = None) -> Tuple[bytes, int]:
    """``weights.delta.encode_counted`` of two buckets (uint8, one size) on any device: the
    changed elements found where the buckets are (Triton on CUDA unless told otherwise) and
    only they copied to the host; a dense delta (more than ``DENSE_FRACTION`` changed) copies
    every element's XOR, as the CPU encoder sends."""
    from ..weights import delta as wdelta

    wdelta.check_pair(new, base, unit)
    a, b = new.view(_UNITS[unit]), base.view(_UNITS[unit])
    use_triton = (a.is_cuda and triton is not None) if use_triton is None else use_triton
    dense_above = int(wdelta.DENSE_FRACTION * a.numel())
    if use_triton:  # counted first: a dense delta is never compacted
        positions, xor = changes_triton(a, b, dense_above)
    else:
        positions, xor = changes_torch(a, b)
    count = xor if positions is None else positions.numel()
    if count > dense_above:
        return wdelta.payload(count, unit, None, _xor_to_host(a, b), level), count
    return wdelta.payload(count, unit, positions.cpu(), xor.cpu(), level), count


def _xor_to_host(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 26) -> torch.Tensor:
    """``(a ^ b)`` in host memory, made ``chunk`` elements at a time where ``a`` lives (a
    dense delta of a large bucket never holds a second whole bucket on the device)."""
    if not a.is_cuda:
        return a ^ b
    out = torch.empty(a.numel(), dtype=a.dtype, device="cpu")
    for i in range(0, a.numel(), chunk):
        out[i:i + chunk].copy_(a[i:i + chunk] ^ b[i:i + chunk])
    return out
