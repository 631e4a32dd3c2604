"""Rewards: pluggable functions (by dotted path) scored in a process pool."""

from .service import RewardService, load_reward_fn

__all__ = ["RewardService", "load_reward_fn"]
