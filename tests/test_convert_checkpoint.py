"""tools/convert_checkpoint.py as users run it: HF -> Megatron torch_dist at TP x PP -> HF is
bit-identical; the Megatron model of a converted checkpoint gives transformers' logits; bad
input fails with the name of what is wrong, before any process starts."""

import json
import os
import subprocess
import sys

import pytest
import torch

from laminar_mcore.models.hf import (initial_hf_state, load_hf_state_dict, save_hf_checkpoint,
                                     tiny_hf_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")

CASES = {
    "qwen2": (dict(family="qwen2"), 2, 2),
    "llama_tied": (dict(family="llama", tie_word_embeddings=True), 2, 2),
    "llama_untied": (dict(family="llama"), 1, 2),
    "qwen3": (dict(family="qwen3"), 2, 1),
}


def _tool(*args, timeout=600):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def _refused(capsys, *args):
    """The tool's ``main`` run in this process on input it must refuse before any process
    starts or anything is loaded: exit status 2; returns what it printed on stderr."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        tool.main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def _hf(tmp_path, case, name="hf", seed=3, shard=60_000):
    kwargs = dict(CASES[case][0])
    cfg = tiny_hf_config(kwargs.pop("family"), **kwargs)
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    save_hf_checkpoint(tmp_path / name, cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, seed),
                       max_shard_bytes=shard)
    return cfg, str(tmp_path / name)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES) - {"qwen2"}))  # qwen2: the logits test's
def test_round_trip_is_bit_identical(tmp_path, case):
    _round_trip(tmp_path, case)


def _round_trip(tmp_path, case):
    """HF -> torch_dist at the case's TP x PP -> HF, bit-identical; returns (config, HF dir)."""
    _, tp, pp = CASES[case]
    cfg, hf = _hf(tmp_path, case)
    out = _tool("hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "mcore"), "--tp", str(tp),
                "--pp", str(pp))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "GB/s" in out.stdout
    back = _tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"),
                 "--origin-hf", hf)
    assert back.returncode == 0, back.stderr[-3000:]
    original, restored = load_hf_state_dict(hf), load_hf_state_dict(tmp_path / "back")
    assert set(original) == set(restored)
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == cfg.model_type
    return cfg, hf


@pytest.fixture(scope="module")
def megatron_world():
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=0)
    yield
    destroy_trainer_parallel()


@pytest.mark.multiprocess
def test_converted_checkpoint_gives_transformers_logits(tmp_path, megatron_world):
    """qwen2's round trip at TP2 x PP2, and the checkpoint it wrote, loaded (resharded) into a
    one-rank Megatron model, gives transformers' logits."""
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    from laminar_mcore.trainer.model import build_gpt_model

    cfg, hf = _round_trip(tmp_path, "qwen2")
    model = build_gpt_model(cfg)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(),
                                                  str(tmp_path / "mcore" / "model")))
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(30).unsqueeze(0).expand(2, -1), None)
        theirs = reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_bad_inputs_fail_with_clear_errors(tmp_path, capsys):
    cfg, hf = _hf(tmp_path, "qwen2")
    # as users run it: a subprocess, its exit status and its stderr (the rest in this process)
    out = _tool("hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"), "--tp", "3")
    assert out.returncode == 2 and "num_attention_heads=4 is not divisible by --tp 3" in out.stderr
    err = _refused(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"), "--tp", "3")
    assert "num_attention_heads=4 is not divisible by --tp 3" in err
    err = _refused(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"), "--pp", "3")
    assert "num_hidden_layers=4 is not divisible by --pp 3" in err

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    data = (tmp_path / "hf" / shard).read_bytes()
    (tmp_path / "hf" / shard).write_bytes(data[: len(data) // 2])
    err = _refused(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"))
    assert shard in err and "truncated" in err
    (tmp_path / "hf" / shard).unlink()
    err = _refused(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"))
    assert "shard" in err and "missing" in err

    _, hf2 = _hf(tmp_path, "qwen3", name="other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, "hf-to-mcore", "--hf", hf2, "--out", str(tmp_path / "o"))
    assert "no adapter for model_type 'gpt_neox'" in err


def test_extra_tensors_and_foreign_checkpoints_are_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    cfg, hf = _hf(tmp_path, "qwen3", shard=10**9)
    state = load_file(os.path.join(hf, "model.safetensors"))
    state["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    save_file(state, os.path.join(hf, "model.safetensors"))
    err = _refused(capsys, "hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "o"))
    assert "experts.0.up_proj.weight" in err

    err = _refused(capsys, "mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "x"))
    assert "laminar_checkpoint.json" in err


@pytest.mark.multiprocess
def test_mcore_to_hf_holds_one_unit_and_one_shard_not_the_model(tmp_path):
    cfg = tiny_hf_config("qwen2", hidden_size=384, intermediate_size=1536, num_hidden_layers=16,
                         num_attention_heads=6, num_key_value_heads=2, vocab_size=1024)
    state = initial_hf_state(type("M", (), {"path": None})(), cfg, 0)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    save_hf_checkpoint(tmp_path / "hf", cfg, state, max_shard_bytes=10**9)
    out = _tool("hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"))
    assert out.returncode == 0, out.stderr[-3000:]
    back = _tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"),
                 "--max-shard-gb", "0.01")
    assert back.returncode == 0, back.stderr[-3000:]
    held_gb = float(back.stdout.split("peak memory ")[1].split(" GB")[0])
    assert held_gb * 1e9 < 0.4 * model_bytes, (held_gb, model_bytes)  # a 0.14 GB model, 9 MB layers
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 5
    restored = load_hf_state_dict(tmp_path / "back")
    assert set(restored) == set(state)
    assert all(torch.equal(state[k], restored[k]) for k in state)


def test_mcore_to_hf_refuses_a_checkpoint_of_another_model(tmp_path):
    cfg, hf = _hf(tmp_path, "qwen2")
    out = _tool("hf-to-mcore", "--hf", hf, "--out", str(tmp_path / "mcore"))
    assert out.returncode == 0, out.stderr[-3000:]
    meta = tmp_path / "mcore" / "hf_meta" / "config.json"
    original = json.loads(meta.read_text())
    fewer = {k: v for k, v in original.items() if k != "layer_types"}
    meta.write_text(json.dumps(dict(fewer, num_hidden_layers=2)))
    out = _tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "holds 4 layers, the config says 2" in out.stderr
    meta.write_text(json.dumps(dict(original, intermediate_size=original["intermediate_size"] * 2)))
    out = _tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "a checkpoint of another model" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "x" / "model.safetensors.index.json").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", [("1", "1", "2"), ("2", "1", "2"), ("1", "2", "2")])
def test_moe_round_trip_at_expert_parallel_layouts_is_bit_identical(tmp_path, layout):
    """Qwen3-MoE (8 experts, one dense layer) HF -> torch_dist at (EP2), (TP2, EP2) and
    (PP2, EP2) -> HF: every expert tensor bit-identical, none lost; and the Megatron model
    loaded from the checkpoint gives transformers' logits."""
    tp, pp, ep = layout
    cfg = tiny_hf_config("qwen3_moe", mlp_only_layers=[1])
    (tmp_path / "hf").mkdir()
    save_hf_checkpoint(tmp_path / "hf", cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 5),
                       max_shard_bytes=200_000)
    out = _tool("hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"),
                "--tp", tp, "--pp", pp, "--ep", ep)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"ep={ep}" in out.stdout
    back = _tool("mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr[-3000:]
    original, restored = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(tmp_path / "back")
    assert set(original) == set(restored)
    assert sum("mlp.experts." in n for n in original) == 3 * 8 * 3
    for name in original:
        assert torch.equal(original[name], restored[name]), name


def test_moe_layout_errors_name_the_fix(tmp_path, capsys):
    cfg = tiny_hf_config("qwen3_moe")
    save_hf_checkpoint(tmp_path / "hf", cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 5))
    err = _refused(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out",
                   str(tmp_path / "o"), "--ep", "3")
    assert "num_experts=8 is not divisible by --ep 3" in err
    dense = tiny_hf_config("qwen2")
    save_hf_checkpoint(tmp_path / "d", dense, initial_hf_state(type("M", (), {"path": None})(), dense, 5))
    err = _refused(capsys, "hf-to-mcore", "--hf", str(tmp_path / "d"), "--out",
                   str(tmp_path / "o"), "--ep", "2")
    assert "--ep 2 needs a mixture-of-experts model" in err
