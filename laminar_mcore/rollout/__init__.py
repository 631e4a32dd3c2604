"""Rollout tier: SGLang-protocol client, the built-in CPU engine, engine launchers, a rollout
node (``node.run``: its relay and engines, or engines and a pull agent without a relay).

Engine code never imports the trainer; it meets it only in ``laminar_mcore.weights`` formats
and ``laminar_mcore.data`` types.
"""
