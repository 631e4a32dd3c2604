"""Engines of a mixture-of-experts model pull only their own experts (issue 52): SGLang
0.5.23's fused expert layout (weights/engine_layout.py) checked by running SGLang's own FusedMoE
loaders, which runner and GPU keep it, a real relay serving a TP2 EP2 CPU engine, and the
layout at Qwen3-235B's size."""

import ast
import asyncio

import pytest
import torch

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.testing import sglang_source
from laminar_mcore.weights.engine_layout import (LAYOUT_ARGS, MOE_LAYOUT_ARGS, Layout,
                                                 LayoutError, layout_for_config,
                                                 sglang_layout_mismatch)

from .test_engine_shards import TOKEN, _generate, _state, assert_the_ranks_give_back


def _sglang_expert_loader(tp, ep, rank):
    """SGLang 0.5.23's own FusedMoE loaders (``_load_w13``, ``_load_w2``,
    ``_map_global_expert_id_to_local_expert_id``, read from its source and run here) bound to
    TP rank ``rank`` of an engine of TP ``tp`` and ``--ep-size`` ``ep`` with the default runner
    (not triton_kernels, not flashinfer, no padding). The rank's EP and MoE-TP positions come
    from the groups ``parallel_state.initialize_model_parallel`` forms (quoted below)."""
    import types

    source = sglang_source.read("sglang/srt/layers/moe/fused_moe_triton/layer.py")
    tree = ast.parse(source)
    cls = next(n for n in tree.body if getattr(n, "name", None) == "FusedMoE")
    fns = [n for n in cls.body if getattr(n, "name", None) in (
        "_load_w13", "_load_w2", "_map_global_expert_id_to_local_expert_id")]
    for fn in fns:
        fn.decorator_list = []
    scope = {"torch": torch, "_is_cpu": False, "_weight_layout_method": lambda layer: None,
             "_maybe_copy_weight_view_before_h2d": lambda w: w}
    exec(compile(ast.Module(body=fns, type_ignores=[]), "sglang", "exec"), scope)
    groups = sglang_source.read("sglang/srt/distributed/parallel_state.py")
    for rule in ("ranks = list(range(st, en, moe_tp_size))",  # the EP groups, st = moe_tp_idx
                 "+ ep_dp_combined_idx * moe_tp_size",  # the MoE-TP groups: consecutive ranks
                 '"moe_tp_size": tp_size // moe_ep_size // moe_dp_size'):
        assert rule in groups + sglang_source.read("sglang/srt/runtime_context.py"), rule
    moe_tp = tp // ep
    ep_groups = [list(range(i, tp, moe_tp)) for i in range(moe_tp)]  # range(st, en, moe_tp)
    tp_groups = [list(range(k * moe_tp, (k + 1) * moe_tp)) for k in range(ep)]  # range(st, en)
    ep_rank = next(g.index(rank) for g in ep_groups if rank in g)
    tp_rank = next(g.index(rank) for g in tp_groups if rank in g)
    experts = 8
    layer = types.SimpleNamespace(
        moe_runner_config=types.SimpleNamespace(is_gated=True), use_padded_loading=False,
        use_presharded_weights=False, use_triton_kernels=False, moe_tp_size=moe_tp,
        moe_tp_rank=tp_rank, _expert_storage_rank=ep_rank, _num_local_routed=experts // ep,
        _has_fused_shared=False, _num_global_routed=experts, quant_config=None)
    for fn in fns:
        setattr(layer, fn.name, types.MethodType(scope[fn.name], layer))
    return layer


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)])
def test_moe_ranks_hold_sglangs_experts_and_give_back_the_model_bit_for_bit(tp, ep):
    """Qwen3-MoE at TP ``tp``, ``--ep-size`` ``ep``: each rank's fused experts equal what
    SGLang's own loaders (``_sglang_expert_loader``) write into its ``w13_weight`` /
    ``w2_weight`` (allocated as ``UnquantizedFusedMoEMethod.create_weights`` does); the router
    is whole on every rank; the CPU engine takes the ranks back bit for bit."""
    cfg = tiny_hf_config("qwen3_moe")
    state = _state(cfg, seed=5)
    layout = layout_for_config(cfg, tp, ep=ep)
    s, m = get_adapter(cfg).shape(cfg), get_adapter(cfg).moe_shape(cfg)
    unquant = sglang_source.read("sglang/srt/layers/quantization/unquant.py")
    assert "w13_weight_n, w13_weight_k = (w13_up_dim, hidden_size)" in unquant
    layer_src = sglang_source.read("sglang/srt/layers/moe/fused_moe_triton/layer.py")
    assert 'SHARD_ID_TO_SHARDED_DIM = {"w1": 0, "w2": 1, "w3": 0}' in layer_src
    ranks = []
    for r in range(tp):
        named = {n: layout.fill(n, r, state.__getitem__,
                                torch.full(layout.shapes[n], float("nan"), dtype=torch.bfloat16))
                 for n in layout.names}
        sg = _sglang_expert_loader(tp, ep, r)
        inter = m.moe_ffn // sg.moe_tp_size
        for i in range(s.layers):
            p = f"model.layers.{i}.mlp."
            w13 = torch.zeros(m.experts // ep, 2 * inter, s.hidden, dtype=torch.bfloat16)
            w2 = torch.zeros(m.experts // ep, s.hidden, inter, dtype=torch.bfloat16)
            for e in range(m.experts):
                local = sg._map_global_expert_id_to_local_expert_id(e)
                if local == -1:
                    continue
                for shard_id, proj in (("w1", "gate_proj"), ("w3", "up_proj")):
                    sg._load_w13(w13[local], 0, shard_id, state[f"{p}experts.{e}.{proj}.weight"])
                sg._load_w2(w2[local], 1, "w2", state[f"{p}experts.{e}.down_proj.weight"])
            assert torch.equal(named[p + "experts.w13_weight"], w13), (r, i)
            assert torch.equal(named[p + "experts.w2_weight"], w2), (r, i)
            assert torch.equal(named[p + "gate.weight"], state[p + "gate.weight"])
        ranks.append(named)
    assert not any(t.isnan().any() for named in ranks for t in named.values())
    assert_the_ranks_give_back(cfg, layout, ranks, state)


def test_moe_layouts_sglang_refuses_or_we_do_not_cover_are_refused():
    """What SGLang refuses (an EP not dividing TP or the experts, more MoE-TP ranks than
    experts) is refused with the fix; a version missing an expert's tensors cannot be laid out;
    nor a dense layer beside experts (SGLang 0.5.23's Qwen3-MoE has none)."""
    cfg = tiny_hf_config("qwen3_moe")  # 8 experts, moe_intermediate_size 32
    with pytest.raises(LayoutError, match="LMC-E519.*engine_ep dividing rollout.engine_tp"):
        layout_for_config(cfg, 4, ep=3)
    with pytest.raises(LayoutError, match="LMC-E519.*greater than the number of experts 8"):
        layout_for_config(tiny_hf_config("qwen3_moe", num_attention_heads=16,
                                         num_key_value_heads=16), 16)
    shapes = get_adapter(cfg).hf_shapes(cfg)
    del shapes["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(LayoutError, match="LMC-E519.*every expert's gate and up"):
        Layout(shapes, 4, 2, ep=2)
    experts = {k: v for k, v in shapes.items() if "layers.0.mlp.experts" in k}
    with pytest.raises(LayoutError, match="LMC-E519: 8 experts do not split over expert "
                                          "parallel size 3"):
        Layout(experts, 4, 3, ep=3)  # (a stripe without attention lays out alone)
    with pytest.raises(LayoutError, match="LMC-E519.*count \\[7, 8\\] experts"):
        Layout({k: v for k, v in get_adapter(cfg).hf_shapes(cfg).items()
                if "experts.7." not in k or "layers.1." not in k}, 4, 2)
    with pytest.raises(LayoutError, match="LMC-E519.*makes every layer sparse"):
        layout_for_config(tiny_hf_config("qwen3_moe", mlp_only_layers=[1]), 2)
    assert "is_layer_sparse = True" in sglang_source.read("sglang/srt/models/qwen3_moe.py")


def test_sglang_engines_refuse_a_qwen3_moe_with_dense_layers(tmp_path):
    """SGLang 0.5.23 serves every Qwen3-MoE layer as MoE (its source, above): an SGLang engine
    of a checkpoint with dense layers is refused before it is launched; the CPU engine, which
    serves them, and an all-sparse checkpoint are not."""
    from laminar_mcore.config.schema import LaminarConfig
    from laminar_mcore.rollout.launcher import check_sglang_serves, engine_process

    from .test_engine_shards import _state as state_of

    for name, cfg in (("dense1", tiny_hf_config("qwen3_moe", mlp_only_layers=[1])),
                      ("sparse", tiny_hf_config("qwen3_moe"))):
        save_hf_checkpoint(str(tmp_path / name), cfg, state_of(cfg, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"LMC-E314: .*layers \[1\] are dense"):
        check_sglang_serves(str(tmp_path / "dense1"))
    check_sglang_serves(str(tmp_path / "sparse"))
    check_sglang_serves(str(tmp_path / "no-such-dir"))  # left to SGLang to say
    run = LaminarConfig()
    run.rollout.backend = "sglang"
    with pytest.raises(ValueError, match="LMC-E314"):
        engine_process(run, str(tmp_path / "dense1"), str(tmp_path / "e.log"), 0)


def _sglang_defaults() -> dict:
    """Every ServerArgs field's declared default, read from SGLang 0.5.23's field modules."""
    import re

    out = {}
    for module in ("parallel", "exec_", "model"):
        text = sglang_source.read(f"sglang/srt/arg_groups/fields/{module}.py")
        for m in re.finditer(r"^    (\w+): A\[.*?\] = (.+?)$", text, re.M | re.S):
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def test_an_engine_says_whether_its_weights_are_in_the_layout():
    """``/server_info`` holds SGLang's resolved arguments, every field at the top level
    (``build_server_info``: ``server_args.resolved_dict()``; read from its source here, with
    each field's declared default, which is the value the layout needs); on an SM100 GPU its
    Qwen3-MoE override has made ``auto`` flashinfer_trtllm. Any argument that moves or re-lays
    the weights, another TP/EP than the pull's, or a key missing says no."""
    override = sglang_source.read("sglang/srt/arg_groups/model_overrides/qwen3_moe.py")
    assert "if get_platform().is_sm100:" in override
    assert 'overrides["moe_runner_backend"] = "flashinfer_trtllm"' in override
    assert "result = server_args.resolved_dict()" in sglang_source.read(
        "sglang/srt/utils/common.py")
    assert 'resolved["enable_dp_attention"] = resolving_view(self).attn_dp_size > 1' in \
        sglang_source.read("sglang/srt/server_args.py")
    defaults = _sglang_defaults()
    for key, want in {**LAYOUT_ARGS, **MOE_LAYOUT_ARGS, "tp_size": (1,), "ep_size": (1,)}.items():
        assert ast.literal_eval(defaults[key]) == want[0], (key, defaults.get(key))
    hopper = {"tp_size": 8, "ep_size": 8, **{k: v[0] for k, v in LAYOUT_ARGS.items()},
              **{k: v[0] for k, v in MOE_LAYOUT_ARGS.items()}, "frontend": "python"}
    assert sglang_layout_mismatch(hopper, 8, 8, moe=True) == ""
    assert sglang_layout_mismatch({**hopper, "moe_runner_backend": "triton"}, 8, 8, True) == ""
    assert sglang_layout_mismatch({**hopper, "ep_size": 1}, 8, 8, moe=False) == ""  # dense
    cpu = {"tp_size": 2, "ep_size": 2, "frontend": "laminar-cpu"}  # what the CPU engine says
    assert sglang_layout_mismatch(cpu, 2, 2, moe=True) == ""
    assert "has no enable_eplb" in sglang_layout_mismatch(
        {k: v for k, v in hopper.items() if k != "enable_eplb"}, 8, 8, moe=True)
    for key, value in (("moe_runner_backend", "flashinfer_trtllm"), ("ep_size", 1),
                       ("moe_runner_backend", "triton_kernels"), ("enable_eplb", True),
                       ("ep_num_redundant_experts", 32), ("moe_a2a_backend", "deepep"),
                       ("enable_dp_attention", True), ("quantization", "fp8"),
                       ("attn_cp_size", 2), ("enable_paged_experts", True)):
        why = sglang_layout_mismatch({**hopper, key: value}, 8, 8, moe=True)
        assert f"{key}={value!r}" in why, key
    assert "attn_cp_size=2" in sglang_layout_mismatch({**hopper, "attn_cp_size": 2}, 8, 8, False)


@pytest.mark.multiprocess
def test_ep2_moe_engine_ranks_pull_only_their_experts_from_a_real_relay(tmp_path, monkeypatch):
    """A Qwen3-MoE version on a real relay: a TP2 EP2 CPU engine pulls each rank's own experts
    (half of them, whole) and attention slices as SGLang's direct payloads, a TP1 engine pulls
    whole tensors: both generate the same tokens with the same log-probs, and each rank of the
    shard pull received about half the version."""
    from laminar_mcore.netutil import TOKEN_ENV
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.relay.client import RelayClient
    from laminar_mcore.relay.transports import PullSpec, make_puller, pull_latest_into_engine
    from laminar_mcore.rollout.client import SGLangClient
    from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    from .conftest import wait_until
    from .test_relay_chain import _get, _relay

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = tiny_hf_config("qwen3_moe")
    init_trainer_parallel(tp=1, pp=1, seed=0)
    procs, publisher = [], None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1)
        procs.append(master)
        publisher = WeightPublisher(build_gpt_model(cfg, dtype=torch.bfloat16), cfg,
                                    relay_host="127.0.0.1", token=TOKEN,
                                    publish_port=int(master.wait_printed(
                                        "LAMINAR_RELAY_PUBLISH_PORT")), bucket_bytes=60_000)
        publisher.publish(1)
        publisher.wait()
        wait_until(lambda: _get(master.url, "/latest")["version"] == 1, what="version 1")
        model_dir = str(tmp_path / "model")
        save_hf_checkpoint(model_dir, cfg, {k: torch.zeros(s) for k, s in
                                            get_adapter(cfg).hf_shapes(cfg).items()})
        engines = [EngineProcess(cpu_engine_command(model_dir, tp=tp, ep=ep,
                                                    kv_capacity_tokens=512),
                                 log_path=str(tmp_path / f"engine{i}.log")).start()
                   for i, (tp, ep) in enumerate(((2, 2), (1, 1)))]
        procs += engines
        specs = (PullSpec("shm", options=(("shard", (2, cfg.num_attention_heads, False, 2)),)),
                 PullSpec("shm"))

        async def pulls():
            served = []
            async with RelayClient(master.url, TOKEN) as relay:
                for engine, spec in zip(engines, specs):
                    async with SGLangClient(engine.url) as eng:
                        assert await pull_latest_into_engine(relay, eng, 0, spec=spec) == 1
                    served.append(relay.last_release["bytes_served"])
            return served

        served = asyncio.run(pulls())
        version_bytes = sum(torch.Size(s).numel() * 2
                            for s in get_adapter(cfg).hf_shapes(cfg).values())
        assert served[1] >= version_bytes
        assert version_bytes / 2 <= served[0] / 2 < 0.6 * version_bytes, (served, version_bytes)
        outputs = [_generate(e.url, [3, 17, 42, 5]) for e in engines]
        assert outputs[0] == outputs[1] and len(outputs[0][0]) == 6, outputs

        async def verified():
            """A run's puller asks the engine first (``verify``): the TP2 EP2 engine confirms
            an EP2 shard; asked for EP1 shards, it says ep_size=2 -- auto pulls whole tensors
            instead, shard refuses."""
            loads = []
            async with RelayClient(master.url, TOKEN) as relay, \
                    SGLangClient(engines[0].url) as eng:
                for ep, mode in ((2, "auto"), (1, "auto"), (1, "shard")):
                    puller = make_puller(PullSpec("shm", options=(
                        ("ranks", 2), ("shard", (2, cfg.num_attention_heads, False, ep)),
                        ("verify", mode), ("moe", True))))
                    try:
                        assert await puller.pull(relay, eng, 0) == 1
                    except ValueError as exc:
                        loads.append(str(exc))
                    else:
                        loads.append(puller.loads)
            return loads

        loads = asyncio.run(verified())
        assert loads[:2] == [{"direct": 1}, {"flattened_bucket": 1}], loads
        assert "LMC-E519" in loads[2] and "ep_size=2" in loads[2], loads
        assert _generate(engines[0].url, [3, 17, 42, 5]) == outputs[1]
    finally:
        if publisher is not None:
            publisher.close()
        for p in procs:
            p.stop()
        destroy_trainer_parallel()


def test_an_moe_engines_pull_is_decided_from_the_config_then_by_the_engine(tmp_path):
    """From the config: an MoE engine of TP > 1 pulls its shard (and, as every shard pull, has its
    own /server_info confirm the layout at its first pull: ``verify``) where
    ``rollout.moe_runner_backend`` is auto or triton; another runner pulls whole tensors, and
    ``shard`` is refused there. The SGLang command carries ``--ep-size`` and the runner."""
    from laminar_mcore.config.schema import RolloutConfig, WeightSyncConfig
    from laminar_mcore.rollout.launcher import engine_pull_spec, sglang_command

    cfg = tiny_hf_config("qwen3_moe")
    model = str(tmp_path / "moe")
    save_hf_checkpoint(model, cfg, _state(cfg, dtype=torch.float32))

    def spec(backend="cpu", runner="auto", mode="auto", tp=2, ep=2):
        rollout = RolloutConfig(backend=backend, engine_tp=tp, engine_ep=ep,
                                moe_runner_backend=runner)
        return engine_pull_spec(rollout, 0, WeightSyncConfig(engine_pull=mode), model)

    heads = cfg.num_attention_heads
    for backend in ("cpu", "sglang"):
        for runner, mode in (("auto", "auto"), ("triton", "shard")):
            got = spec(backend, runner, mode)
            assert got.option("shard") == (2, heads, False, 2), (backend, runner)
            assert got.option("verify") == mode and got.option("moe") is True
    assert spec(ep=1).option("shard") == (2, heads, False, 1)
    assert spec("sglang", "flashinfer_trtllm").option("shard") is None
    with pytest.raises(ValueError, match="LMC-E519.*moe_runner_backend=cutlass"):
        spec("sglang", "cutlass", "shard")
    dense = tiny_hf_config("qwen2")
    save_hf_checkpoint(str(tmp_path / "dense"), dense, _state(dense, dtype=torch.float32))
    dense_spec = engine_pull_spec(RolloutConfig(engine_tp=2), 0, WeightSyncConfig(),
                                  str(tmp_path / "dense"))
    assert dense_spec.option("verify") == "auto" and dense_spec.option("moe") is False
    command = sglang_command(model, port=1, tp=2, ep=2, moe_runner_backend="triton")
    assert command[command.index("--ep-size") + 1] == "2"
    assert command[command.index("--moe-runner-backend") + 1] == "triton"
    assert "--ep-size" not in sglang_command(model, port=1, tp=2)


def test_a_qwen3_235b_engine_rank_pulls_an_eighth_of_it():
    """At production size (Qwen3-235B-A22B's shapes, 470 GB in bf16; shapes only, nothing
    allocated), each rank of a TP8 engine -- experts by TP or by EP8 -- and of a TP16 EP16 one
    pulls 1/TP of the version, plus its whole router and norms and its replicated key/value
    heads (under 1% more)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=94, hidden_size=4096, num_attention_heads=64,
                         num_key_value_heads=4, head_dim=128, num_experts=128,
                         moe_intermediate_size=1536, intermediate_size=12288,
                         vocab_size=151936, num_experts_per_tok=8, tie_word_embeddings=False)
    total = sum(torch.Size(s).numel() for s in get_adapter(cfg).hf_shapes(cfg).values())
    assert 235e9 < total < 235.2e9
    for tp, ep in ((8, 1), (8, 8), (16, 16)):
        layout = layout_for_config(cfg, tp, ep=ep)
        rank = sum(torch.Size(s).numel() for s in layout.shapes.values())
        assert 1 / tp <= rank / total < 1.01 / tp, (tp, ep, rank / total)
