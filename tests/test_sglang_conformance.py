"""Our SGLang client and the CPU engine against SGLang 0.5.23's own source (the pinned wheel,
downloaded once and cached under .venv): its route table, its request structs and defaults, its
sampling-parameter and response contract (``sglang/api/v1/api_types.py``), its auth decision and
its weight-update session messages. Skipped, saying why, when the wheel cannot be had."""

import asyncio
import inspect
import json
import re

import pytest
from aiohttp import web

from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.client import EngineError, SGLangClient
from laminar_mcore.rollout.engine_core import SGLANG_SAMPLING_FIELDS
from laminar_mcore.rollout.engine_http import auth_allowed
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
from laminar_mcore.testing import sglang_source

# The routes the CPU engine serves (README: "The CPU engine and SGLang").
SERVED = {("POST", "/generate"), ("PUT", "/generate"), ("POST", "/begin_weight_update"),
          ("POST", "/end_weight_update"), ("POST", "/update_weights_from_tensor"),
          ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
          ("POST", "/update_weights_from_distributed"), ("POST", "/destroy_weights_update_group"),
          ("POST", "/update_weight_version"), ("POST", "/pause_generation"),
          ("POST", "/continue_generation"), ("POST", "/abort_request"), ("GET", "/flush_cache"),
          ("POST", "/flush_cache"), ("GET", "/model_info"), ("GET", "/get_model_info"),
          ("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/v1/loads"),
          ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/ready"), ("GET", "/metrics"),
          ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}


@pytest.fixture(scope="module")
def sglang():
    try:
        sglang_source.fetch()
    except Exception as exc:  # noqa: BLE001 - no registry, no wheel: say why and skip
        pytest.skip(f"SGLang {sglang_source.VERSION}'s wheel is not available: {exc}")
    return sglang_source


@pytest.fixture(scope="module")
def api_types(sglang):
    pytest.importorskip("msgspec")
    return sglang.load_module("sglang/api/v1/api_types.py", "sglang_api_types_0_5_23")


@pytest.fixture(scope="module")
def cpu_routes(tmp_path_factory):
    from laminar_mcore.rollout.cpu_engine import CpuEngineServer, ServerArgs
    from laminar_mcore.rollout.model import DecoderLM

    cfg = tiny_hf_config("qwen2")
    server = CpuEngineServer(DecoderLM(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0)),
                             ServerArgs("/m"))
    return {(r.method, r.resource.canonical) for r in server.app.router.routes()
            if r.method != "HEAD"}


def test_the_cpu_engine_serves_exactly_the_documented_sglang_routes(sglang, cpu_routes):
    table = sglang.routes()
    assert cpu_routes == SERVED
    assert SERVED <= table, sorted(SERVED - table)  # nothing SGLang 0.5.23 does not serve
    for gone in ("/get_load", "/get_weight_version"):  # what our old client called
        assert not any(path == gone for _, path in table), gone


def test_sampling_fields_and_session_messages_are_sglangs(sglang, api_types):
    assert SGLANG_SAMPLING_FIELDS == api_types.SamplingParams.__struct_fields__
    source = sglang.read("sglang/srt/managers/scheduler_components/weight_updater.py")
    from laminar_mcore.rollout.engine_weights import FLUSH_REFUSED, SESSION_REQUIRED

    for op in ("update_weights_from_tensor", "update_weights_from_distributed"):
        pieces = re.search(rf'message="{op} must run between "\s*"([^"]*)"', source)
        assert pieces and SESSION_REQUIRED.format(op=op) == f"{op} must run between {pieces.group(1)}"
    flat = re.sub(r'"\s*\n\s*"', "", source)
    assert FLUSH_REFUSED in flat
    for msg in ("a weight-update session is already open; call end_weight_update() first",
                "no weight-update session is open; call begin_weight_update() first"):
        assert msg in flat


def test_auth_decisions_equal_sglangs(sglang):
    auth = sglang.load_module("sglang/srt/utils/auth.py", "sglang_auth_0_5_23")
    key = "k3y"
    for path in ("/generate", "/health", "/health_generate", "/ready", "/metrics", "/model_info",
                 "/update_weights_from_tensor", "/v1/chat/completions"):
        for header in (None, "Bearer k3y", "bearer k3y", "BEARER k3y", "Bearer wrong", "k3y",
                       "Basic k3y", "Bearer  k3y", ""):
            for api_key in (None, key):
                level = auth.AuthLevel.ADMIN_OPTIONAL if "weights" in path else auth.AuthLevel.NORMAL
                theirs = auth.decide_request_auth(method="POST", path=path,
                                                  authorization_header=header, api_key=api_key,
                                                  admin_api_key=None, auth_level=level).allowed
                assert auth_allowed(path, "POST", header, api_key) == theirs, (path, header, api_key)


class Recorder:
    """A loopback HTTP server that records what our client sends and answers success."""

    def __init__(self):
        self.bodies = {}
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request):
        self.bodies[request.path] = await request.json() if request.can_read_body else None
        if request.path == "/model_info":
            return web.json_response({"weight_version": "3"})
        return web.json_response({"success": True, "message": "ok"})


def test_client_request_bodies_are_sglang_request_structs(sglang, api_types):
    structs = {"/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
               "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
               "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
               "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
               "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
               "/begin_weight_update": "BeginWeightUpdateReqInput",
               "/end_weight_update": "EndWeightUpdateReqInput",
               "/pause_generation": "PauseGenerationReqInput", "/abort_request": "AbortReq"}

    async def go():
        rec = Recorder()
        runner = web.AppRunner(rec.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with SGLangClient(f"http://127.0.0.1:{port}") as c:
            await c.begin_weight_update()
            await c.update_weights_from_tensor(["cGF5bG9hZA=="], weight_version="3")
            await c.init_weights_update_group("127.0.0.1", 1234, 1, 2)
            await c.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]],
                                                    load_format="flattened_bucket")
            await c.destroy_weights_update_group()
            await c.end_weight_update()
            await c.update_weights_from_disk("/m", weight_version="4")
            await c.pause_generation("retract")
            await c.abort_request("r1")
            await c.generate([1, 2], {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0,
                                      "top_k": -1, "sampling_seed": 7, "ignore_eos": True},
                             rid="r2")
            version = await c.get_weight_version()
        await runner.cleanup()
        return rec.bodies, version

    bodies, version = asyncio.run(go())
    assert version == "3"
    for path, struct in structs.items():
        fields = sglang.struct_fields(struct)
        body = bodies[path] or {}
        assert set(body) <= set(fields), (path, set(body) - set(fields))
        required = {k for k, v in fields.items() if v is ...}
        assert required <= set(body), (path, required - set(body))
    # Defaults we rely on are SGLang's (flush_cache true, the default group name and backend).
    for struct, method in (("UpdateWeightsFromTensorReqInput", SGLangClient.update_weights_from_tensor),
                           ("UpdateWeightsFromDistributedReqInput",
                            SGLangClient.update_weights_from_distributed),
                           ("UpdateWeightFromDiskReqInput", SGLangClient.update_weights_from_disk)):
        assert sglang.struct_fields(struct)["flush_cache"] is True
        assert inspect.signature(method).parameters["flush_cache"].default is True
    group = inspect.signature(SGLangClient.init_weights_update_group).parameters
    fields = sglang.struct_fields("InitWeightsUpdateGroupReqInput")
    assert group["group_name"].default == fields["group_name"] and group["backend"].default == fields["backend"]
    # /generate bodies and the sampling parameters the manager sends decode under SGLang's own
    # contract (unknown sampling keys are refused there).
    api_types.GenerateRequest.from_json_value(bodies["/generate"])
    api_types.SamplingParams.from_json_value(bodies["/generate"]["sampling_params"])
    with pytest.raises(api_types.JsonContractError):
        api_types.SamplingParams.from_json_value({"seed": 1})


def test_cpu_engine_answers_decode_under_sglangs_response_contract(api_types, tmp_path):
    cfg = tiny_hf_config("llama")
    save_hf_checkpoint(str(tmp_path / "m"), cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 1))

    async def go(url):
        async with SGLangClient(url) as c:
            out = await c._request("POST", "/generate", {
                "input_ids": [3, 4, 5], "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 5}}, timeout=30)
            chunks = [ch async for ch in c.generate_stream([3, 4], {"max_new_tokens": 3})]
            busy = asyncio.create_task(c.generate([1], {"max_new_tokens": 300, "ignore_eos": True},
                                                  rid="dup"))
            while not (await c.get_load()).num_running:  # running (300 tokens: a while yet)
                await asyncio.sleep(0.01)                # when its rid is sent again
            raw = []
            async with c._sess().post(url + "/generate", json={
                    "input_ids": [1], "rid": "dup", "stream": True}) as resp:
                status = resp.status
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        raw.append(line[5:].strip())
            await c.abort_request("dup")
            await busy
            return out, chunks, status, raw

    with EngineProcess(cpu_engine_command(str(tmp_path / "m"), kv_capacity_tokens=512),
                       log_path=str(tmp_path / "e.log")) as proc:
        out, chunks, status, raw = asyncio.run(go(proc.url))
    response = api_types.GenerateResponse.from_json_value(out)
    meta = response.meta_info
    assert meta.completion_tokens == 5 and len(meta.output_token_logprobs) == 5
    assert meta.input_token_logprobs[0].logprob is None and len(meta.input_token_logprobs) == 3
    assert [s.version for s in meta.weight_versions] == ["0"] and meta.weight_versions[0].end == 5
    for chunk in chunks:
        api_types.GenerateResponse.from_json_value(chunk)
    # An error after the stream started: HTTP 200, one error chunk, then [DONE] -- as SGLang.
    assert status == 200 and raw[-1] == b"[DONE]"
    error = api_types.GenerateStreamError.from_json_value(json.loads(raw[0]))
    assert "already in flight" in error.error.message


def test_flattened_bucket_payloads_are_what_sglangs_receivers_read(sglang, monkeypatch):
    """Issue #28 point 6, against SGLang's own ``tensor_bucket.py`` (it needs only torch):
    ``/update_weights_from_distributed``'s receiver computes the offsets itself, back to back,
    refusing an offset that is not a multiple of the element size -- our sender matches it byte
    for byte and refuses the same orders; ``/update_weights_from_tensor``'s receiver reads
    ``start_idx``/``end_idx`` from the payload -- our 16-byte-aligned CUDA-IPC bucket rebuilds
    bit for bit through it."""
    import torch
    import torch.distributed as dist

    from laminar_mcore.relay.transports.cuda_ipc import IPC_ALIGN, CudaIpcExporter
    from laminar_mcore.weights.update_group import flattened_order, send_tensors

    bucket_src = sglang.read("sglang/srt/weight_sync/tensor_bucket.py")
    runner_src = sglang.read("sglang/srt/model_executor/model_runner_components/weight_updater.py")
    empty_src = bucket_src[bucket_src.index("def empty("):bucket_src.index("def get_metadata(")]
    assert "if offset % dtype.itemsize:" in empty_src and "offset += size" in empty_src
    assert "self.flattened_tensor[meta.start_idx : meta.end_idx]" in bucket_src
    assert "FlattenedTensorBucket.empty(names, dtypes, shapes, self.device)" in runner_src
    assert "start_idx=meta.start_idx" in runner_src and "end_idx=meta.end_idx" in runner_src
    tb = sglang.load_module("sglang/srt/weight_sync/tensor_bucket.py",
                            "sglang_tensor_bucket_0_5_23")

    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    shapes = {"a": (torch.bfloat16, (3,)), "b": (torch.float32, (5, 3)), "c": (torch.int64, (7,)),
              "d": (torch.uint8, (5,)), "e": (torch.float16, (1,)), "f": (torch.float64, ())}
    named = {n: raw[:torch.Size(s).numel() * d.itemsize].clone().view(d).view(s)
             for n, (d, s) in shapes.items()}

    def same(x, y):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))

    def request(tensors):  # the names/dtypes/shapes of an /update_weights_from_distributed body
        return (list(tensors), [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                [list(t.shape) for t in tensors.values()])

    # Back to back: bf16[3] then fp32 -- SGLang refuses it, and so does our sender (first).
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        tb.FlattenedTensorBucket.empty(*request(named), "cpu")
    with pytest.raises(ValueError, match="Unaligned received tensor b"):
        send_tensors(None, named, "flattened_bucket")
    ordered = flattened_order(named)
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: sent.append(t.clone()))
    send_tensors(None, ordered, "flattened_bucket")
    bucket = tb.FlattenedTensorBucket.empty(*request(ordered), "cpu")
    assert bucket.get_flattened_tensor().numel() == sent[0].numel()
    bucket.get_flattened_tensor().copy_(sent[0])  # what SGLang's broadcast receives
    rebuilt = dict(bucket.reconstruct_tensors())
    assert list(rebuilt) == list(ordered) and all(same(rebuilt[n], t) for n, t in ordered.items())

    # CUDA IPC payload (layout only; CPU tensors, a capturing serializer): SGLang's own
    # metadata class, rebuilt by SGLang's own reconstruct_tensors.
    class Capture:
        @staticmethod
        def serialize(obj, output_str=False):
            Capture.last = obj
            return ""

    exporter = CudaIpcExporter(classes=(tb.FlattenedTensorBucket, tb.FlattenedTensorMetadata,
                                        Capture), require_cuda=False)
    exporter.payload("lease", 0, named, ["cpu"])
    payload = Capture.last
    assert all(m.start_idx % IPC_ALIGN == 0 for m in payload["metadata"])
    metas = payload["metadata"]
    assert any(m.start_idx > p.end_idx for p, m in zip(metas, metas[1:]))  # padded
    rebuilt = dict(tb.FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                            metadata=payload["metadata"]).reconstruct_tensors())
    assert list(rebuilt) == list(named) and all(same(rebuilt[n], t) for n, t in named.items())
    # what the relay serves: its stored bucket (64-byte starts) copied up whole, in one copy
    from laminar_mcore.weights.bucket import ShmBucket

    stored, stored_metas = ShmBucket.from_tensors(named)
    try:
        exporter.payload_stored("lease", 1, stored.buffer, stored_metas, ["cpu"])
        payload = Capture.last
        assert [m.start_idx for m in payload["metadata"]] == [m.offset for m in stored_metas]
        rebuilt = dict(tb.FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"],
                                                metadata=payload["metadata"]).reconstruct_tensors())
        assert list(rebuilt) == list(named)
        assert all(same(rebuilt[n], t) for n, t in named.items())
    finally:
        stored.close()
    exporter.release("lease")


def _between(source: str, start: str, end: str) -> str:
    return source[source.index(start):source.index(end, source.index(start))]


def test_the_twin_at_scale_behaves_as_0_5_23s_source(sglang, tmp_path):
    """Issue #28 point 7, each behaviour read from the wheel's source, then seen on a live CPU
    engine: the final chunk of a request aborted in the waiting queue, /health and /ready while
    starting and while paused with nothing running (the health window from
    SGLANG_HEALTH_CHECK_TIMEOUT), the pause/continue/abort answers, spans on finished outputs
    only, torch dtypes by attribute name, the session checked before the payload, and the
    deferred flush."""
    http = sglang.read("sglang/srt/entrypoints/http_server.py")
    tm = sglang.read("sglang/srt/managers/tokenizer_manager.py")
    abort = _between(tm, "def _handle_abort_req(", "def update_active_ranks(")
    for snippet in ('abort_message = recv_obj.abort_message or "Abort in waiting queue"',
                    'meta_info["completion_tokens"] = len(output_ids)',
                    "if is_stream and self.incremental_streaming_output:",
                    "output_ids = [output_ids[-1]] if len(output_ids) > 0 else []",
                    "finished=True"):
        assert snippet in abort, snippet
    health = _between(http, "async def health_generate(", "@app.")
    assert 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in http
    for snippet in ("server_status == ServerStatus.Starting", "await asyncio.sleep(1)",
                    "last_receive_tstamp > tic", "ServerStatus.UnHealthy",
                    "return Response(status_code=503)"):
        assert snippet in health, snippet
    assert "return not self.is_pause and self.is_healthy()" in tm  # /ready
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in tm  # the gate
    for answer in ('{"message": "Generation paused successfully.", "status": "ok"}',
                   '{"message": "Generation continued successfully.", "status": "ok"}'):
        assert answer in http
    assert "return Response(status_code=200)" in _between(http, "async def abort_request(",
                                                           "@app.")
    sched = sglang.read("sglang/srt/managers/scheduler.py")
    assert "req.rid.startswith(recv_req.rid)" in sched  # aborts by prefix
    streamer = sglang.read("sglang/srt/managers/scheduler_components/output_streamer.py")
    assert "if req.finished():\n            self.weight_versions.append(" in streamer
    assert "getattr(torch, dtype)" in sglang.read(
        "sglang/srt/model_executor/model_runner_components/weight_updater.py")
    updater = sglang.read("sglang/srt/managers/scheduler_components/weight_updater.py")
    tensor = _between(updater, "def update_weights_from_tensor(", "def update_weights_from_ipc(")
    assert tensor.index("if self._session is None:") < tensor.index("deserialize_own_rank")
    flush = sglang.read("sglang/srt/managers/scheduler_components/flush_wrapper.py")
    assert "Another flush_cache is already in progress." in flush
    assert "Timed out waiting for idle state." in flush

    cfg = tiny_hf_config("qwen2")
    save_hf_checkpoint(str(tmp_path / "m"), cfg,
                       initial_hf_state(type("M", (), {"path": None})(), cfg, 1))

    async def go(url):
        import aiohttp

        async def status(path):
            async with aiohttp.ClientSession() as s, s.get(url + path) as r:
                return r.status

        starting = [await status("/ready"), await status("/health")]
        while await status("/ready") != 200:
            await asyncio.sleep(0.1)
        async with SGLangClient(url, incremental_stream=True) as c:
            raw = []
            async with c._sess().post(url + "/generate", json={
                    "input_ids": [1, 2], "rid": "w", "stream": True, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        raw.append(json.loads(line[5:]))
                        if len(raw) == 3:
                            paused = await c._request("POST", "/pause_generation",
                                                      {"mode": "retract"}, timeout=30)
                            aborted = await c._request("POST", "/abort_request", {"rid": "w"},
                                                       timeout=30, expect_json=False)
            t0 = asyncio.get_running_loop().time()
            idle_paused = [await status("/health"), await status("/ready")]
            waited = asyncio.get_running_loop().time() - t0
            resumed = await c._request("POST", "/continue_generation", {}, timeout=30)
            healthy = [await status("/health"), await status("/ready")]
            with pytest.raises(EngineError) as garbage:  # outside a session: its message
                await c._request("POST", "/update_weights_from_tensor", {
                    "serialized_named_tensors": ["not a handle"], "load_format": "flattened_bucket"},
                    timeout=30)
            deferred = asyncio.create_task(c.generate([1], {"max_new_tokens": 200}))
            for _ in range(500):  # running (it takes at least 1 s: 5 ms a token), then flush
                if (await c.get_load()).num_running:
                    break
                await asyncio.sleep(0.01)
            flush = await c._request("POST", "/flush_cache?timeout=30", None, timeout=60,
                                     expect_json=False)
            finished_first = deferred.done()
            await deferred
        return (starting, raw, paused, aborted, idle_paused, waited, resumed, healthy, garbage,
                flush, finished_first)

    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}
    with EngineProcess(cpu_engine_command(str(tmp_path / "m"), incremental_streaming_output=True,
                                          startup_delay_s=3.0, decode_delay_s=0.005),
                       log_path=str(tmp_path / "e.log"), env=env,
                       ready_path="/model_info") as proc:
        (starting, raw, paused, aborted, idle_paused, waited, resumed, healthy, garbage, flush,
         finished_first) = asyncio.run(go(proc.url))
    assert starting == [503, 503]
    *streamed, last = raw
    assert all("weight_versions" not in ch["meta_info"] for ch in streamed)
    n = sum(len(ch["output_ids"]) for ch in streamed)
    assert last["output_ids"] == streamed[-1]["output_ids"][-1:]  # the last id, again
    assert last["meta_info"]["completion_tokens"] == n
    assert len(last["meta_info"]["output_token_logprobs"]) == n  # cumulative
    assert last["meta_info"]["finish_reason"] == {"type": "abort",
                                                  "message": "Abort in waiting queue"}
    assert last["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
    assert paused == {"message": "Generation paused successfully.", "status": "ok"}
    assert aborted == ""
    assert idle_paused == [503, 503] and waited >= 2.0  # the window, then 503 (and unhealthy)
    assert resumed == {"message": "Generation continued successfully.", "status": "ok"}
    assert healthy == [200, 200]
    assert garbage.value.status == 400 and garbage.value.message == (
        "update_weights_from_tensor must run between begin_weight_update() and "
        "end_weight_update()")
    assert flush.startswith("Cache flushed.") and finished_first


def test_whole_tensor_loads_skip_and_fail_where_sglangs_load_weights_do(sglang, caplog):
    """A flattened bucket, a broadcast and a checkpoint reach SGLang 0.5.23's legacy
    ``load_weights`` (the default): a name it has no parameter for is logged and skipped, never
    refused (rotary frequencies and an extra bias silently); a size that differs fails the weight
    loader's assertion mid-load -- uncaught for a tensor update and, through its rollback, for
    a checkpoint (the scheduler dies, the twin too: test_cpu_engine), caught for a broadcast
    with the tensors before it loaded. The twin's model does the same, with SGLang's message."""
    import logging

    import torch

    from laminar_mcore.rollout.engine_weights import PARTIALLY_UPDATED
    from laminar_mcore.rollout.model import DecoderLM

    assert "SGLANG_ENABLE_WEIGHT_LOADER_V2 = EnvBool(False)" in sglang.read("sglang/srt/environ.py")
    for family in ("qwen2", "qwen3", "llama", "qwen3_moe"):
        src = sglang.read(f"sglang/srt/models/{family}.py")
        for snippet in ('logger.warning(f"Parameter {name} not found in params_dict")',
                        '"rotary_emb.inv_freq" in name', "layer_id >= self.model.end_layer",
                        'if name.endswith(".bias") and name not in params_dict:'):
            assert snippet in src, (family, snippet)
        stacked = _between(src, "for param_name, weight_name, shard_id in stacked_params_mapping:",
                           "break\n")
        assert "name = name.replace(weight_name, param_name)" in stacked
        # Qwen3 looks a renamed name up unguarded (KeyError); the others skip it
        assert ("if name not in params_dict:" in stacked) == (family != "qwen3"), family
    assert 'name = add_prefix(name, "model")' in sglang.read("sglang/srt/models/qwen3.py")
    moe = sglang.read("sglang/srt/models/qwen3_moe.py")  # its warning comes after a skip
    assert moe.index("if name not in params_dict:\n                        continue\n\n"
                     "                    if name in params_dict.keys():") < moe.index(
        'logger.warning(f"Parameter {name} not found in params_dict")')
    loader = _between(sglang.read("sglang/srt/model_loader/weight_utils.py"),
                      "def default_weight_loader(", "\ndef ")
    assert 'f"Attempted to load weight ({loaded_weight.size()}) "' in loader
    runner = sglang.read("sglang/srt/model_executor/model_runner_components/weight_updater.py")
    flattened = _between(runner, "def _update_weights_from_flattened_bucket(", "\n    def ")
    assert "self.get_model().load_weights(reconstructed_tensors)" in flattened
    assert "try:" not in flattened  # nothing catches a failed assertion: the scheduler ends
    dist = _between(runner, "def load_weights_from_distributed(", "\n    def ")
    assert "except Exception as e:" in dist
    message = re.findall(r'f?"([^"]*)"', _between(dist, "error_msg = (", ")\n"))
    assert "".join(message).replace("{e}", "{}") == PARTIALLY_UPDATED
    # from disk, the rollback reads the weights again from the checkpoint the update named (the
    # path is set before loading), so a tensor of another size fails it too, uncaught
    disk = _between(runner, "def update_weights_from_disk(", "\n    def ")
    assert disk.index("self.model_config.model_path = model_path") < disk.index(
        "Rolling back to original weights.")
    rollback = disk[disk.index("Rolling back to original weights."):]
    assert "iter = get_weight_iter(self.model_config)" in rollback
    assert "model_load_weights(self.get_model(), iter)" in rollback
    assert "try:" not in rollback[:rollback.index("return False, message")]

    for family in ("qwen2", "llama"):
        cfg = tiny_hf_config(family)
        base = initial_hf_state(type("M", (), {"path": None})(), cfg, 0)
        new = initial_hf_state(type("M", (), {"path": None})(), cfg, 1)
        model = DecoderLM(cfg, base)
        names = sorted(base)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="laminar_mcore.cpu_engine"):
            loaded = model.load_like_sglang({
                names[0]: new[names[0]], "model.no_such.weight": torch.zeros(3),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4),
                "model.layers.0.mlp.down_proj.bias": torch.zeros(3)})
        assert loaded == 1 and torch.equal(model.params[names[0]], new[names[0]].to(model.dtype))
        assert "model.no_such.weight" not in model.params
        assert [r.getMessage() for r in caplog.records] == [
            "Parameter model.no_such.weight not found in params_dict"]
        if family == "llama":  # no such layer: silently; a fused name: renamed, warned of
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="laminar_mcore.cpu_engine"):
                assert model.load_like_sglang({
                    "model.layers.99.mlp.gate_proj.weight": torch.zeros(3),
                    "model.layers.0.self_attn.qkv_proj.weight": torch.zeros(3)}) == 0
            assert [r.getMessage() for r in caplog.records] == [
                "Parameter model.layers.0.self_attn.qkqkv_proj.weight not found in params_dict"]
        wrong = {names[1]: new[names[1]], names[2]: torch.zeros(3), names[3]: new[names[3]]}
        before = {n: model.params[n].clone() for n in names[1:4]}
        with pytest.raises(ValueError, match=r"Attempted to load weight \(\(3,\)\)"):
            model.load_like_sglang(wrong)
        # in order: what came before the failing tensor is loaded, what comes after is not
        assert torch.equal(model.params[names[1]], new[names[1]].to(model.dtype))
        assert not torch.equal(model.params[names[1]], before[names[1]])
        assert torch.equal(model.params[names[3]], before[names[3]])
    # Qwen3: a name without "model." is loaded; a fused name raises SGLang's KeyError text
    cfg = tiny_hf_config("qwen3")
    new = initial_hf_state(type("M", (), {"path": None})(), cfg, 1)
    model = DecoderLM(cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0))
    assert model.load_like_sglang({"norm.weight": new["model.norm.weight"]}) == 1
    assert torch.equal(model.params["model.norm.weight"], new["model.norm.weight"].to(model.dtype))
    with pytest.raises(ValueError, match=r"^'model\.layers\.0\.mlp\.gate_gate_up_proj\.weight'$"):
        model.load_like_sglang({"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(3)})
