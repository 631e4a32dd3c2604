"""Hugging Face checkpoint directories: config, safetensors shards, tiny configs for tests.

Reads and writes only local files (``local_files_only``): nothing is ever fetched from a hub.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import torch

from .base import AdapterError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_config(path: str | os.PathLike):
    """The transformers config of a local checkpoint directory, with a clear error if absent."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise AdapterError("LMC-E114: "
                           f"model path {str(path)!r} has no config.json; point model.path at a "
                           "Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def load_hf_state_dict(path: str | os.PathLike) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (single file or sharded with an index)."""
    reader = SafetensorsReader(path)
    return {name: reader.get(name) for name in reader.names()}


# Files of a Hugging Face checkpoint directory besides config.json and the weights, which every
# writer of one (trainer checkpoints, the converter) carries along.
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                 "chat_template.jinja")


def copy_side_files(source: str | os.PathLike, dest: str | os.PathLike) -> List[str]:
    """Copy the ``HF_SIDE_FILES`` that ``source`` has into ``dest``; returns their names."""
    copied = []
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), dest)
            copied.append(name)
    return copied


class ShardWriter:
    """Streams named tensors into safetensors shards of at most ``max_shard_bytes`` (None: one
    shard), named ``model-0000i-of-0000n.safetensors`` with an index; with ``index=False`` a
    single shard is written as ``model.safetensors`` without one. Holds one shard at a time."""

    def __init__(self, path: str | os.PathLike, max_shard_bytes: Optional[int] = None, *,
                 index: bool = True):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes, self.index = max_shard_bytes, index
        self._shards: List[str] = []
        self._weight_map: Dict[str, str] = {}
        self._current: Dict[str, torch.Tensor] = {}
        self._size = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._current:
            raise AdapterError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._current and self.max_shard_bytes is not None and \
                self._size + nbytes > self.max_shard_bytes:
            self._flush()
        # a copy: callers stream views of buffers they reuse (and safetensors refuses tensors
        # that share memory)
        self._current[name] = tensor.detach().cpu().contiguous().clone()
        self._size += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._current:
            return
        name = f"model-{len(self._shards) + 1:05d}.safetensors.partial"
        save_file(self._current, str(self.path / name), metadata={"format": "pt"})
        self._shards.append(name)
        self._weight_map.update({k: name for k in self._current})
        self._current, self._size = {}, 0

    def close(self) -> int:
        """Write what is pending and the index; returns the number of tensors written."""
        self._flush()
        n = len(self._shards)
        if n == 1 and not self.index:
            os.replace(self.path / self._shards[0], self.path / "model.safetensors")
            return len(self._weight_map)
        final = {}
        for i, name in enumerate(self._shards):
            final[name] = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / name, self.path / final[name])
        (self.path / SAFETENSORS_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": self.total_bytes},
             "weight_map": {k: final[v] for k, v in self._weight_map.items()}}, indent=2))
        return len(self._weight_map)


def save_hf_checkpoint(path: str | os.PathLike, hf_config, state: Mapping[str, torch.Tensor],
                       max_shard_bytes: Optional[int] = None) -> None:
    """Write config.json and safetensors shards (with an index when there is more than one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(path))
    tensors = dict(state)
    if getattr(hf_config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: transformers re-ties it on load
    writer = ShardWriter(path, max_shard_bytes, index=False)
    for name in sorted(tensors):
        writer.add(name, tensors[name])
    writer.close()


_TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu")


def build_hf_config(family: str, **fields):
    """A transformers config of a known family from explicit fields (nothing is downloaded)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config,
               "qwen3_moe": Qwen3MoeConfig}
    if family not in classes:
        raise AdapterError("LMC-E115: "
                           f"unknown model family {family!r}; choose one of {sorted(classes)}")
    fields = {k: v for k, v in fields.items() if v is not None}
    if family not in ("qwen3", "qwen3_moe") and "head_dim" in fields:
        hidden, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
        if hidden and heads and fields["head_dim"] != hidden // heads:
            raise AdapterError("LMC-E310: "
                               f"{family}: head_dim must equal hidden_size/num_attention_heads")
        fields.pop("head_dim")
    return classes[family](**fields)


def tiny_hf_config(family: str, **overrides):
    """A small config of a known family (for tests and demos)."""
    kwargs = dict(_TINY_BASE)
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 16
    if family == "qwen3_moe":  # 8 experts, top-2, every layer MoE
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True)
    kwargs.update(overrides)
    return build_hf_config(family, **kwargs)


def hf_config_for(model_cfg):
    """The transformers config of ``cfg.model``: from ``path`` if set, else from ``arch``."""
    if model_cfg.path is not None:
        return load_hf_config(model_cfg.path)
    return hf_config_from_arch(model_cfg.arch)


def hf_config_from_arch(arch_cfg):
    """The transformers config of a ``model.arch`` section."""
    arch = dict(arch_cfg)
    family = arch.pop("family")
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers")
    if family == "qwen3_moe":
        arch["mlp_only_layers"] = list(arch["mlp_only_layers"])
    else:
        if arch.get("num_experts"):
            raise AdapterError(f"LMC-E310: model.arch.num_experts={arch['num_experts']} needs "
                               f"family=qwen3_moe (family {family!r} is dense)")
        for key in moe_keys:
            arch.pop(key, None)
    return build_hf_config(family, hidden_act="silu", **arch)


def initial_hf_state(model_cfg, hf_config, seed: int) -> Dict[str, torch.Tensor]:
    """Starting weights: the checkpoint at ``path``, or transformers' init under ``seed``."""
    if model_cfg.path is not None:
        return load_hf_state_dict(model_cfg.path)
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    from .base import get_adapter

    state = {k: v.detach() for k, v in model.state_dict().items()}
    return get_adapter(hf_config).from_transformers_state(hf_config, state)


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
                raise AdapterError(f"LMC-E311: {index}: not a safetensors index ({exc})") from None
        elif (self.path / "model.safetensors").is_file():
            self.weight_map = None
        else:
            raise AdapterError(f"LMC-E311: {str(self.path)!r} has neither model.safetensors nor "
                               f"{SAFETENSORS_INDEX}")
        files = sorted(set(self.weight_map.values())) if self.weight_map else ["model.safetensors"]
        self._handles = {}
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise AdapterError(f"LMC-E311: shard {str(file)!r} named by the index is missing")
            try:
                self._handles[name] = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors' own error types
                raise AdapterError(f"LMC-E311: cannot read {str(file)!r} (truncated or corrupt?): "
                                   f"{exc}") from None
        self._where = {}
        for fname, handle in self._handles.items():
            for key in handle.keys():
                self._where[key] = fname
        if self.weight_map:
            missing = sorted(set(self.weight_map) - set(self._where))
            if missing:
                raise AdapterError(f"LMC-E311: tensors listed in the index but absent from the "
                                   f"shards: {missing[:8]}")

    def names(self):
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise AdapterError(f"LMC-E311: tensor {name!r} is missing from {self.path}")
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except Exception as exc:
            raise AdapterError(f"LMC-E311: cannot read {name!r} from {self.path} (truncated?): "
                               f"{exc}") from None

    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self._handles)
