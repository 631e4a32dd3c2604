"""Rank 0's plan of one training batch: the advantages, which trajectories are worth a forward
and backward pass (``trainer.skip_zero_advantage``), and their balanced micro-batches per DP
rank, as batch indices.

Pure planning on Python values: it never touches torch.distributed, the model or the packed
tensors (``actor`` scatters the plan, ``packing`` packs it).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..algos import advantage_fn
from ..config.schema import AlgoConfig, TrainerConfig
from ..data.trajectory import Trajectory
from .packing import pad_multiple, padded_length, plan_microbatches


def plan_batch(trajectories: Sequence[Trajectory], algo: AlgoConfig, trainer: TrainerConfig,
               *, tp: int, cp: int, dp: int):
    """``(advantages, plan, skipped)``: ``plan[dp_rank][micro_batch]`` lists batch indices;
    ``skipped`` is ``skip_zero_advantage``'s (loss tokens, sequences) left out."""
    a = algo
    rewards = [t.reward for t in trajectories]
    if any(r is None for r in rewards):
        raise ValueError("every trajectory needs a reward before training on it")
    adv_fn = advantage_fn(a.advantage)
    adv = adv_fn(rewards, [t.group_id for t in trajectories],
                 lengths=[t.num_sampled for t in trajectories],
                 std_normalize=a.std_normalize, leave_one_out=a.leave_one_out).tolist()
    multiple = pad_multiple(tp, cp)
    keep, skipped = skip_zero_advantage(trajectories, adv, dp) \
        if trainer.skip_zero_advantage else (list(range(len(trajectories))), (0.0, 0.0))
    lengths = [padded_length(trajectories[i].num_tokens, multiple) for i in keep]
    plan = [[[keep[j] for j in mb] for mb in rank]
            for rank in plan_microbatches(lengths, trainer.max_tokens_per_microbatch, dp)]
    return adv, plan, skipped


def skip_zero_advantage(trajectories: Sequence[Trajectory], advantages: Sequence[float],
                        dp_size: int) -> Tuple[List[int], Tuple[float, float]]:
    """``trainer.skip_zero_advantage``: the trajectories worth a forward and backward pass.

    With no entropy or KL term (validated), a trajectory whose advantage is exactly 0 (in the
    float32 the loss reads: a group whose samples all got the same reward) adds exactly 0 to
    the loss and its gradient, so it is not run; its loss tokens (and sequence) still count in
    the batch's denominator, so the gradient is that of the whole batch. At least ``dp_size``
    trajectories are kept (the shortest zero-advantage ones), so that every DP rank has a
    micro-batch and an all-zero batch still makes its optimizer step. Returns the kept indices
    and the skipped (loss tokens, sequences with a loss token)."""
    zero = [i for i, a in enumerate(advantages) if float(torch.tensor(float(a),
                                                                  dtype=torch.float32)) == 0.0]
    zeros = set(zero)
    keep = [i for i in range(len(advantages)) if i not in zeros]
    if len(keep) < dp_size:
        zero.sort(key=lambda i: trajectories[i].num_tokens)
        keep += zero[:dp_size - len(keep)]
        keep.sort()
    kept = set(keep)
    skipped = [trajectories[i].num_sampled for i in zero if i not in kept]
    return keep, (float(sum(skipped)), float(sum(1 for n in skipped if n > 0)))
