"""Relay tier: versioned weights in shared host memory, chain broadcast, pull-anytime, and the
weight transports that take a leased version to an engine (``relay/transports``).

Relays never import trainer or engine code: they move flattened buckets (``laminar_mcore.weights``).
"""
