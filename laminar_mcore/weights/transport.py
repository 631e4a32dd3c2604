"""The trainer -> master relay publish channel: one two-rank ``torch.distributed`` group per
pipeline stage and session (rank 0 the master relay, rank 1 the stage's lead), formed on the
store of an authenticated publish session (``relay/rendezvous.py``), outside the trainer's world.

The relay chooses the backend and tells it in its answer to the join; trainers follow, so the
two ends never disagree: NCCL where the relay has a GPU (``--publish-backend auto`` or ``nccl``), gloo
otherwise. Payloads live in host buffers at both ends (the trainer's pinned export buckets, the
relay's shared-memory version store); with NCCL each chunk goes through a device staging
buffer of one chunk on either side (host -> GPU -> NCCL -> GPU -> host), with gloo it is sent
straight from and received straight into host memory. Both backends run this same code.
"""

from __future__ import annotations

import datetime
import json
from typing import Optional

import torch

PUBLISH_GROUP_PREFIX = "laminar-publish"
BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(requested: str) -> str:
    """``auto``: NCCL when this process sees a GPU, else gloo. ``nccl`` without a GPU fails."""
    if requested not in BACKENDS:
        raise ValueError("LMC-E102: "
                         f"publish backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("LMC-E321: publish backend nccl needs a GPU on the relay's machine; use "
                         "--publish-backend gloo (weight_sync.publish_backend=gloo) on CPU machines")
    return requested


def stage_group(store, stage: int, rank: int, backend: str, timeout: datetime.timedelta,
                session: int = 1):
    """The two-rank publish group of pipeline stage ``stage``'s session ``session`` (each
    trainer process that joins -- the first, or one restarted after a crash -- gets the next
    number from the relay): rank 0 relay, rank 1 trainer."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{PUBLISH_GROUP_PREFIX}-stage{stage}-s{session}", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


class Channel:
    """Point-to-point bytes between host buffers over a publish group.

    Over NCCL the bytes are staged through a device buffer on the channel's own CUDA stream,
    ordered by an event: a trainer's publish sender never queues behind the training kernels
    on the default stream (and training never waits for the publish)."""

    def __init__(self, pg, peer: int, backend: str, chunk_bytes: int,
                 device: Optional[torch.device] = None):
        self.pg, self.peer, self.backend = pg, peer, backend
        self.device = None
        self.staging = None
        self.stream = None
        if backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
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
            self.pg.send([staged], self.peer, 0).wait()
            self._copied.synchronize()  # ``host`` may be reused: only this stream's copy waited

    def recv_into(self, host: torch.Tensor) -> None:
        """Receive exactly ``host.numel()`` bytes into a contiguous host uint8 view."""
        if self.staging is None:
            self.pg.recv([host], self.peer, 0).wait()
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            staged = self._ensure(host.numel())
            self.pg.recv([staged], self.peer, 0).wait()
            host.copy_(staged)  # device -> pageable host: returns once the bytes are there

    def flush(self) -> None:
        """Wait for everything sent so far to leave this process (NCCL sends are async)."""
        if self.stream is not None:
            self.stream.synchronize()

    def send_header(self, header: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8))
        self.send(data)

    def recv_header(self) -> dict:
        length = torch.zeros(1, dtype=torch.int64)
        self.recv_into(length.view(torch.uint8))
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self.recv_into(raw)
        return json.loads(bytes(raw.numpy()))
