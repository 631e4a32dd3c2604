"""Relay processes for the launchers, tests and benchmarks."""

from __future__ import annotations

import sys
from typing import List

from ..netutil import TOKEN_ENV
from ..server_process import ServerProcess
from .server import RelayConfig


class RelayProcess(ServerProcess):
    """One relay process (start, wait for /health, stop)."""

    what = "relay"


def relay_command(cfg: RelayConfig, python: str = sys.executable) -> List[str]:
    """The relay's command line: its whole config as JSON, except the token, which the process
    takes from ``relay_env(cfg)`` (``LAMINAR_RUN_TOKEN``; a token on a command line is readable
    by every user of the machine)."""
    return [python, "-m", "laminar_mcore.relay", "--config-json", cfg.to_json()]


def relay_env(cfg: RelayConfig) -> dict:
    return {TOKEN_ENV: cfg.token}


def relay_process(cfg: RelayConfig, log_path: str) -> RelayProcess:
    """The relay ``cfg`` as a process (not started)."""
    return RelayProcess(relay_command(cfg), log_path=log_path, host=cfg.host,
                        env=relay_env(cfg), port_key="LAMINAR_RELAY_PORT")
