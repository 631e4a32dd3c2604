"""Language-model loss through Megatron's forward-backward schedule (any TP x PP layout).

The supervised objective the warm-up uses and the parallel-equivalence checks run: mean token
cross-entropy over a batch split into micro-batches. The schedule is Megatron's own, so pipeline
parallelism works; the result is the same whatever the layout or micro-batch split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist


@dataclass
class LMMicroBatch:
    tokens: torch.Tensor  # [b, s] input ids
    labels: torch.Tensor  # [b, s] next-token ids
    loss_mask: torch.Tensor  # [b, s] 1.0 where the token counts


def split_micro_batches(tokens: torch.Tensor, loss_mask: torch.Tensor,
                        micro_batch_size: int) -> List[LMMicroBatch]:
    """[B, S+1] token rows -> micro-batches of next-token prediction on S positions."""
    inputs, labels, mask = tokens[:, :-1], tokens[:, 1:], loss_mask[:, 1:].float()
    return [LMMicroBatch(inputs[i:i + micro_batch_size], labels[i:i + micro_batch_size],
                         mask[i:i + micro_batch_size])
            for i in range(0, tokens.shape[0], micro_batch_size)]


def lm_forward_backward(model, micro_batches: List[LMMicroBatch], *,
                        forward_only: bool = False) -> float:
    """Run the schedule; return the batch's mean token loss on every rank of the model group."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_mb = len(micro_batches)
    total_tokens = float(sum(mb.loss_mask.sum().item() for mb in micro_batches))
    if total_tokens == 0:
        raise ValueError("the batch has no token with loss_mask=1")

    from ..parallel import device

    dev = device()

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        mb = LMMicroBatch(mb.tokens.to(dev), mb.labels.to(dev), mb.loss_mask.to(dev))
        positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device)
        positions = positions.unsqueeze(0).expand_as(mb.tokens)
        output = model(mb.tokens, positions, None, labels=mb.labels)

        def loss_func(token_losses):
            loss_sum = (token_losses.float() * mb.loss_mask).sum()
            # The schedule divides by the number of micro-batches; scale so that the gradient
            # is that of the batch's mean over all of its tokens, however it is split.
            loss = loss_sum * (num_mb / total_tokens)
            return loss, {"loss_sum": loss_sum.detach().clone()}

        return output, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=num_mb, seq_length=micro_batches[0].tokens.shape[1],
        micro_batch_size=micro_batches[0].tokens.shape[0], forward_only=forward_only)

    loss = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        loss += sum(float(r["loss_sum"]) for r in results) / total_tokens
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(loss, src=last, group=pp_group)
    return float(loss.item())
