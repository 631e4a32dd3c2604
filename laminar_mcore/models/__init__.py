"""Model-family adapters (Hugging Face <-> Megatron-Core) and the GPTModel builder."""

from . import families  # noqa: F401  (registers the adapters)
from .base import AdapterError, ModelAdapter, get_adapter, known_model_types
from .hf import load_hf_config, load_hf_state_dict, save_hf_checkpoint

__all__ = [
    "AdapterError", "ModelAdapter", "get_adapter", "known_model_types",
    "load_hf_config", "load_hf_state_dict", "save_hf_checkpoint",
]
