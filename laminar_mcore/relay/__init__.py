"""Relay tier: versioned weights in shared host memory, chain broadcast, pull-anytime.

Relays never import trainer or engine code: they move flattened buckets (``laminar_mcore.weights``).
"""
