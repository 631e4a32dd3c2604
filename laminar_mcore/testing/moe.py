"""Mixture-of-experts fixtures for tests and the GPU check: a tiny Qwen3-MoE whose routers
sit on near ties, and trajectories as the CPU engine reports them (behaviour log-probs and
routed experts in SGLang's encoding)."""

from __future__ import annotations

import base64
from typing import List, Tuple

import torch

from ..data.trajectory import Trajectory


def near_tie_model(scale: float = 1e-10, seed: int = 3, **config) -> Tuple[object, dict]:
    """(config, Hugging Face state) of a tiny Qwen3-MoE whose routers score every expert within
    fp32's resolution of a probability: the softmax gives exact ties, so the engine (SGLang and
    transformers take the top-k of the softmax) and Megatron (with norm_topk_prob, the top-k
    of the logits) pick different experts for the same weights -- the case routing replay is
    for."""
    from ..models.hf import initial_hf_state, tiny_hf_config

    cfg = tiny_hf_config("qwen3_moe", **config)
    hf = initial_hf_state(type("M", (), {"path": None})(), cfg, seed)
    gen = torch.Generator().manual_seed(11)
    for i in range(cfg.num_hidden_layers):
        name = f"model.layers.{i}.mlp.gate.weight"
        if name in hf:
            hf[name] = torch.randn(hf[name].shape, generator=gen) * scale
    return cfg, hf


def engine_trajectories(cfg, hf, n: int = 6, seed: int = 4) -> List[Trajectory]:
    """Trajectories with the CPU engine's own behaviour log-probs (temperature 1) and routed
    experts (base64 int32 [positions, layers, top-k], as SGLang returns them)."""
    from ..rollout.model import DecoderLM

    engine = DecoderLM(cfg, hf)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        prompt = torch.randint(0, cfg.vocab_size, (5 + k,), generator=gen).tolist()
        response = torch.randint(0, cfg.vocab_size, (7 + 2 * k,), generator=gen).tolist()
        seq = prompt + response
        routed: list = []
        logits = engine.forward([seq[:-1]], [torch.arange(len(seq))], [0],
                                engine.new_kv_cache(len(seq)), all_logits=True,
                                routed_out=routed)[0]
        lps = torch.log_softmax(logits, -1)[len(prompt) - 1:].gather(
            1, torch.tensor(response)[:, None])[:, 0]
        out.append(Trajectory(
            prompt_ids=prompt, response_ids=response, behav_logprobs=lps.tolist(),
            weight_version=0, group_id=f"g{k // 2}", reward=float(k % 2), uid=f"t{k}",
            routed_experts=[base64.b64encode(routed[0].numpy().tobytes()).decode()]))
    return out
