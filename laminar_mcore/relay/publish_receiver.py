"""The master relay's receiving end of the trainer's publish stream: versions from one trainer
stage lead, over that stage's ``weights.transport.Channel`` (torch.distributed: NCCL or gloo;
on one host the lead copies each bucket straight into the store's shared memory), into the
relay's ``VersionStore`` -- buckets whole or as deltas rebuilt here, digest checked.

Owns the per-version protocol with the lead (accept or refuse, which buckets to send again
whole) and what a broken stream leaves behind (the version it was sending is failed, never
half-served). It never forms the publish group or proves the run's token (relay/rendezvous.py
and relay/master.py do), never speaks the chain's TCP framing (relay/chain.py), and imports no
trainer code: it moves flattened buckets only.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch

from ..weights.bucket import metas_from_dicts
from ..weights.delta import digest as bucket_digest
from .store import StoredVersion, VersionError, VersionStore

logger = logging.getLogger("laminar_mcore.relay")


def receive_publishes(channel, store: VersionStore, stop: threading.Event,
                      on_version: Callable[[int], None],
                      on_bucket: Optional[Callable[[str, int, int], None]] = None,
                      stripes: int = 1) -> None:
    """Master relay: receive versions from one trainer stage lead over its publish ``channel``
    (a ``weights.transport.Channel``) until the trainer closes it or ``stop``.

    Per version: the lead's ``version`` frame names the base its deltas would be against and
    this relay answers whether it takes the version (``store.begin``) and holds that base;
    then buckets, whole (chunks) or as deltas (rebuilt here against the base, digest
    checked); at ``end`` this relay names the buckets it could not rebuild and the lead sends
    them again whole. ``on_bucket(outcome, full_bytes, received_bytes)`` counts them (outcome
    full, delta or fallback). If the stream breaks (the trainer died mid-publish) the version
    it was sending is failed: a pull never sees part of it, and the restarted trainer sends a
    newer one whole. ``stripes``: how many master relays this relay's tier has; a trainer
    that publishes over another number is refused (LMC-E504): each master would otherwise
    complete versions of part of the model."""
    sv = pinned = None  # the version being received; pinned while this thread writes it
    need = []
    note = on_bucket or (lambda outcome, full, got: None)

    def let_go():
        nonlocal pinned
        if pinned is not None:
            store.unpin(pinned)  # (a version failed meanwhile gives its buffers back now)
            pinned = None

    try:
        while not stop.is_set():
            header = channel.recv_header()
            kind = header.get("type")
            if kind == "close":
                return
            if kind == "version":
                let_go()
                sv, need = None, []
                if int(header.get("stripes", 1)) != stripes:
                    channel.send_header({"accept": False, "reason": (
                        f"LMC-E504: the trainer publishes version {header['version']} over "
                        f"{header.get('stripes', 1)} master relay(s) and this relay is one of "
                        f"{stripes} (--stripe S/N, weight_sync.master_relays): start the relays "
                        "and the trainer from one config")})
                    continue
                try:
                    sv = store.begin(int(header["version"]), int(header["num_stages"]),
                                     owner="trainer")
                except VersionError as exc:
                    channel.send_header({"accept": False, "reason": str(exc)})
                    continue
                store.pin(sv)
                pinned = sv
                base = header.get("base")
                channel.send_header({"accept": True, "base_ok": base is not None and store.holds(
                    int(base), int(header["stage"]))})
                continue
            if kind == "end":
                failed = sv is None or bool(sv.failed)  # refused or broken mid-way
                asked = [] if failed else need
                channel.send_header({"need": asked, "failed": failed})
                need = []
                if sv is not None and not sv.complete and store.try_complete(sv):
                    on_version(sv.version)
                if not asked:  # this stage writes no more of it (another may still be)
                    let_go()
                continue
            if kind != "bucket":
                raise ConnectionError(f"unknown publish frame {kind!r}")
            sv = _receive_bucket(channel, store, sv, header, need, note)
            if sv is not None and not sv.complete and store.try_complete(sv):
                on_version(sv.version)
    except BaseException:
        if sv is not None and not sv.complete:
            store.fail(sv, "the trainer's publish stream broke")
        raise
    finally:
        let_go()


def _receive_bucket(channel, store: VersionStore, sv: Optional[StoredVersion], header: dict,
                    need: list, note) -> Optional[StoredVersion]:
    """One bucket of the version being received (drained when the version was refused or
    failed); returns the version, or None once it is refused."""
    nbytes, chunk = int(header["nbytes"]), int(header["chunk_bytes"])
    payload_bytes = int(header.get("payload_bytes", nbytes))
    delta = header.get("encoding") == "delta"
    key = (int(header["stage"]), int(header["index"]))
    if header.get("via") == "shm":
        return _receive_shm_bucket(channel, store, sv, header, key, nbytes, note)
    if sv is None or sv.failed or int(header["version"]) != sv.version:
        _drain(channel, payload_bytes, chunk)
        return None if sv is None or sv.failed else sv
    # the delta first, then a buffer for the rebuilt bucket
    payload = memoryview(_recv_delta(channel, payload_bytes, chunk).numpy()) if delta else None
    try:
        bucket = _slot(store, sv, key, header, payload)
    except VersionError:  # no room for it in /dev/shm: the version is refused, drain
        if not delta:
            _drain(channel, nbytes, chunk)
        return None
    if delta:
        if store.rebuild(sv, bucket):
            note("delta", nbytes, payload_bytes)
        else:
            need.append(key[1])
            note("fallback", nbytes, payload_bytes)
        return sv
    for start in range(0, nbytes, chunk):
        end = min(nbytes, start + chunk)
        channel.recv_into(bucket.shm.buffer[start:end])
        if end == nbytes and not _intact(channel, bucket, header):
            need.append(key[1])  # sent again whole at the end round
            note("fallback", nbytes, nbytes)
            return sv
        store.progress(sv, bucket, end)
    note("resent" if header.get("resend") else "full", nbytes, nbytes)
    return sv


def _intact(channel, bucket, header: dict) -> bool:
    """Over NCCL, whose aborted operations leave stale bytes instead of raising (the publish
    group aborts its communicator only), a whole bucket is checked against the trainer's
    digest before its last chunk counts; over gloo and shared memory the bytes are the
    sender's or an error was raised."""
    if getattr(channel, "backend", None) != "nccl" or not header.get("digest"):
        return True
    if bucket_digest(bucket.shm.buffer[:int(header["nbytes"])]) == header["digest"]:
        return True
    logger.warning("bucket %s of version %s arrived with a digest that differs from the "
                   "trainer's; asking for it again", header.get("index"), header.get("version"))
    return False


def _receive_shm_bucket(channel, store: VersionStore, sv: Optional[StoredVersion], header: dict,
                        key, nbytes: int, note) -> Optional[StoredVersion]:
    """The same-host channel: a delta (if the lead encoded one: what this relay forwards down
    its chain) comes over the channel; then this relay answers with the shared-memory file of
    the bucket's slot (None: not kept) and the lead copies the whole bucket into it and says
    so. Nothing is rebuilt here: the bytes are the trainer's."""
    chunk = int(header["chunk_bytes"])
    payload_bytes = int(header.get("payload_bytes", nbytes))
    delta = bytes(_recv_delta(channel, payload_bytes, chunk).numpy()) \
        if header.get("encoding") == "delta" else None
    if sv is None or sv.failed or int(header["version"]) != sv.version:
        channel.send_header({"path": None})
        return None if sv is None or sv.failed else sv
    try:
        bucket = _slot(store, sv, key, header, delta)
    except VersionError:  # no room for it in /dev/shm: the version is refused
        channel.send_header({"path": None})
        return None
    channel.send_header({"path": bucket.shm.path})
    done = channel.recv_header()
    if done.get("type") != "written" or done.get("nbytes") != nbytes:
        raise ConnectionError(f"the stage lead did not write bucket {key} of version "
                              f"{sv.version} ({done})")
    store.progress(sv, bucket, nbytes)
    note("resent" if header.get("resend") else "delta" if delta is not None else "full",
         nbytes, payload_bytes if delta is not None else nbytes)
    return sv


def _recv_delta(channel, nbytes: int, chunk: int) -> torch.Tensor:
    """A delta payload of ``nbytes``, in the sender's chunks."""
    raw = torch.empty(nbytes, dtype=torch.uint8)
    for start in range(0, nbytes, chunk):
        channel.recv_into(raw[start:min(nbytes, start + chunk)])
    return raw


def _slot(store: VersionStore, sv: StoredVersion, key, header: dict, delta):
    """The bucket ``header`` fills: its slot already (a resend) or a new one in the store."""
    if header.get("resend") and key in sv.buckets:
        return sv.buckets[key]
    return store.add_bucket(sv, key, int(header["nbytes"]), metas_from_dicts(header["metas"]),
                            bool(header["last_of_stage"]), digest=header.get("digest"),
                            delta=delta, base_version=header.get("base_version")
                            if delta is not None else None)


def _drain(channel, nbytes: int, chunk: int) -> None:
    """Read and drop a bucket of ``nbytes`` the store will not keep."""
    sink = torch.empty(min(nbytes, chunk), dtype=torch.uint8)
    for start in range(0, nbytes, chunk):
        channel.recv_into(sink[:min(chunk, nbytes - start)])
