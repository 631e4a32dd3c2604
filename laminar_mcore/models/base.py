"""Model-family adapters: the single naming authority between Hugging Face and Megatron-Core.

An adapter owns, for one family of dense decoder-only models:
  * the translation of a Hugging Face config into a Megatron ``TransformerConfig`` and the
    ``GPTModel`` constructor arguments (rotary base and scaling, tied embeddings, ...);
  * the mapping of weight names and layouts in both directions, in "full" form (every tensor
    whole, layers numbered globally) and the tensor-parallel split of each full tensor.

The online weight publisher, the checkpoint converters and the engines' loaders all go through
these functions; nothing else in the code base knows how QKV is interleaved or how
``linear_fc1`` stacks gate and up. Adapters never import engine or trainer code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

Tensor = torch.Tensor


class AdapterError(ValueError):
    """A config or checkpoint that an adapter cannot map; the message says what and how to fix."""


_REGISTRY: Dict[str, "ModelAdapter"] = {}


def register_adapter(adapter: "ModelAdapter") -> "ModelAdapter":
    for model_type in adapter.hf_model_types:
        if model_type in _REGISTRY:
            raise AdapterError(f"model_type {model_type!r} already has an adapter")
        _REGISTRY[model_type] = adapter
    return adapter


def known_model_types() -> Tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_adapter(hf_config) -> "ModelAdapter":
    """The adapter for a Hugging Face config (by its exact ``model_type``, never a substring)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _REGISTRY:
        raise AdapterError(
            "LMC-E115: "
            f"no adapter for model_type {model_type!r}; known: {', '.join(known_model_types())}. "
            "Add one under laminar_mcore/models/ (see models/families.py)."
        )
    return _REGISTRY[model_type]


# Megatron full names (local layer spec), relative to "decoder.layers.{i}.".
_QKV_W = "self_attention.linear_qkv.weight"
_QKV_B = "self_attention.linear_qkv.bias"
_PROJ_W = "self_attention.linear_proj.weight"
_Q_NORM = "self_attention.q_layernorm.weight"
_K_NORM = "self_attention.k_layernorm.weight"
_IN_NORM = "input_layernorm.weight"
_MLP_NORM = "pre_mlp_layernorm.weight"
_FC1_W = "mlp.linear_fc1.weight"
_FC2_W = "mlp.linear_fc2.weight"

# Transformer-Engine specs fuse the norms into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": _IN_NORM,
    "mlp.linear_fc1.layer_norm_weight": _MLP_NORM,
}

# Tensor-parallel split of full Megatron tensors: name suffix -> partition dim (None: replicated).
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    _QKV_W: 0,
    _QKV_B: 0,
    _PROJ_W: 1,
    _FC1_W: 0,
    _FC2_W: 1,
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Transformer Engine's grouped-GEMM experts: mlp.experts.linear_fc1.weight{e}
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def split_layer_name(name: str) -> Tuple[Optional[int], str]:
    """``decoder.layers.3.mlp.linear_fc2.weight`` -> (3, ``mlp.linear_fc2.weight``)."""
    m = _LAYER_RE.match(name)
    if not m:
        return None, name
    suffix = m.group(2)
    grouped = _GROUPED_EXPERT_RE.match(suffix)
    if grouped:  # the local spec's name of the same expert tensor
        suffix = f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    return int(m.group(1)), _TE_ALIASES.get(suffix, suffix)


def _stacks_gate_up(name: str) -> bool:
    """A SwiGLU ``linear_fc1`` (the dense MLP's, or an expert's): [gate; up] stacked."""
    return split_layer_name(name)[1].endswith("linear_fc1.weight")


def _flatten_groups(t: Tensor, rest) -> Tensor:
    """[groups, rows, *rest] -> [groups*rows, *rest], a view when the groups are one row-block
    each (q of one group, or k, or v), otherwise a copy."""
    try:
        return t.view(-1, *rest)
    except RuntimeError:
        return t.reshape(-1, *rest)


@dataclass(frozen=True)
class Shape:
    """The few sizes every layout transform needs."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    layers: int


@dataclass(frozen=True)
class ModelAdapter:
    """A dense Llama-like family. Subclasses/instances set the flags that distinguish them."""

    name: str
    hf_model_types: Tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    supports_llama3_rope_scaling: bool = False
    is_moe: bool = False  # mixture-of-experts families (models/moe.py) set it

    HF_LAYER: ClassVar[str] = "model.layers.{i}."

    # ---------------------------------------------------------------- config translation
    def shape(self, hf_config) -> Shape:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return Shape(
            hidden=hf_config.hidden_size,
            heads=heads,
            groups=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn=hf_config.intermediate_size,
            vocab=hf_config.vocab_size,
            layers=hf_config.num_hidden_layers,
        )

    def tied_embeddings(self, hf_config) -> bool:
        return bool(getattr(hf_config, "tie_word_embeddings", False))

    def check_hf_config(self, hf_config) -> None:
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise AdapterError("LMC-E310: "
                               f"{self.name}: hidden_act {act!r} is not supported (only silu)")
        if getattr(hf_config, "attention_bias", False) and not self.qkv_bias:
            raise AdapterError(f"LMC-E310: {self.name}: attention_bias=True is not supported")
        if getattr(hf_config, "mlp_bias", False):
            raise AdapterError(f"LMC-E310: {self.name}: mlp_bias=True is not supported")
        if getattr(hf_config, "use_sliding_window", False):
            raise AdapterError(f"LMC-E310: {self.name}: sliding-window attention is not supported; "
                               "set use_sliding_window=false in config.json")
        self.rope_scaling(hf_config)

    def rope_theta(self, hf_config) -> float:
        theta = getattr(hf_config, "rope_theta", None)
        if theta is None:
            params = getattr(hf_config, "rope_parameters", None) or {}
            theta = params.get("rope_theta", 10000.0)
        return float(theta)

    def rope_scaling(self, hf_config) -> Optional[float]:
        """The Llama-3 rope scaling factor, None when the config has no scaling."""
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        if not scaling:
            params = getattr(hf_config, "rope_parameters", None) or {}
            scaling = params if params.get("rope_type", "default") != "default" else {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type == "default":
            return None
        if rope_type != "llama3" or not self.supports_llama3_rope_scaling:
            raise AdapterError("LMC-E310: "
                               f"{self.name}: rope scaling {rope_type!r} is not supported")
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if key in scaling and float(scaling[key]) != float(value):
                raise AdapterError(
                    "LMC-E310: "
                    f"{self.name}: llama3 rope scaling with {key}={scaling[key]} is not supported "
                    f"(Megatron-Core implements {key}={value})")
        return float(scaling.get("factor", 8.0))

    def transformer_config_kwargs(self, hf_config) -> dict:
        """Megatron ``TransformerConfig`` fields that come from the model (not the run)."""
        import torch.nn.functional as F

        self.check_hf_config(hf_config)
        s = self.shape(hf_config)
        return dict(
            num_layers=s.layers,
            hidden_size=s.hidden,
            num_attention_heads=s.heads,
            num_query_groups=s.groups,
            kv_channels=s.head_dim,
            ffn_hidden_size=s.ffn,
            normalization="RMSNorm",
            layernorm_epsilon=float(hf_config.rms_norm_eps),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )

    def gpt_model_kwargs(self, hf_config) -> dict:
        factor = self.rope_scaling(hf_config)
        return dict(
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            share_embeddings_and_output_weights=self.tied_embeddings(hf_config),
            position_embedding_type="rope",
            rotary_base=self.rope_theta(hf_config),
            rope_scaling=factor is not None,
            rope_scaling_factor=factor or 8.0,
        )

    def num_experts(self, hf_config) -> int:
        """Routed experts per MoE layer (0: a dense family)."""
        return 0

    def layer_spec(self, use_te: bool, config=None):
        """Transformer-Engine spec on GPUs when TE is installed, the local spec otherwise
        (``config``, the TransformerConfig, is what per-layer MoE specs need)."""
        from megatron.core.models.gpt import gpt_layer_specs

        if use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=self.qk_norm)
        return gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=self.qk_norm, normalization="RMSNorm")

    # ------------------------------------------------------------- Hugging Face names
    HF_EMBED: ClassVar[str] = "model.embed_tokens.weight"
    HF_FINAL_NORM: ClassVar[str] = "model.norm.weight"
    HF_LM_HEAD: ClassVar[str] = "lm_head.weight"

    def hf_layer_names(self, i: int, hf_config=None) -> Dict[str, str]:
        """Role -> Hugging Face name of layer ``i``'s tensors (for engines that run the
        checkpoint's layout directly, as the CPU engine does; ``hf_config`` tells an MoE
        family which layers are sparse)."""
        p = self.HF_LAYER.format(i=i)
        names = {"input_norm": "input_layernorm.weight",
                 "post_attention_norm": "post_attention_layernorm.weight",
                 "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
                 "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
                 "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
                 "down_proj": "mlp.down_proj.weight"}
        if self.qkv_bias:
            names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
                         v_bias="self_attn.v_proj.bias")
        if self.qk_norm:
            names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
        return {role: p + suffix for role, suffix in names.items()}

    def hf_shapes(self, hf_config) -> Dict[str, Tuple[int, ...]]:
        """Name -> shape of every tensor a Hugging Face checkpoint of ``hf_config`` holds
        (``lm_head`` only when untied)."""
        s = self.shape(hf_config)
        q, kv = s.heads * s.head_dim, s.groups * s.head_dim
        shapes = {self.HF_EMBED: (s.vocab, s.hidden), self.HF_FINAL_NORM: (s.hidden,)}
        if not self.tied_embeddings(hf_config):
            shapes[self.HF_LM_HEAD] = (s.vocab, s.hidden)
        per_role = {"input_norm": (s.hidden,), "post_attention_norm": (s.hidden,),
                    "q_proj": (q, s.hidden), "k_proj": (kv, s.hidden), "v_proj": (kv, s.hidden),
                    "o_proj": (s.hidden, q), "gate_proj": (s.ffn, s.hidden),
                    "up_proj": (s.ffn, s.hidden), "down_proj": (s.hidden, s.ffn),
                    "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
                    "q_norm": (s.head_dim,), "k_norm": (s.head_dim,)}
        for i in range(s.layers):
            for role, name in self.hf_layer_names(i).items():
                shapes[name] = per_role[role]
        return shapes

    # ------------------------------------------------------------- weights: HF <-> full mcore
    def _layer_pairs(self, s: Shape) -> Iterable[Tuple[str, str]]:
        """(mcore suffix, hf suffix) for one-to-one tensors of a layer."""
        yield _IN_NORM, "input_layernorm.weight"
        yield _MLP_NORM, "post_attention_layernorm.weight"
        yield _PROJ_W, "self_attn.o_proj.weight"
        yield _FC2_W, "mlp.down_proj.weight"
        if self.qk_norm:
            yield _Q_NORM, "self_attn.q_norm.weight"
            yield _K_NORM, "self_attn.k_norm.weight"

    def hf_unit_names(self, hf_config, unit: str) -> List[str]:
        """The Hugging Face tensors one conversion unit reads (``lm_head`` only when untied)."""
        if unit == "embedding":
            return ["model.embed_tokens.weight"]
        if unit == "final_norm":
            return ["model.norm.weight"]
        if unit == "output":
            return ["lm_head.weight"]
        s = self.shape(hf_config)
        hf = self.HF_LAYER.format(i=int(unit.split(".")[1]))
        names = [hf + h for _, h in self._layer_pairs(s)]
        names += [hf + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if self.qkv_bias:
            names += [hf + f"self_attn.{p}_proj.bias" for p in "qkv"]
        return names + [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]

    def convert_unit_from_hf(self, hf_config, unit: str,
                             tensors: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Full Megatron tensors of one unit from its Hugging Face tensors."""
        s = self.shape(hf_config)

        def take(name: str) -> Tensor:
            if name not in tensors:
                raise AdapterError(f"LMC-E303: {self.name}: tensor {name!r} is missing from the "
                                   "checkpoint")
            return tensors[name]

        if unit == "embedding":
            return {"embedding.word_embeddings.weight": take("model.embed_tokens.weight")}
        if unit == "final_norm":
            return {"decoder.final_layernorm.weight": take("model.norm.weight")}
        if unit == "output":
            return {"output_layer.weight": take("lm_head.weight")}
        i = int(unit.split(".")[1])
        hf, mc = self.HF_LAYER.format(i=i), f"decoder.layers.{i}."
        out = {mc + m: take(hf + h) for m, h in self._layer_pairs(s)}
        out[mc + _QKV_W] = self.merge_qkv(s, *(take(hf + f"self_attn.{p}_proj.weight") for p in "qkv"))
        if self.qkv_bias:
            out[mc + _QKV_B] = self.merge_qkv(s, *(take(hf + f"self_attn.{p}_proj.bias") for p in "qkv"))
        out[mc + _FC1_W] = torch.cat([take(hf + "mlp.gate_proj.weight"),
                                      take(hf + "mlp.up_proj.weight")], dim=0)
        return out

    def check_hf_names(self, hf_config, names) -> None:
        """Every checkpoint tensor must be one the adapter maps (a converter never drops one)."""
        expected = {n for unit, _ in self.export_units(hf_config)
                    for n in self.hf_unit_names(hf_config, unit)}
        if self.tied_embeddings(hf_config):
            expected.add("lm_head.weight")  # allowed (must equal the embedding), not required
        extra = sorted(n for n in names if n not in expected and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise AdapterError(f"LMC-E303: {self.name}: checkpoint tensors with no Megatron "
                               f"counterpart: {extra[:8]}{' ...' if len(extra) > 8 else ''}")

    def hf_to_mcore(self, hf_config, hf_state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Full Megatron tensors (global layer numbers) from a Hugging Face state dict.

        Every HF tensor must be consumed and every Megatron tensor produced; anything else is an
        error naming the tensor, never a silent drop.
        """
        self.check_hf_names(hf_config, hf_state.keys())
        out: Dict[str, Tensor] = {}
        for unit, _ in self.export_units(hf_config):
            out.update(self.convert_unit_from_hf(hf_config, unit, hf_state))
        if self.tied_embeddings(hf_config) and "lm_head.weight" in hf_state:
            if not torch.equal(hf_state["lm_head.weight"], out["embedding.word_embeddings.weight"]):
                raise AdapterError("LMC-E303: "
                                   f"{self.name}: tie_word_embeddings=true but lm_head.weight "
                                   "differs from model.embed_tokens.weight")
        return out

    def export_units(self, hf_config) -> List[Tuple[str, List[str]]]:
        """The conversion units in order: (unit name, the full Megatron names it needs).

        A unit (the embedding, one layer, the final norm, the output layer) converts to Hugging
        Face tensors on its own, so exporters can stream a model unit by unit.
        """
        s = self.shape(hf_config)
        units = [("embedding", ["embedding.word_embeddings.weight"])]
        for i in range(s.layers):
            mc = f"decoder.layers.{i}."
            names = [mc + m for m, _ in self._layer_pairs(s)] + [mc + _QKV_W, mc + _FC1_W]
            if self.qkv_bias:
                names.append(mc + _QKV_B)
            units.append((f"layer.{i}", names))
        units.append(("final_norm", ["decoder.final_layernorm.weight"]))
        if not self.tied_embeddings(hf_config):
            units.append(("output", ["output_layer.weight"]))
        return units

    def convert_unit_to_hf(self, hf_config, unit: str,
                           tensors: Mapping[str, Tensor]) -> List[Tuple[str, Tensor]]:
        """Hugging Face (name, tensor) pairs of one unit. Tensors may be views (no copies)."""
        s = self.shape(hf_config)
        if unit == "embedding":
            return [("model.embed_tokens.weight", tensors["embedding.word_embeddings.weight"])]
        if unit == "final_norm":
            return [("model.norm.weight", tensors["decoder.final_layernorm.weight"])]
        if unit == "output":
            return [("lm_head.weight", tensors["output_layer.weight"])]
        i = int(unit.split(".")[1])
        hf, mc = self.HF_LAYER.format(i=i), f"decoder.layers.{i}."
        out = [(hf + h, tensors[mc + m]) for m, h in self._layer_pairs(s)]
        q, k, v = self.split_qkv(s, tensors[mc + _QKV_W])
        out += [(hf + "self_attn.q_proj.weight", q), (hf + "self_attn.k_proj.weight", k),
                (hf + "self_attn.v_proj.weight", v)]
        if self.qkv_bias:
            qb, kb, vb = self.split_qkv(s, tensors[mc + _QKV_B])
            out += [(hf + "self_attn.q_proj.bias", qb), (hf + "self_attn.k_proj.bias", kb),
                    (hf + "self_attn.v_proj.bias", vb)]
        gate, up = torch.chunk(tensors[mc + _FC1_W], 2, dim=0)
        out += [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
        return out

    def mcore_to_hf(self, hf_config, mcore_state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Hugging Face tensors from full Megatron tensors (the inverse of ``hf_to_mcore``).

        Every Megatron tensor must be used and every Hugging Face tensor produced.
        """
        out: Dict[str, Tensor] = {}
        used = set()
        for unit, names in self.export_units(hf_config):
            missing = [n for n in names if n not in mcore_state]
            if missing:
                raise AdapterError(f"LMC-E303: {self.name}: Megatron tensor {missing[0]!r} is "
                                   "missing")
            used.update(names)
            for name, tensor in self.convert_unit_to_hf(hf_config, unit, mcore_state):
                out[name] = tensor.contiguous()
        extra = sorted(set(mcore_state) - used)
        if extra:
            raise AdapterError(f"LMC-E303: {self.name}: Megatron tensors with no Hugging Face "
                               f"counterpart: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        return out

    def from_transformers_state(self, hf_config, state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """A transformers model's ``state_dict()`` in checkpoint layout (the same for dense
        families; MoE families unfuse their experts)."""
        return dict(state)

    @staticmethod
    def merge_qkv(s: Shape, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Megatron interleaves QKV by query group: [q_g (heads/groups rows), k_g, v_g] per group."""
        per = s.heads // s.groups
        rest = q.shape[1:]
        q = q.reshape(s.groups, per * s.head_dim, *rest)
        k = k.reshape(s.groups, s.head_dim, *rest)
        v = v.reshape(s.groups, s.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()

    @staticmethod
    def split_qkv(s: Shape, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        per = s.heads // s.groups
        rest = qkv.shape[1:]
        grouped = qkv.reshape(s.groups, (per + 2) * s.head_dim, *rest)
        q, k, v = torch.split(grouped, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
        # Views of ``qkv`` shaped like the Hugging Face tensors (no copy: exporters write them
        # straight into a bucket); call .contiguous() to own the memory.
        return (_flatten_groups(q, rest), _flatten_groups(k, rest), _flatten_groups(v, rest))

    # ------------------------------------------------------------ tensor-parallel layout
    @staticmethod
    def tp_dim(name: str) -> Optional[int]:
        _, suffix = split_layer_name(name)
        return _TP_DIM.get(suffix)

    def shard(self, name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
        """The slice of a full Megatron tensor held by one tensor-parallel rank."""
        dim = self.tp_dim(name)
        if dim is None or tp_size == 1:
            return full
        if full.shape[dim] % tp_size:
            raise AdapterError("LMC-E312: "
                               f"{name}: dimension {dim} of size {full.shape[dim]} does not "
                               f"divide by tensor parallel size {tp_size}")
        if _stacks_gate_up(name):
            # Each rank holds [gate_r; up_r], not a contiguous slice of [gate; up].
            gate, up = torch.chunk(full, 2, dim=0)
            return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank],
                              torch.chunk(up, tp_size, 0)[tp_rank]], dim=0)
        return torch.chunk(full, tp_size, dim=dim)[tp_rank]

    def unshard(self, name: str, shards: list) -> Tensor:
        """The full tensor from every tensor-parallel rank's shard (in rank order)."""
        dim = self.tp_dim(name)
        if dim is None or len(shards) == 1:
            return shards[0]
        if _stacks_gate_up(name):
            pairs = [torch.chunk(t, 2, dim=0) for t in shards]
            return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs], dim=0)
        return torch.cat(shards, dim=dim)

