"""The trainer -> master relay publish channel: one two-rank ``torch.distributed`` group per
pipeline stage and session (rank 0 the master relay, rank 1 the stage's lead), formed on the
store of an authenticated publish session (``relay/rendezvous.py``), outside the trainer's world.

The channel is decided from both ends (:func:`choose_channel`): the trainer's join carries its
host identity (host name, boot id, the ``/dev/shm`` mount) and its GPU's UUID, and the relay
answers per session:

- ``shm`` -- the same host: the stage lead copies each bucket from its pinned buffer straight
  into the relay's shared-memory store (one copy, no sockets); only headers cross a gloo group;
- ``nccl`` -- different hosts, both with a GPU: chunks staged through a device buffer of one
  chunk on either side (host -> GPU -> NCCL -> GPU -> host), on the channel's own stream;
- ``gloo`` -- otherwise, straight from and into host memory.

Never NCCL with both ends on one GPU (NCCL does not support two ranks of a communicator on one
device: it may hang); ``weight_sync.publish_backend`` can force a backend, and forcing that is
refused with the reason. Headers -- and so the relay's wait for the next version, however long
a training step takes -- always travel over a gloo group, never inside an NCCL collective; the
NCCL data group has a timeout of the publish's own (seconds to minutes) and is built so that an
error aborts its communicator only (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` for that group), never
the trainer or the relay process.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import threading
from typing import Optional, Tuple

import torch

from .bucket import SHM_DIR

PUBLISH_GROUP_PREFIX = "laminar-publish"
BACKENDS = ("auto", "gloo", "nccl", "shm")
NCCL_ABORT_COMM_ONLY = "2"  # torch's ErrorHandlingMode CleanUpOnly: abort the communicator
_ENV_LOCK = threading.Lock()


def host_identity() -> str:
    """This machine as a publish peer sees it: host name, boot id and the ``/dev/shm`` mount
    (two containers or network namespaces with private ``/dev/shm`` mounts are different hosts
    for the shared-memory channel, though they share a kernel)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    try:
        st = os.stat(SHM_DIR)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = ""
    return f"{socket.gethostname()}|{boot}|{shm}"


def gpu_uuid(device: Optional[torch.device]) -> Optional[str]:
    """The UUID of ``device`` (a CUDA device), or None (no GPU)."""
    if device is None or device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001 - an old driver without UUIDs: compare by nothing
        return None


def choose_channel(requested: str, trainer: dict, relay: dict) -> Tuple[str, str]:
    """(backend, why) for one publish session. ``trainer``/``relay``: ``host`` (its
    :func:`host_identity`), ``gpu`` (the UUID of its GPU, None without one); the relay's
    ``gpu`` is the one it would stage NCCL on. Raises ValueError (LMC-E321/E323/E324) for a
    forced backend that cannot work, saying why."""
    if requested not in BACKENDS:
        raise ValueError("LMC-E102: "
                         f"publish backend {requested!r} is not one of {', '.join(BACKENDS)}")
    same_host = bool(trainer.get("host")) and trainer.get("host") == relay.get("host")
    same_gpu = bool(trainer.get("gpu")) and trainer.get("gpu") == relay.get("gpu")
    if requested == "gloo":
        return "gloo", "forced (weight_sync.publish_backend=gloo)"
    if requested == "shm":
        if not same_host:
            raise ValueError("LMC-E324: publish backend shm needs the trainer on the relay's "
                             "host (the same /dev/shm); they are on different hosts: use auto")
        return "shm", "forced (weight_sync.publish_backend=shm)"
    if requested == "nccl":
        if not trainer.get("gpu") or not relay.get("gpu"):
            raise ValueError("LMC-E321: publish backend nccl needs a GPU at both ends (the "
                             f"trainer {'has' if trainer.get('gpu') else 'has no'} GPU, the "
                             f"relay {'has' if relay.get('gpu') else 'has no'} GPU); use auto")
        if same_gpu:
            raise ValueError("LMC-E323: publish backend nccl with the trainer and the relay on "
                             f"one GPU ({trainer['gpu']}): NCCL does not support two ranks of a "
                             "communicator on one device (it may hang). Use auto (shared "
                             "memory on one host) or give the relay another GPU "
                             "(weight_sync.relay_device)")
        return "nccl", "forced (weight_sync.publish_backend=nccl)"
    if same_host:
        return "shm", "same host: the trainer writes into the relay's shared memory"
    if same_gpu:  # two hosts (e.g. containers with private /dev/shm) that share a GPU
        return "gloo", "different hosts on one GPU (never NCCL on one device)"
    if trainer.get("gpu") and relay.get("gpu"):
        return "nccl", "different hosts, both with a GPU"
    return "gloo", "different hosts, " + ("the trainer has no GPU" if not trainer.get("gpu")
                                          else "the relay has no GPU")


def resolve_backend(requested: str) -> str:
    """The relay's configured backend, checked at its start (each session then decides with
    :func:`choose_channel`). ``nccl`` without a GPU on the relay's machine fails."""
    if requested not in BACKENDS:
        raise ValueError("LMC-E102: "
                         f"publish backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested in ("auto", "shm", "gloo"):
        return requested
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("LMC-E321: publish backend nccl needs a GPU on the relay's machine; use "
                         "--publish-backend gloo (weight_sync.publish_backend=gloo) on CPU machines")
    return requested


@contextlib.contextmanager
def _env(name: str, value: str):
    """``name=value`` in this process's environment while a process group is built (torch
    reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in ``ProcessGroupNCCL``'s constructor)."""
    with _ENV_LOCK:
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def stage_group(store, stage: int, rank: int, backend: str, timeout: datetime.timedelta,
                session: int = 1, suffix: str = ""):
    """The two-rank publish group of pipeline stage ``stage``'s session ``session`` (each
    trainer process that joins -- the first, or one restarted after a crash -- gets the next
    number from the relay): rank 0 relay, rank 1 trainer. An NCCL group aborts only its
    communicator on an error or timeout (never the process)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{PUBLISH_GROUP_PREFIX}-stage{stage}-s{session}{suffix}", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ABORT_COMM_ONLY):
            return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def open_channel(store, stage: int, rank: int, backend: str, *, session: int,
                 wait_timeout: datetime.timedelta, data_timeout: datetime.timedelta,
                 chunk_bytes: int, device: Optional[torch.device] = None) -> "Channel":
    """Both ends' channel of one session: headers over a gloo group with ``wait_timeout`` (the
    relay waits there for the next version); NCCL's bytes over a group of their own with
    ``data_timeout`` (a publish under way); gloo and shm carry everything on the gloo group."""
    ctrl = stage_group(store, stage, rank, "gloo", wait_timeout, session=session)
    data = ctrl if backend != "nccl" else stage_group(store, stage, rank, "nccl", data_timeout,
                                                      session=session, suffix="-data")
    return Channel(data, 1 - rank, backend, chunk_bytes, device=device, ctrl=ctrl)


def abort_group(pg) -> None:
    """Tear a publish group down before reconnecting (NCCL: abort its communicator, so a
    half-finished operation cannot hang the next one)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass
            return


def _raise_if_failed(work) -> None:
    """Raise the error torch recorded on an NCCL operation's ``work``: with asynchronous error
    handling set to abort the communicator only, a failed or timed-out operation raises nothing
    by itself (its kernel just ends), and the bytes it left would pass for data."""
    exc = getattr(work, "exception", None)
    err = exc() if callable(exc) else None
    if err is not None:
        raise ConnectionError(f"the publish group's NCCL operation failed: {err}")


_RELAY_SEGMENT = re.compile(r"^laminar-relay-\d+-[0-9a-f]{12}$")


def write_shm(path: str, host: torch.Tensor) -> None:
    """The same-host channel's one copy: ``host`` (a contiguous uint8 tensor, the stage lead's
    pinned bucket) into the relay's shared-memory bucket file ``path``, mapped for this copy
    only (a mapping kept open would keep a dropped version's memory alive). Only the relay's
    own segments under ``/dev/shm`` are written."""
    if os.path.dirname(path) != SHM_DIR or not _RELAY_SEGMENT.match(os.path.basename(path)):
        raise ValueError(f"LMC-E324: {path!r} is not a relay's shared-memory bucket")
    size = os.path.getsize(path)
    if size < host.numel():
        raise ValueError(f"LMC-E324: the relay's bucket {path} holds {size} bytes, fewer than "
                         f"the {host.numel()} sent")
    import mmap

    fd = os.open(path, os.O_RDWR)
    try:  # MAP_POPULATE: the page tables filled in one go (twice as fast as faulting them in)
        mapped = mmap.mmap(fd, host.numel(),
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    try:
        target = torch.frombuffer(mapped, dtype=torch.uint8)
        target.copy_(host)
        del target
    finally:
        mapped.close()


class Channel:
    """Point-to-point bytes between host buffers over a publish group.

    Over NCCL the bytes are staged through a device buffer on the channel's own CUDA stream,
    ordered by an event: a trainer's publish sender never queues behind the training kernels
    on the default stream (and training never waits for the publish)."""

    def __init__(self, pg, peer: int, backend: str, chunk_bytes: int,
                 device: Optional[torch.device] = None, ctrl=None):
        """``ctrl``: the gloo group headers go over (None: ``pg``). ``device``: the GPU an NCCL
        channel stages on, captured by the caller on its own thread (``current_device()`` is
        per thread: a failover on the sender thread would otherwise stage on GPU 0)."""
        self.pg, self.peer, self.backend = pg, peer, backend
        self.ctrl = ctrl if ctrl is not None else pg
        self._last_work = None  # the newest NCCL send, checked at flush
        self.device = None
        self.staging = None
        self.stream = None
        if backend == "nccl":
            if device is None:  # never current_device() here: it may be another thread's
                raise ValueError("an NCCL publish channel needs its GPU, captured on the thread "
                                 "that owns it (torch.cuda.current_device() is per thread)")
            self.device = device
            self.staging = torch.empty(max(int(chunk_bytes), 1), dtype=torch.uint8,
                                       device=self.device)
            self.stream = torch.cuda.Stream(device=self.device)
            self._copied = torch.cuda.Event()

    def _ensure(self, nbytes: int) -> torch.Tensor:
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.staging[:nbytes]

    def send(self, host: torch.Tensor) -> None:
        """Send a contiguous host uint8 tensor; returns when ``host`` may be reused."""
        if self.staging is None:
            self.pg.send([host], self.peer, 0).wait()
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            staged = self._ensure(host.numel())
            staged.copy_(host, non_blocking=True)
            self._copied.record(self.stream)
            # The send runs on NCCL's stream after this stream's copy; wait() makes this
            # stream's next copy into ``staged`` wait for the send.
            work = self.pg.send([staged], self.peer, 0)
            work.wait()
            self._copied.synchronize()  # ``host`` may be reused: only this stream's copy waited
            self._last_work = work

    def _check_sent(self) -> None:
        work, self._last_work = self._last_work, None
        if work is not None:
            _raise_if_failed(work)

    def recv_into(self, host: torch.Tensor) -> None:
        """Receive exactly ``host.numel()`` bytes into a contiguous host uint8 view."""
        if self.staging is None:
            self.pg.recv([host], self.peer, 0).wait()
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            staged = self._ensure(host.numel())
            work = self.pg.recv([staged], self.peer, 0)
            work.wait()
            host.copy_(staged)  # device -> pageable host: returns once the bytes are there
            _raise_if_failed(work)  # an aborted communicator leaves stale bytes, not an error

    def flush(self) -> None:
        """Wait for everything sent so far to leave this process (NCCL sends are async)."""
        if self.stream is not None:
            self.stream.synchronize()
            self._check_sent()

    def _ctrl_send(self, host: torch.Tensor) -> None:
        if self.ctrl is self.pg:
            self.send(host)
        else:
            self.ctrl.send([host], self.peer, 0).wait()

    def _ctrl_recv(self, host: torch.Tensor) -> None:
        if self.ctrl is self.pg:
            self.recv_into(host)
        else:
            self.ctrl.recv([host], self.peer, 0).wait()

    def send_header(self, header: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._ctrl_send(torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8))
        self._ctrl_send(data)

    def recv_header(self) -> dict:
        length = torch.zeros(1, dtype=torch.int64)
        self._ctrl_recv(length.view(torch.uint8))
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self._ctrl_recv(raw)
        return json.loads(bytes(raw.numpy()))

    def groups(self) -> list:
        return [self.pg] if self.ctrl is self.pg else [self.pg, self.ctrl]
