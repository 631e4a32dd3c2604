"""Log-probs and entropy of target tokens from vocab-parallel logits, in fp32.

Each tensor-parallel rank holds logits for a slice of the vocabulary; the log-partition is
reduced over the TP group (max, then sums of exponentials), the target's logit comes from the
rank that owns it, and nothing ever gathers the vocabulary on one rank. The work is done by
``laminar_mcore.kernels.logprobs``: Triton on GPUs, the token-chunked torch path on CPU (peak
extra memory bounded by one chunk, whatever the number of tokens).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.logprobs import DEFAULT_CHUNK, logprobs_entropy


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *,
                            vocab_start: int = 0, group=None,
                            chunk_size: Optional[int] = DEFAULT_CHUNK
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) in fp32 of ``targets`` under ``logits`` [..., vocab/tp].

    ``vocab_start`` is the first vocabulary id of this rank's slice and ``group`` the tensor
    parallel group (None: the whole vocabulary is local). Differentiable w.r.t. ``logits``.
    """
    return logprobs_entropy(logits, targets, vocab_start, group, chunk_size)


def megatron_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                                     chunk_size: Optional[int] = DEFAULT_CHUNK):
    """The same, with this rank's vocab slice and TP group taken from Megatron's state."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    v_local = logits.shape[-1]
    return vocab_parallel_logprobs(logits, targets, vocab_start=tp_rank * v_local,
                                   group=parallel_state.get_tensor_model_parallel_group(),
                                   chunk_size=chunk_size)
