"""Agent episodes against real CPU engines, a real relay and the real rollout manager: agents
written with the ``openai`` client, token-exact turns (for a tokenizer whose re-tokenisation of
the model's text differs), loss masks, one version per episode, limits, refused keys, and an
engine killed mid-episode."""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import torch

from laminar_mcore.config.schema import RolloutConfig
from laminar_mcore.agents.episode import AgentEpisode
from laminar_mcore.agents.gateway import AgentGateway, EpisodeLimits
from laminar_mcore.controller.manager import RolloutData, RolloutManager
from laminar_mcore.modes import policy_for
from laminar_mcore.data.chat import ChatFormat, demo_tokenizer
from laminar_mcore.data.pools import PartialResponsePool, PromptPool
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.client import SGLangClient
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

from .test_rollout_manager import (RecordingBuffer, _handle, _incremental_engines, _relay_world,
                                   _state)

pytestmark = pytest.mark.multiprocess
DIGITS = "0123456789"
# every pair of digits is one token: "1" "2" sampled one by one re-tokenises as "12"
TOK = demo_tokenizer([a + b for a in DIGITS for b in DIGITS])
CHAT = ChatFormat(TOK)
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def _digit_model(tmp_path):
    """A tiny random model over the test tokenizer that mostly samples single digits (and,
    now and then, the end-of-turn token)."""
    cfg = tiny_hf_config("qwen2", vocab_size=len(TOK), eos_token_id=CHAT.eos_id)
    state = _state(cfg, 0)
    head = state["lm_head.weight"]
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[[TOK.convert_tokens_to_ids(d) for d in DIGITS] + [CHAT.eos_id]] = True
    head[~keep] = 0.0
    head[keep] *= 8.0
    return cfg, state


def _manager(handles, rows, buffer, episode, mode="laminar", trainer_version=lambda: 0):
    return RolloutManager(handles, RolloutData(PromptPool(rows, n_samples=2, seed=0),
                                               PartialResponsePool(), buffer),
                          episode, policy_for(mode), RolloutConfig(repack=False),
                          trainer_version=trainer_version, batch_trajectories=4)


async def _reward(text, answer, row):
    return float(text == answer), None


def _turns(traj):
    """(start, end) of each run of sampled tokens in the response."""
    runs, start = [], None
    for i, m in enumerate(traj.sampled_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_turns_are_token_exact_masked_and_of_one_version(tmp_path):
    cfg, state = _digit_model(tmp_path)
    rows = [{"prompt": f"{i}+{i}", "answer": "x"} for i in range(40)]
    sent = {}  # row prompt -> the messages of each call, as the agent sent them

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for t in range(3):
            answer = await client.chat.completions.create(model="policy", messages=messages,
                                                          tools=TOOLS, max_tokens=10)
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": "c", "content": f"{t}{t}7"})
            sent.setdefault(row["prompt"], []).append(list(messages))
        return 1.0

    with _relay_world(tmp_path, cfg) as (relay, _, publisher, procs):
        save_hf_checkpoint(tmp_path / "m", cfg, state)
        engines = _incremental_engines(tmp_path, procs)
        buffer = RecordingBuffer(group_size=2)

        async def scenario():
            gateway = AgentGateway(CHAT, EpisodeLimits(max_turns=8, max_new_tokens=10))
            await gateway.start()
            episode = AgentEpisode(agent, gateway, _reward, lambda row: [1],
                                   {"temperature": 1.0}, seed=3)
            handles = [_handle(f"e{i}", p.url, relay.url, 4, timeout_s=30,
                               incremental_stream=True) for i, p in enumerate(engines)]
            manager = _manager(handles, rows, buffer, episode)
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 120
            while len(buffer.seen) < 8:
                assert time.time() < deadline, manager.stats
                await asyncio.sleep(0.05)
            # version 1 reaches the relay while episodes are between turns: engines take it
            # only when their episodes end
            await asyncio.to_thread(publisher.publish, 1)
            await asyncio.to_thread(publisher.wait)
            # (each engine takes it once its own episodes end: wait for both)
            while not (any(t.weight_version == 1 for t in buffer.seen)
                       and all(h.version == 1 for h in handles)):
                assert time.time() < deadline, manager.stats
                await asyncio.sleep(0.05)
            manager.stop()
            await runner
            async with aiohttp.ClientSession() as http:  # a key of nobody's: refused
                async with http.post(f"{gateway.url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "1"}]},
                        headers={"Authorization": "Bearer lm-nobody"}) as r:
                    refused = r.status, await r.json()
            await episode.aclose()  # its HTTP client and its gateway
            for h in handles:
                await h.client.close()
                await h.relay.close()
            return manager, episode, refused

        manager, episode, refused = asyncio.run(scenario())
        assert refused[0] == 401 and refused[1]["error"]["code"] == "invalid_api_key"

        # every turn's tokens are what an engine of version 0 samples from exactly the tokens
        # before it
        fresh = EngineProcess(cpu_engine_command(str(tmp_path / "m"), deterministic=True),
                              log_path=str(tmp_path / "replay.log")).start()
        procs.append(fresh)

        async def replay(traj, start, end, seed):
            async with SGLangClient(fresh.url) as client:
                out = await client.generate(traj.prompt_ids + traj.response_ids[:start], {
                    "temperature": 1.0, "max_new_tokens": end - start,
                    "sampling_seed": (seed + start) & 0x7FFFFFFF})
            return out["output_ids"]

        retokenised_differs = 0
        checked = 0
        for traj in buffer.seen:
            if traj.weight_version != 0:
                continue  # the engines' checkpoint is version 0's weights
            turns = _turns(traj)
            assert len(turns) == 3 and traj.metadata["turns"] == 3
            assert traj.versions_seen() == ["0"]
            msgs = sent[rows[traj.metadata["row_index"]]["prompt"]]
            assert traj.prompt_ids == CHAT.prompt(msgs[0][:1], TOOLS)
            seed = episode._sampling_seed(traj.group_id, int(traj.uid.split("-")[-2]))
            for k, (start, end) in enumerate(turns):
                assert asyncio.run(replay(traj, start, end, seed)) == \
                    traj.response_ids[start:end], (traj.uid, k)
                sampled = traj.response_ids[start:end]
                if CHAT.encode(TOK.decode(sampled)) != sampled:
                    retokenised_differs += 1
                # the environment tokens after turn k: the template's rendering of the tool
                # message, nothing else
                if k + 1 < len(turns):
                    env = traj.response_ids[end:turns[k + 1][0]]
                    ended = sampled[-1] == CHAT.eos_id
                    expected = ("" if ended else "<|im_end|>") + \
                        f"\n<|im_start|>tool\n<tool_response>{k}{k}7</tool_response>" \
                        "<|im_end|>\n<|im_start|>assistant\n"
                    assert TOK.decode(env) == expected
                    assert env == ([] if ended else [CHAT.eos_id]) + CHAT.encode(expected[
                        0 if ended else len("<|im_end|>"):])
                    assert set(traj.behav_logprobs[end:turns[k + 1][0]]) == {0.0}
            checked += 1
        assert checked >= 4
        assert retokenised_differs > 0  # re-encoding the model's text would have drifted
        # one version per episode: none straddles the update, and none had to be resumed or
        # discarded because its engine took version 1 between its turns
        assert all(t.versions_seen() == [str(t.weight_version)] for t in buffer.seen)
        assert not buffer.discarded and manager.stats.resumed == 0, manager.stats
        assert manager.stats.pulls >= 2
        assert episode.ended.get("done", 0) >= len(buffer.seen)


async def _engine_post(url, path, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json=body) as r:
            assert r.status == 200, await r.text()


def test_limits_end_episodes_with_their_reason_and_calls_are_guarded(tmp_path):
    cfg, state = _digit_model(tmp_path)
    save_hf_checkpoint(tmp_path / "m", cfg, state)
    rows = [{"prompt": f"{i}", "answer": "x"} for i in range(8)]
    seen = {}

    async def agent(client, row):
        import openai

        messages = [{"role": "user", "content": row["prompt"]}]
        while True:  # never stops on its own: the gateway's max_turns ends it
            try:
                answer = await client.chat.completions.create(model="p", messages=messages)
            except openai.BadRequestError as exc:
                seen.setdefault("limits", []).append(exc.body["code"])
                raise
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "again"})
            if "claimed" not in seen:  # the first episode checks the guards, then ends
                seen["claimed"] = True
                seen["key"] = client.api_key
                try:  # a history that is not the conversation's: 400
                    await client.chat.completions.create(model="p", messages=[
                        {"role": "user", "content": "other"}, *messages[1:]])
                except openai.BadRequestError as exc:
                    seen["diverged"] = exc.body
                # two calls of one trajectory at once: the second is refused. The engine is
                # paused in place so the first call is held in flight while the second comes
                # (without it a fast turn could end first, and the second would be a repeat)
                session = seen["gateway"].sessions[client.api_key]
                await _engine_post(engine.url, "/pause_generation", {"mode": "in_place"})
                first = asyncio.ensure_future(client.chat.completions.create(
                    model="p", messages=messages))
                while not session.busy:
                    await asyncio.sleep(0.01)
                try:
                    await client.chat.completions.create(model="p", messages=messages)
                    seen["busy"] = [200]
                except openai.APIStatusError as exc:
                    seen["busy"] = [exc.status_code, exc.body.get("code")]
                await _engine_post(engine.url, "/continue_generation", {})
                seen["busy"].append((await first).choices[0].finish_reason is not None)
                return 0.5

    engine = EngineProcess(cpu_engine_command(str(tmp_path / "m"), deterministic=True),
                           log_path=str(tmp_path / "e.log")).start()
    try:
        async def scenario():
            from laminar_mcore.agents.episode import evaluate_agent

            gateway = AgentGateway(CHAT, EpisodeLimits(max_turns=3, max_new_tokens=6))
            seen["gateway"] = gateway
            await gateway.start()
            result = await evaluate_agent(engine.url, rows, agent, gateway, _reward,
                                          lambda row: [1], {"temperature": 1.0}, greedy=False)
            async with aiohttp.ClientSession() as http:  # the ended trajectory's key: refused
                async with http.post(f"{gateway.url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "1"}]},
                        headers={"Authorization": f"Bearer {seen['key']}"}) as r:
                    seen["late"] = r.status, (await r.json())["error"]["message"]
            # a token budget: the second call's prompt would pass it
            small = AgentGateway(CHAT, EpisodeLimits(max_episode_tokens=14, max_new_tokens=6))
            await small.start()
            budget = await evaluate_agent(engine.url, rows[:2], agent, small, _reward,
                                          lambda row: [1], {"temperature": 1.0}, greedy=False)
            await small.close()
            await gateway.close()
            return result, budget

        result, budget = asyncio.run(scenario())
    finally:
        engine.stop()
    assert seen["late"][0] == 401 and "has ended" in seen["late"][1]
    assert budget["turns_per_episode"] == 1 and budget["accuracy"] == 0.0
    assert set(seen["limits"]) == {"max_turns", "max_episode_tokens"}
    assert seen["diverged"]["code"] == "messages" and "differs" in seen["diverged"]["message"]
    assert seen["busy"] == [409, "concurrent_call", True]
    # the first episode returned 0.5 after its busy check; the others hit max_turns (reward 0)
    assert result["turns_per_episode"] == pytest.approx((2 + 3 * 7) / 8)
    assert result["accuracy"] == pytest.approx(0.5 / 8)


def test_an_engine_killed_mid_episode_resumes_its_turns_on_an_engine_of_the_version(tmp_path):
    """Episodes run on two engines; one is killed while some of its episodes are generating a
    turn and others wait for their tool: each resumes on the other engine, of the same version,
    from the tokens it holds, and ends with its three turns; nothing is lost."""
    import random

    cfg, state = _digit_model(tmp_path)
    rows = [{"prompt": f"{i}", "answer": "x"} for i in range(64)]
    rng = random.Random(0)

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for t in range(3):
            answer = await client.chat.completions.create(model="p", messages=messages,
                                                          max_tokens=40)
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
            await asyncio.sleep(rng.random() * 0.3)  # the tool's time
            messages.append({"role": "tool", "tool_call_id": "c", "content": f"{t}"})
        return 1.0

    with _relay_world(tmp_path, cfg) as (relay, _, publisher, procs):
        save_hf_checkpoint(tmp_path / "m", cfg, state)
        engines = _incremental_engines(tmp_path, procs)
        buffer = RecordingBuffer(group_size=2)

        async def scenario():
            gateway = AgentGateway(CHAT, EpisodeLimits(max_turns=8, max_new_tokens=40))
            await gateway.start()
            episode = AgentEpisode(agent, gateway, _reward, lambda row: [1],
                                   {"temperature": 1.0}, seed=5)
            handles = [_handle(f"e{i}", p.url, relay.url, 6, timeout_s=5,
                               incremental_stream=True) for i, p in enumerate(engines)]
            manager = _manager(handles, rows, buffer, episode)
            runner = asyncio.create_task(manager.run())
            deadline = time.time() + 120
            while len(buffer.seen) < 4 or len(handles[1].in_flight) < 4:
                assert time.time() < deadline, manager.stats
                await asyncio.sleep(0.01)
            os.killpg(engines[1].proc.pid, signal.SIGKILL)
            at_kill = len(buffer.seen)

            def resumed_done():
                return any(s["how"] == "resume" for t in buffer.seen
                           for s in t.metadata.get("segments", []))

            while len(buffer.seen) < at_kill + 10 or not resumed_done():
                assert time.time() < deadline, manager.stats
                await asyncio.sleep(0.05)
            manager.stop()
            await runner
            await episode.aclose()
            for h in handles:
                await h.client.close()
                await h.relay.close()
            return manager

        manager = asyncio.run(scenario())

    assert manager.stats.resumed >= 1 and not buffer.discarded, (manager.stats,
                                                                 buffer.discarded)
    moved = [t for t in buffer.seen
             if any(s["how"] == "resume" for s in t.metadata.get("segments", []))]
    assert moved, "no episode was resumed on the other engine"
    for traj in buffer.seen:
        assert len(_turns(traj)) == 3 and traj.metadata["turns"] == 3
        assert traj.versions_seen() == ["0"]
    for traj in moved:
        engines_used = [s["engine"] for s in traj.metadata["segments"]]
        assert engines_used[0] == "e1" and engines_used[-1] == "e0"


def test_hundreds_of_concurrent_episodes_share_one_gateway_and_engine(tmp_path):
    """An engine's production concurrency (256 running requests): 256 agents call at once
    through one HTTP client and one gateway (no connection-pool cap stalls them), each gets
    its own trajectory's answer."""
    cfg, state = _digit_model(tmp_path)
    save_hf_checkpoint(tmp_path / "m", cfg, state)
    rows = [{"prompt": f"{i}", "answer": "x"} for i in range(256)]
    running, peak = [0], [0]

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        try:
            answer = await client.chat.completions.create(model="p", messages=messages,
                                                          max_tokens=4)
        finally:
            running[0] -= 1
        return float(answer.usage.prompt_tokens == len(CHAT.prompt(messages)))

    engine = EngineProcess(cpu_engine_command(str(tmp_path / "m"), max_running_requests=256,
                                              kv_capacity_tokens=65536),
                           log_path=str(tmp_path / "e.log")).start()
    try:
        async def scenario():
            from laminar_mcore.agents.episode import evaluate_agent

            gateway = AgentGateway(CHAT, EpisodeLimits(max_new_tokens=4))
            await gateway.start()
            result = await evaluate_agent(engine.url, rows, agent, gateway, _reward,
                                          lambda row: [1], {"temperature": 1.0}, greedy=False)
            await gateway.close()
            return result

        result = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        engine.stop()
    assert peak[0] == 256
    assert result["accuracy"] == 1.0 and result["turns_per_episode"] == 1.0


@pytest.mark.slow
def test_cpu_agent_train_job_trains_on_multi_turn_episodes(tmp_path):
    """experiment=cpu_agent end to end: warm-up, the calculator agent through the gateway and
    the sandbox, the trainer on masked multi-turn trajectories; books balance."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "laminar_mcore.launch", "experiment=cpu_agent", "output_dir=out",
         "run_name=agent", "trainer.total_steps=2", "trainer.train_batch_prompts=4",
         "data.num_eval=16", "data.warmup_steps=30", "trainer.eval_interval=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = tmp_path / "out" / "agent"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["books_balance"] and summary["steps"] == 2
    assert summary["trajectories_consumed"] == 2 * 4 * 4
    assert sum(summary["episodes_ended"].values()) >= summary["trajectories_consumed"]
    assert summary["turns_per_episode"] >= 1.0 and "tool_calls_per_episode" in summary
    assert summary["sandbox"] == "bubblewrap" and "sandbox_warning" not in summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all("turns_per_episode" in r and "tool_calls_per_episode" in r for r in evals)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]


def test_a_tool_call_round_trip_through_the_openai_client(tmp_path):
    """A tiny model that has memorised one tool-using episode: the calculator agent gets an
    OpenAI tool call (finish_reason "tool_calls"), runs it in the sandbox, sends the result and
    gets the final answer; the trajectory's tokens are the demonstration's, its masks too."""
    from laminar_mcore.agents import builtin as agents
    from laminar_mcore.agents.episode import evaluate_agent
    from laminar_mcore.data.agent_task import tool_demonstrations
    from laminar_mcore.data.warmup import warmup_checkpoint

    chat = ChatFormat(demo_tokenizer())
    row = {"prompt": "123456+654321", "answer": "777777"}
    demo = tool_demonstrations([row], chat, wrong_fraction=0.0, direct_fraction=0.0)
    path = warmup_checkpoint(str(tmp_path), problems=[row], steps=120, batch_size=4, lr=3e-3,
                             hidden=32, layers=1, max_positions=128, demonstrations=demo,
                             tokenizer=chat.tok, log=lambda *_: None)
    seen = {}

    async def agent(client, row):
        class Recording:  # the agent's own client, seen from outside
            def __init__(self):
                self.chat = self.completions = self

            async def create(self, **kw):
                answer = await client.chat.completions.create(**kw)
                seen.setdefault("answers", []).append(answer)
                return answer
        return await agents.calculator(Recording(), row)

    engine = EngineProcess(cpu_engine_command(path), log_path=str(tmp_path / "e.log")).start()
    try:
        async def scenario():
            gateway = AgentGateway(chat, EpisodeLimits(max_turns=4, max_new_tokens=32))
            await gateway.start()
            kept = []
            original = gateway.close_session

            def close(session):
                kept.append(session)
                original(session)
            gateway.close_session = close
            result = await evaluate_agent(engine.url, [row], agent, gateway, _reward,
                                          lambda r: [1], {"temperature": 0.0}, greedy=False)
            await gateway.close()
            # no tool call allowed: the model's call is dropped from the answer, the episode
            # ends with that reason and the agent's empty final answer scores 0
            none = AgentGateway(chat, EpisodeLimits(max_tool_calls=0, max_new_tokens=32))
            await none.start()
            capped = await evaluate_agent(engine.url, [row], agent, none, _reward,
                                          lambda r: [1], {"temperature": 0.0}, greedy=False)
            await none.close()
            return result, kept[0], capped

        result, session, capped = asyncio.run(scenario())
    finally:
        engine.stop()
    assert capped == {"accuracy": 0.0, "turns_per_episode": 1.0, "tool_calls_per_episode": 0.0,
                      "tool_errors": 0}
    assert seen["answers"][2].choices[0].finish_reason == "stop"
    del seen["answers"][2]
    first, last = seen["answers"]
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and \
        json.loads(call.function.arguments) == {"expression": "123456+654321"}
    assert last.choices[0].message.content == "777777" and result["accuracy"] == 1.0
    assert result["tool_calls_per_episode"] == 1 and result["turns_per_episode"] == 2
    traj = session.item.traj
    tokens, mask = demo[0]
    assert traj.prompt_ids + traj.response_ids == tokens
    assert [0] * len(traj.prompt_ids) + traj.loss_mask == mask
    from laminar_mcore.trainer.packing import pack_trajectories

    mb = pack_trajectories([traj], [1.0], [0])  # what the trainer sees: the same tokens, masks
    n = traj.num_tokens
    assert mb.tokens[0, :n].tolist() == tokens
    assert mb.loss_mask[0, :n - 1].tolist() == [float(m) for m in mask[1:]]
