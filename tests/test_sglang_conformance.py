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
from laminar_mcore.rollout.client import SGLangClient
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
            await asyncio.sleep(0.2)
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
