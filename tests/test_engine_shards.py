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

    assert_the_ranks_give_back(cfg, layout, ranks, state)


def assert_the_ranks_give_back(cfg, layout, ranks, state):
    """The CPU engine takes every rank's parameters back into the model (direct), and whole
    tensors narrowed per rank (flattened_bucket at TP > 1): bit for bit either way."""
    for load, payloads in ((load_rank_parameters, ranks),
                           (load_rank_slices, [state] * layout.tp)):
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


@pytest.mark.parametrize("family,ep", [("qwen2", 1), ("qwen3_moe", 2)])
def test_the_cuda_ipc_exporter_cuts_each_ranks_parameters_onto_its_device(family, ep):
    """The GPU path of a shard pull, on CPU devices: group by group, rank r's payload is
    SGLang's direct list of (name, tensor) with exactly the layout's rank-r tensors, whatever
    stored bucket each source tensor sits in (the version spread over many small buckets);
    for Qwen3-MoE at EP2, each rank's fused experts [experts / 2, ...] too."""
    from laminar_mcore.relay.shard_pulls import ShardPlan
    from laminar_mcore.relay.store import VersionStore
    from laminar_mcore.relay.transports.cuda_ipc import CudaIpcExporter, standin_bucket_classes
    from laminar_mcore.weights.bucket import BucketPacker

    cfg = tiny_hf_config(family, vocab_size=200)
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
        plan = ShardPlan.of_version(store, sv, 2, cfg.num_attention_heads, ep=ep)
        bucket_cls, meta_cls, _ = standin_bucket_classes()
        exporter = CudaIpcExporter(classes=(bucket_cls, meta_cls, _Keep), require_cuda=False)
        layout = layout_for_config(cfg, 2, ep=ep)
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
        if ep > 1:
            assert layout.shapes["model.layers.0.mlp.experts.w13_weight"][0] == 4
        with pytest.raises(ValueError, match="one device per TP rank"):
            exporter.payload_shard("lease", 0, plan, ["cpu"])
        exporter.release("lease")
    finally:
        store.close()


def test_each_engine_ranks_pull_is_decided_from_the_config_and_the_model(tmp_path):
    """``weight_sync.engine_pull``: auto pulls shards at engine TP > 1 for a dense model (with
    its head count and tie in the spec), whole tensors at TP1 or for a model the TP does not
    divide; ``shard`` where it cannot be is refused with the reason (MoE:
    test_engine_moe_shards)."""
    from laminar_mcore.config.schema import RolloutConfig, WeightSyncConfig
    from laminar_mcore.rollout.launcher import engine_pull_spec

    dirs = {}
    for name, cfg in (("qwen2", tiny_hf_config("qwen2")),
                      ("llama", tiny_hf_config("llama", tie_word_embeddings=True))):
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

