"""The built-in CPU engine as a real server on loopback, driven by the real SGLang client:
protocol, continuous batching, pause modes, aborts, weight updates, auth and bad input."""

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import pytest
import torch

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.client import EngineError, SGLangClient
from laminar_mcore.rollout.engine_weights import PARTIALLY_UPDATED
from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
from laminar_mcore.weights.bucket import ShmBucket, encode_handle

pytestmark = pytest.mark.multiprocess
KEY = "sekrit"


def _state(cfg, seed):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    cfg = tiny_hf_config("qwen2")
    paths = {}
    for seed in (1, 2):
        paths[seed] = str(root / f"model{seed}")
        save_hf_checkpoint(paths[seed], cfg, _state(cfg, seed))
    return cfg, paths, root


@pytest.fixture(scope="module")
def engine(models):
    cfg, paths, root = models
    # (each decode step 3 ms slower: a 120-token request runs at least 0.36 s, long enough for
    # the pause/abort/flush tests to act on it while it runs, however loaded the machine)
    cmd = cpu_engine_command(paths[1], api_key=KEY, kv_capacity_tokens=2048,
                             max_running_requests=16, deterministic=True, decode_delay_s=0.003)
    with EngineProcess(cmd, log_path=str(root / "engine.log")) as proc:
        yield proc


def run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn, api_key=KEY):
    async with SGLangClient(url, api_key=api_key, timeout_s=30) as client:
        return await fn(client)


def _reference_logprobs(cfg, state, prompt, response):
    """The trainer's recomputation: Megatron-Core model, vocab-parallel log-prob path."""
    from laminar_mcore.trainer.logprobs import vocab_parallel_logprobs
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state

    model = build_gpt_model(cfg)
    load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, state))
    tokens = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1).unsqueeze(0), None)
        lp, _ = vocab_parallel_logprobs(logits[0], tokens[0, 1:])
    return lp[len(prompt) - 1:]


@pytest.fixture(scope="module")
def megatron_world():
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=0)
    yield
    destroy_trainer_parallel()


def test_logprobs_equal_the_trainers_recomputation(engine, models, megatron_world):
    cfg, paths, _ = models
    prompt = [3, 14, 15, 92, 65]

    async def go(c):
        return await c.generate(prompt, {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 7})

    out = run(_with_client(engine.url, go))
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 24
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    engine_lp = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    trainer_lp = _reference_logprobs(cfg, _state(cfg, 1), prompt, out["output_ids"])
    assert (engine_lp - trainer_lp).abs().max().item() <= 1e-4


def test_seeded_sampling_is_reproducible_and_stop_tokens_stop(engine):
    async def go(c):
        a = await c.generate([1, 2, 3], {"max_new_tokens": 12, "sampling_seed": 11})
        b = await c.generate([1, 2, 3], {"max_new_tokens": 12, "sampling_seed": 11})
        greedy = await c.generate([1, 2, 3], {"max_new_tokens": 12, "temperature": 0})
        stop_at = greedy["output_ids"][4]
        stopped = await c.generate([1, 2, 3], {"max_new_tokens": 12, "temperature": 0,
                                               "stop_token_ids": [stop_at]})
        return a, b, greedy, stopped, stop_at

    a, b, greedy, stopped, stop_at = run(_with_client(engine.url, go))
    assert a["output_ids"] == b["output_ids"]
    first = greedy["output_ids"].index(stop_at)
    assert stopped["output_ids"] == greedy["output_ids"][:first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_continuous_batching_lets_short_requests_leave_early(engine):
    async def go(c):
        before = (await c.get_server_info())["internal_states"][0]["steps"]
        lengths = [4, 60, 8, 60, 2, 30]
        finished = []

        async def one(i, n):
            r = await c.generate([7, i + 1], {"max_new_tokens": n, "sampling_seed": i})
            finished.append(i)
            return r

        outs = await asyncio.gather(*[one(i, n) for i, n in enumerate(lengths)])
        after = (await c.get_server_info())["internal_states"][0]["steps"]
        return lengths, outs, finished, after - before

    lengths, outs, finished, steps = run(_with_client(engine.url, go))
    assert [len(o["output_ids"]) for o in outs] == lengths
    assert steps < sum(lengths) / 2  # decoded together, not one request after another
    assert finished.index(4) < finished.index(1) and finished.index(0) < finished.index(3)


async def _start_long(c, rid, n=400):
    task = asyncio.create_task(c.generate([9, 9, 9], {"max_new_tokens": n, "sampling_seed": 1}, rid=rid))
    for _ in range(200):
        load = await c.get_load()
        if load.num_running:
            return task
        await asyncio.sleep(0.02)
    raise AssertionError("request never started")


def test_pause_in_place_and_retract_resume_without_losing_tokens(engine):
    async def go(c):
        results = {}
        for mode in ("in_place", "retract"):
            task = await _start_long(c, f"long-{mode}", n=120)
            await c.pause_generation(mode)
            load1 = await c.get_load()
            await asyncio.sleep(0.3)
            load2 = await c.get_load()
            assert not task.done()
            if mode == "in_place":
                assert load1.kv_used_tokens == load2.kv_used_tokens > 0  # nothing moves
            else:
                assert load2.num_running == 0 and load2.num_waiting == 1 and load2.kv_used_tokens == 0
            await c.continue_generation()
            results[mode] = await task
        return results

    results = run(_with_client(engine.url, go))
    for mode, out in results.items():
        assert out["meta_info"]["finish_reason"]["type"] == "length", mode
        assert len(out["output_ids"]) == 120
        assert len(out["meta_info"]["output_token_logprobs"]) == 120


def test_pause_abort_and_abort_by_rid(engine):
    async def go(c):
        task = await _start_long(c, "to-abort")
        await c.abort_request("to-abort")
        by_rid = await task
        task = await _start_long(c, "to-pause")
        await c.pause_generation("abort")
        paused = await task
        queued = asyncio.create_task(c.generate([1], {"max_new_tokens": 3}))
        await asyncio.sleep(0.3)
        assert not queued.done()  # paused: new work waits
        await c.continue_generation()
        return by_rid, paused, await queued

    by_rid, paused, queued = run(_with_client(engine.url, go))
    assert by_rid["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(by_rid["output_ids"]) < 400
    assert paused["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(queued["output_ids"]) == 3


def test_flush_cache_refuses_while_requests_run(engine):
    async def go(c):
        task = await _start_long(c, "flush-busy", n=200)
        with pytest.raises(EngineError) as err:
            await c.flush_cache()
        await c.abort_request(abort_all=True)
        await task
        return err.value, await c.flush_cache()

    err, ok = run(_with_client(engine.url, go))
    assert err.status == 400 and "Flush cache failed" in err.message and err.endpoint == "/flush_cache"
    assert "flushed" in ok.lower()


def test_weight_updates_need_a_session_wait_for_running_requests_and_flush(engine, models,
                                                                           megatron_world):
    """SGLang 0.5.23: tensor updates only inside begin/end_weight_update; an update waits for
    running requests unless generation is paused (then it applies between steps and the
    request's spans show both versions); flush_cache=true is refused while a request is kept."""
    cfg, paths, _ = models
    new_state = _state(cfg, 2)
    bucket, metas = ShmBucket.from_tensors(new_state)
    payload = [encode_handle(bucket.handle(metas))]
    prompt = [4, 8, 15, 16]

    async def go(c):
        with pytest.raises(EngineError) as outside:
            await c.update_weights_from_tensor(payload, weight_version="v2")
        await c.begin_weight_update()
        with pytest.raises(EngineError) as twice:
            await c.begin_weight_update()
        task = await _start_long(c, "in-flight", n=150)
        # The update, sent while the request runs, waits for it: the request's spans show one
        # version (the engine's record; the order two replies reach the client proves nothing).
        update = asyncio.create_task(c.update_weights_from_tensor(payload, weight_version="v2"))
        unmixed = await task
        await update
        await c.end_weight_update()
        assert await c.get_weight_version() == "v2"
        after = await c.generate(prompt, {"max_new_tokens": 10, "sampling_seed": 3})
        # Paused in place: the update applies between steps; flushing is refused (SGLang).
        task = await _start_long(c, "paused", n=150)
        await c.pause_generation("in_place")
        await c.begin_weight_update()
        with pytest.raises(EngineError) as kept:  # loaded, its version recorded, not flushed
            await c.update_weights_from_disk(paths[1], weight_version="v2.5")
        served_after_kept = await c.get_weight_version()  # SGLang's tokenizer side: unchanged
        held = (await c.get_load()).kv_used_tokens
        await c.continue_generation()  # a token or more under v2.5 (outputs carry it)
        while (await c.get_load()).kv_used_tokens <= held:
            await asyncio.sleep(0.002)
        await c.pause_generation("in_place")
        await c.update_weights_from_tensor(payload, weight_version="v3", flush_cache=False)
        await c.end_weight_update()
        await c.continue_generation()
        mixed = await task
        back = await c.update_weights_from_disk(paths[1], weight_version="v4")  # no session
        restored = await c.generate(prompt, {"max_new_tokens": 10, "sampling_seed": 3})
        return (outside.value, twice.value, unmixed, after, kept.value, mixed, back,
                restored, served_after_kept)

    try:
        outside, twice, unmixed, after, kept, mixed, back, restored, served_after_kept = run(
            _with_client(engine.url, go))
    finally:
        bucket.close()
    assert outside.status == 400 and outside.message == (
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
    assert twice.status == 400 and "already open" in twice.message
    assert unmixed["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 150}]
    assert after["meta_info"]["weight_version"] == "v2"
    assert kept.status == 400 and "cache was not flushed" in kept.message
    assert served_after_kept == "v2"
    spans = mixed["meta_info"]["weight_versions"]  # the scheduler's side recorded v2.5
    assert [s["version"] for s in spans] == ["v2", "v2.5", "v3"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 150
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    assert back["success"] and restored["meta_info"]["weight_version"] == "v4"
    lp = torch.tensor([x[0] for x in after["meta_info"]["output_token_logprobs"]])
    ref = _reference_logprobs(cfg, new_state, prompt, after["output_ids"])
    assert (lp - ref).abs().max().item() <= 1e-4
    lp = torch.tensor([x[0] for x in restored["meta_info"]["output_token_logprobs"]])
    ref = _reference_logprobs(cfg, _state(cfg, 1), prompt, restored["output_ids"])
    assert (lp - ref).abs().max().item() <= 1e-4


def test_bad_weight_updates_are_refused_or_skipped_as_sglang_does(engine, models):
    """Garbage is refused (400) and changes nothing; names the model has no parameter for are
    skipped with SGLang's warning and the update succeeds (SGLang's load_weights: a silently
    stale tensor on a real engine, not an error -- test_sglang_conformance)."""
    cfg, paths, root = models
    unknown = {"model.layers.0.mlp.no_such_proj.weight": torch.zeros(3)}
    bucket, metas = ShmBucket.from_tensors(unknown)

    async def go(c):
        before = await c.generate([5, 5], {"max_new_tokens": 6, "temperature": 0})
        await c.begin_weight_update()
        errors = []
        for call in (
            c.update_weights_from_tensor(["not base64!"]),
            c.update_weights_from_tensor([encode_handle(bucket.handle(metas))], load_format="npz"),
            c.update_weights_from_disk(str(root / "missing")),
        ):
            with pytest.raises(EngineError) as err:
                await call
            errors.append(err.value)
        skipped = await c.update_weights_from_tensor([encode_handle(bucket.handle(metas))],
                                                     weight_version="v-skip")
        await c.end_weight_update()
        after = await c.generate([5, 5], {"max_new_tokens": 6, "temperature": 0})
        await c.update_weights_from_disk(paths[1], weight_version="0")
        return before, errors, skipped, after

    try:
        before, errors, skipped, after = run(_with_client(engine.url, go))
    finally:
        bucket.close()
    assert all(e.status == 400 for e in errors)
    assert "flattened_bucket" in errors[1].message and "is not a directory" in errors[2].message
    assert skipped["success"] and after["meta_info"]["weight_version"] == "v-skip"
    assert before["output_ids"] == after["output_ids"]
    assert ("Parameter model.layers.0.mlp.no_such_proj.weight not found in params_dict"
            in (root / "engine.log").read_text())


@pytest.mark.parametrize("source", ["flattened_bucket", "disk"])
def test_a_tensor_of_another_size_ends_the_engine_as_it_ends_sglangs(models, tmp_path, source):
    """SGLang 0.5.23 loads a flattened bucket with nothing around it to catch its weight
    loader's size assertion, and a checkpoint's rollback reads the same checkpoint again: the
    scheduler dies and takes the server down. The twin too."""
    from safetensors.torch import load_file, save_file

    cfg, paths, root = models
    bad_dir = tmp_path / "bad"
    shutil.copytree(paths[1], bad_dir)
    for f in bad_dir.glob("*.safetensors"):
        state = load_file(str(f))
        if "model.norm.weight" in state:
            state["model.norm.weight"] = torch.zeros(3)
            save_file(state, str(f))
    bucket, metas = ShmBucket.from_tensors({"model.norm.weight": torch.zeros(3)})
    log = tmp_path / "engine.log"
    try:
        with EngineProcess(cpu_engine_command(paths[1], api_key=KEY, kv_capacity_tokens=256),
                           log_path=str(log)) as proc:
            async def go():
                async with SGLangClient(proc.url, api_key=KEY, timeout_s=30, retries=0) as c:
                    await c.begin_weight_update()
                    with pytest.raises(EngineError):
                        if source == "disk":
                            await c.update_weights_from_disk(str(bad_dir))
                        else:
                            await c.update_weights_from_tensor(
                                [encode_handle(bucket.handle(metas))])

            run(go())
            proc.proc.wait(timeout=30)
            assert proc.proc.returncode != 0
    finally:
        bucket.close()
    what = f"the checkpoint {bad_dir}" if source == "disk" else "a flattened_bucket weight payload"
    text = log.read_text()
    assert f"{what} failed to load" in text and "Attempted to load weight ((3,))" in text


def test_weights_from_a_gloo_broadcast_group(engine, models):
    import datetime

    from laminar_mcore.rollout.launcher import free_port

    cfg, paths, _ = models
    new_state = _state(cfg, 2)
    names = sorted(new_state)
    port = free_port()

    async def go(c):
        from laminar_mcore.weights.update_group import (destroy_update_group,
                                                        init_custom_process_group, send_tensors)

        # The sender joins as a trainer joins real SGLang engines (init_custom_process_group).
        sender = asyncio.create_task(asyncio.to_thread(
            init_custom_process_group, "gloo", f"tcp://127.0.0.1:{port}", 2, 0, "wsync",
            datetime.timedelta(seconds=60)))
        await c.init_weights_update_group("127.0.0.1", port, 1, 2, "wsync", backend="gloo")
        pg = await sender
        results = {}
        await c.begin_weight_update()
        with pytest.raises(EngineError) as prefixed:  # SGLang: getattr(torch, dtype)
            await c.update_weights_from_distributed(
                names, [str(new_state[n].dtype) for n in names],
                [list(new_state[n].shape) for n in names], "wsync")
        results["prefixed"] = prefixed.value
        await c.end_weight_update()
        for fmt in (None, "flattened_bucket"):
            await c.begin_weight_update()
            update = asyncio.create_task(c.update_weights_from_distributed(
                names, [str(new_state[n].dtype).removeprefix("torch.") for n in names],
                [list(new_state[n].shape) for n in names], "wsync", weight_version=f"dist-{fmt}",
                load_format=fmt))
            await asyncio.to_thread(send_tensors, pg, {n: new_state[n] for n in names}, fmt)
            results[fmt] = await update
            await c.end_weight_update()
            results[f"{fmt}-version"] = await c.get_weight_version()
            results[f"{fmt}-greedy"] = await c.generate([2, 7], {"max_new_tokens": 8, "temperature": 0})
            await c.update_weights_from_disk(paths[1], weight_version="0")
        # a size that differs, received and then loaded in order: SGLang's loader fails at it
        # with every tensor before it loaded, and says so
        bad = {n: new_state[n] for n in names[:-1]}
        bad[names[-1]] = torch.zeros(3)
        await c.begin_weight_update()
        update = asyncio.create_task(c.update_weights_from_distributed(
            names, [str(bad[n].dtype).removeprefix("torch.") for n in names],
            [list(bad[n].shape) for n in names], "wsync", weight_version="partial"))
        await asyncio.to_thread(send_tensors, pg, bad, None)
        with pytest.raises(EngineError) as partial:
            await update
        await c.end_weight_update()
        results["partial"] = partial.value
        results["partial-version"] = await c.get_weight_version()
        results["partial-greedy"] = await c.generate([2, 7], {"max_new_tokens": 8, "temperature": 0})
        await c.update_weights_from_disk(paths[1], weight_version="0")
        results["destroyed"] = await c.destroy_weights_update_group("wsync")
        with pytest.raises(EngineError, match="no weight update group 'wsync'"):
            await c.destroy_weights_update_group("wsync")
        destroy_update_group(pg)
        return results, results["flattened_bucket-greedy"]

    out, greedy = run(_with_client(engine.url, go))
    assert out["prefixed"].status == 400 and "'torch.float32' is not a torch dtype name" in \
        out["prefixed"].message
    assert out[None]["success"] and out["flattened_bucket"]["success"]
    assert out["destroyed"]["success"]
    assert out["None-version"] == "dist-None" and out["flattened_bucket-version"] == "dist-flattened_bucket"
    assert out["None-greedy"]["output_ids"] == greedy["output_ids"]
    assert out["partial"].status == 400 and out["partial"].message == PARTIALLY_UPDATED.format(
        f"Attempted to load weight ((3,)) into parameter "
        f"({tuple(new_state[names[-1]].shape)}) {names[-1]}")
    assert out["partial-version"] == "0"  # no version recorded for a failed update
    old = _state(cfg, 1)
    assert greedy["output_ids"] == _greedy(cfg, new_state)
    assert out["partial-greedy"]["output_ids"] == _greedy(
        cfg, {**new_state, names[-1]: old[names[-1]]})
    assert _greedy(cfg, {**new_state, names[-1]: old[names[-1]]}) != _greedy(cfg, old)


def _greedy(cfg, state, seq=(2, 7), n=8):
    from laminar_mcore.rollout.model import DecoderLM

    ref = DecoderLM(cfg, state)
    kv = ref.new_kv_cache(64)
    seq, out = list(seq), []
    for _ in range(n):
        token = int(ref.forward([seq], [torch.arange(len(seq))], [0], kv)[0].argmax())
        out.append(token)
        seq = seq + [token]
    return out


def _raw(url, path, body=None, key=KEY, method="POST"):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_auth_and_malformed_requests_get_4xx_and_the_server_keeps_serving(engine):
    url = engine.url
    assert _raw(url, "/health", key=None, method="GET")[0] == 200
    assert _raw(url, "/generate", {"input_ids": [1], "sampling_params": {}}, key=None)[0] == 401
    assert _raw(url, "/get_model_info", key="wrong", method="GET") == (401, '{"error": "Unauthorized"}')
    assert _raw(url, "/model_info", key=None, method="GET")[0] == 401
    for probe in ("/health", "/health_generate", "/ready", "/metrics"):  # exempt, as in SGLang
        assert _raw(url, probe, key=None, method="GET")[0] == 200, probe
    req = urllib.request.Request(url + "/model_info", headers={"Authorization": f"bEaReR {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # the scheme is case-insensitive
        assert resp.status == 200
    cases = [
        (b"{not json", "JSON object"),
        ({"text": "hello"}, "need a tokenizer"),
        ({}, "Either text or input_ids should be provided."),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, "a"]}, "input_ids: expected integer token ids"),  # SGLang's schema
        ({"input_ids": [1000]}, "input_ids must be in [0, 128)"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}},
         "exceeds the model's maximum context length of 512 tokens"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown field `temprature`"),
        ({"input_ids": [1], "sampling_params": {"seed": 1}}, "unknown field `seed`"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}},
         "sampling_params.max_new_tokens: expected an integer"),
    ]
    for body, message in cases:
        status, text = _raw(url, "/generate", body)
        assert status == 400 and message in text, (body, status, text)
    assert _raw(url, "/pause_generation", {"mode": "sideways"})[0] == 400
    # SGLang 0.5.23 ignores an abort without a rid (an empty 200) and refuses wrong types
    assert _raw(url, "/abort_request", {}) == (200, "")
    assert _raw(url, "/abort_request", {"rid": 5})[0] == 400
    assert _raw(url, "/nope", {})[0] == 404
    status, text = _raw(url, "/generate", {"input_ids": [[1, 2], [3]],
                                           "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(json.loads(text)) == 2
    assert engine.alive()


def test_client_errors_name_the_endpoint(engine):
    async def go():
        async with SGLangClient("http://127.0.0.1:9", timeout_s=2, retries=1,
                                retry_backoff_s=0.01) as dead:
            with pytest.raises(EngineError, match="/model_info: unreachable"):
                await dead.get_weight_version()
            assert await dead.health() is False
        async with SGLangClient(engine.url, api_key=None) as anonymous:
            with pytest.raises(EngineError) as err:
                await anonymous.generate([1], {"max_new_tokens": 1})
        return err.value

    err = run(go())
    assert err.endpoint == "/generate" and err.status == 401 and "Unauthorized" in err.message
