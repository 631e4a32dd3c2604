"""The Megatron-Core actor: model building, packed batches, log-probs, train step, publish hook.

Trainer code never imports engine code (``laminar_mcore.rollout``); it meets the engines only in
``laminar_mcore.weights`` formats and ``laminar_mcore.data`` types.
"""
