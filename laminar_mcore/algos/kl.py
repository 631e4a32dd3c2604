"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3), as verl's
``kl_penalty``: ``k1``/``kl`` = log pi - log ref, ``abs`` = |k1|, ``k2``/``mse`` = k1^2 / 2,
``k3``/``low_var_kl`` = exp(-k1) + k1 - 1 (k1 clamped to [-20, 20], the result to [-10, 10]).
A ``+`` suffix (``k1+``, ``k3+``) keeps the value but takes the gradient of k2, which is the
unbiased gradient of KL (verl's straight-through trick).

Nothing in the trainer uses it yet: a KL penalty needs a reference model's log-probs, which the
trainer does not compute (there is no reference model in the run).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of ``kind`` (see the module docstring), differentiable."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)} "
                         "(each with an optional '+')")
    value = _forward(logprob, ref_logprob, base)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def _forward(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    if kind in ("k1", "kl"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # k3, for stability
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
