"""Model-family adapters: name/layout mapping both ways, TP split, errors, and a Megatron-Core
GPTModel built from each family's Hugging Face config giving transformers' logits."""

import pytest
import torch

from laminar_mcore.models import AdapterError, get_adapter, known_model_types
from laminar_mcore.models.hf import (initial_hf_state, load_hf_state_dict, save_hf_checkpoint,
                                     tiny_hf_config)

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CASES = {
    "qwen2": dict(family="qwen2"),
    "qwen2_tied": dict(family="qwen2", tie_word_embeddings=True),
    "llama_untied": dict(family="llama", rope_theta=500000.0),
    "llama3_tied_scaled": dict(family="llama", tie_word_embeddings=True, rope_theta=500000.0,
                               rope_scaling=LLAMA3_SCALING, max_position_embeddings=16384),
    "qwen3": dict(family="qwen3", rope_theta=1000000.0),
}


def _config(case):
    kwargs = dict(CASES[case])
    return tiny_hf_config(kwargs.pop("family"), **kwargs)


def _hf_state(cfg, seed=0):
    return initial_hf_state(type("M", (), {"path": None})(), cfg, seed)


def test_registry_knows_the_three_families():
    assert set(known_model_types()) >= {"qwen2", "llama", "qwen3"}
    bogus = tiny_hf_config("qwen2")
    bogus.model_type = "qwen2_moe"
    with pytest.raises(AdapterError, match="no adapter for model_type 'qwen2_moe'"):
        get_adapter(bogus)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_mcore_to_hf_is_bit_identical(case):
    cfg = _config(case)
    hf = _hf_state(cfg)
    adapter = get_adapter(cfg)
    mcore = adapter.hf_to_mcore(cfg, hf)
    back = adapter.mcore_to_hf(cfg, mcore)
    expected = {k: v for k, v in hf.items() if not (adapter.tied_embeddings(cfg) and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    if cfg.model_type == "qwen2":
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in mcore
    if cfg.model_type == "qwen3":
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in mcore
    assert ("output_layer.weight" in mcore) == (not adapter.tied_embeddings(cfg))


def test_qkv_is_interleaved_by_query_group():
    cfg = tiny_hf_config("qwen2")  # 4 heads, 2 groups, head_dim 16
    s = get_adapter(cfg).shape(cfg)
    q = torch.arange(4 * 16).float().unsqueeze(1)
    k = 1000 + torch.arange(2 * 16).float().unsqueeze(1)
    v = 2000 + torch.arange(2 * 16).float().unsqueeze(1)
    qkv = get_adapter(cfg).merge_qkv(s, q, k, v).squeeze(1)
    # group 0: q heads 0-1, k head 0, v head 0; then group 1.
    assert torch.equal(qkv[:32], q[:32, 0]) and torch.equal(qkv[32:48], k[:16, 0])
    assert torch.equal(qkv[48:64], v[:16, 0]) and torch.equal(qkv[64:96], q[32:, 0])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_reassemble_and_fc1_splits_gate_and_up_per_rank(tp):
    cfg = tiny_hf_config("qwen2")
    adapter = get_adapter(cfg)
    mcore = adapter.hf_to_mcore(cfg, _hf_state(cfg))
    for name, full in mcore.items():
        shards = [adapter.shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(adapter.unshard(name, shards), full), name
    fc1 = mcore["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    rank1 = adapter.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, tp)
    assert torch.equal(rank1, torch.cat([gate.chunk(tp)[1], up.chunk(tp)[1]]))
    proj = adapter.shard("decoder.layers.0.self_attention.linear_proj.weight",
                         mcore["decoder.layers.0.self_attention.linear_proj.weight"], 0, tp)
    assert proj.shape[1] == 64 // tp
    with pytest.raises(AdapterError, match="does not divide"):
        adapter.shard("output_layer.weight", mcore["output_layer.weight"], 0, 3)


def test_missing_or_extra_tensors_are_named():
    cfg = tiny_hf_config("qwen2")
    adapter = get_adapter(cfg)
    hf = _hf_state(cfg)
    broken = dict(hf)
    del broken["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(AdapterError, match="model.layers.2.mlp.up_proj.weight"):
        adapter.hf_to_mcore(cfg, broken)
    extra = dict(hf, **{"model.layers.0.mlp.experts.0.weight": torch.zeros(1)})
    with pytest.raises(AdapterError, match="experts.0.weight"):
        adapter.hf_to_mcore(cfg, extra)
    mcore = adapter.hf_to_mcore(cfg, hf)
    del mcore["decoder.final_layernorm.weight"]
    with pytest.raises(AdapterError, match="decoder.final_layernorm.weight"):
        adapter.mcore_to_hf(cfg, mcore)


def test_unsupported_rope_scaling_is_refused():
    cfg = tiny_hf_config("qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(AdapterError, match="rope scaling 'yarn' is not supported"):
        get_adapter(cfg).transformer_config_kwargs(cfg)
    odd = dict(LLAMA3_SCALING, high_freq_factor=2.0)
    cfg = tiny_hf_config("llama", rope_scaling=odd, max_position_embeddings=16384)
    with pytest.raises(AdapterError, match="high_freq_factor"):
        get_adapter(cfg).transformer_config_kwargs(cfg)


def test_safetensors_round_trip_and_truncated_file(tmp_path):
    cfg = tiny_hf_config("qwen3")
    hf = _hf_state(cfg)
    save_hf_checkpoint(tmp_path / "sharded", cfg, hf, max_shard_bytes=64 * 1024)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    loaded = load_hf_state_dict(tmp_path / "sharded")
    assert set(loaded) == set(hf) and all(torch.equal(loaded[k], hf[k]) for k in hf)
    save_hf_checkpoint(tmp_path / "single", cfg, hf)
    file = tmp_path / "single" / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt"):
        load_hf_state_dict(tmp_path / "single")


@pytest.fixture(scope="module")
def megatron_world():
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=5)
    yield
    destroy_trainer_parallel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_logits_equal_transformers(case, megatron_world):
    from transformers import AutoModelForCausalLM

    from laminar_mcore.trainer.model import build_gpt_model, load_full_state

    cfg = _config(case)
    hf_state = _hf_state(cfg, seed=1)
    model = build_gpt_model(cfg)
    load_full_state(model, cfg, get_adapter(cfg).hf_to_mcore(cfg, hf_state))
    reference = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    reference.load_state_dict(hf_state, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 160), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(160).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(tokens, positions, None).float()
        theirs = reference(tokens).logits.float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5
