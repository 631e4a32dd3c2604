"""The rollout tier at the sizes production runs it (issue #28): 256 streams on one engine
with a pause and a weight update among them, a Qwen3-235B-sized routing table on one stream
line, and a request retracted under KV pressure and then aborted, continued on another engine
with its tokens and log-probs exact. Real CPU engines on loopback; the routing table comes from
a stand-in that streams SGLang 0.5.23's chunk shape, since no CPU model can compute a 94-layer
table over 16K positions in seconds."""

import asyncio
import base64
import json
import time

import numpy as np
import pytest
import torch
from aiohttp import web

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.controller.episode import SingleTurn, TaskCodec
from laminar_mcore.controller.manager import EngineHandle, RolloutData, RolloutManager
from laminar_mcore.modes import policy_for
from laminar_mcore.data.pools import ExperienceBuffer, InFlight, PartialResponsePool, PromptPool
from laminar_mcore.data.trajectory import Trajectory
from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.relay.client import RelayClient
from laminar_mcore.relay.transports import PullSpec, make_puller
from laminar_mcore.rollout.client import SGLangClient, StreamProtocolError
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

pytestmark = pytest.mark.multiprocess

STREAMS = 256  # conf/rollout/sglang.yaml: rollout.max_running_requests
# Qwen3-235B-A22B: 94 layers, top-8 experts; 16,383 positions = a 16K-token sequence
LAYERS, TOPK, POSITIONS = 94, 8, 16383


def _state(cfg, seed):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    cfg = tiny_hf_config("qwen2", max_position_embeddings=1024)
    for seed in (0, 1):
        save_hf_checkpoint(str(root / f"m{seed}"), cfg, _state(cfg, seed))
    return cfg, root


def test_256_streams_on_one_engine_with_a_pause_and_an_update(checkpoints):
    """Every stream is connected at once (none queues behind a connection cap), the pause is
    answered while all 256 still run (control calls have their own connections), the update
    lands between their tokens, and every stream then ends with all its tokens: nothing lost,
    the engine's books balance, and each response's spans name both versions."""
    cfg, root = checkpoints
    new_tokens = 96  # no stream may end before the last one starts (40 did once, under load)

    async def scenario(url):
        client = SGLangClient(url, incremental_stream=True, timeout_s=30)
        first = asyncio.Event()
        started = set()
        finished = set()
        results = {}

        async def one(i):
            ids, lps, meta = [], [], None
            async for chunk in client.stream_tokens([i % 100 + 1, 7, 3], {
                    "max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0},
                    rid=f"s{i:04d}"):
                ids += chunk.new_ids
                lps += chunk.new_logprobs
                meta = chunk.meta
                if ids and i not in started:
                    started.add(i)
                    if len(started) == STREAMS:
                        first.set()
            finished.add(i)
            results[i] = (ids, lps, meta)

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        await asyncio.wait_for(first.wait(), 120)  # all 256 streaming at once
        t0 = time.perf_counter()
        await client.pause_generation("retract")
        pause_s = time.perf_counter() - t0
        running_at_pause = STREAMS - len(finished)
        load_paused = await client.get_load()
        await client.update_weights_from_disk(str(root / "m1"), weight_version="1")
        await client.continue_generation()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        load_after = await client.get_load()
        info = await client.get_server_info()
        await client.close()
        return (pause_s, running_at_pause, load_paused, load_after, info, results)

    # (each step at least 60 ms: the first stream lives over 5 s, so all 256 are open and
    # streaming before any finishes, however long the client takes to open them)
    cmd = cpu_engine_command(str(root / "m0"), max_running_requests=STREAMS,
                             kv_capacity_tokens=STREAMS * 128, incremental_streaming_output=True,
                             stream_interval=4, decode_delay_s=0.06)
    with EngineProcess(cmd, log_path=str(root / "e256.log")) as proc:
        pause_s, running, load_paused, load_after, info, results = asyncio.run(
            scenario(proc.url))
    print(f"pause_generation answered in {pause_s * 1000:.0f} ms with {running} streams open")
    assert running == STREAMS  # answered while every stream still ran
    assert load_paused.num_running == 0 and load_paused.num_waiting == STREAMS  # retracted
    assert len(results) == STREAMS
    for i, (ids, lps, meta) in results.items():
        assert len(ids) == len(lps) == new_tokens, i
        assert meta["finish_reason"]["type"] == "length"
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "1"], (i, spans)
        assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"]
        assert spans[1]["end"] == new_tokens
    state = info["internal_states"][0]
    assert load_after.num_running == load_after.num_waiting == load_after.kv_used_tokens == 0
    assert state["generated_tokens"] == STREAMS * new_tokens  # no token generated twice


def _manager_of(handle: EngineHandle) -> RolloutManager:
    """A rollout manager of the one engine ``handle`` (its trajectories are driven by hand)."""
    codec = TaskCodec(encode_prompt=lambda row: row["prompt_ids"],
                      decode=lambda ids: " ".join(map(str, ids)))
    return RolloutManager([handle], RolloutData(
        PromptPool([{"prompt_ids": [1]}], n_samples=1, seed=0), PartialResponsePool(),
        ExperienceBuffer(1)), SingleTurn(codec, {"max_new_tokens": 4}, None),
        policy_for("laminar"), RolloutConfig(repack=False), trainer_version=lambda: 0,
        batch_trajectories=1)


async def _stand_in_sglang(table: bytes, prompt_len: int, response: list, logprobs: list,
                           miscount: bool = False):
    """An HTTP server streaming SGLang 0.5.23's incremental chunks for one request: the tokens
    in two chunks, then the finished chunk with ``meta_info.routed_experts`` on its one line
    (``batch_result_processor.py``: base64 of int32 [seqlen - 1 - start, layers, top-k])."""
    seen = {}

    async def generate(request):
        body = await request.json()
        seen[body["rid"]] = body
        assert len(body["input_ids"]) == prompt_len or miscount
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        half = len(response) // 2
        for a, b, done in ((0, half, False), (half, len(response), True)):
            meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": len(response)}
                    if done else None, "completion_tokens": b + (5 if miscount else 0),
                    "weight_version": "0",
                    "output_token_logprobs": [[lp, t, None] for lp, t in
                                              zip(logprobs[a:b], response[a:b])]}
            if done:
                meta["weight_versions"] = [{"version": "0", "start": 0, "end": b}]
                meta["routed_experts"] = base64.b64encode(table).decode("ascii")
            line = b"data: " + json.dumps({"output_ids": response[a:b], "meta_info": meta}).encode()
            try:
                for at in range(0, len(line), 1 << 20):  # the line arrives in many TCP reads
                    await resp.write(line[at:at + (1 << 20)])
                await resp.write(b"\n\n")
            except ConnectionError:  # the client gave up on the line (its size limit)
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen


def test_a_235b_routing_table_on_one_stream_line_reaches_the_trajectory():
    """94 layers x top-8 x 16,383 positions (66 MB of base64 on one server-sent-events line)
    passes through the client and the manager into ``Trajectory.routed_experts`` bit for
    bit; a line over the client's limit is a protocol error of that request, not a crash."""
    rng = np.random.default_rng(0)
    table = rng.integers(0, 128, size=(POSITIONS, LAYERS, TOPK), dtype=np.int32).tobytes()
    response = [5, 6, 7, 8]
    prompt_len = POSITIONS + 1 - len(response)
    logprobs = [-0.5, -0.25, -1.0, -2.0]

    async def scenario():
        runner, url, seen = await _stand_in_sglang(table, prompt_len, response, logprobs)
        try:
            handle = EngineHandle("big", SGLangClient(url, retries=0, incremental_stream=True),
                                  RelayClient("http://127.0.0.1:9", "t"),
                                  make_puller(PullSpec("shm")), capacity=256)
            manager = _manager_of(handle)
            manager.routed_experts = True
            traj = Trajectory(prompt_ids=list(range(prompt_len)), response_ids=[],
                              behav_logprobs=[], weight_version=0, group_id="g-0", uid="g-0-0-x")
            item = InFlight(traj, "big", max_new_tokens=4, sampling={"max_new_tokens": 4})
            manager.partial.start(item)
            reason = await manager._stream(handle, item)
            # the same line over a smaller limit: that request fails, cleanly
            small = SGLangClient(url, retries=0, incremental_stream=True,
                                 max_line_bytes=1 << 20)
            with pytest.raises(StreamProtocolError, match="exceeds 1048576 bytes"):
                async for _ in small.stream_tokens(list(range(prompt_len)), {}, rid="r2"):
                    pass
            await small.close()
            await handle.client.close()
            return reason, traj, seen["g-0-0-x"]
        finally:
            await runner.cleanup()

    reason, traj, body = asyncio.run(scenario())
    assert reason == "length"
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    assert traj.response_ids == response and traj.behav_logprobs == logprobs
    assert len(traj.routed_experts) == 1
    assert base64.b64decode(traj.routed_experts[0]) == table
    assert traj.metadata["routed_positions"] == POSITIONS
    from laminar_mcore.trainer.packing import routed_experts_rows

    rows = routed_experts_rows(traj, LAYERS, TOPK)  # what the trainer replays, per token
    assert tuple(rows.shape) == (POSITIONS + 1, LAYERS, TOPK)
    assert torch.equal(rows[:POSITIONS], torch.from_numpy(
        np.frombuffer(table, dtype=np.int32).astype(np.int64)).view(POSITIONS, LAYERS, TOPK))


def test_a_retracted_then_aborted_request_continues_elsewhere_exactly(checkpoints):
    """SGLang 0.5.23 answers a request aborted in its waiting queue -- here after
    ``pause_generation("retract")`` put it there -- with a final chunk that repeats the last id
    and carries the whole cumulative log-prob list. The client takes nothing from it; the
    request continues on another engine from its prefix, and the joined response equals the
    uninterrupted one: every token, and every log-prob to float precision."""
    cfg, root = checkpoints
    n, cut = 40, 9

    async def scenario(url_a, url_b):
        a = SGLangClient(url_a, incremental_stream=True)
        b = SGLangClient(url_b, incremental_stream=True)
        prompt = [11, 7, 3]
        greedy = {"max_new_tokens": n, "temperature": 0.0}
        ids, lps, chunks, paused = [], [], [], False
        async for chunk in a.stream_tokens(prompt, greedy, rid="victim"):
            ids += chunk.new_ids
            lps += chunk.new_logprobs
            chunks.append(chunk)
            if len(ids) >= cut and not paused:
                paused = True
                await a.pause_generation("retract")
                load = await a.get_load()
                assert load.num_waiting == 1 and load.num_running == 0  # retracted
                await a.abort_request("victim")
        await a.continue_generation()
        held = len(ids)
        rest_ids, rest_lps = [], []
        async for chunk in b.stream_tokens(prompt + ids, {**greedy, "max_new_tokens": n - held},
                                           rid="victim-resumed"):
            rest_ids += chunk.new_ids
            rest_lps += chunk.new_logprobs
        ref_ids, ref_lps = [], []
        async for chunk in b.stream_tokens(prompt, greedy, rid="reference"):
            ref_ids += chunk.new_ids
            ref_lps += chunk.new_logprobs
        for c in (a, b):
            await c.close()
        return ids, lps, chunks[-1], rest_ids, rest_lps, ref_ids, ref_lps

    procs = [EngineProcess(cpu_engine_command(str(root / "m0"), seed=i, kv_capacity_tokens=512,
                                              incremental_streaming_output=True,
                                              deterministic=True),
                           log_path=str(root / f"r{i}.log")) for i in range(2)]
    try:
        for p in procs:
            p.start()
        ids, lps, last, rest_ids, rest_lps, ref_ids, ref_lps = asyncio.run(
            scenario(procs[0].url, procs[1].url))
    finally:
        for p in procs:
            p.stop()
    held = len(ids)
    assert cut <= held < n
    # the final chunk is SGLang's waiting-queue abort: nothing new in it
    assert last.new_ids == [] and last.new_logprobs == []
    assert last.meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert last.meta["completion_tokens"] == held
    assert [e[0] for e in last.meta["output_token_logprobs"]] == lps
    assert len(ids) == len(lps) == held
    assert ids + rest_ids == ref_ids
    assert torch.allclose(torch.tensor(lps + rest_lps), torch.tensor(ref_lps), atol=1e-5)


def test_a_stream_that_cannot_be_reconciled_costs_its_trajectory_not_the_engine():
    """A chunk whose ``completion_tokens`` disagrees with its ids is a protocol error of that
    request: the manager discards the trajectory (``protocol_error``), counts it
    (``protocol_errors``) and keeps the engine in service."""
    async def scenario():
        runner, url, _ = await _stand_in_sglang(b"", 3, [5, 6, 7, 8], [-0.5, -0.25, -1.0, -2.0],
                                               miscount=True)
        try:
            handle = EngineHandle("e0", SGLangClient(url, retries=0, incremental_stream=True),
                                  RelayClient("http://127.0.0.1:9", "t"),
                                  make_puller(PullSpec("shm")), capacity=4)
            manager = _manager_of(handle)
            traj = Trajectory(prompt_ids=[1, 2, 3], response_ids=[], behav_logprobs=[],
                              weight_version=0, group_id="g-0", uid="g-0-0-y")
            item = InFlight(traj, "e0", max_new_tokens=4, sampling={"max_new_tokens": 4})
            manager.partial.start(item)
            handle.in_flight[item.rid] = item
            from laminar_mcore.controller.episode import Discard

            with pytest.raises(Discard) as discarded:
                await manager.generate(item)
            await handle.client.close()
            return manager, handle, discarded.value
        finally:
            await runner.cleanup()

    manager, handle, discarded = asyncio.run(scenario())
    assert discarded.reason == "protocol_error" and "cannot be reconciled" in str(discarded)
    assert manager.stats.protocol_errors == 1
    assert handle.healthy and not manager.stats.unhealthy


def test_an_abort_pause_at_256_streams_fits_its_budget(checkpoints):
    """mode=areal's pause (abort) against 256 running streams, with the controller's client
    settings (timeout_s=10 for control calls, rollout.pause_timeout_s for the pause): the CPU
    engine aborts as SGLang 0.5.23 does (abort all, re-check the update lock once a second), so
    the pause takes at least a round; it completes within its budget, every stream ends
    ``abort`` with the tokens it had, and generation continues afterwards."""
    from laminar_mcore.config.schema import RolloutConfig
    from laminar_mcore.rollout.engine_control import ABORT_RECHECK_S

    cfg, root = checkpoints

    async def scenario(url):
        client = SGLangClient(url, incremental_stream=True, retries=0, timeout_s=10,
                              pause_timeout_s=RolloutConfig().pause_timeout_s)
        started, results = set(), {}
        all_started = asyncio.Event()

        async def one(i):
            ids, meta = [], None
            async for chunk in client.stream_tokens([i % 100 + 1, 7, 3], {
                    "max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0},
                    rid=f"a{i:04d}"):
                ids += chunk.new_ids
                meta = chunk.meta
                if ids and i not in started:
                    started.add(i)
                    if len(started) == STREAMS:
                        all_started.set()
            results[i] = (ids, meta)

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        await asyncio.wait_for(all_started.wait(), 120)
        t0 = time.perf_counter()
        await client.pause_generation("abort")  # raises (EngineError) past its budget
        pause_s = time.perf_counter() - t0
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await client.continue_generation()
        after = [c async for c in client.stream_tokens([1, 2], {"max_new_tokens": 3})]
        await client.close()
        return pause_s, results, after

    cmd = cpu_engine_command(str(root / "m0"), max_running_requests=STREAMS,
                             kv_capacity_tokens=STREAMS * 512, incremental_streaming_output=True,
                             stream_interval=4)
    with EngineProcess(cmd, log_path=str(root / "abort256.log")) as proc:
        pause_s, results, after = asyncio.run(scenario(proc.url))
    print(f"abort-mode pause of {STREAMS} streams answered in {pause_s:.2f} s")
    assert pause_s >= ABORT_RECHECK_S  # at least one of SGLang's rounds: a faithful twin
    assert len(results) == STREAMS
    for i, (ids, meta) in results.items():
        assert meta["finish_reason"]["type"] == "abort" and 0 < len(ids) < 400, (i, meta)
    assert after[-1].meta["finish_reason"]["type"] == "length"
