"""Hugging Face checkpoint directories: config, safetensors shards, tiny configs for tests.

Reads and writes only local files (``local_files_only``): nothing is ever fetched from a hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Mapping, Optional

import torch

from .base import AdapterError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_config(path: str | os.PathLike):
    """The transformers config of a local checkpoint directory, with a clear error if absent."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise AdapterError(f"model path {str(path)!r} has no config.json; point model.path at a "
                           "Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def load_hf_state_dict(path: str | os.PathLike) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (single file or sharded with an index)."""
    reader = SafetensorsReader(path)
    return {name: reader.get(name) for name in reader.names()}


def save_hf_checkpoint(path: str | os.PathLike, hf_config, state: Mapping[str, torch.Tensor],
                       max_shard_bytes: Optional[int] = None) -> None:
    """Write config.json and safetensors shards (with an index when there is more than one)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(path))
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: transformers re-ties it on load
    seen = {}
    for name, t in tensors.items():  # safetensors refuses tensors that share memory
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            tensors[name] = t.clone()
        seen[key] = name
    if max_shard_bytes is None or sum(t.numel() * t.element_size() for t in tensors.values()) <= max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / SAFETENSORS_INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


_TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu")


def build_hf_config(family: str, **fields):
    """A transformers config of a known family from explicit fields (nothing is downloaded)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}
    if family not in classes:
        raise AdapterError(f"unknown model family {family!r}; choose one of {sorted(classes)}")
    fields = {k: v for k, v in fields.items() if v is not None}
    if family != "qwen3" and "head_dim" in fields:
        hidden, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
        if hidden and heads and fields["head_dim"] != hidden // heads:
            raise AdapterError(f"{family}: head_dim must equal hidden_size/num_attention_heads")
        fields.pop("head_dim")
    return classes[family](**fields)


def tiny_hf_config(family: str, **overrides):
    """A small config of a known family (for tests and demos)."""
    kwargs = dict(_TINY_BASE)
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return build_hf_config(family, **kwargs)


def hf_config_for(model_cfg):
    """The transformers config of ``cfg.model``: from ``path`` if set, else from ``arch``."""
    if model_cfg.path is not None:
        return load_hf_config(model_cfg.path)
    arch = dict(model_cfg.arch)
    family = arch.pop("family")
    return build_hf_config(family, hidden_act="silu", **arch)


def initial_hf_state(model_cfg, hf_config, seed: int) -> Dict[str, torch.Tensor]:
    """Starting weights: the checkpoint at ``path``, or transformers' init under ``seed``."""
    if model_cfg.path is not None:
        return load_hf_state_dict(model_cfg.path)
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


class SafetensorsReader:
    """Reads one tensor at a time from a safetensors checkpoint (single file or sharded), so a
    converter holds at most what it is converting, never the whole model."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / SAFETENSORS_INDEX
        if index.is_file():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise AdapterError(f"{index}: not a safetensors index ({exc})") from None
        elif (self.path / "model.safetensors").is_file():
            self.weight_map = None
        else:
            raise AdapterError(f"{str(self.path)!r} has neither model.safetensors nor {SAFETENSORS_INDEX}")
        files = sorted(set(self.weight_map.values())) if self.weight_map else ["model.safetensors"]
        self._handles = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise AdapterError(f"shard {str(file)!r} named by the index is missing")
            try:
                self._handles[name] = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors' own error types
                raise AdapterError(f"cannot read {str(file)!r} (truncated or corrupt?): {exc}") from None
        self._where = {}
        for fname, handle in self._handles.items():
            for key in handle.keys():
                self._where[key] = fname
        if self.weight_map:
            missing = sorted(set(self.weight_map) - set(self._where))
            if missing:
                raise AdapterError(f"tensors listed in the index but absent from the shards: {missing[:8]}")

    def names(self):
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise AdapterError(f"tensor {name!r} is missing from {self.path}")
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as exc:
            raise AdapterError(f"cannot read {name!r} from {self.path} (truncated?): {exc}") from None

    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self._handles)
