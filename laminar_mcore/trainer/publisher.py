"""Trainer side of weight publication: one publish per version, to the master relay only.

``WeightPublisher.publish(version)`` exports this rank's pipeline stage into host buckets (the
only part the trainer waits for) and hands them to a sender thread that streams them to the
master relay over a dedicated two-rank ``torch.distributed`` group per stage, formed through the
relay's publish rendezvous once the stage lead has proved the run token (relay/rendezvous.py)
-- outside the trainer's world, NCCL or gloo as the relay announces (see
``weights.transport``) -- while training goes on. The trainer's blocked time therefore does not depend
on how many relays or engines exist. Invariant: a publish first waits for the previous one's
send to finish, since the host buckets are reused.

Roles: every rank of a stage's tensor-parallel group (data-parallel rank 0) takes part in the
gathers; only the stage lead (TP rank 0) packs host buckets (pinned on GPUs) and sends them (rank
1 of its stage's group; the relay is 0) -- the other TP ranks drain the gathers and hold no
buffer. Over NCCL the sender stages chunks of ``chunk_bytes`` (``weight_sync.chunk_mb``) on its
own CUDA stream (``weights.transport.Channel``).

Each version opens with a handshake: the stage lead names the base version its deltas would be
against (``weights/delta.py``, ``weight_sync.delta``) and the relay answers whether it takes
the version and holds that base; then every bucket goes whole or as a delta, with the digest
of its full bytes; the version ends with the relay naming the buckets it could not rebuild,
which are sent again whole.
"""

from __future__ import annotations

import datetime
import functools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..errors import within
from ..models import get_adapter
from ..netutil import TOKEN_ENV
from ..relay.rendezvous import PublishSession, RendezvousRefused, join_publish_session
from ..weights.bucket import BucketPacker
from ..weights.delta import (DeltaEncoder, delta_enabled, delta_placement, digest,
                             triton_importable, unit_for)
from ..weights.transport import (Channel, abort_group, gpu_uuid, host_identity, open_channel,
                                 write_shm)
from ..weights.shards import EXPORTS, check_stripes, stripe_of, stripe_parts
from .export import (export_roles, iter_rank_hf_shards, iter_stage_hf_tensors, publish_part,
                     stage_has_experts)


@dataclass
class PublishStats:
    version: int
    blocked_s: float  # what the trainer waited for: export into host buckets
    nbytes: int
    buckets: int
    waited_previous_s: float = 0.0


class PublishError(RuntimeError):
    """The master relay could not be reached (or no new one came) before a deadline."""


class WeightPublisher:
    def __init__(self, model, hf_config, *, relay_host: Optional[str] = None,
                 publish_port: Optional[int] = None,
                 master_relays: Sequence[Tuple[str, int]] = (),
                 bucket_bytes: int = 512 * 2**20, chunk_bytes: int = 64 * 2**20,
                 dtype: Optional[torch.dtype] = None, timeout_s: float = 300.0,
                 locate_master: Optional[Callable[[Tuple[str, int]], Tuple[str, int]]] = None,
                 failover_timeout_s: float = 180.0, token: Optional[str] = None,
                 delta: str = "off", anchor_interval: int = 16, export: str = "stage_lead",
                 delta_device: str = "auto"):
        """``delta`` (``weight_sync.delta``: auto, on, off) and ``anchor_interval``: buckets
        go as deltas against the previous version, every ``anchor_interval``-th version whole
        (``weights/delta.py``), found on ``delta_device``: auto (this rank's GPU with the
        Triton kernels where it has both, else the host: ``weights.delta.delta_placement``),
        host, or a device to run the kernels on (``cpu``: under Triton's interpreter, tests).
        ``locate_master(failed)``: the publish address of the master relay that replaced
        ``failed`` (the controller knows; None: a lost master relay fails the publish).
        ``token``: the run's token (default ``$LAMINAR_RUN_TOKEN``), which the stage lead
        proves to the master relay before its publish group forms (relay/rendezvous.py).
        ``export`` (``weight_sync.export``): ``stage_lead`` gathers each stage's TP shards on
        its lead, which publishes the stage; ``per_rank``: every rank of the first
        data-parallel replica publishes its own shard as part ``stage * TP + TP rank`` of
        ``PP * TP`` (``trainer.export.iter_rank_hf_shards``, ``weights/shards.py``), blocked
        only for its local copy. ``master_relays``: a striped tier's master relays' publish
        addresses (``weight_sync.master_relays``), one per stripe; each part publishes to its
        stripe's (``weights.shards.stripe_of``: whole pipeline stages per stripe), each version
        completing per stripe. Empty: the one master at ``relay_host:publish_port``."""
        from megatron.core import parallel_state as ps

        self.model = model
        self.hf_config = hf_config
        self.ps = ps
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.locate_master = locate_master
        self.failover_timeout_s = failover_timeout_s
        self.token = token or os.environ.get(TOKEN_ENV, "")
        self.session: Optional[PublishSession] = None
        self._old_sessions: list = []
        if export not in EXPORTS:
            raise ValueError(f"LMC-E102: weight_sync.export={export!r} is not one of "
                             f"{', '.join(EXPORTS)}")
        self.per_rank = export == "per_rank"
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.num_stages = ps.get_pipeline_model_parallel_world_size()
        # Ranks that take part in the export's gathers (MoE: layer by layer, one layer's
        # experts at a time, never the model) and the stage lead, which packs and sends.
        self.exports, self.is_lead = export_roles(hf_config)
        if self.per_rank and get_adapter(hf_config).is_moe and (
                ps.get_tensor_model_parallel_world_size() != 1
                or ps.get_expert_tensor_parallel_world_size() != 1):
            raise ValueError("LMC-E112: weight_sync.export=per_rank exports a "
                             "mixture-of-experts model at parallel.tp=1 and expert TP 1 (each "
                             "EP rank its own experts, whole): use weight_sync.export=stage_lead")
        if self.per_rank and get_adapter(hf_config).is_moe and \
                ps.get_expert_model_parallel_world_size() > 1 and \
                not stage_has_experts(model, hf_config):
            raise ValueError(f"LMC-E112: pipeline stage {self.stage} holds no "
                             "mixture-of-experts layer: with weight_sync.export=per_rank its EP "
                             "ranks but the first would have nothing to publish and no version "
                             "would complete; use weight_sync.export=stage_lead, or a pipeline "
                             "layout that gives every stage an MoE layer")
        if self.per_rank:  # every rank of the first replica sends its own part (per TP rank;
            # for MoE per EP rank)
            publishes, part, per_stage = publish_part(hf_config)
            self.stage = self.stage * per_stage + part
            self.num_stages *= per_stage
            self.exports = self.is_lead = publishes
        masters = list(master_relays) or [(relay_host, publish_port)]
        if any(h is None or p is None for h, p in masters):
            raise ValueError("LMC-E102: WeightPublisher needs relay_host and publish_port, or "
                             "master_relays")
        check_stripes(len(masters), ps.get_pipeline_model_parallel_world_size())
        # the master relay this part publishes to, and how many parts complete a version there
        self.stripes = len(masters)
        self.stripe = stripe_of(self.stage, len(masters), self.num_stages)
        self.version_parts = len(stripe_parts(self.stripe, len(masters), self.num_stages))
        self.packer = BucketPacker(bucket_bytes, dtype=dtype,
                                   pin_memory=torch.cuda.is_available()) if self.is_lead else None
        weights_dtype = dtype or parameter_dtype(model)
        deltas = delta_enabled(delta, weights_dtype) and self.is_lead
        # this rank's GPU, captured here: current_device() is per thread, and a failover runs
        # on the sender thread (where it would be GPU 0)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else None
        if delta_device == "auto":
            on, use_triton, self.delta_where = delta_placement(
                self.device is not None, triton_importable(), self.device, self.per_rank)
        elif delta_device == "host":
            on, use_triton, self.delta_where = None, False, "deltas found on the host (asked)"
        else:  # (a bare "cuda" is this rank's GPU, not GPU 0 of the sender's thread)
            on, use_triton = torch.device(delta_device), True
            if on.type == "cuda" and on.index is None and self.device is not None:
                on = self.device
            self.delta_where = f"deltas found on {on} (Triton kernels/delta.py)"
        kernel = None
        if deltas and on is not None:
            from ..kernels import delta as kdelta  # (Triton: only where it runs)

            kernel = functools.partial(kdelta.encode, use_triton=use_triton)
        self.encoder = DeltaEncoder(deltas, unit_for(weights_dtype), anchor_interval,
                                    device=on if kernel else None, kernel=kernel)
        # the newest version sent: version, full_bytes, sent_bytes (what crossed the wire),
        # buckets, delta_buckets, base_version, encode_s (comparing, compressing, hashing),
        # compared_elements, changed_elements and digests (bucket index -> digest)
        self.sent_stats: dict = {}
        self._accepted = False
        # called (version, reason) when the master relay refuses a version (trainer/loop.py:
        # the controller's POST /refused)
        self.on_refused = None
        self._tally: dict = {}
        self.pg = None
        self.channel: Optional[Channel] = None
        self.backend: Optional[str] = None
        self._said_backend: Optional[str] = None  # the channel last printed
        self.master: Optional[Tuple[str, int]] = None
        self.failovers = 0
        self.error: Optional[BaseException] = None
        self.facts = {"host": host_identity(), "gpu": gpu_uuid(self.device)}
        self._queue: "queue.Queue" = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self.last_send_s = 0.0
        self._reported = False
        if self.is_lead:
            self._connect(*masters[self.stripe])
            self._sender = threading.Thread(target=self._send_loop, name="laminar-publisher",
                                            daemon=True)
            self._sender.start()

    def _connect(self, host: str, port: int) -> None:
        """Join stage ``self.stage``'s publish group through the relay's publish rendezvous,
        proving the run token (a new session: a restarted trainer gets a fresh group on the
        same relay)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            session = join_publish_session(host, port, self.token, self.stage, self.timeout_s,
                                           facts=self.facts)
        except RendezvousRefused as exc:
            raise PublishError(within(f"stage {self.stage}", exc, "LMC-E504")) from None
        except OSError as exc:
            raise PublishError(f"LMC-E320: stage {self.stage}: the master relay's store at "
                               f"{host}:{port} did not answer within {self.timeout_s:.0f} s "
                               f"(weight_sync.publish_timeout_s): {exc}") from exc
        backend = session.backend
        if backend == "nccl" and not torch.cuda.is_available():
            session.close()
            raise RuntimeError("LMC-E321: the master relay publishes over NCCL but this trainer "
                               "has no GPU: start the relay with --publish-backend gloo "
                               "(weight_sync.publish_backend=gloo)")
        if self.channel is not None:  # a failover: the lost master's groups go first
            for pg in self.channel.groups():
                abort_group(pg)
        try:
            channel = open_channel(session.store, self.stage, 1, backend,
                                   session=session.number, wait_timeout=timeout,
                                   data_timeout=timeout, chunk_bytes=self.chunk_bytes,
                                   device=self.device)
        except RuntimeError as exc:
            session.close()
            self._old_sessions.append(session)  # (torch may still hold its store)
            raise PublishError(
                f"LMC-E320: stage {self.stage}: could not join the master relay's publish group at "
                f"{host}:{port} within {self.timeout_s:.0f} s (weight_sync.publish_timeout_s): "
                f"{exc}. Is the relay alive? Its log is relay-*.log in the run's logs/") from exc
        # the group calls back into the session's store (a Python object) while it lives:
        # every session stays referenced; the one of a master relay that was lost is closed
        if self.session is not None:
            self.session.close()
            self._old_sessions.append(self.session)
        self.session = session
        self.backend, self.pg, self.master = backend, channel.pg, (host, port)
        self.channel = channel
        if self.backend != self._said_backend:
            self._said_backend = self.backend
            print(f"[publish] stage {self.stage}: channel {backend} to {host}:{port}"
                  f"{f' ({session.why})' if session.why else ''}", flush=True)

    def wait(self) -> None:
        """Block until the previous publish has been sent (raises if the send failed)."""
        self._idle.wait()
        if self.error is not None:
            raise RuntimeError(within("weight publication to the master relay failed", self.error,
                                      "LMC-E322"))

    def publish(self, version: int, tensors=None) -> PublishStats:
        """Export this stage as ``version``; returns once the host buckets are filled.
        ``tensors``: (Hugging Face name, tensor) pairs to publish instead of exporting the
        model (a one-rank benchmark that trains a transformers model: ``bench.delta``)."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        nbytes = count = 0
        if self.exports and not self.is_lead:  # take part in the TP gathers; pack nothing
            for _name, _tensor in iter_stage_hf_tensors(self.model, self.hf_config):
                pass
        elif self.exports:
            if self.is_lead:
                self._idle.clear()
            held = None  # bucket k is queued when k+1 exists (to know which one is the last)
            named = tensors if tensors is not None else self._exported()
            for bucket in self.packer.pack(named):
                if held is not None:
                    self._enqueue(version, count - 1, held, last=False)
                held = bucket
                nbytes += bucket.nbytes
                count += 1
            if held is not None:
                self._enqueue(version, count - 1, held, last=True)
            if self.is_lead:
                self._queue.put(None)  # end of this publish
        t2 = time.perf_counter()
        if self.is_lead and not self._reported:
            self._reported = True
            print(f"[publish] stage {self.stage}: {count} buckets, {self.pinned_bytes() / 2**30:.2f} "
                  f"GiB of {'pinned' if self.packer.pin_memory else 'host'} buffers on this rank "
                  + (" (its own shard: weight_sync.export=per_rank)" if self.per_rank else
                     " (the stage lead; the stage's other TP ranks hold none)"), flush=True)
        return PublishStats(version, t2 - t1, nbytes, count, waited_previous_s=t1 - t0)

    def _exported(self):
        """What this rank packs: its stage, gathered (the stage lead), or its own shard
        (``per_rank``: (name, slice, (full shape, dim, start)) for a TP-cut tensor)."""
        if not self.per_rank:
            yield from iter_stage_hf_tensors(self.model, self.hf_config)
            return
        tp = self.ps.get_tensor_model_parallel_world_size()
        for name, t, dim, start in iter_rank_hf_shards(self.model, self.hf_config):
            if dim is None:
                yield name, t
            else:
                full = list(t.shape)
                full[dim] *= tp
                yield name, t, (tuple(full), dim, start)

    def pinned_bytes(self) -> int:
        """Host bytes this rank keeps for publishing (0 on ranks that do not send)."""
        return self.packer.nbytes() if self.packer is not None else 0

    def _enqueue(self, version: int, index: int, bucket, last: bool) -> None:
        """Hand bucket ``index`` to the sender: it is sent while the next one is gathered."""
        if not self.is_lead:
            return
        header = {"type": "bucket", "version": version, "stage": self.stage,
                  "num_stages": self.version_parts, "index": index, "last_of_stage": last,
                  "nbytes": bucket.nbytes, "chunk_bytes": self.chunk_bytes,
                  "metas": [m.to_dict() for m in bucket.metas]}
        self._queue.put((header, bucket.buffer))

    def _send_loop(self) -> None:
        sent = []  # the items of the version being sent: sent again, whole, after a failover
        while True:
            item = self._queue.get()
            if item == "close":
                try:
                    self.channel.send_header({"type": "close"})
                    self.channel.flush()
                except Exception:  # noqa: BLE001 - the relay may be gone at shutdown
                    pass
                return
            if item is None:
                try:
                    self._end_version(sent)
                except Exception as exc:  # noqa: BLE001 - a lost master: send it again there
                    if self._failover(sent, exc):
                        try:
                            self._end_version(sent)
                        except Exception as again:  # noqa: BLE001
                            self.error = self.error or again
                sent = []
                self._idle.set()
                if self.error is not None:
                    return
                continue
            start = time.perf_counter()
            sent.append(item)
            try:
                if len(sent) == 1:
                    self._open_version(item[0], self.encoder.proposed_base())
                self._send(item)
            except Exception as exc:  # noqa: BLE001 - surfaced by the next publish / wait
                if not self._failover(sent, exc):
                    self._idle.set()
                    return
            self.last_send_s += time.perf_counter() - start

    def _open_version(self, header: dict, base: Optional[int]) -> None:
        """The version handshake: the relay answers whether it takes ``header``'s version and
        holds ``base`` (the version the deltas would be against)."""
        self.channel.send_header({"type": "version", "version": header["version"],
                                  "stage": self.stage, "num_stages": self.version_parts,
                                  "stripes": self.stripes, "base": base})
        reply = self.channel.recv_header()
        self._accepted = bool(reply.get("accept"))
        against = self.encoder.begin(header["version"], bool(reply.get("base_ok")))
        self._tally = {"version": header["version"], "full_bytes": 0, "sent_bytes": 0,
                       "delta_buckets": 0, "buckets": 0, "base_version": against,
                       "encode_s": 0.0, "compared_elements": 0, "changed_elements": 0,
                       "digests": {}}
        if not self._accepted:
            self.encoder.forget()
            print(f"[publish] stage {self.stage}: the master relay refused version "
                  f"{header['version']} ({reply.get('reason')}); the next one goes whole",
                  flush=True)
            if self.on_refused is not None:  # (the controller: barrier modes must not wait)
                try:
                    self.on_refused(header["version"], str(reply.get("reason") or ""))
                except Exception as exc:  # noqa: BLE001 - the publication goes on
                    print(f"[publish] could not report the refusal: {exc}", flush=True)

    def _send(self, item, whole: bool = False) -> None:
        header, buffer = item
        if not self._accepted:
            return
        start = time.perf_counter()
        encoding, payload = ("full", None) if whole else self.encoder.encode(header["index"],
                                                                              buffer)
        bucket_digest = digest(buffer)
        self._tally["digests"][header["index"]] = bucket_digest
        shm = self.backend == "shm"
        header = dict(header, encoding=encoding, digest=bucket_digest,
                      payload_bytes=len(payload) if payload is not None else header["nbytes"],
                      base_version=self.encoder.against if payload is not None else None,
                      resend=whole, **({"via": "shm"} if shm else {}))
        self._tally["encode_s"] += time.perf_counter() - start
        if not whole and self.encoder.last_changed is not None:
            self._tally["compared_elements"] += header["nbytes"] // self.encoder.unit
            self._tally["changed_elements"] += self.encoder.last_changed
        self.channel.send_header(header)
        self._tally["full_bytes"] += 0 if whole else header["nbytes"]
        self._tally["buckets"] += 0 if whole else 1
        self._tally["sent_bytes"] += header["payload_bytes"]
        full = buffer
        if payload is not None:
            self._tally["delta_buckets"] += 1
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if shm and payload is None:
            buffer = buffer[:0]  # the bytes go through shared memory alone
        for off in range(0, buffer.numel(), self.chunk_bytes):  # as the relay reads
            self.channel.send(buffer[off:min(buffer.numel(), off + self.chunk_bytes)])
        if shm:
            self._write_shm(header, full)

    def _write_shm(self, header: dict, full: torch.Tensor) -> None:
        """The same host: the relay answers with the shared-memory file of the bucket's slot
        and this rank copies the whole bucket into it (one copy from its pinned buffer). A
        delta, sent before, is what the relay forwards down its chain."""
        path = self.channel.recv_header().get("path")
        if path is None:  # the relay does not keep it (refused, or no room)
            return
        write_shm(path, full[:header["nbytes"]])
        self.channel.send_header({"type": "written", "nbytes": header["nbytes"]})

    def _end_version(self, items) -> None:
        """End this stage's part of the version; buckets the relay could not rebuild from
        their deltas (a digest mismatch, a base it no longer holds) are sent again whole."""
        if not items:
            return
        if self._accepted:
            by_index = {item[0]["index"]: item for item in items}
            failed = False
            for _round in range(2):
                self.channel.send_header({"type": "end"})
                answer = self.channel.recv_header()
                need, failed = [int(i) for i in answer.get("need", [])], answer.get("failed")
                if not need:
                    break
                print(f"[publish] stage {self.stage}: the master relay could not rebuild "
                      f"bucket(s) {need} of version {items[0][0]['version']} from their "
                      "deltas; sending them whole", flush=True)
                for index in need:
                    self._send(by_index[index], whole=True)
            self.channel.flush()
            self.encoder.end([item[0]["index"] for item in items])
            if failed:  # the relay dropped it mid-way (no room, or a newer one won)
                self.encoder.forget()
            else:
                self.sent_stats = dict(self._tally)
        else:
            self.encoder.forget()

    def _failover(self, items, exc: BaseException) -> bool:
        """The master relay is gone: ask where its successor is (``locate_master``), join its
        publish group and send this version's buckets so far again, whole (the rest follow as
        usual). Sets ``self.error`` and returns False when there is no successor in time."""
        failed = self.master
        if self.locate_master is None:
            self.error = exc
            return False
        deadline = time.time() + self.failover_timeout_s
        last: BaseException = exc
        while time.time() < deadline:
            try:
                host, port = self.locate_master(failed)
                self._connect(host, port)
                self._open_version(items[0][0], None)  # a new master: no base
                for item in items:
                    self._send(item, whole=False)
                self.channel.flush()
            except Exception as retry_exc:  # noqa: BLE001 - try again until the deadline
                last = retry_exc
                time.sleep(1.0)
                continue
            self.failovers += 1
            print(f"[publish] stage {self.stage}: master relay {failed[0]}:{failed[1]} lost "
                  f"({exc}); publishing to {host}:{port} now", flush=True)
            return True
        self.error = PublishError(
            f"LMC-E322: stage {self.stage}: the master relay {failed[0]}:{failed[1]} was lost "
            f"({exc}) and "
            f"no successor took the publish within {self.failover_timeout_s:.0f} s "
            f"(weight_sync.failover_timeout_s); last error: {last}")
        return False

    def close(self) -> None:
        if self.is_lead and self.error is None:
            self.wait()
            self._queue.put("close")
            self._sender.join(timeout=30)


def parameter_dtype(model) -> Optional[torch.dtype]:
    """The dtype of ``model``'s (or its first chunk's) parameters: what buckets hold when the
    packer casts nothing."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for param in chunk.parameters():
            return param.dtype
    return None
