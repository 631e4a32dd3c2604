"""Launchers: the Hydra entry point, the local (one-machine) launcher, multi-node roles."""


from ..config.paths import conf_dir

CONF_DIR = conf_dir()

__all__ = ["CONF_DIR"]
