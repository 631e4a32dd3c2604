"""A bad request is not a bad engine (issue 50): SGLang 0.5.23 refuses a request past its schema
gate with HTTP 200 and one in-stream error chunk (``http_server.serve_generate_request``) and a
schema violation with HTTP 400 (``api_contract.generate_contract_error``); the CPU engine
answers both as SGLang does, the client raises ``RequestError`` for them (and ``EngineError``
for what is the engine's), and the manager discards the trajectory as ``request_error:<code>``
with every engine kept in service; prompts over the engines' context are filtered before they
are sent."""

import asyncio
import json
import re
import time

import aiohttp
import pytest
from aiohttp import web

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.controller.episode import Discard
from laminar_mcore.data.pools import InFlight
from laminar_mcore.data.trajectory import Trajectory
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.netutil import EngineError, RequestError
from laminar_mcore.rollout.client import SGLangClient
from laminar_mcore.rollout.engine_contract import contract_error
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command, served_context_length

from .test_rollout_manager import (RecordingBuffer, _handle, _manager, _master_relay,
                                  _incremental_engines, _state, _stop_manager)
from .test_rollout_scale import _manager_of
from .test_sglang_conformance import api_types, sglang  # noqa: F401  (fixtures)

CONTEXT = 64  # the tiny model's max_position_embeddings: the engines' context

# bodies past and before SGLang's schema gate (each decoded by SGLang's own contract below)
GATED = [{"input_ids": "1 2 3"}, {"input_ids": [1, 2.5]}, {"input_ids": [[1], "x"]},
         {"text": 3}, {"rid": 7, "input_ids": [1]}, {"stream": "yes", "input_ids": [1]},
         {"input_ids": [1], "sampling_params": {"seed": 1}},
         {"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}},
         {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
         {"input_ids": [1], "sampling_params": [{"top_k": 1.5}]},
         {"input_ids": [1], "logprob_start_len": "0"}, {"input_ids": [1], "return_logprob": 1},
         {"input_ids": [1], "routed_experts_start_len": 1.5}, ["not", "an", "object"]]
PAST_THE_GATE = [{}, {"input_ids": []}, {"input_ids": [1] * 70},
                 {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 8}},
                 {"input_ids": [1], "sampling_params": {"temperature": -1.0}},
                 {"input_ids": [1], "logprob_start_len": 5}]
VALID = [{"input_ids": [1], "sampling_params": {"max_new_tokens": 4}, "unknown_key": 1}]


def test_the_cpu_engines_gate_is_sglangs_contract(api_types):  # noqa: F811
    for body in GATED + PAST_THE_GATE + VALID:
        try:
            api_types.GenerateRequest.from_json_value(body)
            sglang_refuses = False
        except api_types.JsonContractError:
            sglang_refuses = True
        assert (contract_error(body) is not None) == sglang_refuses, body


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("request_errors")
    cfg = tiny_hf_config("qwen2", max_position_embeddings=CONTEXT)
    save_hf_checkpoint(str(root / "m"), cfg, _state(cfg, 0))
    proc = EngineProcess(cpu_engine_command(str(root / "m"), incremental_streaming_output=True),
                         log_path=str(root / "e.log")).start()
    try:
        yield proc, root
    finally:
        proc.stop()


async def _post(url, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json=body) as r:
            return r.status, await r.read()


def test_the_cpu_engine_refuses_as_sglang_does(engine, api_types):  # noqa: F811
    proc, _ = engine

    async def go():
        out = []
        for body in GATED[:-1] + PAST_THE_GATE:
            sent = {"stream": True, **body}
            out.append((sent, *await _post(proc.url, sent)))
        return out

    for body, status, raw in asyncio.run(go()):
        if contract_error(body) is not None:  # the gate: 400, stream or not
            assert status == 400, (body, status, raw)
            continue
        assert status == 200, (body, status, raw)  # past the gate: the error is in the stream
        events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
        assert events[-1] == b"[DONE]" and len(events) == 2, raw
        chunk = json.loads(events[0])
        error = api_types.GenerateStreamError.from_json_value(chunk).error
        assert chunk["error"]["type"] == "invalid_request_error" and error.code == 400
        assert chunk["error"]["retryable"] is False, chunk
    status, raw = asyncio.run(_post(proc.url, {"input_ids": [1] * 70}))  # no stream: 400
    assert status == 400 and b"longer than the model's context length (64 tokens)" in raw


def test_the_client_tells_a_refused_request_from_an_engine_failure(engine, sglang):  # noqa: F811
    """Against the CPU engine and a stand-in that sends SGLang's own error chunk: its fields
    as ``serve_generate_request`` builds them (checked in SGLang's source)."""
    proc, _ = engine
    source = sglang.read("sglang/srt/entrypoints/http_server.py")
    block = source[source.index("async def serve_generate_request"):]
    block = block[:block.index("return StreamingResponse")]
    for field in ('"message": str(e)', '"type": "invalid_request_error"',
                  '"code": getattr(e, "status_code", 400)', '"retryable": False'):
        assert field in block, field
    assert re.search(r'yield b"data: \[DONE\]\\n\\n"', block)

    async def stand_in(code, http=False):
        async def generate(request):
            if http:  # the status line itself (a proxy, an auth layer, a wrong route)
                return web.json_response({"error": {"message": "no", "code": code}},
                                         status=code)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            out = {"error": {"message": "The input (70 tokens) is longer than the model's "
                             "context length (64 tokens).", "type": "invalid_request_error",
                             "code": code, "retryable": False}}
            await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def raised(url, ids, **kw):
        client = SGLangClient(url, retries=0, incremental_stream=True, **kw)
        try:
            async for _ in client.stream_tokens(ids, {"max_new_tokens": 4}):
                pass
        except EngineError as exc:
            return exc
        finally:
            await client.close()

    async def go():
        out = {"cpu_long": await raised(proc.url, [1] * 70)}
        for code in (400, 422, 500, 503, 429, 401, 403, 404):
            for http in (False, True):
                runner, url = await stand_in(code, http)
                try:
                    out[code, http] = await raised(url, [1, 2])
                finally:
                    await runner.cleanup()
        out["refused_connection"] = await raised("http://127.0.0.1:9", [1])
        return out

    out = asyncio.run(go())
    assert isinstance(out["cpu_long"], RequestError) and out["cpu_long"].status == 400
    assert "longer than the model's context length" in str(out["cpu_long"])
    for http in (False, True):  # in SGLang's error chunk, or as the HTTP status
        for code in (400, 422):
            assert isinstance(out[code, http], RequestError), (code, http, out[code, http])
            assert out[code, http].status == code
        # the engine's: a failure, "retry later", or a misconfigured engine (auth, route)
        for code in (500, 503, 429, 401, 403, 404):
            err = out[code, http]
            assert isinstance(err, EngineError) and not isinstance(err, RequestError), \
                (code, http, err)
    err = out["refused_connection"]
    assert isinstance(err, EngineError) and not isinstance(err, RequestError)


def test_bad_prompts_end_their_requests_and_every_engine_stays(tmp_path):
    """Four engines, a stream of prompts of which every third row is over the engines' context:
    with the filter off, the engines refuse those (request_error:400) and every engine stays in
    service; with the context known, they are filtered before they are sent
    (prompt_too_long). Every good group is consumed whole in both."""
    cfg = tiny_hf_config("qwen2", max_position_embeddings=CONTEXT)
    save_hf_checkpoint(str(tmp_path / "m"), cfg, _state(cfg, 0))
    relay = _master_relay(tmp_path)
    procs = [relay]
    rows = [{"prompt_ids": [1] * (70 if i % 3 == 0 else 3), "answer": "", "bad": i % 3 == 0}
            for i in range(60)]
    dropped_prompts = {False: [], True: []}  # the prompt length of each discarded one known
    try:
        engines = _incremental_engines(tmp_path, procs, n=4)

        async def run(filtered: bool):
            buffer = RecordingBuffer(group_size=4)
            buffer.on_discard.append(lambda trajs, _: dropped_prompts[filtered].extend(
                len(t.prompt_ids) for t in trajs))
            handles = [_handle(f"e{i}", e.url, relay.url, 8, timeout_s=10, incremental_stream=True)
                       for i, e in enumerate(engines)]
            manager = _manager(handles, rows, buffer, {"max_new_tokens": 8, "temperature": 1.0},
                               rollout=RolloutConfig(repack=False))
            if filtered:
                manager.context_length = served_context_length(RolloutConfig(), str(tmp_path / "m"))
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 120
            while len(buffer.seen) < 40 or sum(buffer.discarded.values()) < 12:
                assert time.time() < deadline and not runner.done(), (buffer.discarded,
                                                                       manager.error)
                await asyncio.sleep(0.05)
            await _stop_manager(manager, runner, handles)
            return manager, handles, buffer

        for filtered in (False, True):
            manager, handles, buffer = asyncio.run(run(filtered))
            assert all(h.healthy for h in handles) and not manager.stats.unhealthy
            assert manager.stats.resumed == 0 and manager.error is None
            reason = "prompt_too_long" if filtered else "request_error:400"
            assert set(k for k in buffer.discarded if not k.endswith("_group")) == {reason}, \
                buffer.discarded
            bad = buffer.discarded[reason] + buffer.discarded.get(f"{reason}_group", 0)
            # Whole groups, one per bad row: at most 4 each (members still in flight when the
            # manager stopped are aborted, not counted), and never a good row's.
            groups = len(buffer._dropped)
            assert groups >= 3 and bad >= 12 and bad <= 4 * groups, (bad, groups)
            assert dropped_prompts[filtered] and all(n == 70 for n in dropped_prompts[filtered])
            if filtered:
                assert manager.stats.prompts_too_long == buffer.discarded[reason]
                assert manager.stats.request_errors == 0
            else:
                assert manager.stats.request_errors == buffer.discarded[reason]
            assert all(len(t.prompt_ids) == 3 for t in buffer.seen)  # every good one kept
    finally:
        for p in procs:
            p.stop()


def test_a_request_over_the_context_is_filtered_and_named():
    from laminar_mcore.controller.manager import EngineHandle
    from laminar_mcore.relay.client import RelayClient
    from laminar_mcore.relay.transports import PullSpec, make_puller

    async def go():
        handle = EngineHandle("e0", SGLangClient("http://127.0.0.1:9", retries=0),
                              RelayClient("http://127.0.0.1:9", "t"), make_puller(PullSpec("shm")),
                              capacity=4)
        manager = _manager_of(handle)
        manager.context_length = 16
        traj = Trajectory(prompt_ids=[1] * 10, response_ids=[], behav_logprobs=[],
                          weight_version=0, group_id="g-0", uid="g-0-0-y")
        item = InFlight(traj, "e0", max_new_tokens=8, sampling={"max_new_tokens": 8})
        manager.partial.start(item)
        handle.in_flight[item.rid] = item
        with pytest.raises(Discard) as discarded:
            await manager.generate(item)  # (the engine's address is closed: never reached)
        await handle.client.close()
        return manager, handle, discarded.value

    manager, handle, discarded = asyncio.run(go())
    assert discarded.reason == "prompt_too_long"
    assert "10 prompt tokens + 8 to generate = 18 > the engines' context (16 tokens)" \
        in str(discarded)
    assert manager.stats.prompts_too_long == 1 and handle.healthy and not handle.in_flight
