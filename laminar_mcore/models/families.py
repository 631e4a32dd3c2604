"""The model families laminar_mcore knows, registered by their exact Hugging Face model_type."""

from __future__ import annotations

from .base import ModelAdapter, register_adapter

QWEN2 = register_adapter(ModelAdapter(name="qwen2", hf_model_types=("qwen2",), qkv_bias=True))
LLAMA = register_adapter(ModelAdapter(name="llama", hf_model_types=("llama",),
                                      supports_llama3_rope_scaling=True))
QWEN3 = register_adapter(ModelAdapter(name="qwen3", hf_model_types=("qwen3",), qk_norm=True))

from . import moe  # noqa: E402,F401  (registers qwen3_moe)
