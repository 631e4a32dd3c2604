"""The RolloutManager against real engines and a real relay: every trajectory comes from one
version, engines pull a new version between trajectories, an engine that dies has its
trajectories resumed elsewhere, and no trajectory is lost or counted twice."""

import asyncio
import contextlib
import os
import signal
import time

import pytest
import torch

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.controller.episode import SingleTurn, TaskCodec
from laminar_mcore.controller.manager import EngineHandle, RolloutData, RolloutManager
from laminar_mcore.modes import policy_for
from laminar_mcore.data.pools import ExperienceBuffer, PartialResponsePool, PromptPool
from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.relay.client import RelayClient
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.relay.server import RelayConfig
from laminar_mcore.relay.transports import PullSpec, make_puller
from laminar_mcore.rollout.client import SGLangClient
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
from laminar_mcore.rollout.model import DecoderLM

pytestmark = pytest.mark.multiprocess
TOKEN = "t"


def _state(cfg, seed):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


async def _score(text, answer, row):
    return float(len(text.split()) % 2), None  # a toy verifiable reward: parity of the length


CODEC = TaskCodec(encode_prompt=lambda row: row["prompt_ids"],
                  decode=lambda ids: " ".join(map(str, ids)))


class RecordingBuffer(ExperienceBuffer):
    """An experience buffer that also lists what it kept, in order."""

    def __init__(self, group_size):
        super().__init__(group_size)
        self.seen = []

    def add(self, traj):
        kept = super().add(traj)
        if kept:
            self.seen.append(traj)
        return kept


def _master_relay(tmp_path, **kw):
    return relay_process(RelayConfig(TOKEN, master=True, relay_id="m", **kw),
                         str(tmp_path / "relay.log")).start()


@contextlib.contextmanager
def _relay_world(tmp_path, cfg):
    """A checkpoint of ``cfg`` at tmp_path/m, a master relay and a trainer-side publisher
    (TP = PP = 1) of a model of ``cfg``; yields (relay, model, publisher, procs) and stops every
    process appended to ``procs`` (the tests' engines too) at the end."""
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    save_hf_checkpoint(tmp_path / "m", cfg, _state(cfg, 0))
    procs = []
    init_trainer_parallel(tp=1, pp=1, seed=0)
    try:
        relay = _master_relay(tmp_path)
        procs.append(relay)
        model = build_gpt_model(cfg)
        publisher = WeightPublisher(model, cfg, relay_host="127.0.0.1", token=TOKEN,
                                    publish_port=int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")))
        yield relay, model, publisher, procs
    finally:
        for p in procs:
            p.stop()
        destroy_trainer_parallel()


def _handle(name, url, relay_url, capacity, **client_kw):
    return EngineHandle(name, SGLangClient(url, retries=0, **client_kw),
                        RelayClient(relay_url, TOKEN), make_puller(PullSpec("shm")),
                        capacity=capacity)


def _manager(handles, rows, buffer, sampling, *, seed=None, length_fn=None, batch=16,
             rollout=None, mode="laminar"):
    episode = SingleTurn(CODEC, sampling, _score, seed=seed, length_fn=length_fn)
    return RolloutManager(handles, RolloutData(PromptPool(rows, n_samples=4, seed=0),
                                               PartialResponsePool(), buffer),
                          episode, policy_for(mode), rollout or RolloutConfig(repack=False),
                          trainer_version=lambda: 0, batch_trajectories=batch)


async def _stop_manager(manager, runner, handles) -> None:
    """Stop ``manager`` (its ``run`` task ``runner``) and close its engines' clients."""
    manager.stop()
    await runner
    for h in handles:
        await h.client.close()
        await h.relay.close()


def _incremental_engines(tmp_path, procs, n=2, decode_delay_s=0.0):
    """``n`` CPU engines on tmp_path/m streaming incrementally, as the engines of a run do;
    ``decode_delay_s`` keeps long requests running long enough for a test to act meanwhile,
    however loaded the machine (a tiny model's step takes well under a millisecond)."""
    engines = [EngineProcess(cpu_engine_command(str(tmp_path / "m"), seed=i, kv_capacity_tokens=8192,
                                                incremental_streaming_output=True,
                                                stream_interval=4, deterministic=True,
                                                decode_delay_s=decode_delay_s),
                             log_path=str(tmp_path / f"e{i}.log")).start() for i in range(n)]
    procs += engines
    return engines


def _first_two_groups_long(long_len):
    """A length function: the first two groups carry one ``long_len`` trajectory each."""
    def length(group_id, k):
        issued = int(group_id.rsplit("-", 1)[1])
        return long_len if issued < 2 and k == 0 else 4
    return length


def _reference_logprobs(cfg, state, prompt, response):
    model = DecoderLM(cfg, state)
    kv = model.new_kv_cache(max(256, len(prompt) + len(response) + 8))
    seq, out = list(prompt), []
    slots = torch.arange(kv[0].shape[1])  # one request: position i in slot i
    logits = model.forward([seq], [slots], [0], kv)
    for i, tok in enumerate(response):
        out.append(float(torch.log_softmax(logits[0], -1)[tok]))
        logits = model.forward([[tok]], [slots], [len(prompt) + i], kv)
    return torch.tensor(out)


def test_manager_pulls_between_trajectories_and_survives_an_engine(tmp_path):
    from laminar_mcore.trainer.model import load_full_state

    cfg = tiny_hf_config("qwen2")
    with _relay_world(tmp_path, cfg) as (relay, model, publisher, procs):
        engines = [EngineProcess(cpu_engine_command(str(tmp_path / "m"), seed=i, kv_capacity_tokens=4096),
                                 log_path=str(tmp_path / f"e{i}.log")).start() for i in range(2)]
        procs += engines
        rows = [{"prompt_ids": [i % 100 + 1, 7, 3], "answer": ""} for i in range(500)]
        buffer = RecordingBuffer(group_size=4)
        seen = buffer.seen

        async def scenario():
            handles = [_handle(f"e{i}", p.url, relay.url, 8, timeout_s=5)
                       for i, p in enumerate(engines)]
            manager = _manager(handles, rows, buffer, {"max_new_tokens": 24, "temperature": 1.0})
            runner = asyncio.create_task(manager.run())
            while manager.stats.generated < 16:
                await asyncio.sleep(0.05)
            state = _state(cfg, 5)
            load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, state))
            await asyncio.to_thread(publisher.publish, 1)
            await asyncio.to_thread(publisher.wait)
            deadline = time.time() + 60
            while not all(h.version == 1 for h in handles):
                assert time.time() < deadline, "engines never pulled version 1"
                await asyncio.sleep(0.05)
            while sum(t.weight_version == 1 for t in seen) < 8:
                await asyncio.sleep(0.05)
            # An engine dies with trajectories in flight.
            while not handles[1].in_flight:
                await asyncio.sleep(0.01)
            os.killpg(engines[1].proc.pid, signal.SIGKILL)
            while not manager.stats.resumed:
                assert time.time() < deadline + 60, "nothing was resumed"
                await asyncio.sleep(0.05)
            generated_at_kill = manager.stats.generated
            while manager.stats.generated < generated_at_kill + 8:
                await asyncio.sleep(0.05)
            await _stop_manager(manager, runner, handles)
            return manager, handles, state

        manager, handles, new_state = asyncio.run(scenario())

    assert handles[0].healthy and not handles[1].healthy
    assert manager.stats.pulls >= 2 and manager.stats.resumed >= 1
    for traj in seen:  # exactly one version per trajectory
        assert traj.versions_seen() == [str(traj.weight_version)], traj.uid
        assert traj.version_spans[0]["start"] == 0  # the spans cover every response token
        assert traj.version_spans[-1]["end"] == len(traj.response_ids), traj.version_spans
    v1 = [t for t in seen if t.weight_version == 1]
    assert v1, "no trajectory of version 1"
    ref = _reference_logprobs(cfg, new_state, v1[0].prompt_ids, v1[0].response_ids)
    assert (torch.tensor(v1[0].behav_logprobs) - ref).abs().max().item() <= 1e-4
    discarded = sum(buffer.discarded.values())
    kept = len(seen)
    assert manager.stats.generated == buffer.consumed + buffer.buffered + discarded
    assert kept == manager.stats.generated - sum(v for k, v in buffer.discarded.items()
                                                 if not k.endswith("_group"))


def test_repack_moves_long_tail_trajectories_so_freed_engines_pull(tmp_path):
    """Two engines each wait on one long trajectory when version 1 arrives: the repack moves
    one engine's trajectory to the other (same version), the freed engine pulls version 1 and
    starts fresh work while the long ones finish on version 0 -- each still from one version,
    with the tokens generated before the move kept."""
    cfg = tiny_hf_config("qwen2", max_position_embeddings=4096)
    state0 = _state(cfg, 0)  # what _relay_world saves as the engines' checkpoint
    long_len = 1500
    with _relay_world(tmp_path, cfg) as (relay, _, publisher, procs):
        # Engines of a run stream incrementally (the first test reads cumulative streams);
        # 1500 tokens take at least 3 s, while the test publishes and repacks
        engines = _incremental_engines(tmp_path, procs, decode_delay_s=0.002)
        rows = [{"prompt_ids": [i % 100 + 1, 7, 3], "answer": ""} for i in range(500)]
        buffer = RecordingBuffer(group_size=4)
        seen = buffer.seen
        length = _first_two_groups_long(long_len)

        async def scenario():
            handles = [_handle(f"e{i}", p.url, relay.url, 4, timeout_s=30,
                               incremental_stream=True) for i, p in enumerate(engines)]
            manager = _manager(handles, rows, buffer,
                               {"max_new_tokens": long_len, "temperature": 1.0}, seed=1,
                               length_fn=length, batch=8,
                               rollout=RolloutConfig(repack=True, repack_interval_s=60.0))
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 60
            # each engine holds its group's long trajectory, the short ones are done
            while not (len(seen) == 6 and all(len(h.in_flight) == 1 for h in handles)):
                assert time.time() < deadline, (len(seen), [len(h.in_flight) for h in handles])
                await asyncio.sleep(0.01)
            await asyncio.to_thread(publisher.publish, 1)  # version 1 (same weights: the move is
            await asyncio.to_thread(publisher.wait)        # checked token by token below)
            while not (manager.stats.repacked == 1 and any(t.weight_version == 1 for t in seen)):
                assert time.time() < deadline + 60, (manager.stats, [h.version for h in handles])
                await asyncio.sleep(0.01)
            longs_done_when_v1_seen = sum(len(t.response_ids) == long_len for t in seen)
            while sum(len(t.response_ids) == long_len for t in seen) < 2:
                assert time.time() < deadline + 120, "the long trajectories never finished"
                await asyncio.sleep(0.05)
            await _stop_manager(manager, runner, handles)
            return manager, handles, longs_done_when_v1_seen

        manager, handles, longs_done_early = asyncio.run(scenario())

    assert manager.stats.repacked == 1 and manager.stats.repack_rounds == 1
    assert longs_done_early < 2  # fresh version-1 work ran while a long trajectory was going
    longs = [t for t in seen if len(t.response_ids) == long_len]
    assert len(longs) == 2 and all(t.weight_version == 0 for t in longs)
    assert {t.metadata["engine"] for t in longs} == {longs[0].metadata["engine"]}  # one engine now
    for traj in seen:  # exactly one version per trajectory
        assert traj.versions_seen() == [str(traj.weight_version)], traj.uid
        assert traj.version_spans[0]["start"] == 0  # the spans cover every response token
        assert traj.version_spans[-1]["end"] == len(traj.response_ids), traj.version_spans
    # the trace tells the move: the moved one ran on both engines, a "repack" request second,
    # each request's tokens adding up to the response (data/trace.py)
    from laminar_mcore.data.trace import trace_record

    records = [trace_record(t, "consumed", trainer_version=1) for t in longs]
    moved = [r for r in records if r["repacks"]]
    assert len(moved) == 1 and len(moved[0]["engines"]) == 2
    assert [s["how"] for s in moved[0]["segments"]] == ["new", "repack"]
    for r in records:
        assert sum(s["tokens"] for s in r["segments"]) == long_len
        assert {s["version"] for s in r["segments"]} == {0} and r["staleness"] == 1
        assert r["timings"]["submitted"] < r["timings"]["first_token"] < r["timings"]["finished"]
        assert all(s["start"] <= s["end"] for s in r["segments"])
    for traj in longs:  # nothing lost or duplicated across the move: logprobs of the sequence
        ref = _reference_logprobs(cfg, state0, traj.prompt_ids, traj.response_ids)
        assert (torch.tensor(traj.behav_logprobs) - ref).abs().max().item() <= 1e-4
    assert manager.stats.generated == buffer.consumed + buffer.buffered + sum(buffer.discarded.values())
    assert not buffer.discarded


def test_repack_plan_is_best_fit_within_a_version_and_respects_kv_room():
    """Sources are draining engines down to a long tail; each goes whole to the densest engine
    of its own version with request slots and, when engines report it, KV-cache room."""
    from laminar_mcore.data.pools import InFlight
    from laminar_mcore.data.trajectory import Trajectory

    def engine(name, version, n, tokens_each, capacity=8, draining=True):
        e = EngineHandle(name, None, None, None, version=version, capacity=capacity,
                         draining=draining)
        for k in range(n):
            traj = Trajectory([1] * 10, [2] * (tokens_each - 10), [0.0] * (tokens_each - 10),
                              version, "g", uid=f"{name}-{k}")
            e.in_flight[traj.uid] = InFlight(traj, name)
        return e

    a, b, c = engine("a", 0, 1, 500), engine("b", 0, 2, 400), engine("c", 0, 2, 100)
    other = engine("v1", 1, 1, 100)  # another version: never mixed in
    busy = engine("busy", 0, 6, 100, draining=False)  # still taking work: not a tail
    manager = _manager([a, b, c, other, busy], [{"prompt_ids": [1]}], ExperienceBuffer(group_size=4),
                       {}, batch=1, rollout=RolloutConfig(repack=True))
    # by request slots alone: a (1 in flight) goes to b (densest, first), then c joins b too
    plan = manager.plan_repack()
    assert [(s.name, d.name, rids) for s, d, rids in plan] == [
        ("a", "b", ["a-0"]), ("c", "b", ["c-0", "c-1"])]
    # with KV room reported: c (300 free) cannot take a's 500 tokens, b (1000 free) can; then
    # b has 500 left, enough for c's 200
    plan = manager.plan_repack({"a": 0, "b": 1000, "c": 300})
    assert [(s.name, d.name) for s, d, _ in plan] == [("a", "b"), ("c", "b")]
    plan = manager.plan_repack({"a": 0, "b": 600, "c": 300})  # b full after a: c stays
    assert [(s.name, d.name) for s, d, _ in plan] == [("a", "b")]
    assert manager.plan_repack({"a": 0, "b": 100, "c": 100}) == []  # no room anywhere
    # exactly as many tokens free as a holds: it fits (b then has none left for c)
    plan = manager.plan_repack({"a": 0, "b": 500, "c": 499})
    assert [(s.name, d.name) for s, d, _ in plan] == [("a", "b")]


async def _slow_pull_proxy(target: str, slow_pulls: int, delay_s: float):
    """A loopback HTTP proxy in front of a real relay whose first ``slow_pulls`` answers to
    ``/pull`` come only after ``delay_s`` (and are then refused: nothing is leased)."""
    import aiohttp
    from aiohttp import web

    state = {"slow": slow_pulls, "delayed": 0}
    session = aiohttp.ClientSession()

    async def handler(request):
        body = await request.read()
        if request.path == "/pull" and state["slow"] > 0:
            state["slow"] -= 1
            state["delayed"] += 1
            await asyncio.sleep(delay_s)
            return web.json_response({"error": "slow relay"}, status=504)
        headers = {k: v for k, v in request.headers.items()
                   if k in ("Authorization", "Content-Type")}
        async with session.request(request.method, target + request.path_qs, data=body,
                                   headers=headers) as r:
            return web.Response(status=r.status, body=await r.read(),
                                content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def close():
        await session.close()
        await runner.cleanup()

    return url, state, close


def test_an_engine_recovers_from_a_relay_slower_than_its_timeout(tmp_path):
    """The relay answers /pull later than the client's timeout, twice: each is a RelayError
    the manager survives (no silent end of the engine's loop, the engine stays in service),
    it backs off and pulls the version once the relay answers in time."""
    cfg = tiny_hf_config("qwen2")
    with _relay_world(tmp_path, cfg) as (relay, _, publisher, procs):
        engine = EngineProcess(cpu_engine_command(str(tmp_path / "m"), kv_capacity_tokens=2048),
                               log_path=str(tmp_path / "e0.log")).start()
        procs.append(engine)
        rows = [{"prompt_ids": [i % 100 + 1, 7, 3], "answer": ""} for i in range(200)]
        buffer = RecordingBuffer(group_size=4)

        async def scenario():
            proxy, state, close = await _slow_pull_proxy(relay.url, slow_pulls=2, delay_s=3.0)
            handle = EngineHandle("e0", SGLangClient(engine.url, retries=0, timeout_s=5),
                                  RelayClient(proxy, TOKEN, timeout_s=2.0),
                                  make_puller(PullSpec("shm")), capacity=8)
            manager = _manager([handle], rows, buffer, {"max_new_tokens": 8})
            runner = asyncio.create_task(manager.run())
            try:
                await asyncio.to_thread(publisher.publish, 1)
                await asyncio.to_thread(publisher.wait)
                deadline = time.time() + 60
                while handle.version < 1:
                    assert time.time() < deadline, "the engine never pulled version 1"
                    assert not runner.done(), runner
                    await asyncio.sleep(0.05)
                while not any(t.weight_version == 1 for t in buffer.seen):
                    assert time.time() < deadline, "no work on version 1"
                    await asyncio.sleep(0.05)
            finally:
                manager.stop()
                await runner
                await handle.client.close()
                await handle.relay.close()
                handle.puller.close()
                await close()
            return manager, handle, state

        manager, handle, state = asyncio.run(scenario())

    # (>=: under load another relay call may also outlast the client's 2 s, and is retried too)
    assert state["delayed"] == 2 and manager.stats.pull_retries >= 2
    assert handle.healthy and handle.pulls == 1 and not manager.stats.unhealthy
    assert manager.stats.generated == buffer.consumed + buffer.buffered + sum(buffer.discarded.values())


def test_areal_mode_interrupts_generation_for_each_new_version(tmp_path):
    """mode=areal (AReaL's interruptible generation): when version 1 arrives, the engines are
    paused with abort while long trajectories are running, take version 1 at once, and the
    interrupted requests continue from their prefix on the new weights: each long trajectory
    spans both versions, every token's behaviour log-prob is that of the version its span names,
    and nothing is lost or counted twice."""
    cfg = tiny_hf_config("qwen2", max_position_embeddings=4096)
    state0, state1 = _state(cfg, 0), _state(cfg, 5)
    long_len = 600
    with _relay_world(tmp_path, cfg) as (relay, model, publisher, procs):
        from laminar_mcore.trainer.model import load_full_state

        # the long ones take at least 3 s: still running when version 1 is published
        engines = _incremental_engines(tmp_path, procs, decode_delay_s=0.005)
        rows = [{"prompt_ids": [i % 100 + 1, 7, 3], "answer": ""} for i in range(500)]
        buffer = RecordingBuffer(group_size=4)
        seen = buffer.seen
        length = _first_two_groups_long(long_len)

        async def scenario():
            handles = [_handle(f"e{i}", p.url, relay.url, 4, timeout_s=30,
                               incremental_stream=True) for i, p in enumerate(engines)]
            manager = _manager(handles, rows, buffer,
                               {"max_new_tokens": long_len, "temperature": 1.0}, seed=1,
                               length_fn=length, batch=8, mode="areal",
                               rollout=RolloutConfig(repack=True))
            assert manager.interrupt and not manager.repack
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 60
            while not (len(seen) == 6 and all(len(h.in_flight) == 1 for h in handles)):
                assert time.time() < deadline, (len(seen), [len(h.in_flight) for h in handles])
                await asyncio.sleep(0.01)
            load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, state1))
            await asyncio.to_thread(publisher.publish, 1)
            await asyncio.to_thread(publisher.wait)
            while not all(h.version == 1 for h in handles):
                assert time.time() < deadline + 60, [h.version for h in handles]
                await asyncio.sleep(0.01)
            longs_done_at_pull = sum(len(t.response_ids) == long_len for t in seen)
            while sum(len(t.response_ids) == long_len for t in seen) < 2:
                assert time.time() < deadline + 120, "the long trajectories never finished"
                await asyncio.sleep(0.05)
            await _stop_manager(manager, runner, handles)
            return manager, longs_done_at_pull

        manager, longs_done_at_pull = asyncio.run(scenario())

    assert longs_done_at_pull == 0  # both engines took version 1 while the long ones ran
    assert manager.stats.interrupted >= 2 and manager.stats.pulls == 2
    longs = [t for t in seen if len(t.response_ids) == long_len]
    assert len(longs) == 2
    for traj in longs:
        assert traj.weight_version == 0  # admitted (and its staleness counted) from version 0
        assert traj.versions_seen() == ["0", "1"], traj.version_spans
        spans = traj.version_spans
        assert spans[0]["start"] == 0 and spans[-1]["end"] == long_len
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        cut = spans[0]["end"]
        assert 0 < cut < long_len
        # every token's log-prob is that of the weights its span names (tokens, not requests)
        ref0 = _reference_logprobs(cfg, state0, traj.prompt_ids, traj.response_ids)
        ref1 = _reference_logprobs(cfg, state1, traj.prompt_ids, traj.response_ids)
        behav = torch.tensor(traj.behav_logprobs)
        assert (behav[:cut] - ref0[:cut]).abs().max().item() <= 1e-4
        assert (behav[cut:] - ref1[cut:]).abs().max().item() <= 1e-4
    assert manager.stats.generated == buffer.consumed + buffer.buffered + sum(buffer.discarded.values())
    assert not buffer.discarded


def test_an_engine_a_repacked_trajectory_is_heading_to_does_not_pull_before_it_lands(tmp_path):
    """Repack aborts a long tail at its source to continue it on a destination of the same
    version; if the destination's own trajectories finished first it would pull the next
    version and the moved one would find no engine of its version (the race that lost a
    trajectory as no_engine_of_its_version). ``repack_once`` (against a real CPU engine's
    /v1/loads and abort) marks every move before it aborts any: the destination is expecting
    it until it lands, ends at its source, or goes elsewhere; then it is free to pull."""
    from laminar_mcore.data.pools import InFlight
    from laminar_mcore.data.trajectory import Trajectory

    cfg = tiny_hf_config("qwen2")
    model_dir = str(tmp_path / "model")
    save_hf_checkpoint(model_dir, cfg, _state(cfg, 0))
    engine = EngineProcess(cpu_engine_command(model_dir, kv_capacity_tokens=512),
                           log_path=str(tmp_path / "engine.log")).start()
    try:
        def handle(name):
            return EngineHandle(name, SGLangClient(engine.url, retries=0), None, None,
                                version=0, capacity=8, draining=True)  # long tails: <= 2

        src, dest = handle("src"), handle("dest")
        manager = _manager([src, dest], [{"prompt_ids": [1]}], ExperienceBuffer(group_size=4),
                           {}, batch=1, rollout=RolloutConfig(repack=True))
        items = {}
        for k, engine_of in ((0, src), (1, dest), (2, dest)):  # dest: the densest, has room
            traj = Trajectory([1] * 10, [2] * 20, [0.0] * 20, 0, "g", uid=f"t{k}")
            items[k] = engine_of.in_flight[traj.uid] = InFlight(traj, engine_of.name)
        assert asyncio.run(manager.repacker.repack_once()) == 1
        assert items[0].migrate_to == "dest" and dest.incoming == {"t0": ("src", items[0])}
        del dest.in_flight["t1"], dest.in_flight["t2"]  # its own work done before t0 lands
        assert manager._expecting(dest) and not manager._expecting(src)
        # t0 lands (manager.generate: placed on its destination): dest may pull once it drains
        del src.in_flight["t0"]
        items[0].migrate_to, items[0].engine, dest.in_flight["t0"] = None, "dest", items[0]
        assert not manager._expecting(dest) and not dest.incoming
        # a move whose trajectory ended at its source, or went elsewhere, is forgotten too
        for k, how in ((3, "ended"), (4, "elsewhere")):
            traj = Trajectory([1] * 10, [2] * 20, [0.0] * 20, 0, "g", uid=f"t{k}")
            items[k] = src.in_flight[traj.uid] = InFlight(traj, "src")
            items[k].migrate_to, dest.incoming[traj.uid] = "dest", ("src", items[k])
            assert manager._expecting(dest)
            if how == "ended":
                del src.in_flight[traj.uid]
            else:  # (an engine failure resumed it on another engine: its move is off)
                items[k].migrate_to = None
            assert not manager._expecting(dest), how
    finally:
        engine.stop()
