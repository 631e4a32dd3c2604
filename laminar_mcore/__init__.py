"""laminar_mcore: trajectory-level asynchronous RL post-training (Laminar) with AReaL's decoupled
PPO, on Megatron-Core trainers and SGLang (or the built-in CPU engine) rollouts.

Importing the package is cheap: it imports neither torch nor Megatron. Subpackages own one role
each (see DESIGN.md): trainer code never imports engine code and engines never import the
trainer; they meet in ``laminar_mcore.weights`` formats and ``laminar_mcore.data`` types.
"""

__version__ = "0.1.0"
