"""The master relay's publish rendezvous: where a trainer stage lead joins the relay's publish
group -- after proving the run token.

The trainer -> master relay publish group (one two-rank ``torch.distributed`` group per stage and
session, ``weights.transport``) needs a store to form. A torch ``TCPStore`` has no
authentication: whoever reached its port could set keys, join a session's group as the trainer
and publish weights of their own, or disturb a publish. So the relay exposes no store. Its
publish port is this rendezvous instead:

1. the relay opens each connection with a challenge (a fresh random nonce);
2. the trainer answers with its stage, a nonce of its own and an HMAC-SHA256, under the run
   token, of both nonces and the stage (the token itself never crosses the wire);
3. the relay refuses (and logs) a join without a valid proof before it holds anything for it;
   otherwise it opens a session for the stage -- a fresh in-process ``HashStore`` that only this
   connection reaches -- and answers with the backend, the session number and a proof of the
   token of its own (a trainer publishes only to a relay that knows the token);
4. the connection then carries that session's store operations (``RemoteStore`` on the trainer:
   set, get, add, check, wait, ...) for as long as the group lives.

A stranger who connects can only fail the proof: it reaches no store and no session.
Unauthenticated connections are few (``MAX_PENDING`` at once) and short (``HANDSHAKE_S``), and
their opening frame is small (``MAX_HELLO`` bytes). The group's own data connections (gloo's
pairs, NCCL's bootstrap) use ephemeral ports that are exchanged only through an authenticated
session's store.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

import torch.distributed as dist

from ..errors import within
from .chain import recv_frame, send_frame

logger = logging.getLogger("laminar_mcore.relay")

HANDSHAKE_S = 10.0  # an unauthenticated connection must prove the token within this
MAX_PENDING = 32  # unauthenticated connections at once; more are closed at once
MAX_HELLO = 4096  # bytes of a frame before the proof
AUTH_FAILED = ("LMC-E503: authentication failed: the join does not prove the run's token "
               "(LAMINAR_RUN_TOKEN must be the same for the trainer and the relay)")


class RendezvousRefused(ConnectionError):
    """A join refused: no valid proof of the run token (either way), or a bad stage."""


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def join_proof(token: str, relay_nonce: str, stage: int, trainer_nonce: str,
               host: Optional[str] = None, gpu: Optional[str] = None) -> str:
    """The trainer's proof: HMAC-SHA256 under the token of the relay's nonce, the stage, the
    trainer's nonce and, when it sends them, its host and GPU (so nobody on the way can change
    the facts the channel is decided from)."""
    facts = "" if host is None and gpu is None else f"/{host or ''}/{gpu or ''}"
    return _mac(token, f"laminar-publish-join/{relay_nonce}/{stage}/{trainer_nonce}{facts}")


def relay_proof(token: str, relay_nonce: str, trainer_nonce: str, session: int,
                backend: str = "") -> str:
    """The relay's proof, over the trainer's nonce (so it cannot be replayed) and the channel
    it chose (so nobody on the way can make the two ends build different groups)."""
    return _mac(token, f"laminar-publish-relay/{trainer_nonce}/{relay_nonce}/{session}/{backend}")


def _recv_small(sock: socket.socket, limit: int, deadline: Optional[float] = None) -> Any:
    """One frame of at most ``limit`` bytes (before the proof, nothing bigger is read), all
    of it before ``deadline`` (``time.monotonic()``; a peer that trickles bytes gets no more
    time than one that sends none)."""
    def recv(n: int) -> bytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the opening frame did not arrive in time")
            sock.settimeout(left)
        return sock.recv(n)

    head = b""
    while len(head) < 4:
        chunk = recv(4 - len(head))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        head += chunk
    (length,) = struct.unpack(">I", head)
    if length > limit:
        raise ConnectionError(f"an opening frame of {length} bytes (at most {limit})")
    data = b""
    while len(data) < length:
        chunk = recv(length - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return json.loads(data)


def _b64(value) -> str:
    if isinstance(value, str):
        value = value.encode()
    return base64.b64encode(bytes(value)).decode()


def _unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text or "")


def _seconds(value: Any, default: float) -> datetime.timedelta:
    try:
        s = float(value)
    except (TypeError, ValueError):
        s = default
    return datetime.timedelta(seconds=min(max(s, 0.001), 30 * 86400.0))


# ---------------------------------------------------------------------- relay side
class PublishRendezvous:
    """The master relay's publish port. ``on_session(stage, session, store, backend)`` is
    called for each authenticated join, with the session's store (the relay forms rank 0 of the
    session's group on it) and the channel ``choose(hello)`` decided for it from the trainer's
    facts in its join (``host``, ``gpu``: ``weights.transport.choose_channel``); a ValueError
    from ``choose`` refuses the join with its message. ``choose`` may be a backend's name."""

    def __init__(self, host: str, port: int, token: str, stages: Union[int, range], choose,
                 on_session: Callable[[int, int, "dist.Store", str], None],
                 stop: threading.Event):
        """``stages``: the publishing parts this relay takes (a striped tier's master takes
        its stripe's, ``weights.shards.stripe_parts``), or how many (all of them)."""
        self.token = token
        self.stages = range(stages) if isinstance(stages, int) else stages
        self.choose = choose if callable(choose) else (lambda hello, name=choose: (name, ""))
        self.on_session, self.stop = on_session, stop
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.sessions: Dict[int, int] = {s: 0 for s in self.stages}
        self.refused = 0
        self._lock = threading.Lock()
        # connections that have not proved the token yet, oldest first: when MAX_PENDING are
        # open the oldest is dropped for the newcomer, so strangers holding slots cannot keep
        # a trainer out (each has HANDSHAKE_S in all to prove the token)
        self._pending: Dict[socket.socket, float] = {}
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name="laminar-relay-rendezvous")

    def start(self) -> "PublishRendezvous":
        self._thread.start()
        return self

    def close(self) -> None:
        for how in (lambda s: s.shutdown(socket.SHUT_RDWR), lambda s: s.close()):
            try:  # shutdown wakes the thread blocked in accept()
                how(self.sock)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        import errno

        while not self.stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:
                if self.stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the port was closed
                logger.warning("publish port: accept failed (%s); still listening", exc)
                time.sleep(0.1)  # e.g. out of file descriptors for a moment
                continue
            with self._lock:
                if len(self._pending) >= MAX_PENDING:
                    oldest = min(self._pending, key=self._pending.get)
                    self._pending.pop(oldest)
                    try:
                        oldest.shutdown(socket.SHUT_RDWR)  # its handshake fails now
                    except OSError:
                        pass
                self._pending[conn] = time.monotonic()
            try:
                threading.Thread(target=self._serve, args=(conn, "%s:%s" % addr[:2]),
                                 daemon=True, name="laminar-relay-rendezvous-conn").start()
            except RuntimeError as exc:  # no thread to be had: drop this one, keep listening
                with self._lock:
                    self._pending.pop(conn, None)
                conn.close()
                logger.warning("publish port: cannot serve a connection (%s)", exc)

    def _refused(self, peer: str, exc: BaseException) -> None:
        """Count a refusal; log the first ten, then one in a hundred (a scan is not a flood)."""
        with self._lock:
            self.refused += 1
            n = self.refused
        if n <= 10 or n % 100 == 0:
            logger.warning("refused a publish join from %s: %s (%d refused so far)", peer, exc,
                           n)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            try:
                try:
                    store = self._handshake(conn)
                finally:
                    with self._lock:
                        self._pending.pop(conn, None)
            except (RendezvousRefused, OSError, ValueError, TypeError, RecursionError) as exc:
                self._refused(peer, exc)  # no proof, or not our protocol at all
                return
            serve_store(conn, store)

    def _handshake(self, conn: socket.socket) -> "dist.Store":
        deadline = time.monotonic() + HANDSHAKE_S
        conn.settimeout(HANDSHAKE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_hex(16)
        send_frame(conn, {"type": "publish-challenge", "nonce": nonce})
        hello = _recv_small(conn, MAX_HELLO, deadline)
        stage = hello.get("stage") if isinstance(hello, dict) else None
        theirs = hello.get("nonce") if isinstance(hello, dict) else None
        proof = hello.get("proof") if isinstance(hello, dict) else None
        if not (isinstance(hello, dict) and hello.get("type") == "join"
                and isinstance(stage, int) and not isinstance(stage, bool)
                and isinstance(theirs, str) and 16 <= len(theirs) <= 128
                and isinstance(proof, str)
                and all(isinstance(hello.get(k), (str, type(None))) for k in ("host", "gpu"))
                and hmac.compare_digest(proof.encode(), join_proof(
                    self.token, nonce, stage, theirs, hello.get("host"),
                    hello.get("gpu")).encode())):
            send_frame(conn, {"accept": False, "reason": AUTH_FAILED})
            raise RendezvousRefused("LMC-E503: no valid proof of the run's token")
        if stage not in self.stages:
            first, last = self.stages.start, self.stages.stop - 1
            reason = (f"LMC-E504: stage {stage} is not one of this relay's trainer stages "
                      f"({first}..{last}; --trainer-stages: the trainer's pipeline-parallel "
                      "size, times its tensor-parallel size with weight_sync.export=per_rank; "
                      "a striped tier's master takes its stripe's: --stripe S/N)")
            send_frame(conn, {"accept": False, "reason": reason})
            raise RendezvousRefused(reason)
        try:
            backend, why = self.choose(hello)
        except ValueError as exc:  # a forced backend that cannot work here: say why
            send_frame(conn, {"accept": False, "reason": str(exc)})
            raise RendezvousRefused(str(exc)) from None
        with self._lock:
            self.sessions[stage] += 1
            session = self.sessions[stage]
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(days=30))
        self.on_session(stage, session, store, backend)
        send_frame(conn, {"accept": True, "backend": backend, "why": why, "session": session,
                          "proof": relay_proof(self.token, nonce, theirs, session, backend)})
        conn.settimeout(None)  # the session's store lives as long as its group
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return store


def serve_store(conn: socket.socket, store: "dist.Store") -> None:
    """Answer an authenticated trainer's store operations on ``store`` until it hangs up."""
    while True:
        try:
            request = recv_frame(conn)
        except (OSError, ConnectionError, ValueError):
            return
        try:
            reply = {"ok": True, "value": _apply(store, request)}
        except Exception as exc:  # noqa: BLE001 - a store error is the caller's to see
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000],
                     "timeout": "timeout" in str(exc).lower()}
        try:
            send_frame(conn, reply)
        except OSError:
            return


def _apply(store: "dist.Store", req: dict) -> Any:
    op = req.get("op")
    if op == "set":
        store.set(str(req["key"]), _unb64(req["value"]))
        return None
    if op == "get":
        key = str(req["key"])
        store.wait([key], _seconds(req.get("timeout_s"), 300.0))
        return _b64(store.get(key))
    if op == "add":
        return int(store.add(str(req["key"]), int(req["amount"])))
    if op == "check":
        return bool(store.check([str(k) for k in req["keys"]]))
    if op == "wait":
        store.wait([str(k) for k in req["keys"]], _seconds(req.get("timeout_s"), 300.0))
        return None
    if op == "compare_set":
        return _b64(store.compare_set(str(req["key"]), _unb64(req["expected"]),
                                      _unb64(req["desired"])))
    if op == "multi_get":
        keys = [str(k) for k in req["keys"]]
        store.wait(keys, _seconds(req.get("timeout_s"), 300.0))
        return [_b64(v) for v in store.multi_get(keys)]
    if op == "multi_set":
        store.multi_set([str(k) for k in req["keys"]], [_unb64(v) for v in req["values"]])
        return None
    if op == "append":
        store.append(str(req["key"]), _unb64(req["value"]))
        return None
    if op == "delete_key":
        return bool(store.delete_key(str(req["key"])))
    if op == "num_keys":
        return int(store.num_keys())
    raise ValueError(f"unknown store operation {op!r}")


# ---------------------------------------------------------------------- trainer side
class RemoteStore(dist.Store):
    """A session's store as the trainer sees it: every operation goes to the relay over the
    authenticated connection (one at a time). Keep a reference for as long as a process group
    formed on it lives (torch calls back into this Python object)."""

    def __init__(self, sock: socket.socket, timeout_s: float, where: str):
        super().__init__()
        self._sock: Optional[socket.socket] = sock
        self._lock = threading.Lock()
        self._timeout_s = float(timeout_s)
        self.where = where
        self.set_timeout(datetime.timedelta(seconds=self._timeout_s))

    def _wait_s(self, timeout=None) -> float:
        """A wait's bound: ``timeout``, else the store's (``set_timeout``); c10d's zero
        ("no timeout") is the longest wait a session allows."""
        if timeout is None:
            timeout = self.timeout
        if isinstance(timeout, datetime.timedelta):
            seconds = timeout.total_seconds()
            return seconds if seconds > 0 else 30 * 86400.0
        return self._timeout_s

    def _call(self, op: str, wait_s: float = 0.0, **args) -> Any:
        with self._lock:
            if self._sock is None:
                raise RuntimeError(f"the publish session with {self.where} is closed")
            try:
                self._sock.settimeout(wait_s + 60.0)
                send_frame(self._sock, {"op": op, **args})
                reply = recv_frame(self._sock)
            except (OSError, ValueError) as exc:
                # a half-read reply would answer the next call: the session is over
                sock, self._sock = self._sock, None
                try:
                    sock.close()
                except OSError:
                    pass
                raise RuntimeError(f"the publish session with {self.where} broke during "
                                   f"{op}: {exc}") from None
        if not isinstance(reply, dict):
            raise RuntimeError(f"the relay's store at {self.where} answered {str(reply)[:100]}")
        if not reply.get("ok"):
            error = f"the relay's store at {self.where}: {reply.get('error')}"
            if reply.get("timeout") and hasattr(dist, "DistStoreError"):
                raise dist.DistStoreError(error)
            raise RuntimeError(error)
        return reply.get("value")

    def set(self, key, value):
        self._call("set", key=str(key), value=_b64(value))

    def get(self, key):
        wait = self._wait_s()
        return _unb64(self._call("get", wait, key=str(key), timeout_s=wait))

    def add(self, key, amount):
        return int(self._call("add", key=str(key), amount=int(amount)))

    def check(self, keys):
        return bool(self._call("check", keys=[str(k) for k in keys]))

    def wait(self, keys, timeout=None):
        wait = self._wait_s(timeout)
        self._call("wait", wait, keys=[str(k) for k in keys], timeout_s=wait)

    def compare_set(self, key, expected, desired):
        return _unb64(self._call("compare_set", key=str(key), expected=_b64(expected),
                                 desired=_b64(desired)))

    def multi_get(self, keys):
        wait = self._wait_s()
        return [_unb64(v) for v in self._call("multi_get", wait, keys=[str(k) for k in keys],
                                              timeout_s=wait)]

    def multi_set(self, keys, values):
        self._call("multi_set", keys=[str(k) for k in keys], values=[_b64(v) for v in values])

    def append(self, key, value):
        self._call("append", key=str(key), value=_b64(value))

    def delete_key(self, key):
        return bool(self._call("delete_key", key=str(key)))

    def num_keys(self):
        return int(self._call("num_keys"))

    # the names torch's C++ trampoline looks up
    getNumKeys = num_keys
    deleteKey = delete_key

    def close(self) -> None:
        sock = self._sock
        if sock is not None:
            try:  # wakes a call waiting on the relay without taking its lock
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


@dataclass
class PublishSession:
    """A joined publish session: its ``store`` (for ``weights.transport.stage_group``, rank 1),
    the ``backend`` the relay chose and the session ``number``."""

    store: RemoteStore
    backend: str
    number: int
    why: str = ""  # the relay's reason for the backend

    def close(self) -> None:
        self.store.close()


def join_publish_session(host: str, port: int, token: str, stage: int,
                         timeout_s: float, facts: Optional[dict] = None) -> PublishSession:
    """Join stage ``stage``'s publish group at the master relay ``host:port``: prove the run
    token, check the relay's proof, and return the session. ``facts``: this trainer's ``host``
    identity and ``gpu`` UUID, from which the relay decides the channel. Raises
    ``RendezvousRefused`` when either side does not prove the token (or the relay refuses the
    channel), OSError when the relay cannot be reached."""
    if not token:
        raise RendezvousRefused("LMC-E200: publishing needs the run's token (LAMINAR_RUN_TOKEN)")
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            challenge = _recv_small(sock, MAX_HELLO)
        except ValueError:
            challenge = None
        if not isinstance(challenge, dict) or challenge.get("type") != "publish-challenge" \
                or not isinstance(challenge.get("nonce"), str):
            raise RendezvousRefused(f"LMC-E504: {host}:{port} is not a master relay's publish port")
        mine = secrets.token_hex(16)
        host_id, gpu = (facts or {}).get("host"), (facts or {}).get("gpu")
        hello = {"type": "join", "stage": int(stage), "nonce": mine, "host": host_id, "gpu": gpu,
                 "proof": join_proof(token, challenge["nonce"], int(stage), mine, host_id, gpu)}
        send_frame(sock, hello)
        try:
            reply = _recv_small(sock, MAX_HELLO)  # the relay has proved nothing yet
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise RendezvousRefused(f"LMC-E504: {host}:{port} answered the join with no valid "
                                    "reply")
        if not reply.get("accept"):
            raise RendezvousRefused(within(f"the master relay at {host}:{port} refused the join",
                                           reply.get("reason"), "LMC-E503"))
        session = reply.get("session")
        proof = reply.get("proof")
        if not isinstance(session, int) or not isinstance(proof, str) or \
                not hmac.compare_digest(proof.encode(), relay_proof(
                    token, challenge["nonce"], mine, session,
                    str(reply.get("backend"))).encode()):
            raise RendezvousRefused(f"LMC-E503: the relay at {host}:{port} did not prove the "
                                    "run's token: not publishing to it")
        backend = str(reply.get("backend"))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return PublishSession(RemoteStore(sock, timeout_s, f"{host}:{port}"), backend, session,
                              str(reply.get("why") or ""))
    except BaseException:
        sock.close()
        raise
