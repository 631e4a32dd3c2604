"""laminar_mcore: trajectory-level asynchronous RL post-training (Laminar) with AReaL's decoupled
PPO, on Megatron-Core trainers and SGLang (or the built-in CPU engine) rollouts.

Importing the package is cheap: it imports neither torch nor Megatron. One subpackage per role
(see DESIGN.md): ``trainer`` (Megatron-Core actor, export and publisher), ``relay`` (versions in
host memory, the chain, the weight transports), ``rollout`` (SGLang client, CPU engine, engine
launcher, a rollout node), ``controller`` (rollout manager, episodes, modes, books, REST API and
its client). ``launch`` only composes them. Trainer and engines never import each other; they
meet in ``laminar_mcore.weights`` formats and ``laminar_mcore.data`` types.
"""

__version__ = "0.1.0"

from . import import_cost as _import_cost  # noqa: E402  (megatron without its wandb import)

_import_cost.install()
