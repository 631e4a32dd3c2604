"""SGLang 0.5.23's per-rank parameter layout: what each engine TP rank holds.

An SGLang engine of TP size N keeps, on each rank, its slice of every parameter under
SGLang's own names, with the projections fused (``models/qwen2.py``, ``llama.py``,
``qwen3.py``: ``stacked_params_mapping``):

* ``self_attn.qkv_proj`` (``layers/linear.py`` ``QKVParallelLinear``): the rank's query heads,
  then its key and value heads, along dim 0 -- ``heads / N`` query heads; ``kv_heads / N``
  key/value heads, or one replicated head (head ``rank // (N / kv_heads)``) when N exceeds
  them. The bias (Qwen2) the same way;
* ``mlp.gate_up_proj`` (``MergedColumnParallelLinear``): the rank's rows of gate, then of up;
* ``self_attn.o_proj``, ``mlp.down_proj`` (``RowParallelLinear``): the rank's columns;
* ``model.embed_tokens``, ``lm_head`` (``layers/vocab_parallel_embedding.py``): the rank's rows
  of the vocabulary padded to a multiple of 64 (64 x N when that does not divide by N), the
  padding rows zero;
* norms (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, Qwen3's
  ``q_norm``/``k_norm``): whole on every rank. A tied ``lm_head`` is the embedding (no
  parameter of its own).

``/update_weights_from_tensor`` with ``load_format="direct"`` copies each rank's payload
(``serialized_named_tensors[rank]``: a list of (SGLang name, tensor)) straight into these
parameters (``default_weight_loader``: names must exist, sizes must be equal), so a relay that
serves this layout lets each engine GPU copy only its own shard. ``Layout`` is computed from a
checkpoint's tensor names and shapes plus the attention head count (the only fact the shapes do
not carry); the relay builds each rank's tensors with ``fill`` and the CPU engine takes them
back with ``pieces`` (``rollout/engine_weights.py``).

Mixture-of-experts layers (Qwen3-MoE, ``models/qwen3_moe.py``: ``FusedMoE`` with SGLang's
default runner, ``layers/moe/fused_moe_triton/layer.py``) at TP ``N`` and ``--ep-size E``: the
router ``mlp.gate`` whole on every rank (``ReplicatedLinear``); ``mlp.experts.w13_weight``
[experts / E, 2 I / (N / E), H] (each local expert's rows of gate, then of up) and
``mlp.experts.w2_weight`` [experts / E, H, I / (N / E)] (its columns of down). Rank ``r``
holds experts ``[k * experts / E, (k + 1) * experts / E)`` with ``k = r // (N / E)`` (the EP
group is every ``N / E``-th rank, ``distributed/parallel_state.py``) and the ``r % (N / E)``-th
slice of each. That is the layout the ``triton`` runner keeps (and ``auto`` on GPUs other than
SM100, where SGLang picks flashinfer's TRT-LLM runner for Qwen3-MoE and reorders the experts'
blocks): ``sglang_layout_mismatch`` tells from what the engine reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

import torch

VOCAB_PADDING = 64  # sglang layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_REPLICATED = {"input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight"}
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0),
          "self_attn.k_proj": ("self_attn.qkv_proj", 1),
          "self_attn.v_proj": ("self_attn.qkv_proj", 2),
          "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1)}
_ROW_PARALLEL = {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_ROLES = ("w13", "w2")


class LayoutError(ValueError):
    """A model that SGLang's per-rank layout cannot hold at this TP size (the message says why)."""


class EngineLayoutError(LayoutError):
    """An engine that reports (``/server_info``) a layout other than the one its shard pulls
    need, with ``weight_sync.engine_pull=shard``: a configuration to change, not a fault of
    the engine (the run stops and says why)."""


@dataclass(frozen=True)
class Piece:
    """Rank tensor ``out.narrow(dim, at, length)`` is Hugging Face tensor
    ``hf.narrow(dim, start, length)``."""

    hf: str
    dim: int
    start: int
    length: int
    at: int
    expert: int = -1  # >= 0: in ``out[expert]`` (a stacked expert parameter)


def padded_vocab(vocab: int, tp: int) -> int:
    """SGLang's padded vocabulary size at TP ``tp`` (``VocabParallelEmbedding.__init__``)."""
    pad = VOCAB_PADDING
    if -(-vocab // pad) * pad % tp:
        pad *= tp
    return -(-vocab // pad) * pad


# SGLang 0.5.23 ServerArgs (``/server_info``: the resolved values) that change what a rank
# holds, with the values that keep the layout above: of any model (attention data or context
# parallel, quantized weights) ...
LAYOUT_ARGS = {"enable_dp_attention": (False,), "attn_cp_size": (1,), "quantization": (None,)}
# ... and of an MoE model's experts (where they are, how they are laid out)
MOE_LAYOUT_ARGS = {"moe_runner_backend": ("auto", "triton"), "moe_a2a_backend": ("none",),
                   "enable_eplb": (False,), "ep_num_redundant_experts": (0,),
                   "init_expert_location": ("trivial",), "moe_dp_size": (1,),
                   "enable_paged_experts": (False,)}


def sglang_layout_mismatch(info: Mapping, tp: int, ep: int, moe: bool) -> str:
    """'' when an engine whose ``/server_info`` is ``info`` holds the layout above at TP
    ``tp`` (and, for an MoE model, EP ``ep``), else why not. SGLang reports its *resolved*
    arguments there: on an SM100 GPU its Qwen3-MoE override has already turned ``auto`` into
    ``flashinfer_trtllm`` (``arg_groups/model_overrides/qwen3_moe.py``: w1/w3 swapped, blocked
    experts), while ``auto`` left as it is means the triton runner (``unquant.py``); the
    triton-kernels runner transposes each expert, a cutlass layout puts up before gate, EPLB
    and redundant experts move them, an all-to-all backend or attention DP/CP changes what a
    rank holds. Every key must be there (a renamed one is a mismatch), except from the CPU
    engine (``frontend`` laminar-cpu), which reports its TP and EP only: SGLang's defaults
    otherwise. Not visible there: ROCm's aiter layout (``SGLANG_USE_AITER``), and a quantized
    checkpoint loaded without ``--quantization``."""
    keys = [("tp_size", (tp,)), *LAYOUT_ARGS.items()]
    if moe:
        keys += [("ep_size", (ep,)), *MOE_LAYOUT_ARGS.items()]
    twin = info.get("frontend") == "laminar-cpu"
    for key, want in keys:
        if key not in info and not twin:
            return (f"the engine's /server_info has no {key} (not SGLang 0.5.23's?), so its "
                    "layout cannot be confirmed")
        got = info.get(key, want[0])
        if got not in want:
            return (f"the engine reports {key}={got!r} (/server_info), where its weights are in "
                    f"SGLang's default layout only at {key}={want[0]!r}")
    return ""


class Layout:
    """SGLang's parameters of a checkpoint at TP ``tp`` (and ``--ep-size`` ``ep`` for its
    experts): ``shapes`` (name -> the rank's shape, equal on every rank), ``dtypes``, and each
    rank's ``pieces``."""

    def __init__(self, hf_shapes: Mapping[str, Sequence[int]], heads: int, tp: int,
                 hf_dtypes: Mapping[str, torch.dtype] = None, ep: int = 1):
        if tp < 1 or ep < 1 or tp % ep:
            raise LayoutError(f"LMC-E519: TP {tp} and expert parallel size {ep}: both must be "
                              ">= 1 and EP must divide TP (SGLang's moe_tp_size = tp / ep): "
                              "choose rollout.engine_ep dividing rollout.engine_tp")
        self.tp, self.heads, self.ep = int(tp), int(heads), int(ep)
        self.moe_tp = self.tp // self.ep
        self.hf_shapes = {k: tuple(int(d) for d in v) for k, v in hf_shapes.items()
                          if not k.endswith("rotary_emb.inv_freq")}
        self._plan: Dict[str, List[Tuple[str, str, int]]] = {}  # name -> [(hf, role, part)]
        self._by_hf: Dict[int, Dict[str, List[Piece]]] = {}  # rank -> hf name -> its pieces
        for hf in self.hf_shapes:
            name, role, part = self._place(hf)
            self._plan.setdefault(name, []).append((hf, role, part))
        for parts in self._plan.values():
            parts.sort(key=lambda p: p[2])
        self._check_heads()
        self.shapes = {name: self._shape(name) for name in self._plan}
        self.dtypes = {name: (hf_dtypes or {}).get(parts[0][0], torch.float32)
                       for name, parts in self._plan.items()}

    # ------------------------------------------------------------- names
    def _place(self, hf: str) -> Tuple[str, str, int]:
        """(SGLang name, role, part index in a fused parameter) of Hugging Face tensor ``hf``."""
        if hf in _VOCAB:
            return hf, "vocab", 0
        if hf == "model.norm.weight":
            return hf, "whole", 0
        m = _LAYER.match(hf)
        if m:
            prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
            if rest in _REPLICATED or rest == "mlp.gate.weight":  # norms; the MoE router
                return hf, "whole", 0
            e = _EXPERT.match(rest)
            if e:
                expert, kind = int(e.group(1)), e.group(2)
                if kind == "down":
                    return f"{prefix}mlp.experts.w2_weight", "w2", expert
                return f"{prefix}mlp.experts.w13_weight", "w13", 2 * expert + (kind == "up")
            if rest in _ROW_PARALLEL:
                return hf, "columns", 0
            stem, _, kind = rest.rpartition(".")
            if stem in _FUSED and kind in ("weight", "bias"):
                fused, part = _FUSED[stem]
                return f"{prefix}{fused}.{kind}", "qkv" if fused.endswith("qkv_proj") else "rows", \
                    part
        raise LayoutError(f"LMC-E519: {hf!r} has no place in SGLang's per-rank layout of a "
                          "model of the families covered: pull whole tensors "
                          "(weight_sync.engine_pull=whole)")

    def _check_heads(self) -> None:
        tp = self.tp
        q = next((s for k, s in self.hf_shapes.items() if k.endswith("self_attn.q_proj.weight")),
                 None)
        k = next((s for k, s in self.hf_shapes.items() if k.endswith("self_attn.k_proj.weight")),
                 None)
        if q is None and k is None:  # no attention here (a stripe of other tensors)
            self.head_dim = self.kv_heads = 0
            q = k = ()
        elif q is None or k is None or q[0] % self.heads:
            raise LayoutError(f"LMC-E519: cannot find {self.heads} attention heads in the "
                              "checkpoint's q_proj")
        else:
            self.head_dim = q[0] // self.heads
            self.kv_heads = k[0] // self.head_dim
        if q and (self.kv_heads < 1 or k[0] % self.head_dim):
            raise LayoutError(f"LMC-E519: k_proj's {k[0]} rows are not whole heads of "
                              f"{self.head_dim} ({self.heads} attention heads?)")
        if q and (self.heads % tp or (tp % self.kv_heads if tp >= self.kv_heads
                                      else self.kv_heads % tp)):
            raise LayoutError(f"LMC-E519: {self.heads} query and {self.kv_heads} key/value heads "
                              f"do not split over TP {tp} (SGLang's QKVParallelLinear divides "
                              "them): choose rollout.engine_tp dividing the heads")
        for hf, shape in self.hf_shapes.items():
            role = self._place(hf)[1]
            dim = 1 if role in ("columns", "w2") else 0
            if role in ("rows", "columns") and shape[dim] % tp:
                raise LayoutError(f"LMC-E519: {hf} {list(shape)} does not split over TP {tp} "
                                  f"along dim {dim}: choose rollout.engine_tp dividing it")
            if role in _EXPERT_ROLES and shape[dim] % self.moe_tp:
                raise LayoutError(f"LMC-E519: {hf} {list(shape)} does not split over the "
                                  f"experts' TP {self.moe_tp} (engine_tp / engine_ep) along dim "
                                  f"{dim}: choose rollout.engine_ep so that it does")
        for name, parts in self._plan.items():
            if parts[0][1] in _EXPERT_ROLES:
                experts = self._experts(name)
                per = 2 if parts[0][1] == "w13" else 1
                if [p for _, _, p in parts] != list(range(per * experts)):
                    raise LayoutError(f"LMC-E519: {name}: the version does not hold every "
                                      f"expert's {'gate and up' if per == 2 else 'down'} "
                                      "projection (SGLang's fused experts take them all)")
                if self.moe_tp > experts:
                    raise LayoutError(f"LMC-E519: Tensor parallel size {self.moe_tp} is greater "
                                      f"than the number of experts {experts} (SGLang refuses "
                                      "it): raise rollout.engine_ep")
                if experts % self.ep:
                    raise LayoutError(f"LMC-E519: {experts} experts do not split over "
                                      f"expert parallel size {self.ep} (SGLang asserts it): "
                                      "choose rollout.engine_ep dividing them")
        self._check_moe_layers()

    def _check_moe_layers(self) -> None:
        """Every MoE layer's gate/up, down and router agree on its number of experts; no dense
        MLP beside experts: SGLang 0.5.23's Qwen3-MoE makes every layer sparse
        (``models/qwen3_moe.py`` ``stage_facts``), whatever ``mlp_only_layers`` says."""
        counts: Dict[str, set] = {}
        for name, parts in self._plan.items():
            layer = name.split("mlp.")[0]
            if parts[0][1] in _EXPERT_ROLES:
                counts.setdefault(layer, set()).add(self._experts(name))
            elif name.endswith("mlp.gate.weight"):
                counts.setdefault(layer, set()).add(self.hf_shapes[name][0])
        for layer, seen in counts.items():
            if len(seen) > 1:
                raise LayoutError(f"LMC-E519: {layer}mlp: its gate/up and down projections "
                                  f"and router count {sorted(seen)} experts (a version missing "
                                  "an expert's tensors?)")
        if counts and any(n.endswith("mlp.gate_up_proj.weight") for n in self._plan):
            raise LayoutError("LMC-E519: a dense MLP beside experts: SGLang 0.5.23's Qwen3-MoE "
                              "makes every layer sparse (models/qwen3_moe.py), so it cannot "
                              "serve a model with mlp_only_layers or decoder_sparse_step > 1")

    def _experts(self, name: str) -> int:
        parts = self._plan[name]
        return len(parts) // (2 if parts[0][1] == "w13" else 1)

    # ------------------------------------------------------------- shapes and pieces
    def _shape(self, name: str) -> Tuple[int, ...]:
        parts = self._plan[name]
        hf, role, _ = parts[0]
        shape = list(self.hf_shapes[hf])
        if role in _EXPERT_ROLES:  # [local experts, rows, columns] of the experts' TP slice
            dim = 1 if role == "w2" else 0
            shape[dim] //= self.moe_tp
            if role == "w13":
                shape[0] *= 2
            return (self._experts(name) // self.ep, *shape)
        if role == "vocab":
            shape[0] = padded_vocab(shape[0], self.tp) // self.tp
        elif role == "columns":
            shape[1] //= self.tp
        elif role in ("rows", "qkv"):
            shape[0] = sum(self._rows(h, r)[1] for h, r, _ in parts)
        return tuple(shape)

    def _rows(self, hf: str, role: str) -> Tuple[int, int]:
        """(ranks sharing a slice, rows a rank takes) of a row-split tensor: key/value heads
        are replicated over ``tp / kv_heads`` ranks when TP exceeds them."""
        rows = self.hf_shapes[hf][0]
        if role == "qkv" and not re.search(r"q_proj\.(weight|bias)$", hf) \
                and self.tp >= self.kv_heads:
            return self.tp // self.kv_heads, self.head_dim
        return 1, rows // self.tp

    def pieces(self, name: str, rank: int) -> List[Piece]:
        """Where rank ``rank``'s ``name`` comes from, in order."""
        if not 0 <= rank < self.tp:
            raise LayoutError(f"rank {rank} is not in [0, {self.tp})")
        out, at = [], 0
        parts = self._plan[name]
        if parts[0][1] in _EXPERT_ROLES:
            return self._expert_pieces(name, rank)
        for hf, role, _ in parts:
            shape = self.hf_shapes[hf]
            if role == "whole":
                out.append(Piece(hf, 0, 0, shape[0], 0))
            elif role == "columns":
                n = shape[1] // self.tp
                out.append(Piece(hf, 1, rank * n, n, 0))
            elif role == "vocab":
                per = padded_vocab(shape[0], self.tp) // self.tp
                start = rank * per
                if start < shape[0]:
                    out.append(Piece(hf, 0, start, min(per, shape[0] - start), 0))
            else:
                replicas, n = self._rows(hf, role)
                out.append(Piece(hf, 0, (rank // replicas) * n, n, at))
                at += n
        return out

    def _expert_pieces(self, name: str, rank: int) -> List[Piece]:
        """The rank's experts (EP group position ``rank // moe_tp``), each its ``rank % moe_tp``
        slice: gate's rows then up's (w13), or down's columns (w2)."""
        parts, per = self._plan[name], 2 if self._plan[name][0][1] == "w13" else 1
        local = self._experts(name) // self.ep
        first, slot = (rank // self.moe_tp) % self.ep * local, rank % self.moe_tp
        out = []
        for j in range(local):
            for k in range(per):
                hf = parts[(first + j) * per + k][0]
                dim = 1 if per == 1 else 0
                n = self.hf_shapes[hf][dim] // self.moe_tp
                out.append(Piece(hf, dim, slot * n, n, k * n, j))
        return out

    def hf_pieces(self, rank: int) -> Dict[str, List[Piece]]:
        """Rank ``rank``'s pieces by the Hugging Face tensor they come from (made once)."""
        if rank not in self._by_hf:
            by_hf: Dict[str, List[Piece]] = {}
            for name in self._plan:
                for p in self.pieces(name, rank):
                    by_hf.setdefault(p.hf, []).append(p)
            self._by_hf[rank] = by_hf
        return self._by_hf[rank]

    @property
    def names(self) -> List[str]:
        return list(self._plan)

    def sources(self, name: str) -> List[str]:
        """The Hugging Face tensors SGLang parameter ``name`` is made of."""
        return [hf for hf, _, _ in self._plan[name]]

    def nbytes(self, name: str) -> int:
        return torch.Size(self.shapes[name]).numel() * self.dtypes[name].itemsize

    def fill(self, name: str, rank: int, hf: Callable[[str], torch.Tensor],
             out: torch.Tensor) -> torch.Tensor:
        """Write rank ``rank``'s ``name`` into ``out`` (its shape; any device) from the Hugging
        Face tensors ``hf(name)`` returns; vocabulary padding rows are zero."""
        if tuple(out.shape) != self.shapes[name]:
            raise LayoutError(f"{name}: out has shape {list(out.shape)}, the rank's is "
                              f"{list(self.shapes[name])}")
        covered = 0
        for p in self.pieces(name, rank):
            into = out[p.expert] if p.expert >= 0 else out
            into.narrow(p.dim, p.at, p.length).copy_(hf(p.hf).narrow(p.dim, p.start, p.length),
                                                     non_blocking=True)
            covered = max(covered, p.at + p.length) if p.dim == 0 and p.expert < 0 \
                else out.shape[0]
        if covered < out.shape[0]:
            out[covered:].zero_()
        return out

    def groups(self, bucket_bytes: int) -> List[List[str]]:
        """The parameters in pulls of about ``bucket_bytes`` per rank each (a parameter is
        never split: SGLang's direct load copies it whole)."""
        out: List[List[str]] = []
        size = 0
        for name in self._plan:
            n = self.nbytes(name)
            if out and size + n <= bucket_bytes:
                out[-1].append(name)
                size += n
            else:
                out.append([name])
                size = n
        return out


def layout_for_config(hf_config, tp: int, adapter=None, ep: int = 1) -> Layout:
    """The layout of a model the CPU engine (or a launcher) has the config of."""
    from ..models import get_adapter

    adapter = adapter or get_adapter(hf_config)
    return Layout(adapter.hf_shapes(hf_config), adapter.shape(hf_config).heads, tp, ep=ep)


__all__ = ["EngineLayoutError", "Layout", "LayoutError", "Piece", "VOCAB_PADDING",
           "layout_for_config", "padded_vocab", "sglang_layout_mismatch"]
