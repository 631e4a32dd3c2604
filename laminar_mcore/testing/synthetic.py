"""Deterministic synthetic trajectories for tests and benchmarks (no engine involved)."""

from __future__ import annotations

from typing import List

import torch

from ..data.trajectory import Trajectory


def random_trajectories(n_groups: int, group_size: int, vocab: int, *, seed: int = 0,
                        prompt_len=(3, 9), response_len=(1, 14), version: int = 0) -> List[Trajectory]:
    """GRPO groups with random prompts/responses, rewards and plausible behaviour log-probs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(n_groups):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        for k in range(group_size):
            r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=gen))
            response = torch.randint(0, vocab, (r,), generator=gen).tolist()
            behav = (-torch.rand(r, generator=gen) * 3.0 - 3.5).tolist()  # around log(1/vocab)
            reward = float(torch.randint(0, 2, (1,), generator=gen))
            out.append(Trajectory(prompt_ids=prompt, response_ids=response, behav_logprobs=behav,
                                  weight_version=version, group_id=f"g{g}", reward=reward,
                                  finish_reason="stop", uid=f"g{g}-{k}"))
    return out
