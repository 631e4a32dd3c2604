"""Loopback networking helpers shared by launchers, servers and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (servers that can bind port 0 should do that instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
