"""Rollout tier: SGLang-protocol client, the built-in CPU engine, engine launchers.

Engine code never imports the trainer; it meets it only in ``laminar_mcore.weights`` formats
and ``laminar_mcore.data`` types.
"""
