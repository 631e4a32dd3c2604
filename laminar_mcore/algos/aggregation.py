"""verl's loss aggregation modes over flat per-token terms, split-independent by construction.

With per-token loss terms ``l_t`` (0 where masked), ``n_i`` the loss tokens of sequence ``i``
and ``N_tok`` / ``N_seq`` the loss tokens / the sequences with at least one loss token of the
*whole* batch (all micro-batches of all data-parallel ranks):

    token-mean               sum_t l_t / N_tok                    (today's default, AReaL's)
    token-sum                sum_t l_t
    seq-mean-token-sum       sum_i (sum_{t in i} l_t) / N_seq
    seq-mean-token-sum-norm  sum_i (sum_{t in i} l_t) / (N_seq * loss_scale_factor)  (Dr. GRPO)
    seq-mean-token-mean      sum_i (sum_{t in i} l_t / n_i) / N_seq

Every mode is ``sum_t c_t l_t / D``: ``c_t`` depends only on the token's own sequence (which a
micro-batch always holds whole) and ``D`` only on global counts, so a micro-batch contributes
``aggregate_terms(...) / D`` and the sum over micro-batches and ranks is the loss of the whole
batch, whatever the split. ``aggregate_terms`` gives the numerator, ``batch_counts`` the counts
to all-reduce and ``denominator`` the ``D`` of the reduced counts. ``agg_loss`` is the whole
batch in one call (verl's ``agg_loss`` on a single batch).

As in verl, ``seq-mean-token-mean`` divides a sequence's sum by ``n_i + 1e-8``, and a sequence
without loss tokens counts in no mode's ``N_seq``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .spec import LOSS_AGG_MODES

Tensor = torch.Tensor


def check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")


def sequence_index(seq_ids: Tensor) -> Tuple[Tensor, int]:
    """Per token the index (0..n-1) of its sequence among the ``n`` distinct ``seq_ids``."""
    inverse = torch.unique(seq_ids, return_inverse=True)[1]
    return inverse, (int(inverse.max()) + 1 if inverse.numel() else 0)


def segment_sum(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Per-sequence sums of per-token ``values`` (``index`` from ``sequence_index``)."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _needs_sequences(mode: str) -> bool:
    return mode.startswith("seq-")


def aggregate_terms(terms: Tensor, loss_mask: Tensor, seq_ids: Optional[Tensor],
                    mode: str) -> Tensor:
    """The numerator ``sum_t c_t l_t`` of this micro-batch (differentiable). ``terms`` must be
    0 where ``loss_mask`` is; for every mode but seq-mean-token-mean it is ``terms.sum()``."""
    check_mode(mode)
    if mode != "seq-mean-token-mean":
        return terms.sum()
    if seq_ids is None:
        raise ValueError("loss_agg_mode=seq-mean-token-mean needs seq_ids (the sequence of "
                         "every token)")
    index, n = sequence_index(seq_ids)
    mask = loss_mask.to(terms.dtype)
    per_token_n = segment_sum(mask, index, n)[index]
    return (terms / (per_token_n + 1e-8)).sum()


def batch_counts(loss_mask: Tensor, seq_ids: Optional[Tensor]) -> Tuple[float, float]:
    """(loss tokens, sequences with a loss token) of this micro-batch, to sum over the batch.
    Without ``seq_ids`` the sequence count is 0 (the token modes do not need it)."""
    tokens = float(loss_mask.sum())
    if seq_ids is None:
        return tokens, 0.0
    index, n = sequence_index(seq_ids)
    per_seq = segment_sum(loss_mask.to(torch.float64), index, n)
    return tokens, float((per_seq > 0).sum())


def denominator(mode: str, tokens: float, sequences: float,
                loss_scale_factor: Optional[float] = None) -> float:
    """``D`` of the whole batch from its summed counts (never 0: an empty batch's loss is 0)."""
    check_mode(mode)
    if mode == "token-mean":
        return max(tokens, 1.0)
    if mode == "token-sum":
        return 1.0
    d = max(sequences, 1.0)
    if mode != "seq-mean-token-sum-norm":
        return d
    if loss_scale_factor is None or not loss_scale_factor > 0:
        raise ValueError("loss_agg_mode=seq-mean-token-sum-norm needs loss_scale_factor > 0 "
                         "(the constant every sequence's token sum is divided by)")
    return d * loss_scale_factor


def agg_loss(terms: Tensor, loss_mask: Tensor, seq_ids: Optional[Tensor], mode: str, *,
             loss_scale_factor: Optional[float] = None) -> Tensor:
    """The aggregated loss of one whole batch (verl's ``agg_loss`` with ``dp_size=1``)."""
    if _needs_sequences(mode) and seq_ids is None:
        raise ValueError(f"loss_agg_mode={mode} needs seq_ids (the sequence of every token)")
    tokens, sequences = batch_counts(loss_mask, seq_ids)
    return aggregate_terms(terms, loss_mask, seq_ids, mode) / denominator(
        mode, tokens, sequences, loss_scale_factor)
