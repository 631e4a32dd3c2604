"""The relay data plane between relays: chunked, pipelined pushes of a version down the chain
of relays over TCP -- the framing, the token proof, the receiving end (``serve_push``), the
pushing end (``push_version``) and the ``Forwarder`` that keeps the downstream relay current.

A push streams buckets chunk by chunk *as they arrive* at the pushing relay, so a version flows
through the whole chain while the master is still receiving it (Laminar's pipelined chain:
T(p, k) = (p + k - 2)(M/k * t_byte + t_start), minimised at k* = sqrt((p - 2) M t_byte / t_start)).

Frames on a connection: a 4-byte big-endian length, a JSON header, then ``length`` raw bytes for
chunk frames. The receiver opens with a challenge (a fresh random nonce); the pusher's opening
frame carries an HMAC-SHA256 of the nonce and the frame under the run's token (the token itself
never crosses the wire), and the receiver refuses a push whose proof is missing or wrong before
anything reaches its store -- so a stranger who can reach a relay's data port cannot publish
weights. The receiver then answers with whether it wants the version.

It never talks to a trainer (the trainer -> master relay stream is relay/publish_receiver.py)
and decides nothing about the chain's order (relay/master.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import math
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ..weights.bucket import metas_from_dicts
from .store import BusyError, StoredBucket, StoredVersion, VersionError, VersionStore

logger = logging.getLogger(__name__)


def optimal_chunks(num_relays: int, nbytes: int, t_byte: float = 1 / 2e9,
                   t_start: float = 2e-4, max_chunks: int = 4096) -> int:
    """Laminar's k* for a chain of ``num_relays`` relays after the source (p = relays + 1)."""
    p = num_relays + 1
    if p <= 2 or nbytes <= 0:
        return 1
    return max(1, min(max_chunks, round(math.sqrt((p - 2) * nbytes * t_byte / t_start))))


def chain_time(num_relays: int, nbytes: int, k: int, t_byte: float, t_start: float) -> float:
    p = num_relays + 1
    return (p + k - 2) * (nbytes / k * t_byte + t_start)


# ---------------------------------------------------------------------- framing
def send_frame(sock: socket.socket, header: dict, payload=None) -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)
    if payload is not None:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict:
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    if length > 64 * 2**20:
        raise ConnectionError(f"frame header of {length} bytes is not plausible")
    return json.loads(_recv_exact(sock, length))


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:], len(view) - got)
        if r == 0:
            raise ConnectionError("peer closed the connection mid-chunk")
        got += r


def _np_view(bucket: StoredBucket):
    return bucket.shm.buffer.numpy()


# ---------------------------------------------------------------------- authentication
def push_proof(token: str, nonce: str, version: int, num_stages: int) -> str:
    """HMAC-SHA256 under the run's token of the receiver's nonce and the pushed version."""
    message = f"laminar-push/{nonce}/{version}/{num_stages}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


class PushRefused(ConnectionError):
    """A push without a valid proof of the run's token."""


# ---------------------------------------------------------------------- receiving (TCP)
def serve_push(conn: socket.socket, store: VersionStore, owner: str, token: str,
               on_bucket: Optional[Callable[[str, int, int], None]] = None) -> Optional[int]:
    """Receive one pushed version on ``conn`` into ``store``; returns the version if completed.
    Raises ``PushRefused`` (after telling the peer) when the push does not prove the token.
    The accept names this relay's newest version, so the pusher sends a bucket that arrived
    as a delta against exactly that version as the delta (rebuilt here, digest checked);
    buckets that do not rebuild are named at ``end`` and pushed again whole.
    ``on_bucket(outcome, full_bytes, wire_bytes)`` counts them (full, delta, fallback)."""
    note = on_bucket or (lambda outcome, full, got: None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nonce = secrets.token_hex(16)
    send_frame(conn, {"type": "challenge", "nonce": nonce})
    hello = recv_frame(conn)
    if hello.get("type") != "version":
        raise ConnectionError("push must start with a version frame")
    version, num_stages = int(hello["version"]), int(hello["num_stages"])
    proof = hello.get("proof")
    if not isinstance(proof, str) or not hmac.compare_digest(
            proof, push_proof(token, nonce, version, num_stages)):
        send_frame(conn, {"accept": False, "busy": False, "have": None,
                          "reason": "authentication failed: the push does not prove the run's "
                                    "token (--token / LAMINAR_RUN_TOKEN must match)"})
        raise PushRefused(f"LMC-E503: push of version {version} refused: no valid proof of the "
                          "run's token")
    try:
        sv = store.begin(version, num_stages, owner=owner)
    except VersionError as exc:
        send_frame(conn, {"accept": False, "busy": isinstance(exc, BusyError),
                          "have": store.latest_version, "reason": str(exc)})
        return None
    store.pin(sv)  # its buffers stay this push's while it writes them, even if it fails
    try:
        send_frame(conn, {"accept": True, "have": store.latest_version})
        buckets: Dict[Tuple[int, int], StoredBucket] = {}
        need = []
        while True:
            frame = recv_frame(conn)
            kind = frame.get("type")
            if kind == "bucket":
                key = tuple(frame["key"])
                nbytes = int(frame["nbytes"])
                if frame.get("resend") and key in buckets:
                    note("resent", nbytes, nbytes)
                    continue  # its chunks follow
                delta = None
                if frame.get("encoding") == "delta":
                    length = int(frame["length"])
                    if not 0 < length <= nbytes * 5 + 64:
                        raise ConnectionError("a delta of implausible length")
                    delta = _recv_exact(conn, length)
                try:
                    buckets[key] = store.add_bucket(
                        sv, key, nbytes, metas_from_dicts(frame["metas"]),
                        bool(frame["last_of_stage"]), digest=frame.get("digest"), delta=delta,
                        base_version=frame.get("base_version") if delta is not None else None)
                except VersionError:
                    if sv.failed:  # superseded, or no room: read the rest, keep nothing
                        continue
                    raise
                if delta is None:
                    note("full", nbytes, nbytes)
                elif store.rebuild(sv, buckets[key]):
                    note("delta", nbytes, len(delta))
                else:
                    need.append(list(key))
                    note("fallback", nbytes, len(delta))
            elif kind == "chunk":
                start, length = int(frame["offset"]), int(frame["length"])
                bucket = buckets.get(tuple(frame["key"]))
                if bucket is None and sv.failed:
                    if not 0 <= length <= 2**31:
                        raise ConnectionError("a chunk of implausible length")
                    _recv_exact(conn, length)  # superseded meanwhile: drop it
                    continue
                if bucket is None:
                    raise ConnectionError("a chunk of a bucket that was not announced")
                if start < 0 or start + length > bucket.nbytes:
                    raise ConnectionError("chunk outside its bucket")
                recv_into(conn, memoryview(_np_view(bucket))[start:start + length])
                store.progress(sv, bucket, start + length)
            elif kind == "end":
                done = store.try_complete(sv)
                if not done and need:
                    send_frame(conn, {"complete": False, "need": need})
                    need = []
                    continue
                send_frame(conn, {"complete": done})
                if not done:
                    raise ConnectionError(f"version {version} ended incomplete")
                return version
            else:
                raise ConnectionError(f"unknown frame type {kind!r}")
    except BaseException as exc:
        store.fail(sv, f"push broken: {exc}")
        raise
    finally:
        store.unpin(sv)


# ---------------------------------------------------------------------- pushing (TCP)
class PushAborted(Exception):
    pass


class ReceiverBusy(Exception):
    pass


def push_version(sock: socket.socket, store: VersionStore, sv: StoredVersion, chunk_bytes: int,
                 should_abort: Callable[[], bool], token: str,
                 stats: Optional[dict] = None) -> bool:
    """Stream ``sv`` (complete or still arriving) to the relay at the other end of ``sock``.
    A bucket that arrived here as a delta against the receiver's newest version goes as that
    delta; every other bucket whole, chunk by chunk as it arrives. Returns False when the
    receiver already has it or something newer; raises ``ReceiverBusy`` when it is
    receiving this version from another relay right now. ``stats["wire_bytes"]``: the
    bytes sent."""
    stats = stats if stats is not None else {}
    stats["wire_bytes"] = 0
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    challenge = recv_frame(sock)
    if challenge.get("type") != "challenge" or not isinstance(challenge.get("nonce"), str):
        raise ConnectionError("the downstream relay did not open with a challenge")
    send_frame(sock, {"type": "version", "version": sv.version, "num_stages": sv.num_stages,
                      "proof": push_proof(token, challenge["nonce"], sv.version, sv.num_stages)})
    reply = recv_frame(sock)
    if not reply.get("accept"):
        if str(reply.get("reason", "")).startswith("authentication failed"):
            raise PushRefused(f"LMC-E503: the downstream relay refused the push: {reply['reason']}")
        if reply.get("busy"):
            raise ReceiverBusy(reply.get("reason"))
        return False
    have = reply.get("have")
    sent_buckets = 0
    sent_bytes: Dict[Tuple[int, int], int] = {}
    while True:
        with store.cond:
            store.cond.wait_for(lambda: sv.failed or should_abort() or len(sv.order) > sent_buckets
                                or any(sv.buckets[k].received > sent_bytes.get(k, 0) for k in sv.order)
                                or _all_sent(sv, sent_bytes), timeout=1.0)
            if sv.failed or should_abort():
                raise PushAborted(sv.failed or "downstream changed")
            new_keys = sv.order[sent_buckets:]
            ready = [(k, sv.buckets[k].received) for k in sv.order]
            finished = _all_sent(sv, sent_bytes)
        for key in new_keys:
            b = sv.buckets[key]
            frame = {"type": "bucket", "key": list(key), "nbytes": b.nbytes,
                     "metas": [m.to_dict() for m in b.metas], "last_of_stage": b.last_of_stage,
                     "digest": b.digest}
            sent_buckets += 1
            sent_bytes[key] = 0
            if b.delta is not None and b.digest and b.base_version == have:
                frame.update(encoding="delta", base_version=b.base_version, length=len(b.delta))
                send_frame(sock, frame, b.delta)
                stats["wire_bytes"] += len(b.delta)
                sent_bytes[key] = b.nbytes  # nothing more to send for it
                ready = [(k, r) for k, r in ready if k != key]
                continue
            send_frame(sock, frame)
        for key, received in ready:
            start = sent_bytes.get(key, 0)
            view = memoryview(_np_view(sv.buckets[key]))
            while received - start >= chunk_bytes or (start < received == sv.buckets[key].nbytes):
                length = min(chunk_bytes, received - start)
                send_frame(sock, {"type": "chunk", "key": list(key), "offset": start, "length": length},
                           view[start:start + length])
                stats["wire_bytes"] += length
                start += length
            sent_bytes[key] = max(start, sent_bytes[key])
        if finished:
            for _round in range(2):
                send_frame(sock, {"type": "end"})
                answer = recv_frame(sock)
                if not answer.get("need"):
                    break
                for key in answer["need"]:  # deltas that did not rebuild there: whole
                    _push_whole(sock, store, sv, tuple(key), chunk_bytes, should_abort, stats)
            return bool(answer.get("complete"))


def _push_whole(sock: socket.socket, store: VersionStore, sv: StoredVersion, key, chunk_bytes: int,
                should_abort: Callable[[], bool], stats: dict) -> None:
    """Send bucket ``key`` of ``sv`` whole, once it is whole here (it may be rebuilding)."""
    bucket = sv.buckets.get(key)
    if bucket is None:
        raise ConnectionError(f"the downstream relay asked for bucket {key}, which "
                              f"version {sv.version} does not have")
    with store.cond:
        store.cond.wait_for(lambda: sv.failed or should_abort() or bucket.received >= bucket.nbytes)
        if sv.failed or should_abort():
            raise PushAborted(sv.failed or "downstream changed")
    send_frame(sock, {"type": "bucket", "key": list(key), "nbytes": bucket.nbytes,
                      "metas": [m.to_dict() for m in bucket.metas],
                      "last_of_stage": bucket.last_of_stage, "digest": bucket.digest,
                      "resend": True})
    view = memoryview(_np_view(bucket))
    for start in range(0, bucket.nbytes, chunk_bytes):
        length = min(chunk_bytes, bucket.nbytes - start)
        send_frame(sock, {"type": "chunk", "key": list(key), "offset": start, "length": length},
                   view[start:start + length])
        stats["wire_bytes"] += length


def _all_sent(sv: StoredVersion, sent_bytes) -> bool:
    return (len(sv.stages_done) >= sv.num_stages and len(sent_bytes) == len(sv.order)
            and all(sent_bytes.get(k, 0) >= sv.buckets[k].nbytes for k in sv.order))


class Forwarder:
    """Keeps the downstream relay up to date: pushes every newer version (complete, or while it
    is still arriving) and reports a dead downstream so that the chain can be rebuilt."""

    def __init__(self, store: VersionStore, chunk_bytes: Optional[int],
                 on_failure: Callable[[str], None], chain_chunks: Optional[int] = None, *,
                 token: str, on_pushed: Optional[Callable[[int, float], None]] = None):
        self.store = store
        self.token = token
        self.chunk_bytes = chunk_bytes  # None: from Laminar's T(p, k) model
        self.chain_chunks = chain_chunks  # a fixed k instead of k*
        self.relays_after_source = 1  # set by the master with the chain
        self.on_failure = on_failure
        self.on_pushed = on_pushed  # (bytes sent, seconds) of each version pushed
        self.downstream: Optional[Tuple[str, int]] = None
        self.pushed: Dict[Tuple[str, int], int] = {}
        self.stats: Dict[str, float] = {}
        self._generation = 0
        self._sock: Optional[socket.socket] = None  # the push under way
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="laminar-relay-forwarder", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self, timeout_s: float = 10.0):
        self._stop.set()
        with self.store.cond:
            self.store.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def chunk_for(self, sv: StoredVersion) -> int:
        """Chunk size for pushing ``sv``: configured, or M / k with k = chain_chunks or k*."""
        if self.chunk_bytes:
            return self.chunk_bytes
        latest = self.store.latest
        nbytes = latest.nbytes if latest is not None and latest.nbytes else sv.nbytes
        k = self.chain_chunks or optimal_chunks(self.relays_after_source, nbytes)
        return max(2**20, -(-nbytes // max(k, 1)))

    @property
    def downstream_changes(self) -> int:
        """How many times the downstream relay changed (to another, or to none)."""
        return self._generation

    def set_downstream(self, addr: Optional[Tuple[str, int]]) -> None:
        """Push to ``addr`` from now on. A push under way to the previous downstream is cut
        at once: one to a relay whose host went silent would otherwise block this thread (and
        every relay after it in the chain) in a socket call for up to a minute."""
        sock = None
        with self.store.cond:
            if addr != self.downstream:
                self.downstream = addr
                self._generation += 1
                sock = self._sock
            self.store.cond.notify_all()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _candidate(self) -> Optional[StoredVersion]:
        if self.downstream is None:
            return None
        done = self.pushed.get(self.downstream, -1)
        versions = [v for v in self.store.receiving.values() if not v.failed]
        if self.store.latest is not None:
            versions.append(self.store.latest)
        versions = [v for v in versions if v.version > done]
        return max(versions, key=lambda v: v.version) if versions else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.store.cond:
                self.store.cond.wait_for(lambda: self._stop.is_set() or self._candidate() is not None,
                                         timeout=1.0)
                sv = self._candidate()
                target, generation = self.downstream, self._generation
            if sv is None or target is None:
                continue
            abort = lambda: self._stop.is_set() or self._generation != generation  # noqa: E731
            self.store.pin(sv)  # newer versions may complete meanwhile: keep sv's bytes intact
            try:
                start = time.perf_counter()
                with socket.create_connection(target, timeout=10) as sock:
                    sock.settimeout(60)
                    with self.store.cond:
                        self._sock = sock
                    if abort():  # the downstream changed while connecting
                        raise PushAborted("downstream changed")
                    sent: dict = {}
                    complete = push_version(sock, self.store, sv, self.chunk_for(sv), abort,
                                            self.token, sent)
                if complete:
                    self.stats = {"version": sv.version, "seconds": time.perf_counter() - start,
                                  "bytes": sv.nbytes, "wire_bytes": sent["wire_bytes"]}
                    if self.on_pushed is not None:
                        self.on_pushed(sent["wire_bytes"], self.stats["seconds"])
                self.pushed[target] = max(self.pushed.get(target, -1), sv.version)
            except PushAborted:
                continue
            except ReceiverBusy:
                self._stop.wait(0.2)
                continue
            except (OSError, ConnectionError) as exc:
                if abort():
                    continue
                logger.warning("push of version %d to %s failed: %s", sv.version, target, exc)
                self.on_failure(f"{target[0]}:{target[1]}")
                self._stop.wait(0.5)
            finally:
                with self.store.cond:
                    self._sock = None
                self.store.unpin(sv)
