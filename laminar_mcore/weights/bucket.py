"""Flattened weight buckets: the format in which weights travel between trainer, relays and
engines, and their CPU shared-memory handles (the CPU twin of CUDA IPC).

A bucket is one contiguous byte buffer plus, per tensor, its name (Hugging Face naming), dtype,
shape and byte offset -- the payload of SGLang's ``update_weights_from_tensor`` with
``load_format="flattened_bucket"``. On CPU the buffer lives in a file under /dev/shm and the
handle that crosses process boundaries names that file; receivers map it without copying.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool)}
_ALIGN = 64


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int
    # a slice of a larger tensor (issue 52: each trainer rank publishes its own shard): the
    # Hugging Face tensor's full shape, the dim it is cut along and where this slice starts;
    # None for a whole tensor. ``weights.shards`` puts the slices back together.
    full_shape: Optional[Tuple[int, ...]] = None
    dim: Optional[int] = None
    start: int = 0

    def to_dict(self) -> dict:
        """The one JSON form (handles, chain frames, publish headers); ``metas_from_dicts``
        reads it back. A slice's three fields are there only for a slice."""
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
               "offset": self.offset, "nbytes": self.nbytes}
        if self.dim is not None:
            out.update(full_shape=list(self.full_shape), dim=self.dim, start=self.start)
        return out


def slice_fits(m: TensorMeta) -> bool:
    """Whether a slice's meta (``dim`` set) is a slice of its ``full_shape``: the same rank,
    equal outside ``dim``, within it along ``dim``. True for a whole tensor."""
    return m.dim is None or (
        len(m.full_shape) == len(m.shape) and 0 <= m.dim < len(m.shape)
        and 0 <= m.start and m.start + m.shape[m.dim] <= m.full_shape[m.dim]
        and all(a == b for d, (a, b) in enumerate(zip(m.shape, m.full_shape)) if d != m.dim))


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} in a weight bucket")
    return _DTYPES[name]


def layout(named: Mapping[str, torch.Tensor],
           slices: Optional[Mapping[str, Tuple[Tuple[int, ...], int, int]]] = None
           ) -> Tuple[List[TensorMeta], int]:
    """Byte layout of ``named`` in one bucket: each tensor at a multiple of 64 bytes (aligned
    for any dtype's ``.view`` and vectorised loads), its offset explicit in its ``TensorMeta``
    (readers never assume tensors back to back). ``slices``: name -> (full shape, dim, start)
    of the tensors that are slices of a larger one."""
    metas, offset = [], 0
    slices = slices or {}
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        full, dim, start = slices.get(name, (None, None, 0))
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                offset, nbytes, tuple(full) if full is not None else None,
                                dim, int(start)))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return metas, offset


def write_bucket(buffer: torch.Tensor, named: Mapping[str, torch.Tensor],
                 metas: List[TensorMeta]) -> None:
    for meta in metas:
        src = named[meta.name].detach()
        dst = buffer[meta.offset:meta.offset + meta.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)  # one copy, straight from a strided view if need be


def read_bucket(buffer: torch.Tensor, metas: List[TensorMeta]) -> Dict[str, torch.Tensor]:
    """Views (no copy) of every tensor in ``buffer``."""
    out = {}
    for meta in metas:
        raw = buffer[meta.offset:meta.offset + meta.nbytes]
        out[meta.name] = raw.view(dtype_from_name(meta.dtype)).view(meta.shape)
    return out


class ShmBucket:
    """A bucket in a /dev/shm file owned by this process (unlinked on ``close``)."""

    def __init__(self, nbytes: int, prefix: str = "laminar-bucket"):
        self.path = os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.nbytes = max(int(nbytes), 1)
        with open(self.path, "wb") as f:
            f.truncate(self.nbytes)
        self.buffer = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)

    @classmethod
    def from_tensors(cls, named: Mapping[str, torch.Tensor]) -> Tuple["ShmBucket", List[TensorMeta]]:
        metas, nbytes = layout(named)
        bucket = cls(nbytes)
        write_bucket(bucket.buffer, named, metas)
        return bucket, metas

    def handle(self, metas: List[TensorMeta]) -> dict:
        return {"kind": "shm", "path": self.path, "nbytes": self.nbytes,
                "tensors": [m.to_dict() for m in metas]}

    def close(self) -> None:
        self.buffer = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


_SEGMENT = re.compile(r"^(laminar-[a-z]+(?:-[a-z]+)*)-(\d+)-([0-9a-f]{12})$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to reclaim
        return True
    return True


def reclaim_segments(pid: Optional[int] = None) -> List[str]:
    """Unlink the shared-memory buckets (``laminar-<kind>-<pid>-<id>`` in /dev/shm) of process
    ``pid``, or with no ``pid`` of every process that no longer exists. A process killed with
    -9 cannot unlink its own segments; its supervisor (which knows its pid) or a successor
    calls this. Mappings that readers still hold stay valid; only the names go. Returns the
    paths removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = _SEGMENT.match(name)
        if match is None:
            continue
        owner = int(match.group(2))
        if (owner != pid) if pid is not None else (owner == os.getpid() or _pid_alive(owner)):
            continue
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)
            removed.append(path)
    return removed


def encode_handle(handle: dict) -> str:
    """A handle as the string SGLang's ``serialized_named_tensors`` entries are."""
    return base64.b64encode(json.dumps(handle).encode()).decode()


def decode_handle(data: str, kind: str = "shm") -> dict:
    """A handle from ``encode_handle``; ``kind`` is the one expected ("shm", or "mooncake" for
    buffers read across machines)."""
    try:
        handle = json.loads(base64.b64decode(data, validate=True))
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's input error
        raise ValueError(f"not a laminar bucket handle (base64 JSON): {exc}") from None
    if not isinstance(handle, dict) or handle.get("kind") != kind:
        hint = (" (CUDA IPC handles are served to SGLang engines, not to the CPU engine)"
                if kind == "shm" else f" (pull with format={kind!r})")
        raise ValueError(f"LMC-E514: unsupported bucket handle: expected kind {kind!r}{hint}")
    return handle


def metas_from_dicts(raw) -> List[TensorMeta]:
    """``TensorMeta`` from their JSON form (handles, chain frames, publish headers)."""
    return [TensorMeta(m["name"], m["dtype"], tuple(m["shape"]), int(m["offset"]),
                       int(m["nbytes"]),
                       tuple(int(d) for d in m["full_shape"]) if m.get("dim") is not None
                       else None,
                       int(m["dim"]) if m.get("dim") is not None else None,
                       int(m.get("start", 0)) if m.get("dim") is not None else 0)
            for m in raw]


def checked_metas(raw, nbytes: int) -> List[TensorMeta]:
    """``metas_from_dicts``, refusing an entry that lies outside an ``nbytes`` bucket, whose
    byte size does not match its shape and dtype, or whose offset is not a multiple of its
    element size (``read_bucket``'s ``.view(dtype)`` needs it; ``layout`` makes 64) -- handles
    come from other processes."""
    metas = metas_from_dicts(raw)
    for m in metas:
        numel = 1
        for d in m.shape:
            numel *= d
        itemsize = dtype_from_name(m.dtype).itemsize
        if m.offset < 0 or m.offset + m.nbytes > nbytes or numel * itemsize != m.nbytes:
            raise ValueError(f"bucket entry {m.name!r} does not fit its declared shape/bounds")
        if m.offset % itemsize:
            raise ValueError(f"bucket entry {m.name!r}: offset {m.offset} is not a multiple of "
                             f"its element size {itemsize}")
        if not slice_fits(m):
            raise ValueError(f"bucket entry {m.name!r}: shape {list(m.shape)} at {m.start} "
                             f"along dim {m.dim} is not a slice of {list(m.full_shape)}")
    return metas


@contextlib.contextmanager
def open_handle(handle: dict) -> Iterator[Dict[str, torch.Tensor]]:
    """Map a shared-memory bucket and yield views of its tensors (valid inside the block)."""
    path = handle.get("path", "")
    if not os.path.realpath(path).startswith(os.path.realpath(SHM_DIR) + os.sep):
        raise ValueError(f"bucket path {path!r} is outside {SHM_DIR}")
    if not os.path.exists(path):
        raise ValueError(f"LMC-E513: bucket {path!r} does not exist (released by its owner?)")
    nbytes = int(handle["nbytes"])
    if os.path.getsize(path) < nbytes:
        raise ValueError(f"bucket {path!r} is smaller than its handle says")
    metas = checked_metas(handle["tensors"], nbytes)
    buffer = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    try:
        yield read_bucket(buffer, metas)
    finally:
        del buffer


@dataclass
class Bucket:
    metas: List[TensorMeta]
    buffer: torch.Tensor  # uint8, at least layout's nbytes

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class BucketPacker:
    """Packs a stream of named tensors into reusable byte buffers of about ``bucket_bytes``.

    Buffers are kept between publishes (weights have the same sizes every time), so a publish
    allocates nothing after the first. ``dtype`` casts floating tensors (the rollout dtype).
    """

    def __init__(self, bucket_bytes: int, dtype: Optional[torch.dtype] = None,
                 device: str = "cpu", pin_memory: bool = False):
        if bucket_bytes < 1:
            raise ValueError("bucket size must be >= 1 byte")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: List[torch.Tensor] = []

    def _buffer(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                               pin_memory=self.pin_memory)
        return self._buffers[index]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if self.dtype is not None and t.is_floating_point() and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def pack(self, named: Iterator[tuple]) -> Iterator[Bucket]:
        """Yield filled buckets as they complete (the caller may send bucket k while this
        generator gathers bucket k+1). Items are (name, tensor), or (name, tensor, (full shape,
        dim, start)) for a slice of a larger tensor (``TensorMeta.full_shape``)."""
        pending, slices, size, index = {}, {}, 0, 0
        self.last_buckets: List[Bucket] = []  # this publish's buckets (views of the buffers)
        for item in named:
            name, tensor = item[0], self._cast(item[1])
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > self.bucket_bytes:
                yield self._fill(index, pending, slices)
                index += 1
                pending, slices, size = {}, {}, 0
            pending[name] = tensor
            if len(item) > 2 and item[2] is not None:
                slices[name] = item[2]
            size += -(-nbytes // 64) * 64
        if pending:
            yield self._fill(index, pending, slices)

    def _fill(self, index: int, pending, slices=None) -> Bucket:
        metas, nbytes = layout(pending, slices)
        buffer = self._buffer(index, nbytes)[:nbytes]
        write_bucket(buffer, pending, metas)
        bucket = Bucket(metas, buffer)
        self.last_buckets.append(bucket)
        return bucket
