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


def _source_tree_subpackages() -> None:
    """From a source checkout without ``pip install -e .`` (a PYTHONPATH of the repository root),
    the top-level ``kernels/`` and ``conf/`` are ``laminar_mcore.kernels`` / ``laminar_mcore.conf``
    as setup.py's ``package_dir`` installs them: a meta-path finder for exactly those two names,
    appended last, so an installed or editable copy is found first and is never shadowed."""
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    dirs = {f"{__name__}.{n}": os.path.join(root, n) for n in ("kernels", "conf")}
    if (any(os.path.isdir(os.path.join(here, n)) for n in ("kernels", "conf"))
            or not os.path.isfile(os.path.join(root, "conf", "config.yaml"))
            or not all(os.path.isfile(os.path.join(d, "__init__.py")) for d in dirs.values())
            or any(getattr(f, "_laminar_dirs", None) == dirs for f in sys.meta_path)):
        return  # an installed layout, not this source tree, or already registered

    class _SourceTreeFinder:
        _laminar_dirs = dirs

        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            d = dirs.get(fullname)
            return d and importlib.util.spec_from_file_location(
                fullname, os.path.join(d, "__init__.py"), submodule_search_locations=[d])

    sys.meta_path.append(_SourceTreeFinder)


_source_tree_subpackages()
