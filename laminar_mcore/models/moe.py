"""Mixture-of-Experts families (Qwen3-MoE): Hugging Face <-> Megatron-Core MoE ``GPTModel``.

A Qwen3-MoE layer is Qwen3's attention (q/k norm, no bias) followed either by a dense SwiGLU
MLP (layers in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid) or by a router
(``mlp.gate``, softmax over all experts, top-k, renormalised when ``norm_topk_prob``) and
``num_experts`` SwiGLU experts (``mlp.experts.{e}.gate_proj/up_proj/down_proj``). No shared
experts.

Full Megatron names of an MoE layer (global expert numbers ``e``, whatever the EP layout):

    decoder.layers.{i}.mlp.router.weight                                 [E, H]
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight   [2 I, H]  (gate; up)
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight   [H, I]

Transformer Engine's grouped-GEMM experts name them ``mlp.experts.linear_fc1.weight{e}``;
``split_layer_name`` maps those to the names above, so one layout serves both specs. Expert
tensors are split over the *expert*-tensor-parallel group (``expert_tp``) the way the dense
``linear_fc1``/``linear_fc2`` are split over TP; which experts a rank holds is the
expert-parallel layout's business (``trainer.model``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .base import (_FC1_W, _FC2_W, AdapterError, ModelAdapter, Tensor, register_adapter,
                   split_layer_name)

ROUTER_W = "mlp.router.weight"
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
# transformers >= 5 in memory: one layer's experts fused
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def expert_suffix(e: int, which: str) -> str:
    """``mlp.experts.local_experts.{e}.linear_fc1.weight`` (``which``: fc1 or fc2)."""
    return f"mlp.experts.local_experts.{e}.linear_{which}.weight"


def parse_expert(suffix: str) -> Optional[Tuple[int, str]]:
    """(expert number, ``linear_fc1.weight``/``linear_fc2.weight``) of an expert tensor's layer
    suffix as ``split_layer_name`` returns it (grouped-GEMM names already in local form)."""
    m = _EXPERT_RE.match(suffix)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class MoeShape:
    experts: int
    topk: int
    moe_ffn: int
    norm_topk_prob: bool
    moe_layers: Tuple[bool, ...]  # per layer: True for an MoE layer, False for a dense one


@dataclass(frozen=True)
class MoeAdapter(ModelAdapter):
    """Qwen3-MoE: Qwen3 attention, dense or MoE MLP per layer."""

    is_moe: bool = True

    # ---------------------------------------------------------------- config translation
    def moe_shape(self, hf_config) -> MoeShape:
        n = hf_config.num_hidden_layers
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        # transformers' Qwen3MoeDecoderLayer: MoE where (i + 1) % step == 0 and i not dense
        layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
        return MoeShape(experts=experts, topk=int(hf_config.num_experts_per_tok),
                        moe_ffn=int(hf_config.moe_intermediate_size),
                        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                        moe_layers=layers)

    def num_experts(self, hf_config) -> int:
        return self.moe_shape(hf_config).experts

    def check_hf_config(self, hf_config) -> None:
        super().check_hf_config(hf_config)
        m = self.moe_shape(hf_config)
        if m.experts < 1:
            raise AdapterError(f"LMC-E310: {self.name}: num_experts must be >= 1 (got {m.experts})")
        if not 1 <= m.topk <= m.experts:
            raise AdapterError(f"LMC-E310: {self.name}: num_experts_per_tok={m.topk} must be in "
                               f"[1, num_experts={m.experts}]")
        bad = [i for i in (getattr(hf_config, "mlp_only_layers", None) or [])
               if not 0 <= int(i) < hf_config.num_hidden_layers]
        if bad:
            raise AdapterError("LMC-E310: "
                               f"{self.name}: mlp_only_layers {bad} are not layer numbers "
                               f"(0..{hf_config.num_hidden_layers - 1})")
        if getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise AdapterError(f"LMC-E310: {self.name}: shared experts are not supported")

    def transformer_config_kwargs(self, hf_config) -> dict:
        kwargs = super().transformer_config_kwargs(hf_config)
        m = self.moe_shape(hf_config)
        kwargs.update(
            num_moe_experts=m.experts,
            moe_router_topk=m.topk,
            moe_ffn_hidden_size=m.moe_ffn,
            moe_layer_freq=[1 if moe else 0 for moe in m.moe_layers],
            moe_router_score_function="softmax",
            # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probs);
            # otherwise softmax over every expert, then top-k (Megatron's pre-softmax)
            moe_router_pre_softmax=not m.norm_topk_prob,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
        )
        return kwargs

    def layer_spec(self, use_te: bool, config=None):
        """The block spec of every layer (dense or MoE by ``config.moe_layer_freq``)."""
        from megatron.core.models.gpt import gpt_layer_specs

        if config is None:
            raise AdapterError(f"{self.name}: the MoE layer spec needs the TransformerConfig")
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm")

    # ------------------------------------------------------------- Hugging Face names
    def hf_expert_names(self, i: int, e: int) -> Dict[str, str]:
        p = self.HF_LAYER.format(i=i) + f"mlp.experts.{e}."
        return {"gate_proj": p + "gate_proj.weight", "up_proj": p + "up_proj.weight",
                "down_proj": p + "down_proj.weight"}

    def hf_router_name(self, i: int) -> str:
        return self.HF_LAYER.format(i=i) + "mlp.gate.weight"

    def hf_layer_names(self, i: int, hf_config=None) -> Dict[str, str]:
        names = super().hf_layer_names(i)
        if hf_config is not None and self.moe_shape(hf_config).moe_layers[i]:
            for role in ("gate_proj", "up_proj", "down_proj"):
                names.pop(role)
            names["router"] = self.hf_router_name(i)
        return names

    def hf_shapes(self, hf_config) -> Dict[str, Tuple[int, ...]]:
        s, m = self.shape(hf_config), self.moe_shape(hf_config)
        shapes = super().hf_shapes(hf_config)
        for i, moe in enumerate(m.moe_layers):
            if not moe:
                continue
            dense = super().hf_layer_names(i)
            for role in ("gate_proj", "up_proj", "down_proj"):
                shapes.pop(dense[role])
            shapes[self.hf_router_name(i)] = (m.experts, s.hidden)
            for e in range(m.experts):
                n = self.hf_expert_names(i, e)
                shapes[n["gate_proj"]] = (m.moe_ffn, s.hidden)
                shapes[n["up_proj"]] = (m.moe_ffn, s.hidden)
                shapes[n["down_proj"]] = (s.hidden, m.moe_ffn)
        return shapes

    # ------------------------------------------------------------- weights: HF <-> full mcore
    def _is_moe_unit(self, hf_config, unit: str) -> bool:
        return unit.startswith("layer.") and \
            self.moe_shape(hf_config).moe_layers[int(unit.split(".")[1])]

    def hf_unit_names(self, hf_config, unit: str) -> List[str]:
        names = super().hf_unit_names(hf_config, unit)
        if not self._is_moe_unit(hf_config, unit):
            return names
        i = int(unit.split(".")[1])
        hf = self.HF_LAYER.format(i=i)
        names = [n for n in names if n not in (hf + "mlp.gate_proj.weight",
                                                hf + "mlp.up_proj.weight",
                                                hf + "mlp.down_proj.weight")]
        names.append(self.hf_router_name(i))
        for e in range(self.num_experts(hf_config)):
            names += list(self.hf_expert_names(i, e).values())
        return names

    def export_units(self, hf_config) -> List[Tuple[str, List[str]]]:
        units = super().export_units(hf_config)
        m = self.moe_shape(hf_config)
        out = []
        for unit, names in units:
            if self._is_moe_unit(hf_config, unit):
                mc = f"decoder.layers.{unit.split('.')[1]}."
                names = [n for n in names if n not in (mc + _FC1_W, mc + _FC2_W)]
                names.append(mc + ROUTER_W)
                for e in range(m.experts):
                    names += [mc + expert_suffix(e, "fc1"), mc + expert_suffix(e, "fc2")]
            out.append((unit, names))
        return out

    def convert_unit_from_hf(self, hf_config, unit: str,
                             tensors: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        if not self._is_moe_unit(hf_config, unit):
            return super().convert_unit_from_hf(hf_config, unit, tensors)

        def take(name: str) -> Tensor:
            if name not in tensors:
                raise AdapterError(f"LMC-E303: {self.name}: tensor {name!r} is missing from the "
                                   "checkpoint")
            return tensors[name]

        i = int(unit.split(".")[1])
        hf, mc = self.HF_LAYER.format(i=i), f"decoder.layers.{i}."
        # the attention half through the dense path, with placeholders for the dense MLP
        dense_mlp = {hf + f"mlp.{p}_proj.weight": torch.empty(0) for p in ("gate", "up", "down")}
        out = super().convert_unit_from_hf(hf_config, unit, {**tensors, **dense_mlp})
        out.pop(mc + _FC1_W)
        out.pop(mc + _FC2_W)
        out[mc + ROUTER_W] = take(self.hf_router_name(i))
        for e in range(self.num_experts(hf_config)):
            n = self.hf_expert_names(i, e)
            out[mc + expert_suffix(e, "fc1")] = torch.cat([take(n["gate_proj"]),
                                                           take(n["up_proj"])], dim=0)
            out[mc + expert_suffix(e, "fc2")] = take(n["down_proj"])
        return out

    def convert_unit_to_hf(self, hf_config, unit: str, tensors: Mapping[str, Tensor],
                           experts: Optional[List[int]] = None,
                           dense: bool = True) -> List[Tuple[str, Tensor]]:
        """An MoE layer's tensors in Hugging Face form: the attention, norms and router (unless
        ``dense`` is False) and the ``experts`` given (default: all of them; a per-rank export
        passes one EP rank's, ``trainer.export``)."""
        if not self._is_moe_unit(hf_config, unit):
            return super().convert_unit_to_hf(hf_config, unit, tensors)
        i = int(unit.split(".")[1])
        hf, mc = self.HF_LAYER.format(i=i), f"decoder.layers.{i}."
        out = []
        if dense:
            placeholder = torch.empty(2, 1)
            converted = super().convert_unit_to_hf(
                hf_config, unit, {**tensors, mc + _FC1_W: placeholder, mc + _FC2_W: placeholder})
            out = [(n, t) for n, t in converted
                   if n not in (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight",
                                hf + "mlp.down_proj.weight")]
            out.append((self.hf_router_name(i), tensors[mc + ROUTER_W]))
        for e in range(self.num_experts(hf_config)) if experts is None else experts:
            n = self.hf_expert_names(i, e)
            gate, up = torch.chunk(tensors[mc + expert_suffix(e, "fc1")], 2, dim=0)
            out += [(n["gate_proj"], gate), (n["up_proj"], up),
                    (n["down_proj"], tensors[mc + expert_suffix(e, "fc2")])]
        return out

    def from_transformers_state(self, hf_config, state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """A transformers model's ``state_dict()`` in checkpoint layout: transformers >= 5 keeps
        each layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2 I, H],
        ``mlp.experts.down_proj`` [E, H, I]); checkpoints (and SGLang) name every expert."""
        out: Dict[str, Tensor] = {}
        for name, tensor in state.items():
            m = _FUSED_RE.match(name)
            if not m:
                out[name] = tensor
                continue
            i = int(m.group(1))
            for e in range(tensor.shape[0]):
                n = self.hf_expert_names(i, e)
                if m.group(2) == "down_proj":
                    out[n["down_proj"]] = tensor[e].contiguous()
                else:
                    gate, up = torch.chunk(tensor[e], 2, dim=0)
                    out[n["gate_proj"]], out[n["up_proj"]] = gate.contiguous(), up.contiguous()
        return out

    # ------------------------------------------------------------ tensor-parallel layout
    @staticmethod
    def tp_dim(name: str) -> Optional[int]:
        _, suffix = split_layer_name(name)
        expert = parse_expert(suffix)
        if expert is not None:
            return 0 if expert[1] == "linear_fc1.weight" else 1
        return ModelAdapter.tp_dim(name)  # the router is replicated (no entry)


def is_expert_param(name: str) -> bool:
    """Whether a (full or local) Megatron name is an expert tensor (split over expert TP and
    distributed over expert parallelism)."""
    return parse_expert(split_layer_name(name)[1]) is not None


QWEN3_MOE = register_adapter(MoeAdapter(name="qwen3_moe", hf_model_types=("qwen3_moe",),
                                        qk_norm=True))
