"""Entry point: ``python -m laminar_mcore.launch [hydra overrides]``.

Composes the run config from ``conf/`` (checked against the schemas), validates it before any
process starts, then runs the chosen job. ``--cfg job`` prints the composed config.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from ..config import ConfigError, register_configs, validate_config
from ..config.overrides import check_overrides
from . import CONF_DIR

register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        validate_config(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if cfg.job == "plan":
        from .plan import run_plan

        run_plan(cfg)
    elif cfg.job == "smoke":
        from .smoke import run_smoke

        run_smoke(cfg)
    elif cfg.job == "train":
        from ..config.gpu_map import GpuMapError
        from .train import run_train

        try:
            summary = run_train(cfg)
        except GpuMapError as exc:  # this machine's GPUs cannot hold the roles apart
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        from ..bench.reference import compare  # the stored sync run of the same job, if any

        compare(cfg, summary, f"{cfg.output_dir}/{cfg.run_name}")
    else:  # the multi-node roles, each its own process
        from ..rollout.node import NodeError
        from .cluster import ClusterError, run_role

        try:
            run_role(cfg.job, cfg)
        except (ClusterError, NodeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)


def cli() -> None:
    try:
        check_overrides(sys.argv[1:], CONF_DIR)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
