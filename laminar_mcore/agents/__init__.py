"""Agents: multi-turn, tool-using episodes written as ordinary OpenAI-client code. This package
owns the agent episode and runner (``episode``: an agent per trajectory, its reward, its
evaluation), the OpenAI-compatible gateway that turns each model call into one exact-token turn
of a trajectory (``gateway``), the tool sandbox in which model-written code runs (``sandbox``,
``sandbox_child``) and the agents that ship with laminar_mcore (``builtin``). It is the
controller's episode plug-in for ``data.agent`` (``controller/episode.py``'s
``EPISODE_PLUGINS``): it may import the controller's episode interface (``Discard``,
``Stopped``, ``Episode``) and neutral types (``data/``), but the controller never imports it, and
no trainer, relay or engine code does.
"""
