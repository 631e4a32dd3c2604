"""Qwen3-MoE: the adapter (names, layouts, every expert tensor checked), Megatron-Core's MoE
GPTModel and the CPU engine against transformers, and the engine's routed experts over HTTP
(SGLang 0.5.23's return_routed_experts)."""

import asyncio
import base64

import numpy as np
import pytest
import torch

from laminar_mcore.models import AdapterError, get_adapter
from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.model import DecoderLM
from laminar_mcore.testing.moe import engine_trajectories, near_tie_model

MOE_CASES = {
    "norm_topk": dict(norm_topk_prob=True),
    "softmax_then_topk_with_a_dense_layer": dict(norm_topk_prob=False, mlp_only_layers=[1]),
    "sparse_step_2": dict(decoder_sparse_step=2),
}


def _cfg(case="norm_topk"):
    return tiny_hf_config("qwen3_moe", **MOE_CASES[case])


def _state(cfg, seed=3):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_hf_to_mcore_to_hf_is_bit_identical_and_names_every_expert(case):
    cfg = _cfg(case)
    hf = _state(cfg)
    adapter = get_adapter(cfg)
    assert set(hf) == set(adapter.hf_shapes(cfg))
    mcore = adapter.hf_to_mcore(cfg, hf)
    back = adapter.mcore_to_hf(cfg, mcore)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    moe_layers = adapter.moe_shape(cfg).moe_layers
    for i, moe in enumerate(moe_layers):
        has_router = f"decoder.layers.{i}.mlp.router.weight" in mcore
        assert has_router == moe
        if moe:
            fc1 = mcore[f"decoder.layers.{i}.mlp.experts.local_experts.7.linear_fc1.weight"]
            gate = hf[f"model.layers.{i}.mlp.experts.7.gate_proj.weight"]
            up = hf[f"model.layers.{i}.mlp.experts.7.up_proj.weight"]
            assert torch.equal(fc1, torch.cat([gate, up]))
        else:
            assert f"decoder.layers.{i}.mlp.linear_fc1.weight" in mcore
    if case == "sparse_step_2":
        assert moe_layers == (False, True, False, True)


def test_a_missing_extra_or_misnamed_expert_tensor_is_a_named_error():
    cfg = _cfg()
    adapter = get_adapter(cfg)
    hf = _state(cfg)
    missing = dict(hf)
    missing.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(AdapterError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight.*missing"):
        adapter.hf_to_mcore(cfg, missing)
    extra = dict(hf, **{"model.layers.0.mlp.experts.8.down_proj.weight": torch.zeros(64, 32)})
    with pytest.raises(AdapterError, match=r"no Megatron counterpart.*experts\.8\.down_proj"):
        adapter.hf_to_mcore(cfg, extra)
    misnamed = dict(hf)
    misnamed["model.layers.1.mlp.experts.3.w1.weight"] = misnamed.pop(
        "model.layers.1.mlp.experts.3.gate_proj.weight")
    with pytest.raises(AdapterError, match=r"experts\.3\.w1\.weight"):
        adapter.hf_to_mcore(cfg, misnamed)
    mcore = adapter.hf_to_mcore(cfg, hf)
    mcore.pop("decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight")
    with pytest.raises(AdapterError, match=r"local_experts\.0\.linear_fc2\.weight.*missing"):
        adapter.mcore_to_hf(cfg, mcore)
    # the CPU engine's loader fails on a wrong expert shape (SGLang's size check), naming it
    model = DecoderLM(cfg, hf)
    before = model.params["model.layers.0.mlp.experts.0.down_proj.weight"].clone()
    bad = {"model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(64, 33)}
    with pytest.raises(ValueError, match=r"\(\(64, 33\)\).*experts\.0\.down_proj\.weight"):
        model.load_like_sglang(bad)
    assert torch.equal(model.params["model.layers.0.mlp.experts.0.down_proj.weight"], before)


def test_expert_tp_split_and_grouped_gemm_names():
    from laminar_mcore.models.base import split_layer_name

    cfg = _cfg()
    adapter = get_adapter(cfg)
    mcore = adapter.hf_to_mcore(cfg, _state(cfg))
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    shards = [adapter.shard(name, mcore[name], r, 2) for r in range(2)]
    assert shards[0].shape == (32, 64)  # [gate_r; up_r], 16 rows each
    assert torch.equal(adapter.unshard(name, shards), mcore[name])
    fc2 = name.replace("fc1", "fc2")
    assert adapter.tp_dim(fc2) == 1 and adapter.tp_dim("decoder.layers.1.mlp.router.weight") is None
    # Transformer Engine's grouped GEMM names the same tensor mlp.experts.linear_fc1.weight2
    assert split_layer_name("decoder.layers.1.mlp.experts.linear_fc1.weight2") == \
        (1, "mlp.experts.local_experts.2.linear_fc1.weight")


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_megatron_moe_model_and_cpu_engine_match_transformers(case, tmp_path):
    from transformers import AutoModelForCausalLM

    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.model import build_gpt_model, load_full_state

    cfg = _cfg(case)
    hf = _state(cfg)
    save_hf_checkpoint(tmp_path, cfg, hf)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.log_softmax(ref(tokens[None]).logits[0].float(), -1)
    engine = DecoderLM(cfg, hf)
    routed = []
    got = engine.forward([tokens.tolist()], [torch.arange(24)], [0], engine.new_kv_cache(32),
                         all_logits=True, routed_out=routed)[0]
    assert (torch.log_softmax(got, -1) - expected).abs().max() < 1e-4
    assert routed[0].shape == (24, cfg.num_hidden_layers, 2)
    moe = get_adapter(cfg).moe_shape(cfg).moe_layers
    for i, is_moe in enumerate(moe):
        rows = routed[0][:, i]
        assert ((rows >= 0).all() and (rows < 8).all()) if is_moe else (rows == 0).all()
        if is_moe:  # two distinct experts per token
            assert (rows[:, 0] != rows[:, 1]).all()
    init_trainer_parallel(seed=1)
    try:
        model = build_gpt_model(cfg)
        load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, hf))
        mask = torch.triu(torch.ones(1, 1, 24, 24, dtype=torch.bool), 1)
        with torch.no_grad():
            logits = model(tokens[None], torch.arange(24)[None], attention_mask=mask)[0]
        assert (torch.log_softmax(logits.float(), -1) - expected).abs().max() < 1e-4
    finally:
        destroy_trainer_parallel()


@pytest.mark.multiprocess
def test_engine_returns_routed_experts_as_sglang_does(tmp_path):
    """meta_info.routed_experts: base64 int32 [seqlen - 1 - start, layers, top-k], only when
    the server was started with --enable-return-routed-experts; a start past the prompt is
    an abort (SGLang's scheduler)."""
    from laminar_mcore.rollout.client import SGLangClient
    from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

    cfg = _cfg()
    hf = _state(cfg)
    save_hf_checkpoint(tmp_path / "m", cfg, hf)
    prompt = [5, 9, 17, 33, 2, 64]

    async def generate(url, **extra):
        async with SGLangClient(url, timeout_s=30) as c:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 7,
                    "temperature": 0.0, "ignore_eos": True}, "return_logprob": True, **extra}
            return await c._request("POST", "/generate", body, timeout=30)

    with EngineProcess(cpu_engine_command(str(tmp_path / "m"), routed_experts=True),
                       log_path=str(tmp_path / "e.log")) as on:
        out = asyncio.run(generate(on.url, return_routed_experts=True))
        part = asyncio.run(generate(on.url, return_routed_experts=True, routed_experts_start_len=4))
        plain = asyncio.run(generate(on.url))
        bad = asyncio.run(generate(on.url, return_routed_experts=True, routed_experts_start_len=7))
    with EngineProcess(cpu_engine_command(str(tmp_path / "m")),
                       log_path=str(tmp_path / "e2.log")) as off:
        without_flag = asyncio.run(generate(off.url, return_routed_experts=True))
    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    seqlen = len(prompt) + 7
    routed = routed.reshape(seqlen - 1, cfg.num_hidden_layers, 2)
    # the same routing as the model's own forward over the sequence (positions 0..seqlen-2)
    engine = DecoderLM(cfg, hf)
    ref = []
    engine.forward([prompt + out["output_ids"][:-1]], [torch.arange(seqlen - 1)], [0],
                   engine.new_kv_cache(32), routed_out=ref)
    assert np.array_equal(routed, ref[0].numpy())
    tail = np.frombuffer(base64.b64decode(part["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(tail.reshape(-1, cfg.num_hidden_layers, 2), routed[4:])
    assert "routed_experts" not in plain["meta_info"]
    assert "routed_experts" not in without_flag["meta_info"]
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "routed_experts_start_len=7" in bad["meta_info"]["finish_reason"]["message"]


# (TP2, EP2) trains only with sequence parallelism in Megatron-Core (MoELayer refuses TP > 1
# without it): on CPU, torch's norm takes SP as TE's does (parallel/cpu_compat.py). Expert
# TP > 1 gathers token slices of uneven sizes, which gloo cannot: a GPU layout.
EP_LAYOUTS = ["t1p1e1", "t1p1e2", "t2p1e2s", "t1p2e2", "t1p1e4"]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    import os

    from laminar_mcore.testing.dist import run_torchrun

    from .conftest import WORKERS

    out = str(tmp_path_factory.mktemp("moe_layouts"))
    results = run_torchrun(os.path.join(WORKERS, "moe_step.py"), 4,
                           ["--layouts", ",".join(EP_LAYOUTS), "--replay"], out_dir=out,
                           timeout=900)
    return out, results


def _stage_files(out, prefix, layout):
    import glob

    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(f"{out}/{prefix}_{layout}_pp*.safetensors")):
        part = load_file(path)
        assert not set(part) & set(tensors), "two stages hold the same tensor"
        tensors.update(part)
    return tensors


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_ep_rank_exports_its_own_experts_which_make_the_export_bit_for_bit(ep_run):
    """Issue 52, per-rank export of a mixture-of-experts model (TP1): every EP rank of the
    first expert-data-parallel replica yields its own experts, whole, and EP rank 0 the rest,
    with no collective; one part per EP rank and stage (``publish_part``); together they are
    the stage-lead export (experts gathered over EP) bit for bit, every tensor exactly once."""
    import glob

    from safetensors.torch import load_file

    out, _ = ep_run
    for layout in [x for x in EP_LAYOUTS if x.startswith("t1")]:
        pp, ep = int(layout[3]), int(layout[5])
        exported = _stage_files(out, "export", layout)
        paths = sorted(glob.glob(f"{out}/shards_{layout}_part*.safetensors"))
        assert [p.rsplit("part", 1)[1] for p in paths] == [
            f"{k}.safetensors" for k in range(pp * ep)], (layout, paths)
        pieces = {}
        for path in paths:
            part = load_file(path)
            experts = {k for k in part if ".experts." in k}
            assert experts or ep == 1, (layout, path)  # every EP rank holds experts
            for key, tensor in part.items():
                name, dim = key.split("|")
                assert dim == "None" and name not in pieces, (layout, name)  # whole, once
                pieces[name] = tensor
        assert set(pieces) == set(exported), (layout, set(pieces) ^ set(exported))
        for name, tensor in pieces.items():
            assert torch.equal(tensor, exported[name]), f"{layout} {name}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_step_gives_the_same_weights_at_every_expert_layout(ep_run):
    """EP1, EP2, (TP2, EP2, sequence parallel), (PP2, EP2) and EP4 on 4 ranks: the same updated weights (fp32, 1e-5),
    every expert present once; the export (the publisher's HF tensors, experts gathered over
    EP) equals the adapter's conversion of those weights; with routing replay, the recomputed
    log-probs of near-tie trajectories equal the engine's (1e-4) at every layout."""
    out, results = ep_run
    cfg = tiny_hf_config("qwen3_moe", mlp_only_layers=[2])
    adapter = get_adapter(cfg)
    initial = adapter.hf_to_mcore(cfg, _state(cfg))
    reference = _stage_files(out, "weights", "t1p1e1")
    assert set(reference) == set(initial)
    moved = [n for n in reference if not torch.equal(reference[n], initial[n])]
    assert any("local_experts" in n for n in moved) and any("router" in n for n in moved)
    loss = results[0]["stats"]["t1p1e1"]["loss"]
    assert sum(len(r.get("replay_gap", {})) for r in results) >= 2 * (len(EP_LAYOUTS) - 1)
    for layout in EP_LAYOUTS[1:]:
        weights = _stage_files(out, "weights", layout)
        assert set(weights) == set(reference), layout
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, reference[name], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{layout} {name}: {m}")
        for r in results:
            assert abs(r["stats"][layout]["loss"] - loss) < 1e-5, (layout, r["rank"])
        exported = _stage_files(out, "export", layout)
        for r in results:  # routing replay through the EP dispatcher and across stages
            gap = r.get("replay_gap", {}).get(layout)
            assert gap is None or gap < 1e-4, (layout, r["rank"], gap)
        expected = adapter.mcore_to_hf(cfg, weights)
        assert set(exported) == set(expected), layout
        for name, tensor in exported.items():
            assert torch.equal(tensor, expected[name]), f"{layout} export {name}"
    # R3 at the 235B recipe's shape of parallelism (TP2 x EP2, sequence parallel): replayed
    # log-probs equal the engine's, and a replayed step is the same with full activation
    # recompute (the recomputed forward takes the same micro-batch's routes again)
    sp_gaps = [r["replay_gap"]["t2p1e2s"] for r in results if "t2p1e2s" in r.get("replay_gap", {})]
    assert sp_gaps and max(sp_gaps) < 1e-4, sp_gaps
    for layout in ("t2p1e2s", "t1p2e2"):  # and under pipeline parallelism's 1F1B
        recompute = [r["replay_recompute_gap"][layout] for r in results]
        assert len(recompute) == 4 and max(recompute) < 1e-6, (layout, recompute)


def test_routing_replay_makes_the_trainer_match_the_engine_on_near_ties():
    from laminar_mcore.config.schema import AlgoConfig, TrainerConfig
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.actor import MegatronActor

    cfg, hf = near_tie_model()
    trajs = engine_trajectories(cfg, hf)
    full = get_adapter(cfg).hf_to_mcore(cfg, hf)
    results = {}
    init_trainer_parallel(seed=1)
    try:
        for replay in (False, True):
            actor = MegatronActor(cfg, AlgoConfig(routing_replay=replay, mismatch_threshold=1e-3),
                                  TrainerConfig(lr=1e-6, max_tokens_per_microbatch=64),
                                  full_state=full)
            mbs = actor.distribute(trajs)
            actor.compute_logprobs(mbs)
            diffs = torch.cat([(mb.prox_logprobs - mb.behav_logprobs)[mb.loss_mask > 0].abs()
                               for mb in mbs])
            stats = actor.train_step(trajs)
            results[replay] = (diffs, stats)
    finally:
        destroy_trainer_parallel()
    without, with_replay = results[False][0], results[True][0]
    assert with_replay.max() < 1e-4, with_replay.max()
    assert without.max() > 1e-2, without.max()  # the routers disagreed on near ties
    # the step's metrics report it: the same numbers, from the training forward pass
    s_off, s_on = results[False][1], results[True][1]
    assert s_on["mismatch_tokens"] == s_off["mismatch_tokens"] == len(without)
    assert abs(s_off["mismatch_max"] - float(without.max())) < 1e-5
    assert s_off["mismatch_frac_above"] > 0.05 and s_on["mismatch_frac_above"] == 0.0
    assert s_on["mismatch_max"] < 1e-4 and s_on["mismatch_p99"] <= s_on["mismatch_max"]
    assert s_off["mismatch_mean"] <= s_off["mismatch_p99"] <= s_off["mismatch_max"]


def test_the_reference_model_replays_the_engines_routing_too():
    """algo.kl_coef with routing replay: the frozen reference (the initial weights, which the
    engine generated with) routes each token as the engine did, so its log-probs equal the
    engine's on near ties (without replay they differ by > 1e-2, test above), and the first
    step's KL is 0."""
    from laminar_mcore.config.schema import AlgoConfig, TrainerConfig
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.trainer.actor import MegatronActor

    cfg, hf = near_tie_model()
    trajs = engine_trajectories(cfg, hf)
    full = get_adapter(cfg).hf_to_mcore(cfg, hf)
    init_trainer_parallel(seed=1)
    try:
        actor = MegatronActor(cfg, AlgoConfig(routing_replay=True, kl_coef=0.1),
                              TrainerConfig(lr=1e-6, max_tokens_per_microbatch=64),
                              full_state=full)
        assert actor._ref_replays and not set(map(id, actor._ref_replays)) & set(
            map(id, actor._replays))
        mbs = actor.distribute(trajs)
        actor.compute_ref_logprobs(mbs)
        diffs = torch.cat([(mb.extras["ref_logprobs"] - mb.behav_logprobs)[mb.loss_mask > 0]
                           .abs() for mb in mbs])
        stats = actor.train_step(trajs)
    finally:
        destroy_trainer_parallel()
    assert diffs.max() < 1e-4, diffs.max()
    assert stats["kl_loss"] == pytest.approx(0.0, abs=1e-6)


def test_replay_needs_the_engines_routing_and_says_so():
    from laminar_mcore.trainer.packing import routed_experts_rows

    cfg, hf = near_tie_model()
    traj = engine_trajectories(cfg, hf, n=1)[0]
    rows = routed_experts_rows(traj, cfg.num_hidden_layers, 2)
    assert rows.shape == (traj.num_tokens, cfg.num_hidden_layers, 2)
    traj.routed_experts = []
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routed_experts_rows(traj, cfg.num_hidden_layers, 2)
    traj.routed_experts = [base64.b64encode(np.zeros(6, dtype=np.int32).tobytes()).decode()]
    with pytest.raises(ValueError, match=r"6 routed-expert entries, expected"):
        routed_experts_rows(traj, cfg.num_hidden_layers, 2)
