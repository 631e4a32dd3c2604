"""GPU-only decisions made testable on CPU: which fusions Megatron gets (each only where its
kernel exists) and which attention the trainer's layers use, from facts a test sets (CUDA
reported available, Transformer Engine and Apex importable or not)."""

import importlib.machinery
import sys
import types

import pytest
import torch

from laminar_mcore.models.hf import tiny_hf_config
from laminar_mcore.trainer import model as tmodel

APEX = (*tmodel.SOFTMAX_EXTENSIONS, tmodel.WGRAD_EXTENSION)
FUSION_KERNELS = {  # the extension modules each enabled fusion flag needs (beyond TE)
    "masked_softmax_fusion": tmodel.SOFTMAX_EXTENSIONS,
    "gradient_accumulation_fusion": (tmodel.WGRAD_EXTENSION,),
}


@pytest.fixture(scope="module")
def megatron_world():
    from laminar_mcore.parallel import destroy_trainer_parallel, init_trainer_parallel

    init_trainer_parallel(tp=1, pp=1, seed=5)
    yield
    destroy_trainer_parallel()


def _fake_apex(monkeypatch):
    """Apex's CUDA extensions as importable modules (findable by ``importlib.util.find_spec``),
    and Megatron's own import-time probe of the weight-gradient one set as if it had found it."""
    from megatron.core.tensor_parallel import layers

    for name in APEX:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)


@pytest.mark.parametrize("apex", [False, True], ids=["no-apex", "apex"])
@pytest.mark.parametrize("te", [False, True], ids=["no-te", "te"])
def test_every_enabled_fusion_has_its_kernel_and_the_output_layer_builds(
        te, apex, megatron_world, monkeypatch):
    from megatron.core import tensor_parallel

    if te:  # Transformer Engine's fused RoPE, which TransformerConfig looks for
        from megatron.core.models.common.embeddings import rope_utils

        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    if apex:
        _fake_apex(monkeypatch)
    else:
        assert not any(tmodel.module_findable(m) for m in APEX), "Apex is installed here"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = tiny_hf_config("qwen2")
    config = tmodel.transformer_config(cfg, dtype=torch.bfloat16, use_te=te,
                                       use_cpu_initialization=True)
    assert config.bias_activation_fusion  # torch's own jit: no extension needed
    # packed sequences: never the fused causal softmax (it ignores their block-diagonal mask)
    assert not config.masked_softmax_fusion
    assert config.apply_rope_fusion == te
    assert config.gradient_accumulation_fusion == (te and apex)
    for flag, kernels in FUSION_KERNELS.items():
        if getattr(config, flag):
            assert all(tmodel.module_findable(m) for m in kernels), flag
    # GPTModel's output layer is Megatron's own ColumnParallelLinear even with TE: it raises
    # at construction when gradient_accumulation_fusion is on without Apex's kernel
    layer = tensor_parallel.ColumnParallelLinear(
        cfg.hidden_size, cfg.vocab_size, config=config, init_method=config.init_method,
        bias=False, gather_output=False)
    assert layer.weight.shape == (cfg.vocab_size, cfg.hidden_size)


def test_the_old_flags_would_have_failed_to_build_the_output_layer(megatron_world, monkeypatch):
    """What the first GPU run hit with TE but no Apex: the check above is not vacuous."""
    from megatron.core import tensor_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = tiny_hf_config("qwen2")
    config = tmodel.transformer_config(cfg, dtype=torch.bfloat16, use_te=False,
                                       use_cpu_initialization=True,
                                       gradient_accumulation_fusion=True)
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False)


@pytest.mark.parametrize("on_gpu,te,packed,apex,expected", [
    (False, False, True, True, dict(bias_activation_fusion=False, masked_softmax_fusion=False,
                                    gradient_accumulation_fusion=False, apply_rope_fusion=False)),
    (True, False, False, True, dict(bias_activation_fusion=True, masked_softmax_fusion=True,
                                    gradient_accumulation_fusion=False, apply_rope_fusion=False)),
    (True, False, False, False, dict(bias_activation_fusion=True, masked_softmax_fusion=False,
                                     gradient_accumulation_fusion=False, apply_rope_fusion=False)),
    (True, True, True, True, dict(bias_activation_fusion=True, masked_softmax_fusion=False,
                                  gradient_accumulation_fusion=True, apply_rope_fusion=True)),
])
def test_fusion_flags_follow_the_facts(on_gpu, te, packed, apex, expected):
    assert tmodel.fusion_flags(on_gpu=on_gpu, use_te=te, packed=packed,
                               findable=lambda name: apex) == expected


def test_a_bf16_model_has_one_dtype_and_a_mixed_group_is_refused_by_name(megatron_world):
    from laminar_mcore.models import AdapterError

    cfg = tiny_hf_config("qwen3")  # QK norms as well as the layer norms
    model = tmodel.build_gpt_model(cfg, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tmodel.check_parameter_dtypes(model)
    norm = "decoder.layers.1.self_attention.k_layernorm.weight"
    dict(model.named_parameters())[norm].data = dict(model.named_parameters())[norm].data.float()
    with pytest.raises(AdapterError, match="LMC-E333: the optimizer's no-weight-decay parameter "
                                           "group mixes dtypes") as err:
        tmodel.check_parameter_dtypes(model)
    assert f"float32: {norm}" in str(err.value) and "bfloat16: " in str(err.value)
