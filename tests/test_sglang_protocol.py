"""What SGLang 0.5.23 serves, the CPU engine serves: status endpoints, both stream styles,
error chunks, text prompts with a tokenizer, stop strings, min_new_tokens, prompt and top
log-probs, batches with an rid prefix, context-length refusals, waiting for KV room, the
OpenAI routes driven by the real ``openai`` client, and weight updates applied in one session
(``apply_version``) that leave an engine on a complete version."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.relay.client import WeightApplyError, apply_version
from laminar_mcore.rollout.client import EngineError, SGLangClient
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
from laminar_mcore.rollout.model import DecoderLM
from laminar_mcore.testing.tokenizer import save_char_tokenizer
from laminar_mcore.weights.bucket import ShmBucket, encode_handle

pytestmark = pytest.mark.multiprocess
KEY = "protocol-key"


def _state(cfg, seed):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    cfg = tiny_hf_config("qwen3")
    path = root / "model"
    cfg.eos_token_id = save_char_tokenizer(str(path), cfg.vocab_size)
    save_hf_checkpoint(str(path), cfg, _state(cfg, 3))
    return cfg, str(path), root


@pytest.fixture(scope="module")
def engines(model_dir):
    """A cumulative-stream engine (SGLang's defaults: no --weight-version) and an incremental one
    with a small KV cache and a long context (AReaL-sized max_new_tokens)."""
    cfg, path, root = model_dir
    a = EngineProcess(cpu_engine_command(path, api_key=KEY, weight_version=None, deterministic=True),
                      log_path=str(root / "a.log"))
    b = EngineProcess(cpu_engine_command(path, kv_capacity_tokens=256, deterministic=True,
                                         incremental_streaming_output=True, stream_interval=3)
                      + ["--context-length", "20000"], log_path=str(root / "b.log"))
    with a, b:
        yield a, b


def run(coro):
    return asyncio.run(coro)


def _get(url, path, key=KEY):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_status_endpoints_of_0_5_23(engines):
    a, b = engines
    info = json.loads(_get(a.url, "/model_info")[1])
    assert info["weight_version"] == "default"  # SGLang's value before any update
    assert json.loads(_get(a.url, "/get_model_info")[1]) == info  # deprecated alias
    assert json.loads(_get(b.url, "/model_info")[1])["weight_version"] == "0"
    server = json.loads(_get(a.url, "/server_info")[1])
    assert server["internal_states"] and "max_total_tokens" in server
    assert "internal_states" in json.loads(_get(a.url, "/get_server_info")[1])
    loads = json.loads(_get(b.url, "/v1/loads")[1])["loads"]
    assert loads[0]["max_total_num_tokens"] == 256 and loads[0]["num_used_tokens"] == 0
    assert {"num_running_reqs", "num_waiting_reqs", "token_usage", "max_running_requests"} <= set(loads[0])
    assert _get(b.url, "/v1/loads?include=nonsense")[0] == 400
    for gone in ("/get_load", "/get_weight_version"):  # not routes of SGLang 0.5.23
        assert _get(a.url, gone)[0] == 404, gone
    for probe in ("/health", "/health_generate", "/ready"):
        assert _get(a.url, probe, key=None)[0] == 200, probe
    metrics = _get(a.url, "/metrics", key=None)[1]
    assert "# TYPE sglang:num_running_reqs gauge" in metrics


def test_cumulative_and_incremental_streams_carry_the_same_tokens(engines):
    a, b = engines
    params = {"max_new_tokens": 20, "sampling_seed": 5, "ignore_eos": True}

    async def go():
        async with SGLangClient(a.url, api_key=KEY) as ca, \
                SGLangClient(b.url, incremental_stream=True) as cb:
            whole = await ca.generate([5, 6, 7], params)
            raw_a = [c async for c in ca.generate_stream([5, 6, 7], params)]
            raw_b = [c async for c in cb.generate_stream([5, 6, 7], params)]
            got_a = [c async for c in ca.stream_tokens([5, 6, 7], params)]
            got_b = [c async for c in cb.stream_tokens([5, 6, 7], params)]
            return whole, raw_a, raw_b, got_a, got_b

    whole, raw_a, raw_b, got_a, got_b = run(go())
    ids = whole["output_ids"]
    # Cumulative: every chunk holds all tokens so far; incremental: disjoint pieces, the first
    # token at once and then every 3 (SGLang's output streamer), the rest with the finish.
    assert [len(c["output_ids"]) for c in raw_a] == list(range(1, 21))
    assert [t for c in raw_b for t in c["output_ids"]] == ids
    assert [len(c["output_ids"]) for c in raw_b] == [1, 3, 3, 3, 3, 3, 3, 1]
    assert all(len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"]) for c in raw_b)
    for got in (got_a, got_b):
        assert [t for c in got for t in c.new_ids] == ids
        lps = [lp for c in got for lp in c.new_logprobs]
        assert lps == [e[0] for e in whole["meta_info"]["output_token_logprobs"]]
        assert got[-1].finished and not any(c.finished for c in got[:-1])


def test_an_error_chunk_in_a_started_stream_is_an_engine_error(engines):
    a, _ = engines

    async def go():
        async with SGLangClient(a.url, api_key=KEY) as c:
            long = asyncio.create_task(c.generate([1, 2], {"max_new_tokens": 400, "ignore_eos": True},
                                                  rid="busy"))
            while not (await c.get_load()).num_running:  # running (400 tokens: a while yet)
                await asyncio.sleep(0.01)                # when its rid is sent again
            with pytest.raises(EngineError) as err:  # HTTP 200, then data: {"error": ...}
                async for _ in c.stream_tokens([3], {"max_new_tokens": 5}, rid="busy"):
                    pass
            await c.abort_request("busy")
            await long
            return err.value

    err = run(go())
    assert err.endpoint == "/generate" and "already in flight" in err.message


def test_text_prompts_stop_strings_min_new_tokens_and_batches(engines):
    a, _ = engines

    async def go():
        async with SGLangClient(a.url, api_key=KEY) as c:
            greedy = await c._request("POST", "/generate", {
                "text": "abc", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True}}, timeout=30)
            text = greedy["text"]
            stop = text[5:7]
            stopped = await c._request("POST", "/generate", {
                "text": "abc", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                   "stop": [stop], "ignore_eos": True}}, timeout=30)
            first = (await c.generate([5, 6], {"max_new_tokens": 1, "temperature": 0}))["output_ids"][0]
            early = await c.generate([5, 6], {"max_new_tokens": 12, "temperature": 0,
                                              "stop_token_ids": [first]})
            late = await c.generate([5, 6], {"max_new_tokens": 12, "temperature": 0,
                                             "stop_token_ids": [first], "min_new_tokens": 4})
            batch = await c._request("POST", "/generate", {
                "input_ids": [[1, 2], [3], [4, 5, 6]], "rid": "b",
                "sampling_params": {"max_new_tokens": 2}}, timeout=30)
            return greedy, text, stop, stopped, early, late, first, batch

    greedy, text, stop, stopped, early, late, first, batch = run(go())
    assert len(greedy["output_ids"]) == 16 and len(text) == 16  # one character per token
    at = text.find(stop)
    assert stopped["text"] == text[:at]  # trimmed before the stop string, as SGLang does
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert early["output_ids"] == [first]
    assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert late["output_ids"][0] == first and len(late["output_ids"]) >= 4  # not before 4 tokens
    assert [r["meta_info"]["id"] for r in batch] == ["b_0", "b_1", "b_2"]
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [2, 1, 3]


def test_prompt_and_top_logprobs_match_a_reference(engines, model_dir):
    a, _ = engines
    cfg, path, _ = model_dir
    prompt = [7, 3, 9, 12, 4]

    async def go():
        async with SGLangClient(a.url, api_key=KEY) as c:
            return await c._request("POST", "/generate", {
                "input_ids": prompt, "return_logprob": True, "logprob_start_len": 1,
                "top_logprobs_num": 3, "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
                timeout=30)

    out = run(go())
    meta = out["meta_info"]
    ref = DecoderLM(cfg, _state(cfg, 3))
    seq = prompt + out["output_ids"]
    logits = ref.forward([seq], [torch.arange(len(seq))], [0], ref.new_kv_cache(64),
                         all_logits=True)[0]
    lp = torch.log_softmax(logits, -1)
    expected = [float(lp[i - 1, seq[i]]) for i in range(1, len(prompt))]
    got = meta["input_token_logprobs"]
    assert [e[1] for e in got] == prompt[1:] and all(e[2] is not None for e in got)
    assert max(abs(g[0] - x) for g, x in zip(got, expected)) < 1e-5
    tops = meta["output_top_logprobs"]
    assert len(tops) == 4 and all(len(row) == 3 for row in tops)
    assert [row[0][1] for row in tops] == out["output_ids"]  # greedy: the top token is chosen
    assert all(row[0][0] >= row[1][0] >= row[2][0] for row in tops)


def test_context_length_is_refused_and_kv_shortage_waits(engines):
    a, b = engines

    async def go():
        async with SGLangClient(a.url, api_key=KEY) as ca, \
                SGLangClient(b.url, incremental_stream=True) as cb:
            with pytest.raises(EngineError) as refused:
                await ca.generate([1], {"max_new_tokens": 16384})
            # 4 requests of 4 + 100 tokens on a 256-token cache: served, none refused.
            outs = await asyncio.gather(*[cb.generate([i + 1, 2, 3, 4], {
                "max_new_tokens": 100, "ignore_eos": True}) for i in range(4)])
            # AReaL's default max_new_tokens on a long-context engine is admitted.
            stream = cb.stream_tokens([1, 2], {"max_new_tokens": 16384, "ignore_eos": True},
                                      rid="areal")
            first = await stream.__anext__()
            await cb.abort_request("areal")
            rest = [c async for c in stream]
            info = await cb.get_server_info()
            return refused.value, outs, first, rest, info

    refused, outs, first, rest, info = run(go())
    assert refused.status == 400 and "maximum context length of 512" in refused.message
    assert [len(o["output_ids"]) for o in outs] == [100] * 4
    assert first.new_ids and rest[-1].meta["finish_reason"]["type"] == "abort"


def test_the_openai_client_works_unchanged(engines):
    openai = pytest.importorskip("openai")
    a, _ = engines
    client = openai.OpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    models = client.models.list()
    name = models.data[0].id
    completion = client.completions.create(model=name, prompt="abc", max_tokens=5, n=2,
                                           logprobs=2, seed=1)
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=1,
        logprobs=True, top_logprobs=2, seed=3)
    stopped = client.completions.create(model=name, prompt="abc", max_tokens=8, temperature=0,
                                        stop=[completion.choices[0].text[:1] or "a"])
    assert len(completion.choices) == 2 and completion.usage.completion_tokens == 10
    assert all(len(c.logprobs.tokens) == 5 and len(c.logprobs.top_logprobs[0]) <= 2
               for c in completion.choices)
    message = chat.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert len(chat.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    assert stopped.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=a.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_apply_version_leaves_an_engine_on_a_complete_version(engines, model_dir):
    """One session per version; a bucket refused half-way is retried whole, then reported as a
    possible mix; a session left open by a crashed puller is closed first; an unreachable
    engine keeps its version."""
    _, b = engines
    cfg, path, _ = model_dir
    new = _state(cfg, 4)
    names = sorted(new)
    good1, metas1 = ShmBucket.from_tensors({n: new[n] for n in names[:3]})
    good2, metas2 = ShmBucket.from_tensors({n: new[n] for n in names[3:]})
    ok = [[encode_handle(good1.handle(metas1))], [encode_handle(good2.handle(metas2))]]
    # the second bucket refused (400) after the first loaded: a payload the engine cannot read
    # (a tensor of another size would end the engine, as it ends SGLang's scheduler)
    broken = [[encode_handle(good1.handle(metas1))], ["not base64!"]]

    async def go():
        async with SGLangClient(b.url, incremental_stream=True) as c, \
                SGLangClient("http://127.0.0.1:9", retries=0, timeout_s=2) as dead:
            with pytest.raises(WeightApplyError) as mixed:
                await apply_version(c, broken, 7)
            after_mix = await c.get_weight_version()
            await c.begin_weight_update()  # a crashed puller's session: closed, then applied
            await apply_version(c, ok, 8)
            version = await c.get_weight_version()
            greedy = await c.generate([2, 7], {"max_new_tokens": 6, "temperature": 0,
                                               "ignore_eos": True})
            with pytest.raises(WeightApplyError) as unreachable:
                await apply_version(dead, ok, 9)
            return mixed.value, after_mix, version, greedy, unreachable.value

    try:
        mixed, after_mix, version, greedy, unreachable = run(go())
    finally:
        for bucket in (good1, good2):
            bucket.close()
    assert mixed.mixed and "may hold a mix" in str(mixed) and after_mix == "0"
    assert version == "8"
    ref = DecoderLM(cfg, new)
    seq = [2, 7]
    kv = ref.new_kv_cache(64)
    for _ in range(6):
        seq.append(int(ref.forward([seq], [torch.arange(len(seq))], [0], kv)[0].argmax()))
    assert greedy["output_ids"] == seq[2:]
    assert not unreachable.mixed and "keeps its previous version" in str(unreachable)
