"""Loopback networking helpers and the engine protocol's error, shared by launchers, servers,
clients and tests (every role may import it; it imports no role)."""

from __future__ import annotations

import random
import socket
from typing import Optional

# The environment variable that carries the run's token to every process of a run.
TOKEN_ENV = "LAMINAR_RUN_TOKEN"


class EngineError(RuntimeError):
    """An engine answered with an error or could not be reached (raised by
    ``rollout.client.SGLangClient``; relays and the controller catch it without importing
    engine code)."""

    def __init__(self, endpoint: str, status: Optional[int], message: str):
        super().__init__(f"{endpoint}: {message}" + (f" (HTTP {status})" if status else ""))
        self.endpoint, self.status, self.message = endpoint, status, message


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, for a server that is told its port and binds it a moment later.

    It is taken *below* the kernel's ephemeral range: a port handed out by a port-0 bind could
    meanwhile become the local port of some outgoing connection, and the later bind would fail
    with EADDRINUSE. (Servers that can bind port 0 themselves should do that instead.)
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # fall back to the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def token_middleware(token: str, needs_token=lambda request: True):
    """The aiohttp middleware of our servers: a request for which ``needs_token(request)`` holds
    must carry ``Authorization: Bearer <token>`` (else 401), and a handler's ValueError,
    KeyError, TypeError or bad JSON is answered 400 -- the server keeps serving."""
    import json

    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        if needs_token(request) and request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": "missing or wrong run token"}, status=401)
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            return web.json_response({"error": f"bad request: {exc}"}, status=400)

    return middleware
