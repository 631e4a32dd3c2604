"""The GPU check, 4-6: the publish export, the publish channel's staging (and the channel to a relay process), the CUDA-IPC exporter opened in a second process (``bench/gpu.py``)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from typing import Dict, Tuple

import torch

from .common import GB, QWEN2_5_7B, Bench, _child_failed, _digest, _Peer


# ---------------------------------------------------------------------- 4. publish export
def check_publish(b: Bench) -> Tuple[bool, str]:
    from megatron.core import parallel_state as ps

    from ...models.hf import build_hf_config, tiny_hf_config
    from ...trainer.model import build_gpt_model
    from ...trainer.export import iter_stage_hf_tensors
    from ...weights.bucket import BucketPacker

    if b.cuda:  # one PP4 stage of Qwen2.5-7B with the embedding and the output layer
        cfg = build_hf_config("qwen2", hidden_act="silu", num_hidden_layers=7, **QWEN2_5_7B)
        bucket_bytes, dtype = 512 * 2**20, torch.bfloat16
    else:
        cfg, bucket_bytes, dtype = tiny_hf_config("qwen2"), 40_000, torch.float32
    with torch.no_grad():
        model = build_gpt_model(cfg, dtype=dtype)
    packer = BucketPacker(bucket_bytes, pin_memory=b.cuda)

    def publish():
        return [bkt.nbytes for bkt in packer.pack(iter_stage_hf_tensors(model, cfg))]

    first = b.timed(publish)  # allocates the pinned buffers
    sizes = publish()
    steady = b.timed(publish, 3 if b.cuda else 1)
    nbytes = sum(sizes)
    b.shared["publish"] = (packer, len(sizes), max(sizes))
    b.shared["publish_heads"] = cfg.num_attention_heads  # the shard pull's layout
    b.figures.update({"publish_blocked_s": steady, "publish_first_s": first,
                      "publish_bytes_gb": nbytes / GB, "publish_pinned_gb": packer.nbytes() / GB,
                      "publish_gb_per_s": nbytes / GB / max(steady, 1e-9), "publish_buckets": len(sizes)})
    model = None
    if b.cuda:
        torch.cuda.empty_cache()
    ok = packer.nbytes() >= nbytes and len(sizes) > 1 and (packer.pin_memory or not b.cuda)
    tp = ps.get_tensor_model_parallel_world_size()
    b.exercised("stage_export", f"{cfg.num_hidden_layers} layers of hidden size "
                f"{cfg.hidden_size}, {str(dtype)[6:]}, into {len(sizes)} host buckets")
    b.covered("pinned_host_buckets", packer.pin_memory, f"{packer.nbytes() / GB:.2f} GB pinned",
              "no GPU (CPU rehearsal: pageable host memory)")
    b.covered("qwen2.5_7b_stage_size", b.cuda, "a PP4 stage (7 of 28 layers)",
              "no GPU (CPU rehearsal: a tiny model)")
    b.covered("tp_gathers_in_export", tp > 1, f"TP={tp}", f"TP={tp}: nothing to gather")
    return ok, (f"{nbytes / GB:.2f} GB in {len(sizes)} buckets: blocked {steady:.2f} s "
                f"({nbytes / GB / max(steady, 1e-9):.1f} GB/s; first {first:.2f} s), "
                f"{packer.nbytes() / GB:.2f} GB {'pinned' if packer.pin_memory else 'host'}")


# ---------------------------------------------------------------------- 5. staging
def check_staging(b: Bench) -> Tuple[bool, str]:
    """How long one chunk's host-to-device copy takes to complete while a long queue of GEMMs
    waits on the default stream: on the channel's own stream (what ``Channel.send`` does) and,
    for comparison, on the default stream (what it did). Then the channel itself: chunks of a
    bucket sent to a relay in a second process (``_publish_channel``)."""
    chunk = (64 if b.cuda else 1) * 2**20
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=b.cuda)
    dev = torch.empty(chunk, dtype=torch.uint8, device=b.device)
    n = 4096 if b.cuda else 64
    a = torch.randn(n, n, device=b.device, dtype=torch.bfloat16 if b.cuda else torch.float32)

    def gemms():
        for _ in range(40 if b.cuda else 2):
            a @ a

    def copy_latency(side: bool) -> float:
        b.sync()
        stream = torch.cuda.Stream() if (side and b.cuda) else None
        gemms()  # queued, not finished
        t0 = time.perf_counter()
        with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            dev.copy_(host, non_blocking=True)
            if b.cuda:
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
        latency = time.perf_counter() - t0
        b.sync()
        return latency

    gemm_s = b.timed(gemms)
    side = min(copy_latency(True) for _ in range(3))
    default = min(copy_latency(False) for _ in range(3))
    b.figures.update({"staging_chunk_mb": chunk / 2**20, "staging_side_stream_ms": side * 1e3,
                      "staging_default_stream_ms": default * 1e3, "staging_gemm_queue_ms": gemm_s * 1e3})
    ok = side < 0.5 * default if b.cuda else True  # CPU: no streams to compare
    note = (f"a {chunk / 2**20:.0f} MiB chunk completes in {side * 1e3:.1f} ms on its own stream, "
            f"{default * 1e3:.1f} ms behind {gemm_s * 1e3:.0f} ms of queued GEMMs on the default "
            "stream" + ("" if b.cuda else " (CPU: streams are no-ops, logic only)"))
    b.covered("side_stream_h2d_staging", b.cuda, f"{chunk / 2**20:.0f} MiB chunks behind queued "
              "GEMMs", "no GPU (CPU rehearsal: streams are no-ops)")
    # The channel itself: NCCL needs one GPU per rank (the relay's and the trainer's).
    backend = "nccl" if b.gpus >= 2 else "gloo"
    channel_ok, channel_note = _publish_channel(b, backend, chunk)
    b.covered("nccl_publish_channel", backend == "nccl", "GPU 0 -> GPU 1",
              f"{b.short_of(2)}: NCCL needs one GPU per rank (gloo ran instead)")
    return ok and channel_ok, f"{note}; publish channel: {channel_note}"


def _publish_channel(b: Bench, backend: str, chunk: int) -> Tuple[bool, str]:
    """A buffer of 3.5 chunks sent as the publisher sends a bucket (a header, then chunk by
    chunk through ``weights.transport.Channel`` over a two-rank ``stage_group``) to a relay in
    a second process (on GPU 1 over NCCL), which returns a SHA-256 of what it received."""
    import torch.distributed as dist

    from ...weights.transport import Channel, stage_group

    nbytes = chunk * 3 + chunk // 2 + 13  # a short, odd last chunk
    g = torch.Generator().manual_seed(11)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if b.cuda:
        host = host.pin_memory()
    timeout = datetime.timedelta(seconds=300)
    # The relay's rendezvous store: here, hosted by this (the trainer's) end.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout)
    relay = _Peer("transfer:_relay_main", backend, store.port, chunk, 1 if backend == "nccl" else None)
    try:
        pg = stage_group(store, 0, 1, backend, timeout)  # rank 1: the stage's lead
        channel = Channel(pg, 0, backend, chunk,
                          device=b.device if backend == "nccl" else None)
        channel.send_header({"type": "bucket", "nbytes": nbytes, "chunk_bytes": chunk})
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            channel.send(host[off:off + chunk])
        channel.flush()
        send_s = time.perf_counter() - t0
        digest, where = relay.recv()
    finally:
        relay.close()
    equal = digest == hashlib.sha256(host.numpy()).hexdigest()
    rate = nbytes / GB / max(send_s, 1e-9)
    b.figures.update({"staging_channel_backend": backend, "staging_channel_equal": equal,
                      "staging_channel_gb_per_s": rate})
    b.exercised("publish_channel", f"{backend}: stage_group + Channel to a second process "
                f"(pid {relay.pid}, staged on {where}), {nbytes} bytes in "
                f"{-(-nbytes // chunk)} chunks, bytes {'equal' if equal else 'DIFFERENT'}")
    return equal, (f"{backend} to pid {relay.pid}, {nbytes / 2**20:.1f} MiB "
                   f"{'equal' if equal else 'DIFFERENT'}, {rate:.2f} GB/s")


def _relay_main(conn, backend: str, port: int, chunk: int, device) -> None:
    """The relay end of ``_publish_channel`` (a ``_Peer``): receive one bucket as
    ``relay/publish_receiver.py`` does and answer (SHA-256, where it was staged)."""
    try:
        import torch.distributed as dist

        from ...weights.transport import Channel, stage_group

        if device is not None:
            torch.cuda.set_device(device)
        conn.send(os.getpid())
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        pg = stage_group(store, 0, 0, backend, timeout)  # rank 0: the relay
        channel = Channel(pg, 1, backend, chunk,
                          device=torch.device("cuda", device) if device is not None else None)
        header = channel.recv_header()
        host = torch.empty(header["nbytes"], dtype=torch.uint8)
        for off in range(0, header["nbytes"], header["chunk_bytes"]):
            channel.recv_into(host[off:off + header["chunk_bytes"]])
        where = str(channel.staging.device) if channel.staging is not None else "host"
        conn.send((hashlib.sha256(host.numpy()).hexdigest(), where))
        conn.recv()  # stop: the groups live until the sender has flushed
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        _child_failed(conn)


# ---------------------------------------------------------------------- 6. CUDA IPC
def check_cuda_ipc(b: Bench) -> Tuple[bool, str]:
    from ...relay.transports.cuda_ipc import CudaIpcExporter, standin_bucket_classes
    from ...weights.bucket import read_bucket

    packer, count, largest = b.shared["publish"]
    try:
        from ...relay.transports.cuda_ipc import _sglang_bucket_classes

        classes, which = _sglang_bucket_classes(), "SGLang's"
    except ImportError:
        classes, which = standin_bucket_classes(), "stand-in"
    exporter = CudaIpcExporter(classes=classes, require_cuda=b.cuda)
    devices = [str(b.device)]  # the engine's GPUs, one per TP rank: an engine at TP=1
    mem: Dict[str, float] = {}
    payload_bytes = 0
    buffers = packer.last_buckets
    # The engine: a second process that opens each payload as SGLang's TP worker does, before
    # the next bucket is served (started first: its imports and CUDA context are not measured).
    engine = _Peer("transfer:_engine_main", which == "SGLang's")
    opened, equal, where = 0, True, set()
    try:
        with b.peak(mem, "pull"):
            for i, bucket in enumerate(buffers):
                if i >= 2:  # the engine applied bucket i-2 (the relay's /bucket protocol)
                    exporter.free("lease", [i - 2])
                named = read_bucket(bucket.buffer, bucket.metas)
                # what the relay serves: its stored bucket, copied up whole
                per_rank = exporter.payload_stored("lease", i, bucket.buffer, bucket.metas,
                                                   devices)
                payload_bytes += sum(len(p) for p in per_rank)
                index, digest, on = engine.ask((i, per_rank[0]))
                opened += index == i
                equal &= digest == _digest(named.items())
                where.add(on)
            held = exporter.held("lease")
            exporter.release("lease")
        shard = _shard_pull(b, exporter, engine, buffers)
        _relay_h2d(b, max(buffers, key=lambda bkt: bkt.nbytes))
    finally:
        engine.close()
    left = (torch.cuda.memory_allocated() / GB) if b.cuda else 0.0
    b.figures.update({"cuda_ipc_gpu_peak_gb": mem["pull"], "cuda_ipc_largest_bucket_gb": largest / GB,
                      "cuda_ipc_payload_bytes": payload_bytes, "cuda_ipc_peak_buckets":
                      exporter.peak_buckets_held, "cuda_ipc_classes": which,
                      "cuda_ipc_second_process_buckets": opened,
                      "cuda_ipc_second_process_equal": equal,
                      "cuda_ipc_second_process_device": ",".join(sorted(where))})
    b.figures.update(shard[1])
    reopened = opened == len(buffers) and equal and where == {b.device.type} and shard[0]
    ok = (exporter.peak_buckets_held <= 2 and held == sorted(held)[-2:] and
          mem["pull"] <= 2 * largest / GB * 1.05 + 0.01 and not exporter.held("lease") and
          reopened)
    carrier = "CUDA IPC handles" if b.cuda else "CPU shared memory (torch's fd passing)"
    b.exercised("ipc_payloads", f"{which} classes, {len(buffers)} buckets, at most "
                f"{exporter.peak_buckets_held} held")
    b.covered("second_process_open", opened > 0, f"pid {engine.pid} rebuilt {opened} of "
              f"{len(buffers)} buckets from {carrier} on {','.join(sorted(where))}, bytes "
              f"{'equal (SHA-256)' if equal else 'DIFFERENT'}", "the engine process opened none")
    b.covered("cuda_ipc_handles", b.cuda, "opened by another process",
              "no GPU (CPU rehearsal: the same payload over CPU shared memory)")
    b.covered("sglang_format_and_patched_reductions", which == "SGLang's",
              "SGLang's MultiprocessingSerializer/SafeUnpickler, device UUIDs",
              "SGLang not importable (stand-in classes, handles by device index)")
    b.covered("one_payload_per_engine_tp_rank", len(devices) > 1, f"{len(devices)} GPUs",
              f"an engine on {len(devices)} device: one payload per bucket")
    return ok, (f"{len(buffers)} buckets, {which} classes: at most {exporter.peak_buckets_held} "
                f"held, engine-GPU peak {mem['pull']:.2f} GB (largest bucket {largest / GB:.2f} GB), "
                f"{payload_bytes} payload bytes, {left:.2f} GB allocated after release; "
                f"{opened} rebuilt in pid {engine.pid}, bytes {'equal' if equal else 'DIFFERENT'}")


def _relay_h2d(b: Bench, bucket) -> None:
    """The relay's copy of a stored bucket up to an engine GPU: from its shared memory as it is
    (pageable: what it does today) and after registering those pages with CUDA
    (``cudaHostRegister``: what pinning the relay's buckets would give), and what registering
    costs -- the figures that decide whether the relay should pin its buckets."""
    from ...weights.bucket import ShmBucket

    shm = ShmBucket(bucket.buffer.numel(), prefix="laminar-bench")  # as the relay stores it
    try:
        shm.buffer.copy_(bucket.buffer)
        _h2d_from(b, shm.buffer)
    finally:
        shm.close()


def _h2d_from(b: Bench, buffer: torch.Tensor) -> None:
    dev = torch.empty(buffer.numel(), dtype=torch.uint8, device=b.device)
    pageable = b.timed(lambda: dev.copy_(buffer, non_blocking=True), repeat=3)
    gb = buffer.numel() / GB
    b.figures["relay_h2d_pageable_gb_per_s"] = gb / pageable
    if not b.cuda:
        b.not_exercised("relay_h2d_registered", "no GPU (CPU rehearsal: nothing to register)")
        return
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    register_s = time.perf_counter() - t0
    try:
        pinned = b.timed(lambda: dev.copy_(buffer, non_blocking=True), repeat=3) \
            if int(err) == 0 else float("nan")
    finally:
        if int(err) == 0:
            cudart.cudaHostUnregister(buffer.data_ptr())
    b.figures.update({"relay_h2d_registered_gb_per_s": gb / pinned,
                      "relay_h2d_register_s": register_s, "relay_h2d_bucket_gb": gb})
    b.covered("relay_h2d_registered", int(err) == 0, f"{gb:.2f} GB bucket: pageable "
              f"{gb / pageable:.1f} GB/s, registered {gb / pinned:.1f} GB/s (registering took "
              f"{register_s:.3f} s)", f"cudaHostRegister failed ({err})")


SHARD_GROUPS = 2  # groups of a shard pull sent to the engine (the embedding and first layers)


def _shard_pull(b: Bench, exporter, engine, buffers) -> Tuple[bool, dict]:
    """Each TP rank's own parameters (``weight_sync.engine_pull=shard``): the stage as SGLang's
    per-rank layout at TP2 (both ranks on this device), the first ``SHARD_GROUPS`` groups cut
    onto the device and opened by the engine process as SGLang's direct load does (a list of
    (name, tensor), views of one allocation per rank); each rank's tensors equal the layout's."""
    from ...relay.shard_pulls import ShardPlan
    from ...weights.bucket import read_bucket

    named = {}
    for bucket in buffers:
        named.update(read_bucket(bucket.buffer, bucket.metas))
    plan = ShardPlan.of_tensors(named, 2, b.shared["publish_heads"],
                                max(bkt.nbytes for bkt in buffers))
    groups = min(SHARD_GROUPS, len(plan.groups))
    ok, equal = _open_groups(b, exporter, engine, plan, "shard", groups)
    b.covered("shard_pull_direct_payloads", ok,
              f"{groups} groups x 2 ranks opened in another process, equal to the layout",
              "a rank's payload was not opened, or differed")
    version = sum(t.numel() * t.element_size() for t in named.values())
    moe_ok, moe = _moe_shard_pull(b, exporter, engine)
    return ok and moe_ok, {
        "shard_pull_groups_checked": groups, "shard_pull_equal": bool(equal),
        "shard_pull_groups": len(plan.groups),
        "shard_pull_rank_fraction": sum(plan.rank_bytes(i) for i in range(
            len(plan.groups))) / max(version, 1), **moe}


def _open_groups(b: Bench, exporter, engine, plan, lease: str, groups: int) -> Tuple[bool, bool]:
    """The first ``groups`` groups of ``plan`` at TP2 (both ranks on this device), cut onto the
    device and opened by the engine process as SGLang's direct load does: (every rank's
    payload opened and equal to the layout, every one equal)."""
    equal, opened = True, 0
    for i in range(groups):
        per_rank = exporter.payload_shard(lease, i, plan, [str(b.device)] * 2)
        for rank, payload in enumerate(per_rank):
            want = [(n, plan.layout.fill(n, rank, plan.tensor, torch.empty(
                plan.layout.shapes[n], dtype=plan.layout.dtypes[n]))) for n in plan.groups[i]]
            index, digest, _ = engine.ask((i, payload, "direct"))
            opened += index == i
            equal &= digest == _digest(want)
        exporter.free(lease, [i])
    exporter.release(lease)
    return opened == 2 * groups and equal, equal


def _moe_shard_pull(b: Bench, exporter, engine) -> Tuple[bool, dict]:
    """An MoE layer's shard pull at TP2 EP2 (both ranks on this device): one Qwen3-30B-A3B
    layer (128 experts of 768 x 2048, bf16: 1.2 GB; 8 small experts in the rehearsal), each
    rank's fused experts (``w13_weight`` [64, 1536, 2048], ``w2_weight``) cut onto the device
    and opened by the engine process as SGLang's direct load does, equal to the layout."""
    from ...relay.shard_pulls import ShardPlan

    experts, inter, hidden, heads, kv, dim = (128, 768, 2048, 32, 4, 128) if b.cuda else \
        (8, 32, 64, 4, 2, 16)
    p = "model.layers.0."
    shapes = {p + "self_attn.q_proj.weight": (heads * dim, hidden),
              p + "self_attn.k_proj.weight": (kv * dim, hidden),
              p + "self_attn.v_proj.weight": (kv * dim, hidden),
              p + "self_attn.o_proj.weight": (hidden, heads * dim),
              p + "mlp.gate.weight": (experts, hidden)}
    for e in range(experts):
        for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                            ("down", (hidden, inter))):
            shapes[f"{p}mlp.experts.{e}.{proj}_proj.weight"] = shape
    g = torch.Generator().manual_seed(7)
    named = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    plan = ShardPlan.of_tensors(named, 2, heads, 512 << 20, ep=2)
    ok, equal = _open_groups(b, exporter, engine, plan, "moe", len(plan.groups))
    w13 = plan.layout.shapes[p + "mlp.experts.w13_weight"]
    b.covered("shard_pull_moe_experts", ok, f"an MoE layer's {len(plan.groups)} groups x 2 "
              f"ranks (w13_weight {list(w13)} each) opened in another process, equal to the "
              "layout", "a rank's payload was not opened, or differed")
    version = sum(t.numel() * t.element_size() for t in named.values())
    return ok, {"shard_pull_moe_equal": bool(equal), "shard_pull_moe_rank_fraction": sum(
        plan.rank_bytes(i) for i in range(len(plan.groups))) / version}


def _engine_main(conn, sglang: bool) -> None:
    """The engine of ``check_cuda_ipc`` (a ``_Peer``): for each ``(index, payload)``, what an
    SGLang TP worker does with its entry of ``serialized_named_tensors`` -- deserialize it
    (SGLang's serializer after its ``monkey_patch_torch_reductions``, or, with the stand-in
    classes, the pickle they make), rebuild the bucket's tensors by their metadata -- and answer
    ``(index, SHA-256 of the tensors, device type)``, dropping them before it answers."""
    try:
        if sglang:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
            from sglang.srt.weight_sync.tensor_bucket import (FlattenedTensorBucket,
                                                              FlattenedTensorMetadata)

            monkey_patch_torch_reductions()  # device UUIDs back to this process's indices

            def rebuild(payload):  # weight_updater._update_weights_from_flattened_bucket
                obj = MultiprocessingSerializer.deserialize(payload)
                meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
                                                start_idx=m.start_idx, end_idx=m.end_idx,
                                                numel=m.numel) for m in obj["metadata"]]
                flat = obj["flattened_tensor"]
                return flat, FlattenedTensorBucket(flattened_tensor=flat,
                                                   metadata=meta).reconstruct_tensors()
        else:
            import base64
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401 - registers torch's reductions

            from ...relay.transports.cuda_ipc import reconstruct_tensors

            def rebuild(payload):
                obj = ForkingPickler.loads(base64.b64decode(payload))
                flat = obj["flattened_tensor"]
                return flat, reconstruct_tensors(flat, obj["metadata"])
        def direct(payload):  # weight_updater.update_weights_from_tensor, load_format=direct
            if sglang:
                return MultiprocessingSerializer.deserialize(payload)
            return ForkingPickler.loads(base64.b64decode(payload))

        conn.send(os.getpid())
        while (msg := conn.recv()) is not None:
            if len(msg) == 3:  # a shard pull's rank payload: a list of (name, tensor)
                named = direct(msg[1])
                answer = (msg[0], _digest(named), named[0][1].device.type)
                del named
                conn.send(answer)
                continue
            index, payload = msg
            flat, named = rebuild(payload)
            answer = (index, _digest(named), flat.device.type)
            del flat, named  # the exporter may free the bucket once we answer
            conn.send(answer)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the check
        _child_failed(conn)
