"""Command lines for relay processes (used by the local launcher, tests and benchmarks)."""

from __future__ import annotations

import sys
from typing import List, Optional


def relay_command(token: str, *, master: bool = False, master_url: Optional[str] = None,
                  trainer_stages: int = 1, host: str = "127.0.0.1", port: int = 0,
                  relay_id: Optional[str] = None, chunk_bytes: int = 0,
                  chain_chunks: Optional[int] = None, heartbeat_s: float = 0.5,
                  mooncake_protocol: Optional[str] = None, mooncake_device: str = "",
                  publish_backend: str = "auto", relay_device: str = "auto",
                  python: str = sys.executable) -> List[str]:
    """``chunk_bytes=0`` lets the relay size chunks from Laminar's T(p, k) model (or from
    ``chain_chunks``, the ``weight_sync.chain_chunks`` config)."""
    cmd = [python, "-m", "laminar_mcore.relay", "--token", token, "--host", host, "--port",
           str(port), "--chunk-bytes", str(chunk_bytes), "--heartbeat-s", str(heartbeat_s),
           "--relay-device", relay_device]
    if chain_chunks:
        cmd += ["--chain-chunks", str(chain_chunks)]
    if master:
        cmd += ["--master", "--trainer-stages", str(trainer_stages),
                "--publish-backend", publish_backend]
    else:
        cmd += ["--master-url", str(master_url)]
    if relay_id:
        cmd += ["--relay-id", relay_id]
    if mooncake_protocol:
        cmd += ["--mooncake-protocol", mooncake_protocol]
        if mooncake_device:
            cmd += ["--mooncake-device", mooncake_device]
    return cmd
