"""Each engine rank pulls only its own shard (issue 52): SGLang 0.5.23's per-rank parameter
layout (weights/engine_layout.py) checked against SGLang's own source, taken back bit for bit
by the CPU engine, and served by a real relay to real TP2 CPU engines on loopback."""

import ast
import asyncio
import dataclasses

import pytest
import torch

from laminar_mcore.models import get_adapter
from laminar_mcore.models.hf import save_hf_checkpoint, tiny_hf_config
from laminar_mcore.rollout.engine_weights import load_rank_parameters, load_rank_slices
from laminar_mcore.rollout.model import DecoderLM
from laminar_mcore.testing import sglang_source
from laminar_mcore.weights.engine_layout import (Layout, LayoutError, layout_for_config,
                                                 padded_vocab)

TOKEN = "run-token"
# (family, overrides): GQA with 2 key/value heads (replicated at TP4), a vocabulary that is no
# multiple of 64 (SGLang pads it), Qwen2's qkv bias, Qwen3's q/k norms, Llama's tied embedding
MODELS = [("qwen2", dict(vocab_size=200)), ("qwen3", dict(vocab_size=130)),
          ("llama", dict(vocab_size=100, tie_word_embeddings=True))]


def _state(cfg, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype)
            for k, s in get_adapter(cfg).hf_shapes(cfg).items()}


def _sglang_shape(cfg, name, tp):
    """A rank's parameter shape by SGLang's formulas, written out here (not the layout's)."""
    s = get_adapter(cfg).shape(cfg)
    kv = max(1, s.groups // tp)
    if name.endswith("qkv_proj.weight"):
        return ((s.heads // tp + 2 * kv) * s.head_dim, s.hidden)
    if name.endswith("qkv_proj.bias"):
        return ((s.heads // tp + 2 * kv) * s.head_dim,)
    if name.endswith("gate_up_proj.weight"):
        return (2 * s.ffn // tp, s.hidden)
    if name.endswith("down_proj.weight"):
        return (s.hidden, s.ffn // tp)
    if name.endswith("o_proj.weight"):
        return (s.hidden, s.heads * s.head_dim // tp)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (padded_vocab(s.vocab, tp) // tp, s.hidden)
    return tuple(get_adapter(cfg).hf_shapes(cfg)[name])


@pytest.mark.parametrize("family,overrides", MODELS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_holds_sglangs_slices_and_the_ranks_give_back_the_model_bit_for_bit(
        family, overrides, tp):
    cfg = tiny_hf_config(family, **overrides)
    state = _state(cfg)
    layout = layout_for_config(cfg, tp)
    ranks = []
    for r in range(tp):
        named = {n: layout.fill(n, r, state.__getitem__,
                                torch.full(layout.shapes[n], float("nan"), dtype=torch.bfloat16))
                 for n in layout.names}
        assert {n: tuple(t.shape) for n, t in named.items()} == \
            {n: _sglang_shape(cfg, n, tp) for n in named}
        ranks.append(named)
    # each rank's fused parameters rebuilt here the way SGLang's weight loaders place them
    # (linear.py: q at rank * shard, k/v at (rank // replicas) * shard, gate then up; row
    # parallel columns), not from the layout
    s = get_adapter(cfg).shape(cfg)
    replicas = tp // s.groups if tp >= s.groups else 1
    kv = s.head_dim * max(1, s.groups // tp)
    for r, named in enumerate(ranks):
        for i in range(s.layers):
            p = f"model.layers.{i}."
            rows = lambda n, size, at: state[p + n].narrow(0, at * size, size)  # noqa: E731
            qkv = [rows(f"self_attn.{x}_proj.weight", q, at) for x, q, at in (
                ("q", s.heads * s.head_dim // tp, r), ("k", kv, r // replicas),
                ("v", kv, r // replicas))]
            assert torch.equal(named[p + "self_attn.qkv_proj.weight"], torch.cat(qkv)), (r, i)
            f = s.ffn // tp
            assert torch.equal(named[p + "mlp.gate_up_proj.weight"], torch.cat(
                [rows("mlp.gate_proj.weight", f, r), rows("mlp.up_proj.weight", f, r)]))
            cols = s.heads * s.head_dim // tp
            assert torch.equal(named[p + "self_attn.o_proj.weight"],
                               state[p + "self_attn.o_proj.weight"][:, r * cols:(r + 1) * cols])
            assert torch.equal(named[p + "mlp.down_proj.weight"],
                               state[p + "mlp.down_proj.weight"][:, r * f:(r + 1) * f])
    # the vocabulary's padding rows are zero; no value is left unwritten
    embed = ranks[-1]["model.embed_tokens.weight"]
    real = max(0, s.vocab - (tp - 1) * embed.shape[0])  # (Qwen3 at TP4: padding only)
    assert torch.equal(embed[:real], state["model.embed_tokens.weight"][s.vocab - real:])
    assert not embed[real:].any()
    assert not any(t.isnan().any() for named in ranks for t in named.values())

    # the CPU engine takes every rank's parameters back into the model (direct), and whole
    # tensors narrowed per rank (flattened_bucket at TP > 1): bit for bit either way
    for load, payloads in ((load_rank_parameters, ranks), (load_rank_slices, [state] * tp)):
        model = DecoderLM(cfg, {k: torch.zeros_like(v) for k, v in state.items()})
        load(model, layout, payloads)
        differ = [k for k, v in state.items() if not torch.equal(model.params[k], v.float())]
        assert not differ, f"{load.__name__}: {differ[:3]}"


def test_shapes_sglang_refuses_are_refused_with_a_fix():
    cfg = tiny_hf_config("qwen2")  # 4 heads, 2 key/value heads
    with pytest.raises(LayoutError, match="LMC-E519.*rollout.engine_tp"):
        layout_for_config(cfg, 3)
    shapes = get_adapter(cfg).hf_shapes(cfg)
    with pytest.raises(LayoutError, match="LMC-E519.*no place"):
        Layout({**shapes, "model.layers.0.mlp.shared_expert.up_proj.weight": (8, 64)}, 4, 2)
    # a stripe of the version without attention (its norm and output layer) lays out alone
    tail = {n: shapes[n] for n in ("model.norm.weight", "lm_head.weight")}
    assert Layout(tail, 4, 2).shapes == {"model.norm.weight": (64,), "lm_head.weight": (64, 64)}
    with pytest.raises(LayoutError, match="LMC-E519.*attention heads"):
        Layout({**tail, "model.layers.0.self_attn.q_proj.weight": (64, 64)}, 4, 2)
    rank = {"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(3, 64)}
    model = DecoderLM(cfg, _state(cfg, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"Attempted to load weight \(\(3, 64\)\)"):
        load_rank_parameters(model, layout_for_config(cfg, 2), [rank, rank])


def _sglang_functions(source: str, names, method_of=None):
    """Top-level functions and classes ``names`` of an SGLang module (and, with ``method_of``,
    that class's ``_get_indices``), executed alone."""
    tree = ast.parse(source)
    body = [n for n in tree.body if getattr(n, "name", None) in names or (
        isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "DEFAULT_VOCAB_PADDING_SIZE"
                                          for t in n.targets))]
    if method_of:
        cls = next(n for n in tree.body if getattr(n, "name", None) == method_of)
        fn = next(n for n in cls.body if getattr(n, "name", None) == "_get_indices")
        fn.decorator_list = []
        body.append(fn)
    scope = {"dataclass": dataclasses.dataclass, "Sequence": list, "Optional": object,
             "divide": lambda a, b: a // b if a % b == 0 else (_ for _ in ()).throw(
                 AssertionError(f"{a} is not divisible by {b}"))}
    exec(compile(ast.Module(body=body, type_ignores=[]), "sglang", "exec"), scope)
    return scope


def test_the_layout_is_sglangs_own():
    """Read from SGLang 0.5.23's source: the fused names of every family (its
    stacked_params_mapping), the vocabulary rows of each rank (its own functions, run here),
    and the rules of QKVParallelLinear the layout follows."""
    for family in ("qwen2", "qwen3", "llama"):
        tree = ast.parse(sglang_source.read(f"sglang/srt/models/{family}.py"))
        mapping = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                       if isinstance(n, ast.Assign) and "stacked_params_mapping" in ast.unparse(
                           n.targets[0]) and isinstance(n.value, ast.List))
        cfg = tiny_hf_config(family)
        layout = layout_for_config(cfg, 2)
        for hf in get_adapter(cfg).hf_shapes(cfg):
            name = hf  # SGLang's load_weights: the first shard name found is replaced
            for param, shard, _ in mapping:
                if shard in hf:
                    name = hf.replace(shard, param)
                    break
            assert hf in layout.sources(name), (family, hf, name)
        order = [s for _, s, _ in mapping if "proj" in s]
        assert [o.strip(".") for o in order] == ["q_proj", "k_proj", "v_proj", "gate_proj",
                                                 "up_proj"]

    source = sglang_source.read("sglang/srt/layers/vocab_parallel_embedding.py")
    assert "if pad_vocab_size(self.org_vocab_size, padding_size) % self.tp_size != 0:\n" \
           "            padding_size *= self.tp_size" in source
    sg = _sglang_functions(source, {"pad_vocab_size", "vocab_range_from_per_partition_vocab_size",
                                    "vocab_range_from_global_vocab_size",
                                    "VocabParallelEmbeddingShardIndices"}, "VocabParallelEmbedding")
    assert sg["DEFAULT_VOCAB_PADDING_SIZE"] == 64
    for vocab in (100, 128, 151936, 152064, 32000, 128256):
        for tp in (1, 2, 3, 4, 8):
            pad = 64 * (tp if sg["pad_vocab_size"](vocab, 64) % tp else 1)
            padded = sg["pad_vocab_size"](sg["pad_vocab_size"](vocab, pad), pad)
            assert padded_vocab(vocab, tp) == padded
            shapes = {"model.embed_tokens.weight": (vocab, 8),
                      "model.layers.0.self_attn.q_proj.weight": (8 * tp, 8),
                      "model.layers.0.self_attn.k_proj.weight": (8 * tp, 8)}
            layout = Layout(shapes, tp, tp)
            for r in range(tp):
                ix = sg["_get_indices"](None, padded, sg["pad_vocab_size"](vocab, pad), vocab,
                                        vocab, r, tp)
                pieces = layout.pieces("model.embed_tokens.weight", r)
                got = (pieces[0].start, pieces[0].start + pieces[0].length) if pieces else None
                want = (ix.org_vocab_start_index, ix.org_vocab_end_index)
                assert got == (want if want[1] > want[0] else None), (vocab, tp, r)

    linear = sglang_source.read("sglang/srt/layers/linear.py")
    for rule in ("self.num_kv_head_replicas = divide(kv_tp_size, self.total_num_kv_heads)",
                 "shard_id = kv_tp_rank // self.num_kv_head_replicas",
                 "shard_offset = (self.num_heads + self.num_kv_heads) * self.head_size"):
        assert rule in linear, rule


def _generate(url, prompt):
    """Greedy tokens and their log-probs from an engine."""
    from laminar_mcore.rollout.client import SGLangClient

    async def go():
        async with SGLangClient(url) as engine:
            return await engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 6})

    out = asyncio.run(go())
    return out["output_ids"], [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.multiprocess
def test_tp2_engines_pull_only_their_shards_from_a_real_relay(tmp_path, monkeypatch):
    """A TP1 trainer publishes bf16 versions to a real relay; a TP2 CPU engine pulls each
    rank's own parameters (SGLang's direct payload), another TP2 engine and a TP1 engine pull
    whole tensors: all three generate the same tokens with the same log-probs, each rank of
    the shard pull received about half the version; the relay refuses a TP the heads do not
    split over, and an engine given another TP's payload ends as SGLang's scheduler does."""
    from laminar_mcore.netutil import TOKEN_ENV
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.relay.client import RelayClient, RelayError
    from laminar_mcore.relay.transports import PullSpec, pull_latest_into_engine
    from laminar_mcore.rollout.client import EngineError, SGLangClient
    from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command
    from laminar_mcore.trainer.model import build_gpt_model
    from laminar_mcore.trainer.publisher import WeightPublisher

    from .conftest import wait_until
    from .test_relay_chain import _get, _relay

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = tiny_hf_config("qwen2", vocab_size=200)
    init_trainer_parallel(tp=1, pp=1, seed=0)
    procs, publisher = [], None
    try:
        master = _relay(tmp_path, "master", master=True, trainer_stages=1)
        procs.append(master)
        model = build_gpt_model(cfg, dtype=torch.bfloat16)
        publisher = WeightPublisher(model, cfg, relay_host="127.0.0.1", token=TOKEN,
                                    publish_port=int(master.wait_printed(
                                        "LAMINAR_RELAY_PUBLISH_PORT")), bucket_bytes=40_000)
        publisher.publish(1)
        publisher.wait()
        wait_until(lambda: _get(master.url, "/latest")["version"] == 1, what="version 1")
        model_dir = str(tmp_path / "model")
        save_hf_checkpoint(model_dir, cfg, {k: torch.zeros(s) for k, s in
                                            get_adapter(cfg).hf_shapes(cfg).items()})
        engines = [EngineProcess(cpu_engine_command(model_dir, tp=tp, kv_capacity_tokens=512),
                                 log_path=str(tmp_path / f"engine{i}.log")).start()
                   for i, tp in enumerate((2, 2, 1))]
        procs += engines
        shard = PullSpec("shm", options=(("shard", (2, cfg.num_attention_heads, False, 1)),))

        async def pulls():
            served = []
            async with RelayClient(master.url, TOKEN) as relay:
                whole2 = PullSpec("shm", options=(("ranks", 2),))  # a handle for each rank
                for engine, spec in zip(engines, (shard, whole2, PullSpec("shm"))):
                    async with SGLangClient(engine.url) as eng:
                        assert await pull_latest_into_engine(relay, eng, 0, spec=spec) == 1
                    served.append(relay.last_release["bytes_served"])
                # refused: heads that do not split over the TP size (SGLang refuses the TP)
                with pytest.raises(RelayError, match="LMC-E519.*engine_tp"):
                    await relay.lease(shard={"tp_size": 3, "heads": 4})
            return served

        served = asyncio.run(pulls())
        version_bytes = sum(torch.Size(s).numel() * 2
                            for s in get_adapter(cfg).hf_shapes(cfg).values())
        per_rank = served[0] / 2
        print(f"shard pull: {per_rank / version_bytes:.3f} of the version per rank; whole: "
              f"{served[1] / version_bytes:.3f} per rank")
        # each rank of the shard pull: half the version plus its replicated norms, the padding
        # rows of its vocabulary and its key/value heads (replicated: no) -- never the whole
        assert served[1] == served[2] >= version_bytes  # whole tensors: every byte, per rank
        assert version_bytes / 2 <= per_rank < 0.56 * version_bytes, (per_rank, version_bytes)
        outputs = [_generate(e.url, [3, 17, 42, 5]) for e in engines]
        assert outputs[0] == outputs[1] == outputs[2], outputs
        assert len(outputs[0][0]) == 6

        async def wrong_payload():
            """TP2 payloads to the TP1 engine: it reads entry 0 (SGLang ignores the rest), whose
            sizes are not its parameters'; SGLang's scheduler dies on that, and so does it."""
            async with RelayClient(master.url, TOKEN) as relay:
                lease = await relay.lease(shard={"tp_size": 2, "heads": 4})
                wrong = await relay.bucket(lease, 0)
                async with SGLangClient(engines[2].url, retries=0) as eng:
                    await eng.begin_weight_update()
                    with pytest.raises(EngineError):
                        await eng.update_weights_from_tensor(wrong, load_format="direct")
                await relay.release(lease)

        asyncio.run(wrong_payload())
        wait_until(lambda: engines[2].proc.poll() is not None, timeout=30, what="engine exit")
        assert "SGLang 0.5.23's scheduler exits on it" in (tmp_path / "engine2.log").read_text()
    finally:
        if publisher is not None:
            publisher.close()
        for p in procs:
            p.stop()
        destroy_trainer_parallel()


class _Keep:
    """A serializer keeping the payload object (SGLang's pickling needs SGLang; the layout of
    what is pickled is tested)."""

    kept = []

    @staticmethod
    def serialize(obj, output_str=False):
        _Keep.kept.append(obj)
        return "kept"


def test_the_cuda_ipc_exporter_cuts_each_ranks_parameters_onto_its_device():
    """The GPU path of a shard pull, on CPU devices: group by group, rank r's payload is
    SGLang's direct list of (name, tensor) with exactly the layout's rank-r tensors, whatever
    stored bucket each source tensor sits in (the version spread over many small buckets)."""
    from laminar_mcore.relay.shard_pulls import ShardPlan
    from laminar_mcore.relay.store import VersionStore
    from laminar_mcore.relay.transports.cuda_ipc import CudaIpcExporter, standin_bucket_classes
    from laminar_mcore.weights.bucket import BucketPacker

    cfg = tiny_hf_config("qwen2", vocab_size=200)
    state = _state(cfg, seed=3)
    store = VersionStore()
    try:
        sv = store.begin(1, 1, owner="t")
        buckets = list(BucketPacker(20_000).pack(iter(state.items())))
        for index, b in enumerate(buckets):
            stored = store.add_bucket(sv, (0, index), b.buffer.numel(), b.metas,
                                      last_of_stage=index == len(buckets) - 1)
            stored.shm.buffer.copy_(b.buffer)
            store.progress(sv, stored, b.buffer.numel())
        assert len(buckets) > 4 and store.try_complete(sv)
        plan = ShardPlan.of_version(store, sv, 2, cfg.num_attention_heads)
        bucket_cls, meta_cls, _ = standin_bucket_classes()
        exporter = CudaIpcExporter(classes=(bucket_cls, meta_cls, _Keep), require_cuda=False)
        layout = layout_for_config(cfg, 2)
        seen = set()
        for i in range(len(plan.groups)):
            _Keep.kept.clear()
            assert exporter.payload_shard("lease", i, plan, ["cpu", "cpu"]) == ["kept", "kept"]
            for rank, pairs in enumerate(_Keep.kept):
                assert [n for n, _ in pairs] == plan.groups[i]
                for name, t in pairs:
                    want = layout.fill(name, rank, state.__getitem__,
                                       torch.empty(layout.shapes[name], dtype=torch.bfloat16))
                    assert torch.equal(t, want), (name, rank)
                    seen.add(name)
            exporter.free("lease", [i])
        assert seen == set(layout.names)
        with pytest.raises(ValueError, match="one device per TP rank"):
            exporter.payload_shard("lease", 0, plan, ["cpu"])
        exporter.release("lease")
    finally:
        store.close()


def test_each_engine_ranks_pull_is_decided_from_the_config_and_the_model(tmp_path):
    """``weight_sync.engine_pull``: auto pulls shards at engine TP > 1 for a dense model (with
    its head count and tie in the spec), whole tensors at TP1, for an MoE model or a model the
    TP does not divide; ``shard`` where it cannot be is refused with the reason."""
    from laminar_mcore.config.schema import RolloutConfig, WeightSyncConfig
    from laminar_mcore.rollout.launcher import engine_pull_spec

    dirs = {}
    for name, cfg in (("qwen2", tiny_hf_config("qwen2")),
                      ("llama", tiny_hf_config("llama", tie_word_embeddings=True)),
                      ("moe", tiny_hf_config("qwen3_moe"))):
        dirs[name] = str(tmp_path / name)
        save_hf_checkpoint(dirs[name], cfg, _state(cfg, dtype=torch.float32))

    def spec(model, tp, mode="auto", transport="auto"):
        return engine_pull_spec(RolloutConfig(engine_tp=tp), 0,
                                WeightSyncConfig(engine_pull=mode, engine_transport=transport),
                                dirs[model]).option("shard")

    assert spec("qwen2", 2) == (2, 4, False, 1) and spec("llama", 4) == (4, 4, True, 1)
    assert spec("qwen2", 1) is None and spec("qwen2", 2, "whole") is None
    assert spec("qwen2", 3) is None  # auto: whole tensors where the heads do not split
    assert spec("qwen2", 1, "shard") == (1, 4, False, 1)
    with pytest.raises(ValueError, match="LMC-E519.*engine_tp"):
        spec("qwen2", 3, "shard")


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
    for load, payloads in ((load_rank_parameters, ranks), (load_rank_slices, [state] * tp)):
        model = DecoderLM(cfg, {k: torch.zeros_like(v) for k, v in state.items()})
        load(model, layout, payloads)
        differ = [k for k, v in state.items() if not torch.equal(model.params[k], v.float())]
        assert not differ, f"{load.__name__}: {differ[:3]}"


def test_moe_layouts_sglang_refuses_or_we_do_not_cover_are_refused():
    """What SGLang refuses (an EP not dividing TP or the experts, more MoE-TP ranks than
    experts) is refused with the fix; a version missing an expert cannot be laid out; the
    runners whose expert layout differs are named (read from SGLang's Qwen3-MoE override)."""
    from laminar_mcore.weights.engine_layout import moe_layout_known

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
    override = sglang_source.read("sglang/srt/arg_groups/model_overrides/qwen3_moe.py")
    assert 'if get_platform().is_sm100:' in override
    assert 'overrides["moe_runner_backend"] = "flashinfer_trtllm"' in override
    assert moe_layout_known("triton", (10, 0)) == moe_layout_known("auto", (9, 0)) == ""
    assert moe_layout_known("auto", None, cpu=True) == ""
    assert "SM100" in moe_layout_known("auto", (10, 0))
    assert "not known" in moe_layout_known("auto", None)
    assert "triton_kernels" in moe_layout_known("triton_kernels", (9, 0))


@pytest.mark.multiprocess
def test_ep2_moe_engine_ranks_pull_only_their_experts_from_a_real_relay(tmp_path, monkeypatch):
    """A Qwen3-MoE version on a real relay: a TP2 EP2 CPU engine pulls each rank's own experts
    (half of them, whole) and attention slices as SGLang's direct payloads, a TP1 engine pulls
    whole tensors: both generate the same tokens with the same log-probs, and each rank of the
    shard pull received about half the version."""
    from laminar_mcore.netutil import TOKEN_ENV
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel
    from laminar_mcore.relay.client import RelayClient
    from laminar_mcore.relay.transports import PullSpec, pull_latest_into_engine
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
    finally:
        if publisher is not None:
            publisher.close()
        for p in procs:
            p.stop()
        destroy_trainer_parallel()


def test_an_moe_engines_pull_follows_its_moe_runner_and_gpu(tmp_path, monkeypatch):
    """An MoE engine pulls its shard where SGLang keeps the experts in the covered layout: the
    CPU engine always; SGLang with the triton runner, or auto on a Hopper GPU (capability 9.0)
    but not on SM100 (10.0, flashinfer's TRT-LLM runner) or where no GPU says which; ``shard``
    is refused there with the reason. The GPU facts are set here, as on a GPU node."""
    import torch.cuda

    from laminar_mcore.config.schema import RolloutConfig, WeightSyncConfig
    from laminar_mcore.rollout.launcher import engine_pull_spec, sglang_command

    cfg = tiny_hf_config("qwen3_moe")
    model = str(tmp_path / "moe")
    save_hf_checkpoint(model, cfg, _state(cfg, dtype=torch.float32))

    def spec(backend="cpu", runner="auto", mode="auto", tp=2, ep=2):
        rollout = RolloutConfig(backend=backend, engine_tp=tp, engine_ep=ep,
                                moe_runner_backend=runner)
        return engine_pull_spec(rollout, 0, WeightSyncConfig(engine_pull=mode),
                                model).option("shard")

    heads = cfg.num_attention_heads
    assert spec() == (2, heads, False, 2) and spec(ep=1) == (2, heads, False, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spec("sglang") is None and spec("sglang", "triton") == (2, heads, False, 2)
    with pytest.raises(ValueError, match="LMC-E519.*GPU is not known"):
        spec("sglang", mode="shard")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, want in (((9, 0), (2, heads, False, 2)), ((10, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, c=capability: c)
        assert spec("sglang") == want, capability
    assert spec("sglang", "triton") == (2, heads, False, 2)
    assert spec("sglang", "flashinfer_cutlass") is None
    with pytest.raises(ValueError, match="LMC-E519.*SM100"):
        spec("sglang", mode="shard")
    command = sglang_command(model, port=1, tp=2, ep=2, moe_runner_backend="triton")
    assert command[command.index("--ep-size") + 1] == "2"
    assert command[command.index("--moe-runner-backend") + 1] == "triton"
    assert "--ep-size" not in sglang_command(model, port=1, tp=2)
