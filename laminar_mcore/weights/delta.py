"""Delta publication: a weight bucket sent as what changed since the previous version.

At RL learning rates most 16-bit weights are bit-identical from one step to the next (Adam's
update is below one bf16 ulp for most elements), so a version can travel as the positions of
the changed elements and their new bits. The format of one bucket's delta (``CODEC``):

    zstd( count (uint64) | unit (uint8) | layout (uint8) | body )
    sparse body (layout 0): gaps as uint32, byte planes | xor as unit bytes, byte planes
    dense body (layout 1): every element's xor, byte planes

* the bucket is read as ``unit``-byte elements (2 for bf16/fp16 buckets, 4 for fp32);
* ``gaps``: the changed positions, each the distance from the previous one (the first from
  -1), so they are small numbers; ``xor``: new bits XOR base bits of each changed element
  (a one-ulp change leaves only low bits set). Both are stored as byte planes (all first bytes,
  then all second bytes, ...), which zstd compresses far better than interleaved bytes. When
  more than ``DENSE_FRACTION`` of the elements changed, listing positions costs more than it
  saves: the dense layout XORs every element (unchanged ones are zeros, which zstd removes);
* applying it *overwrites* each changed element with ``base ^ xor`` -- the exact new bits, no
  floating-point arithmetic -- so a delta applied to its base gives the new bucket bit for bit
  and nothing can drift over many versions. Every bucket travels with the digest of its full
  new bytes (``digest``: XXH3-128); whoever rebuilds one checks it, so a wrong or missing base
  is caught and the bucket is fetched whole instead.

``DeltaEncoder`` is the sender's side (the trainer's stage lead): it keeps the previous
published version's bytes per bucket and decides per version and bucket whether a delta pays.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import xxhash
import zstandard

logger = logging.getLogger("laminar_mcore.weights")

CODEC = "zstd-xor-gap-v1"
DIGEST = "xxh3-128"
MODES = ("auto", "on", "off")
DEFAULT_MAX_FRACTION = 0.5  # a delta above this fraction of its bucket is sent whole
_HEAD = struct.Struct("<QBB")  # changed elements, element bytes, layout
SPARSE, DENSE = 0, 1  # layouts: changed positions + their XOR, or every element's XOR
DENSE_FRACTION = 0.1  # above this fraction of changed elements the dense layout is cheaper
_UNIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_MAX_ELEMENTS = 2**32 - 1  # gaps are uint32


class DeltaError(ValueError):
    """A delta that cannot be applied: malformed, or not for this bucket."""


def digest(buffer: torch.Tensor) -> str:
    """``DIGEST``:hex of a contiguous uint8 CPU tensor's bytes. XXH3-128 guards against a
    wrong base or a corrupted byte (a collision by accident is 2^-128); it is not a defence
    against forgery, which the run token's HMAC on every push and publish session is. At
    ~13 GB/s per core it costs relays a memory pass, where SHA-256 (~1.5 GB/s) would cost
    more than the rebuild itself."""
    return f"{DIGEST}:{xxhash.xxh3_128(memoryview(buffer.contiguous().numpy())).hexdigest()}"


def unit_for(dtype: Optional[torch.dtype]) -> int:
    """The element width compared for buckets of ``dtype`` (the rollout dtype)."""
    if dtype is None:
        return 4
    return 2 if dtype.itemsize == 2 else 4 if dtype.itemsize >= 4 else 1


def delta_enabled(mode: str, dtype: Optional[torch.dtype]) -> bool:
    """A publisher's ``delta``: on, off, or auto (on when the rollout dtype is 16-bit). The
    trainer passes ``weight_sync.delta`` resolved by ``choose_delta`` (auto weighs the links
    there), so auto here is only the dtype's rule, for a publisher built by hand."""
    if mode not in MODES:
        raise ValueError(f"LMC-E102: weight_sync.delta={mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        return dtype is not None and dtype.itemsize == 2 and dtype.is_floating_point
    return mode == "on"


# What ``choose_delta`` weighs, each measured by ``bench.delta`` (2026-11-24, a Qwen2-0.5B-shaped
# bf16 model trained with AdamW on this repository's 2-core machine; docs/benchmarks.md): a stage
# lead's compare + encode + hash and a relay's copy + apply + check, bytes of the full bucket per
# second (both run on host CPUs, wherever the trainer runs), and full bytes / sent bytes per
# Adam learning rate (interpolated in log-log between the points, held beyond them).
ENCODE_BYTES_S = 0.51e9
APPLY_BYTES_S = 6.2e9
# A rank's deltas found on its GPU (``delta_placement``): the Triton kernels with the compacted
# changes' copy to the host and zstd, bucket bytes per second: bench.gpu's
# ``delta_kernel_gb_per_s`` on an H200 (docs/gpu.md, 2026-11-28: 13.1 and 17.5 GB/s on a 512 MiB
# bf16 bucket with 1% changed; the lower one).
DEVICE_ENCODE_BYTES_S = 13.1e9
# A trainer GPU's device -> pinned host copy: the `publish` check of bench.gpu on an H200
# (docs/gpu.md, 2026-11-28: a 5.44 GB stage in 0.113 s, 48.1 GB/s; the way up assumed alike).
DEVICE_COPY_BYTES_S = 48.1e9
# The publisher's path also copies each packed host bucket up to the GPU first, so a bucket's
# deltas are found at 1 / (1/13.1 + 1/48.1) = 10.3 GB/s. (Sparse deltas, about 1% changed: at
# lr 1e-4 more than 10% change and the dense XOR comes to the host whole.)
DEVICE_PATH_BYTES_S = 1.0 / (1.0 / DEVICE_ENCODE_BYTES_S + 1.0 / DEVICE_COPY_BYTES_S)
BYTES_RATIO_BY_LR = ((1e-6, 93.6), (1e-5, 13.6), (1e-4, 5.37))


def bytes_ratio_for_lr(lr: float) -> float:
    """The full / sent bytes ``bench.delta`` measured at Adam learning rate ``lr``."""
    pts = BYTES_RATIO_BY_LR
    if lr <= pts[0][0]:
        return pts[0][1]
    for (l0, r0), (l1, r1) in zip(pts, pts[1:]):
        if lr <= l1:
            f = (math.log(lr) - math.log(l0)) / (math.log(l1) - math.log(l0))
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return pts[-1][1]


def choose_delta(mode: str, dtype: Optional[torch.dtype], *, model_bytes: int, stages: int,
                 link_gbit: float, lr: float, encode_bytes_s: float = ENCODE_BYTES_S,
                 apply_bytes_s: float = APPLY_BYTES_S,
                 encoders: str = "stage leads") -> Tuple[bool, str]:
    """``weight_sync.delta`` resolved: (deltas on, why). ``on`` and ``off`` are kept; ``auto``
    turns deltas on only where they make a version reach the relays sooner than whole buckets:

    * whole: the version's ``model_bytes`` over the slowest link it crosses (``link_gbit``:
      the master relay's ingress, where every stage lead sends, or a hop of the chain);
    * delta: the slowest of its pipelined stages (buckets overlap, so the slowest stage sets
      the pace): each of the ``stages`` encoders (``encoders`` says which: stage leads, or
      with per-rank export every rank, on its host or its GPU) encodes its share at
      ``encode_bytes_s``,
      ``model_bytes / bytes_ratio_for_lr(lr)`` over the link, each relay rebuilds the whole
      version at ``apply_bytes_s``.

    Never for weights that travel in 32 bits (Adam moves most of them every step) and never
    on a link the config does not name (``link_gbit`` <= 0): on a fast link the encoder is
    the slower path (``bench.delta``: 0.63x the speed of whole versions over 10 Gbit/s)."""
    on = delta_enabled(mode, dtype)  # (refuses a bad mode) on, off as given; auto: the dtype
    if mode != "auto":
        return on, f"weight_sync.delta={mode}"
    if not on:
        return False, (f"weight_sync.delta=auto: whole versions: the weights travel in {dtype} "
                       "(deltas pay for 16-bit weights, most of which a step leaves unchanged)")
    if not link_gbit or link_gbit <= 0:
        return False, ("weight_sync.delta=auto: whole versions: no link named "
                       "(weight_sync.link_gbit=0); deltas pay only on a link slower than the "
                       "encoder, so name the slowest link a version crosses to let auto weigh "
                       "them, or set weight_sync.delta=on")
    link = link_gbit * 1e9 / 8
    ratio = bytes_ratio_for_lr(lr)
    whole = model_bytes / link
    encode = model_bytes / max(stages, 1) / encode_bytes_s
    wire = model_bytes / ratio / link
    rebuild = model_bytes / apply_bytes_s
    delta = max(encode, wire, rebuild)
    on = delta < whole

    def sec(x: float) -> str:
        return f"{x:,.0f} s" if x >= 100 else f"{x:.3g} s"

    return on, (f"weight_sync.delta=auto: {'deltas' if on else 'whole versions'}: a version "
                f"of {model_bytes / 1e9:.3g} GB reaches the relays in ~{sec(whole)} whole over "
                f"{link_gbit:g} Gbit/s, ~{sec(delta)} as deltas (encode {sec(encode)} on each "
                f"of {max(stages, 1)} {encoders}, {sec(wire)} on the wire at "
                f"{ratio:.3g}x fewer bytes for lr {lr:g}, rebuild {sec(rebuild)} per relay)")


def _planes(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t``'s bytes as ``width`` planes, one after the other (stacking column views is several
    times faster than a strided transpose)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    cols = t.contiguous().view(torch.uint8).view(-1, width)
    return torch.stack([cols[:, k] for k in range(width)]).flatten()


def _from_planes(raw: memoryview, count: int, width: int) -> torch.Tensor:
    with warnings.catch_warnings():  # read only: the planes are copied by the stack below
        warnings.simplefilter("ignore", UserWarning)
        planes = torch.frombuffer(raw, dtype=torch.uint8).view(width, count)
    return torch.stack([planes[k] for k in range(width)], dim=1).view(_UNIT_DTYPES[width]).flatten()


def encode(new: torch.Tensor, base: torch.Tensor, unit: int = 2, level: int = 1) -> bytes:
    """The delta taking ``base`` to ``new`` (contiguous uint8 CPU tensors of one size)."""
    return encode_counted(new, base, unit, level)[0]


def encode_counted(new: torch.Tensor, base: torch.Tensor, unit: int = 2,
                   level: int = 1) -> Tuple[bytes, int]:
    """``encode``, and how many elements changed. (``laminar_mcore.kernels.delta.encode``
    makes the same bytes from buckets on the accelerator.)"""
    check_pair(new, base, unit)
    a = new.view(_UNIT_DTYPES[unit])
    b = base.view(_UNIT_DTYPES[unit])
    changed = a != b
    count = int(torch.count_nonzero(changed))
    if count > DENSE_FRACTION * a.numel():  # every element's XOR: cheaper than positions
        return payload(count, unit, None, a ^ b, level), count
    positions = torch.nonzero(changed).flatten()
    return payload(count, unit, positions, a[positions] ^ b[positions], level), count


def check_pair(new: torch.Tensor, base: torch.Tensor, unit: int) -> None:
    """Refuse (``DeltaError``) two buckets that cannot be delta-coded as ``unit``-byte
    elements."""
    if new.numel() != base.numel():
        raise DeltaError("LMC-E505: "
                         f"a delta needs buckets of one size ({new.numel()} != {base.numel()})")
    if new.numel() % unit:
        raise DeltaError("LMC-E505: "
                         f"a {new.numel()}-byte bucket is not a whole number of {unit}-byte "
                         "elements")
    if new.numel() // unit > _MAX_ELEMENTS:
        raise DeltaError("LMC-E505: "
                         f"a bucket of more than {_MAX_ELEMENTS} elements cannot be delta-coded")


def payload(count: int, unit: int, positions: Optional[torch.Tensor], xor: torch.Tensor,
            level: int = 1) -> bytes:
    """A delta's bytes (``CODEC``) from its ``count`` changed elements: sparse, their
    ``positions`` (increasing, int64, host) and ``xor`` (new ^ base at them); dense
    (``positions`` None), every element's ``xor``."""
    if positions is None:
        parts = [_HEAD.pack(count, unit, DENSE), _planes(xor, unit)]
    else:
        # gaps are < 2**32 (_MAX_ELEMENTS); stored as uint32 bits (int32 in torch)
        gaps = (torch.diff(positions, prepend=positions.new_tensor([-1])) & 0xFFFFFFFF).to(
            torch.int32)
        parts = [_HEAD.pack(count, unit, SPARSE), _planes(gaps, 4), _planes(xor, unit)]
    head = torch.tensor(list(parts[0]), dtype=torch.uint8, device="cpu")
    raw = torch.cat([head, *parts[1:]])
    compressor = zstandard.ZstdCompressor(level=level, threads=-1)  # all cores on big buckets
    return compressor.compress(memoryview(raw.numpy()))


def apply(payload: bytes, target: torch.Tensor, unit: Optional[int] = None) -> int:
    """Overwrite the changed elements of ``target`` (which holds the base's bytes) with the
    new bits; returns how many changed. ``unit``: the element width expected (None: the
    delta's own). Raises ``DeltaError`` on anything malformed before writing a byte."""
    limit = _HEAD.size + target.numel() * 5  # the most any delta of this bucket decodes to
    try:
        # a frame that states its size is decompressed whole whatever max_output_size says
        stated = zstandard.frame_content_size(payload)
        if stated > limit:
            raise DeltaError("LMC-E505: "
                             f"a delta that decompresses to {stated} bytes cannot be for a "
                             f"{target.numel()}-byte bucket")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"LMC-E505: not a {CODEC} delta: {exc}") from None
    if len(raw) < _HEAD.size:
        raise DeltaError("LMC-E505: a delta shorter than its header")
    count, raw_unit, mode = _HEAD.unpack_from(raw)
    if raw_unit not in _UNIT_DTYPES or (unit is not None and raw_unit != unit):
        raise DeltaError("LMC-E505: "
                         f"a delta of {raw_unit}-byte elements for a bucket of {unit}-byte ones")
    if target.numel() % raw_unit:
        raise DeltaError("LMC-E505: "
                         f"a delta of {raw_unit}-byte elements for a {target.numel()}-byte bucket")
    unit, elements = raw_unit, target.numel() // raw_unit
    size = _HEAD.size + (elements * unit if mode == DENSE else count * (4 + unit))
    if mode not in (SPARSE, DENSE) or count > elements or len(raw) != size:
        raise DeltaError("LMC-E505: "
                         f"a delta of {count} elements does not fit a {target.numel()}-byte "
                         "bucket (or is truncated)")
    view = memoryview(raw)[_HEAD.size:]
    t = target.view(_UNIT_DTYPES[unit])
    if mode == DENSE:
        t ^= _from_planes(view, elements, unit)
        return count
    if count == 0:
        return 0
    gaps = _from_planes(view[:4 * count], count, 4).to(torch.int64) & 0xFFFFFFFF
    xor = _from_planes(view[4 * count:], count, unit)
    if int(gaps.min()) < 1:
        raise DeltaError("LMC-E505: a delta whose positions do not increase")
    positions = torch.cumsum(gaps, 0) - 1
    if int(positions[-1]) >= elements:
        raise DeltaError("LMC-E505: a delta position outside its bucket")
    t[positions] = t[positions] ^ xor
    return count


def triton_importable() -> bool:
    """Whether Triton is installed (what ``delta_placement``'s ``triton`` fact says)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def delta_placement(cuda: bool, triton: bool, device: Optional[torch.device] = None,
                    per_rank: bool = True) -> tuple:
    """Where a publisher's ``DeltaEncoder`` keeps its bases and finds the changes: (device,
    kernel, why). A rank that publishes its own shard (``weight_sync.export=per_rank``) on a
    GPU with Triton: its GPU (``device``), with the Triton kernels, its shard's base there
    (``job=plan``: ``delta_base_gb``); else the host's encoder (a stage lead would hold its
    whole stage again on its GPU). Facts only, so CPU tests decide it as a GPU machine would."""
    if cuda and triton and device is not None and per_rank:
        return device, True, f"deltas found on {device} (Triton kernels/delta.py)"
    why = ("no GPU" if not cuda else "no Triton" if not triton else "no device"
           if device is None else "a stage lead's whole stage: weight_sync.export=stage_lead")
    return None, False, f"deltas found on the host ({why})"


class DeltaEncoder:
    """The stage lead's half: the previous published version's bytes per bucket index, and
    the choice per bucket.

    ``begin(version, base_ok)`` returns the base version this version's deltas are against
    (None: every bucket whole -- the first version, the anchor every ``anchor_interval``
    versions, or a master relay that does not hold the base); ``encode(index, buffer)``
    returns ``(encoding, payload)`` with ``encoding`` "delta" or "full" and keeps ``buffer``
    as the next version's base for ``index``.

    ``device`` (``delta_placement``): where the bases are kept and each bucket is compared
    with its base -- None, the host (this module's encoder, ~0.5 GB/s a core), or the
    trainer's GPU, where ``kernel(new, base, unit) -> (payload, changed)`` encodes
    (``kernels.delta.encode``: Triton kernels find and compact the changed elements and only
    they come back to the host to be compressed; issue 52, item 3). The payloads are the same
    bytes either way."""

    def __init__(self, enabled: bool, unit: int, anchor_interval: int = 16,
                 max_fraction: float = DEFAULT_MAX_FRACTION,
                 device: Optional[torch.device] = None, kernel: Optional[Callable] = None):
        if anchor_interval < 1:
            raise ValueError(f"LMC-E103: weight_sync.anchor_interval={anchor_interval} must be "
                             ">= 1 (1: every version whole)")
        if not 0 < max_fraction <= 1:
            raise ValueError(f"delta max_fraction={max_fraction} must be in (0, 1]")
        self.enabled, self.unit = enabled, unit
        self.anchor_interval, self.max_fraction = anchor_interval, max_fraction
        if device is not None and kernel is None:
            raise ValueError("a DeltaEncoder on a device needs its kernel (kernels.delta.encode)")
        self.device, self.kernel = (torch.device(device) if device is not None else None), kernel
        self._stream = None  # (a GPU's: created on first use, on the sender's thread)
        self.base_version: Optional[int] = None  # the version ``self._base`` holds
        self._base: Dict[int, torch.Tensor] = {}
        self._since_anchor = 0
        self.last_changed: Optional[int] = None
        self.against: Optional[int] = None  # the version being encoded is against this
        self._pending: Optional[int] = None

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._base.values())

    def proposed_base(self) -> Optional[int]:
        """The base a delta of the next version would be against (asked of the relay)."""
        if not self.enabled or self.base_version is None:
            return None
        if self._since_anchor + 1 >= self.anchor_interval:
            return None  # this version is an anchor
        return self.base_version

    def begin(self, version: int, base_ok: bool) -> Optional[int]:
        proposed = self.proposed_base()
        self.against = proposed if base_ok else None
        self._pending = version
        return self.against

    def encode(self, index: int, buffer: torch.Tensor) -> Tuple[str, Optional[bytes]]:
        if self.device is not None:
            try:
                return self._encode(index, buffer)
            except Exception as exc:  # noqa: BLE001 - out of memory, a kernel that fails
                # not the master relay's fault: this bucket goes whole, the rest on the host
                logger.warning("deltas on %s failed (%s): bucket %d goes whole and deltas are "
                               "found on the host from now on", self.device, exc, index)
                self.device, self.kernel, self._stream = None, None, None
                self._base.clear()
                self.last_changed = None
                return "full", None
        return self._encode(index, buffer)

    def _encode(self, index: int, buffer: torch.Tensor) -> Tuple[str, Optional[bytes]]:
        base = self._base.get(index)
        encoding, payload = "full", None
        self.last_changed = None  # elements that changed in this bucket (None: not compared)
        new = buffer
        with self._on_stream():
            if self.enabled and self.device is not None:  # the bucket where its base is
                new = buffer.to(self.device)  # (synchronous: the host bucket is reused)
            if self.against is not None and base is not None and base.numel() == buffer.numel():
                if self.device is None:
                    delta, self.last_changed = encode_counted(buffer, base, self.unit)
                else:
                    delta, self.last_changed = self.kernel(new, base, self.unit)
                if len(delta) <= self.max_fraction * buffer.numel():
                    encoding, payload = "delta", delta
        if self.enabled:
            if self.device is not None:
                self._base[index] = new if new is not buffer else new.clone()
            else:
                if base is None or base.numel() != buffer.numel():
                    base = self._base[index] = torch.empty_like(buffer, device="cpu")
                base.copy_(buffer)
        return encoding, payload

    def _on_stream(self):
        """On a GPU, a CUDA stream of the encoder's own (the copy up and the kernels never
        queue behind the training step's work on the default stream, nor it behind them)."""
        if self.device is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._stream)

    def end(self, indices: List[int]) -> None:
        """The version was sent (buckets ``indices``): it is the next one's base."""
        if not self.enabled:
            return
        for index in [i for i in self._base if i not in set(indices)]:
            del self._base[index]  # a bucket that no longer exists
        self.base_version = self._pending
        self._since_anchor = 0 if self.against is None else self._since_anchor + 1

    def forget(self) -> None:
        """The base is unusable (a send failed midway): the next version goes whole."""
        self.base_version = None
