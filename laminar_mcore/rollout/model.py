"""The CPU engine's model: a plain-torch decoder for the Llama family (Qwen2, Llama 3, Qwen3) and
Qwen3-MoE that reads Hugging Face weights by their own names and attends over a shared KV cache.

Owns the forward pass of a ragged batch (each request brings its new tokens and attends to its
cached ones) and in-place weight loading. It never imports Megatron or trainer code; the weight
names it accepts are Hugging Face's, as produced by ``ModelAdapter.mcore_to_hf``.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..models import get_adapter

logger = logging.getLogger("laminar_mcore.cpu_engine")

# Names SGLang 0.5.23's legacy ``load_weights`` (models/qwen2.py, llama.py, qwen3.py,
# qwen3_moe.py) passes over without a word; any other name it has no parameter for it logs
# (``Parameter NAME not found in params_dict``; Qwen3-MoE silently) and skips, an extra bias
# or a layer the model does not have silently -- except Qwen3's, whose fused-parameter branch
# looks the renamed name up unguarded (a KeyError) for a name holding one of these parts.
SGLANG_SILENT_SKIPS = ("rotary_emb.inv_freq", "projector", "rotary_emb.cos_cached",
                       "rotary_emb.sin_cached")
SGLANG_STACKED = (("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
                  ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj"))
_LAYER_ID = re.compile(r"layers\.(\d+)\.")  # SGLang's get_layer_id


def rope_inv_freq(head_dim: int, theta: float, llama3_factor: Optional[float]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if llama3_factor is None:
        return inv.float()
    # Llama 3.1 frequency-dependent scaling (low 1, high 4, original context 8192).
    low, high, original = 1.0, 4.0, 8192
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / llama3_factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / llama3_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderLM:
    """Weights as a flat dict of Hugging Face names; forward over a ragged batch."""

    def __init__(self, hf_config, state: Mapping[str, torch.Tensor], dtype=torch.float32):
        self.config = hf_config
        self.adapter = get_adapter(hf_config)
        self.adapter.check_hf_config(hf_config)
        s = self.adapter.shape(hf_config)
        self.shape = s
        self.dtype = dtype
        self.eps = float(hf_config.rms_norm_eps)
        self.tied = self.adapter.tied_embeddings(hf_config)
        self.inv_freq = rope_inv_freq(s.head_dim, self.adapter.rope_theta(hf_config),
                                      self.adapter.rope_scaling(hf_config))
        self.params: Dict[str, torch.Tensor] = {}
        # names and shapes from the family's adapter (the trainer's exporter uses the same)
        self.expected = self.adapter.hf_shapes(hf_config)
        self.moe = self.adapter.moe_shape(hf_config) if self.adapter.is_moe else None
        self.layer_names = [self.adapter.hf_layer_names(i, hf_config) for i in range(s.layers)]
        self.expert_names = {i: [self.adapter.hf_expert_names(i, e) for e in range(self.moe.experts)]
                             for i, moe in enumerate(self.moe.moe_layers) if moe} if self.moe else {}
        self._load_initial(state)

    @torch.no_grad()
    def _load_initial(self, state: Mapping[str, torch.Tensor]) -> None:
        """The checkpoint the engine starts from: every tensor the family's adapter names, each
        name and shape checked before anything is kept (``ValueError``); rotary frequencies and
        a tied ``lm_head`` are not kept. Updates load through ``load_like_sglang``."""
        named = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.tied:
            named.pop(self.adapter.HF_LM_HEAD, None)
        unknown = sorted(set(named) - set(self.expected))
        if unknown:
            raise ValueError(f"unknown weight names: {unknown[:8]}")
        missing = sorted(set(self.expected) - set(named))
        if missing:
            raise ValueError(f"missing weights: {missing[:8]}")
        for name, tensor in named.items():
            self.check_size(name, tensor)
        self.params = {name: t.detach().to(self.dtype).clone().contiguous()
                       for name, t in named.items()}

    @torch.no_grad()
    def load_like_sglang(self, named: Mapping[str, torch.Tensor]) -> int:
        """Whole Hugging Face tensors as SGLang 0.5.23's ``load_weights`` takes them (a flattened
        bucket, a broadcast, a checkpoint), in order: a name the model has no parameter for is
        skipped (``sglang_name``), so an update of names the model does not have succeeds and
        changes nothing; a tensor of another size raises ``ValueError`` (SGLang's weight loader
        asserts: the twin refuses every size that differs, where SGLang's fused loaders cut or
        zero-pad rows of q/k/v, gate/up and experts) with the tensors before it written, as
        SGLang's are. Returns how many tensors were written."""
        written = 0
        for name, tensor in named.items():
            name = self.sglang_name(name)
            if name is not None:
                self.check_size(name, tensor)
                self.params[name].copy_(tensor)
                written += 1
        return written

    def sglang_name(self, name: str) -> Optional[str]:
        """The parameter SGLang 0.5.23's ``load_weights`` loads ``name`` into (its Hugging Face
        name here), or None where it skips it: rotary frequencies, a layer the model does not
        have, an extra bias silently; a tied ``lm_head`` and any other name with a warning
        (Llama's lm_head and Qwen3-MoE's names silently). Qwen3 adds ``model.`` to a name that
        lacks it, and raises (``ValueError``, the text of SGLang's ``KeyError``) for a name
        it has no parameter for that holds a fused parameter's part."""
        family = getattr(self.config, "model_type", "")
        if family == "qwen3" and name.startswith(("layers.", "embed_tokens.", "norm.")):
            name = "model." + name
        layer = _LAYER_ID.search(name)
        if any(s in name for s in SGLANG_SILENT_SKIPS) or (
                layer is not None and int(layer.group(1)) >= self.shape.layers):
            return None
        if name in self.expected and not (self.tied and name == self.adapter.HF_LM_HEAD):
            return name
        if name.endswith(".bias"):
            return None
        renamed = name  # renamed by each fused part it holds, in SGLang's order
        for fused, part in SGLANG_STACKED:
            if part in renamed:
                renamed = renamed.replace(part, fused)
                if family == "qwen3":
                    raise ValueError(repr(renamed))
        if family != "qwen3_moe" and not (family == "llama" and name == self.adapter.HF_LM_HEAD):
            logger.warning("Parameter %s not found in params_dict", renamed)
        return None

    def check_size(self, name: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.expected[name]:
            raise ValueError(f"Attempted to load weight ({tuple(tensor.shape)}) into parameter "
                             f"({self.expected[name]}) {name}")

    def new_kv_cache(self, capacity_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        size = (s.layers, capacity_tokens, s.groups, s.head_dim)
        return torch.zeros(size, dtype=self.dtype), torch.zeros(size, dtype=self.dtype)

    @torch.no_grad()
    def forward(self, new_tokens: Sequence[Sequence[int]], slot_tables: Sequence[torch.Tensor],
                cached_lens: Sequence[int], kv: Tuple[torch.Tensor, torch.Tensor],
                all_logits: bool = False, routed_out: Optional[list] = None):
        """Logits (fp32) of the last new token of each request, [R, vocab]; with
        ``all_logits`` a list of [new tokens, vocab] per request (prompt log-probs).

        ``routed_out`` (MoE models): receives, per request, the experts each new token was
        routed to, int32 [new tokens, layers, top-k], SGLang's ``routed_experts`` layout (0 in
        dense layers: SGLang's capture buffer is zero-filled and only MoE layers write it).

        Request r's KV lives in the cache slots ``slot_tables[r]`` (a paged layout: position i
        in slot ``slot_tables[r][i]``); its first ``cached_lens[r]`` positions hold its past,
        and its new tokens are written to the positions right after them.
        """
        s, p = self.shape, self.params
        k_cache, v_cache = kv
        R = len(new_tokens)
        n_new = [len(t) for t in new_tokens]
        q_max, total = max(n_new), [c + n for c, n in zip(cached_lens, n_new)]
        l_max = max(total)
        tokens = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long)
        positions = torch.tensor([c + i for c, n in zip(cached_lens, n_new) for i in range(n)])
        slots = torch.cat([table[c:c + n] for table, c, n in zip(slot_tables, cached_lens, n_new)])
        # Padded views: [R, q_max] index of each new token in the flat batch; [R, l_max] slots.
        row_of = torch.repeat_interleave(torch.arange(R), torch.tensor(n_new))
        col_of = torch.cat([torch.arange(n) for n in n_new])
        key_slots = torch.zeros(R, l_max, dtype=torch.long)
        for r, (table, t) in enumerate(zip(slot_tables, total)):
            key_slots[r, :t] = table[:t]
        key_valid = torch.arange(l_max).unsqueeze(0) < torch.tensor(total).unsqueeze(1)
        q_pos = torch.full((R, q_max), -1, dtype=torch.long)
        q_pos[row_of, col_of] = positions
        allowed = (torch.arange(l_max).view(1, 1, l_max) <= q_pos.unsqueeze(-1)) & key_valid.unsqueeze(1)
        allowed |= (q_pos < 0).unsqueeze(-1) & (torch.arange(l_max) == 0).view(1, 1, -1)  # pad rows
        mask = allowed.unsqueeze(1)  # [R, 1, q_max, l_max]

        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(self.dtype).unsqueeze(1), emb.sin().to(self.dtype).unsqueeze(1)

        a = self.adapter
        x = F.embedding(tokens, p[a.HF_EMBED])
        rep = s.heads // s.groups
        routed = torch.zeros((len(tokens), s.layers, self.moe.topk), dtype=torch.int32) \
            if self.moe is not None and routed_out is not None else None
        for i in range(s.layers):
            n = self.layer_names[i]
            h = _rms_norm(x, p[n["input_norm"]], self.eps)
            q = F.linear(h, p[n["q_proj"]], p[n["q_bias"]] if "q_bias" in n else None)
            k = F.linear(h, p[n["k_proj"]], p[n["k_bias"]] if "k_bias" in n else None)
            v = F.linear(h, p[n["v_proj"]], p[n["v_bias"]] if "v_bias" in n else None)
            q = q.view(-1, s.heads, s.head_dim)
            k = k.view(-1, s.groups, s.head_dim)
            v = v.view(-1, s.groups, s.head_dim)
            if "q_norm" in n:
                q = _rms_norm(q, p[n["q_norm"]], self.eps)
                k = _rms_norm(k, p[n["k_norm"]], self.eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k_cache[i, slots] = k
            v_cache[i, slots] = v
            qp = torch.zeros(R, q_max, s.heads, s.head_dim, dtype=self.dtype)
            qp[row_of, col_of] = q
            keys = k_cache[i][key_slots]  # [R, l_max, groups, d]
            values = v_cache[i][key_slots]
            if rep > 1:
                keys = keys.repeat_interleave(rep, dim=2)
                values = values.repeat_interleave(rep, dim=2)
            out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys.transpose(1, 2),
                                                 values.transpose(1, 2), attn_mask=mask)
            out = out.transpose(1, 2)[row_of, col_of].reshape(-1, s.heads * s.head_dim)
            x = x + F.linear(out, p[n["o_proj"]])
            h = _rms_norm(x, p[n["post_attention_norm"]], self.eps)
            if "router" in n:
                out, top = self._moe_mlp(i, h)
                if routed is not None:
                    routed[:, i] = top.to(torch.int32)
                x = x + out
                continue
            gate = F.linear(h, p[n["gate_proj"]])
            up = F.linear(h, p[n["up_proj"]])
            x = x + F.linear(F.silu(gate) * up, p[n["down_proj"]])
        head = p[a.HF_EMBED] if self.tied else p[a.HF_LM_HEAD]
        if routed is not None:
            routed_out.extend(torch.split(routed, n_new))
        if all_logits:
            logits = F.linear(_rms_norm(x, p[a.HF_FINAL_NORM], self.eps), head).float()
            return list(torch.split(logits, n_new))
        last = torch.tensor(n_new).cumsum(0) - 1
        h = _rms_norm(x[last], p[a.HF_FINAL_NORM], self.eps)
        return F.linear(h, head).float()

    def _moe_mlp(self, i: int, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-MoE's sparse block: softmax router (fp32), top-k, renormalised when
        ``norm_topk_prob``; each expert runs on the tokens routed to it. Returns the output and
        the chosen experts [tokens, k] (in descending score order)."""
        p, m = self.params, self.moe
        logits = F.linear(h.float(), p[self.layer_names[i]["router"]].float())
        probs = torch.softmax(logits, dim=-1)
        weights, top = torch.topk(probs, m.topk, dim=-1)
        if m.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e, names in enumerate(self.expert_names[i]):
            rows, slot = torch.nonzero(top == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            x = h[rows]
            y = F.linear(F.silu(F.linear(x, p[names["gate_proj"]])) * F.linear(x, p[names["up_proj"]]),
                         p[names["down_proj"]])
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
        return out, top


def load_decoder(model_dir: str, dtype=torch.float32) -> DecoderLM:
    from ..models.hf import load_hf_config, load_hf_state_dict

    return DecoderLM(load_hf_config(model_dir), load_hf_state_dict(model_dir), dtype=dtype)


__all__: List[str] = ["DecoderLM", "load_decoder", "rope_inv_freq"]
