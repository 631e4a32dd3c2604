"""RL algorithms over plain tensors: advantage estimators and the decoupled PPO loss.

Nothing here knows about Megatron or engines; the trainer feeds these functions flat per-token
tensors, and users can call them with their own estimators.
"""

from .advantages import get_advantage_fn, grpo_advantages, register_advantage
from .ppo import decoupled_ppo_loss, decoupled_ppo_token_terms, finalize_stats

__all__ = ["decoupled_ppo_loss", "decoupled_ppo_token_terms", "finalize_stats",
           "grpo_advantages", "get_advantage_fn", "register_advantage"]
