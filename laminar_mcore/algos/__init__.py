"""RL algorithms over plain tensors: advantage estimators, policy losses, loss aggregation.

Nothing here knows about Megatron or engines; the trainer feeds these functions flat per-token
tensors, and users can call them with their own estimators. The registries use verl's names:

    advantage_fn(name)(rewards, group_ids, *, lengths=None, std_normalize=True,
                       leave_one_out=False, eps=1e-6) -> per-trajectory advantages
    policy_loss_fn(name)(logprobs, prox_logprobs, behav_logprobs, advantages, loss_mask, *,
                         seq_ids=None, behav_imp_weight_cap=None, cap_mode="mask",
                         cap_level="token", **options) -> (per-token terms, stat sums)

(see ``advantages.py`` and ``losses.py``); ``aggregation.py`` turns per-token terms into a
batch's loss (verl's ``loss_agg_mode``s); ``kl.py`` holds the KL estimators and
``regularized_sums`` (the entropy bonus and the KL penalty against the reference policy, added
to the policy loss as verl's ``ppo_loss`` adds them); ``spec.py`` holds the names and the valid
combinations, torch-free. The submodules load on first use, so that ``config/validate.py`` can
read ``spec`` without importing torch.
"""

from importlib import import_module

from .spec import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES,
                   algo_problems)

_EXPORTS = {
    "advantage_fn": "advantages", "get_advantage_fn": "advantages",
    "register_advantage": "advantages", "grpo_advantages": "advantages",
    "policy_loss_fn": "losses", "register_policy_loss": "losses",
    "policy_loss_options": "losses", "policy_loss": "losses",
    "decoupled_ppo_loss": "ppo", "decoupled_ppo_token_terms": "ppo", "finalize_stats": "ppo",
    "behaviour_weights": "ppo",
    "agg_loss": "aggregation", "aggregate_terms": "aggregation", "batch_counts": "aggregation",
    "denominator": "aggregation",
    "kl_penalty": "kl", "regularized_sums": "kl",
}

__all__ = sorted(_EXPORTS) + ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGG_MODES",
                              "POLICY_LOSSES", "algo_problems"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
