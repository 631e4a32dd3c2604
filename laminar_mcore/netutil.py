"""Loopback networking helpers and the engine protocol's error, shared by launchers, servers,
clients and tests (every role may import it; it imports no role)."""

from __future__ import annotations

import hmac
import json
import math
import random
import re
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .errors import coded, error_body, split

# The environment variable that carries the run's token to every process of a run.
TOKEN_ENV = "LAMINAR_RUN_TOKEN"


def engine_api_key(token: str) -> str:
    """The API key a run's engines are started with (SGLang's ``--api-key``), derived from the
    run token: SGLang logs its server arguments, the key among them, at start-up, so the
    engines never see the token itself -- a leaked engine log opens the engines, not the run."""
    import hashlib

    return hmac.new(token.encode(), b"laminar engine api key", hashlib.sha256).hexdigest()


class EngineError(RuntimeError):
    """An engine answered with an error or could not be reached (raised by
    ``rollout.client.SGLangClient``; relays and the controller catch it without importing
    engine code). A code ``message`` starts with leads the whole; ``message`` is the rest (the
    engine's own words), ``code`` the code."""

    def __init__(self, endpoint: str, status: Optional[int], message: str):
        code, rest = split(message)
        text = f"{endpoint}: {rest}" + (f" (HTTP {status})" if status else "")
        super().__init__(coded(code, text) if code else text)
        self.endpoint, self.status, self.message, self.code = endpoint, status, rest, code


# HTTP answers of an engine that say the engine (or our configuration of it) is at fault, not
# the request: a wrong key (401, 403), a route it does not serve (404), "retry later" (429)
ENGINE_SIDE_4XX = (401, 403, 404, 429)


class RequestError(EngineError):
    """One request was refused by a working engine: SGLang's in-stream error chunk with a 4xx
    code (a prompt longer than the context, an invalid sampling parameter), an abort whose
    ``finish_reason.status_code`` is 4xx, or an HTTP 4xx other than ``ENGINE_SIDE_4XX``. The
    same request would be refused by every engine: it ends the request, never the engine, and
    is never retried elsewhere."""


def is_request_error(status) -> bool:
    """Whether an engine's HTTP status or error-chunk code refuses the request itself."""
    return (isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500
            and status not in ENGINE_SIDE_4XX)


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


class BadRequest(ValueError):
    """A request field that is missing, unknown, of the wrong type or out of range: answered
    400 with a message that names it (``field``: where in the request, e.g. ``publish.port``;
    empty for the body or query as a whole), under its error code (one for every malformed
    field)."""

    def __init__(self, field: str, problem: str, code: str = "LMC-E400"):
        super().__init__(coded(code, f"{field!r} {problem}" if field else problem))
        self.field, self.code = field, code


def error_response(status: int, code: str, message: str, **extra):
    """The JSON answer of our servers to a request they refuse: ``{"error": "<code>: <message>",
    "code": code, **extra}``."""
    from aiohttp import web

    return web.json_response(error_body(code, message, **extra), status=status)


INT64 = (-2**63, 2**63 - 1)


@dataclass(frozen=True)
class Field:
    """One field of a JSON body or query string, for ``check_fields``.

    ``kind``: int, number (int or float), str, url (an http(s) URL), bool, list, dict or any.
    Numbers must be finite and in ``[low, high]`` (ints: int64 by default); a str, list or dict
    has at most ``max_len`` characters, items or keys; ``item`` checks each list item,
    ``fields`` each key of a dict (None: any keys); ``choices``: the values allowed. An optional
    field that is absent or null is left out of the result."""

    kind: str
    required: bool = False
    low: Optional[float] = None
    high: Optional[float] = None
    max_len: int = 4096
    item: Optional["Field"] = None
    fields: Optional[Mapping[str, "Field"]] = None
    choices: Optional[tuple] = None


def _check(value: Any, spec: Field, name: str) -> Any:
    kind = spec.kind
    if kind in ("int", "number"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind == "int" and not isinstance(value, int)):
            raise BadRequest(name, f"must be {'an integer' if kind == 'int' else 'a number'}, "
                                   f"not {_shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(name, f"must be a finite number, not {value!r}")
        low, high = (spec.low, spec.high) if kind == "number" else (
            INT64[0] if spec.low is None else spec.low, INT64[1] if spec.high is None else spec.high)
        if (low is not None and value < low) or (high is not None and value > high):
            bound = (f"at most {high:g}" if low is None else f"at least {low:g}" if high is None
                     else f"in [{low:g}, {high:g}]")
            raise BadRequest(name, f"must be {bound}, not {_shown(value)}")
    elif kind in ("str", "url"):
        if not isinstance(value, str):
            raise BadRequest(name, f"must be a string, not {_shown(value)}")
        if len(value) > spec.max_len:
            raise BadRequest(name, f"is {len(value)} characters long; at most {spec.max_len}")
        if kind == "url" and not value.startswith(("http://", "https://")):
            raise BadRequest(name, f"must be an http(s) URL, not {_shown(value)}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise BadRequest(name, f"must be true or false, not {_shown(value)}")
    elif kind == "list":
        if not isinstance(value, list):
            raise BadRequest(name, f"must be a list, not {_shown(value)}")
        if len(value) > spec.max_len:
            raise BadRequest(name, f"has {len(value)} items; at most {spec.max_len}")
        if spec.item is not None:
            value = [_check(v, spec.item, f"{name}[{i}]") for i, v in enumerate(value)]
    elif kind == "dict":
        if not isinstance(value, dict):
            raise BadRequest(name, f"must be a JSON object, not {_shown(value)}")
        if len(value) > spec.max_len:
            raise BadRequest(name, f"has {len(value)} keys; at most {spec.max_len}")
        if spec.fields is not None:
            value = check_fields(value, spec.fields, prefix=f"{name}.")
    if spec.choices is not None and value not in spec.choices:
        raise BadRequest(name, f"must be one of {', '.join(map(str, spec.choices))}, "
                               f"not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_fields(data: Any, schema: Mapping[str, Field], prefix: str = "",
                 where: str = "the body") -> dict:
    """``data`` checked against ``schema`` (unknown, missing, mistyped or out-of-range fields
    raise ``BadRequest`` naming the field); the fields given, checked."""
    if not isinstance(data, dict):
        if prefix:
            raise BadRequest(prefix.rstrip("."), f"must be a JSON object, not {_shown(data)}")
        raise BadRequest("", f"{where} must be a JSON object, not {_shown(data)}")
    unknown = sorted(k for k in data if k not in schema)
    if unknown:
        raise BadRequest(prefix + str(unknown[0])[:80],
                         f"is not a field here (the fields: {', '.join(schema) or 'none'})")
    out = {}
    for key, spec in schema.items():
        value = data.get(key)
        if value is None:
            if spec.required:
                raise BadRequest(prefix + key, "is missing")
            continue
        out[key] = _check(value, spec, prefix + key)
    return out


async def read_json(request, schema: Mapping[str, Field],
                    query: Optional[Mapping[str, Field]] = None) -> dict:
    """The request's JSON object body checked against ``schema`` (no body: ``{}``), after its
    query string against ``query`` (None: it takes none). A body over the server's
    ``client_max_size`` is aiohttp's 413."""
    read_query(request, query or {})
    raw = await request.read() if request.can_read_body else b""
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise BadRequest("", f"the body is not JSON: {str(exc)[:200]}") from None
    return check_fields(data, schema)


def read_query(request, schema: Mapping[str, Field]) -> dict:
    """The request's query string checked against ``schema`` (numbers and bools parsed from
    their text; a ``list`` field may repeat, any other may not)."""
    query = request.query
    unknown = sorted(k for k in query if k not in schema)
    if unknown:
        raise BadRequest(unknown[0][:80], f"is not a query parameter here (the parameters: "
                                          f"{', '.join(schema) or 'none'})")
    out = {}
    for key, spec in schema.items():
        values = query.getall(key, [])
        if not values:
            if spec.required:
                raise BadRequest(key, "is missing from the query string")
            continue
        if spec.kind != "list" and len(values) > 1:
            raise BadRequest(key, "is given more than once")
        if spec.kind == "list":
            out[key] = _check(list(values), spec, key)
        else:
            out[key] = _check(_parse(values[0], spec, key), spec, key)
    return out


def _parse(text: str, spec: Field, name: str) -> Any:
    try:
        if spec.kind == "int":
            if not re.fullmatch(r"-?[0-9]{1,19}", text):
                raise ValueError
            return int(text)
        if spec.kind == "number":
            if not re.fullmatch(r"-?[0-9]{1,30}(\.[0-9]{0,30})?([eE][-+]?[0-9]{1,3})?", text):
                raise ValueError
            return float(text)
        if spec.kind == "bool":
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
    except (ValueError, KeyError):
        wanted = {"int": "an integer", "number": "a number"}.get(spec.kind, "true or false")
        raise BadRequest(name, f"must be {wanted}, not {_shown(text)}") from None
    return text


def bearer_ok(request, token: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (compared in constant
    time)."""
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "replace"),
                               f"Bearer {token}".encode("utf-8", "replace"))


def token_middleware(token: str, needs_token=lambda request: True,
                     closing: Optional[Callable[[], bool]] = None):
    """The aiohttp middleware of our servers: a request for which ``needs_token(request)`` holds
    must carry ``Authorization: Bearer <token>`` (else 401, before anything else is looked at:
    a caller without the token learns nothing, not even which paths exist); a handler's
    ``BadRequest`` (naming the field), ValueError, KeyError, TypeError, OverflowError or bad JSON
    is answered 400 -- the server keeps serving. ``closing()``: the server is shutting down;
    new requests but the open ones (``/health``) are answered 503. Every such answer carries
    its error code (``errors.error_body``)."""
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        guarded = needs_token(request)
        if guarded and not bearer_ok(request, token):
            return error_response(401, "LMC-E401", "missing or wrong run token (Authorization: "
                                                   f"Bearer ${TOKEN_ENV})")
        if guarded and closing is not None and closing():  # (/health still answers)
            return error_response(503, "LMC-E402", "shutting down")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:  # aiohttp's, over client_max_size
            return error_response(413, "LMC-E403", f"the request body is too large: {exc.text}")
        except web.HTTPException:
            raise
        except BadRequest as exc:
            return error_response(400, exc.code, f"bad request: {split(exc)[1]}",
                                  field=exc.field)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            code, message = split(exc)  # a handler's own code, if its error has one
            return error_response(400, code or "LMC-E400", f"bad request: "
                                  f"{type(exc).__name__}: {message[:300]}")

    return middleware


# ------------------------------------------------------------------ addresses across hosts
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve(host: str) -> str:
    """``host`` as an IP address (a name is looked up); ValueError naming it if it cannot be."""
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"LMC-E202: cannot resolve the host name {host!r}: {exc}") from None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve to them (Debian's and Ubuntu's
    ``127.0.1.1 <hostname>`` line included)."""
    import ipaddress

    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """0.0.0.0 or :: (bind to every interface; not an address another host can dial)."""
    return host in ("0.0.0.0", "::", "")


def route_source_address(target: str) -> str:
    """This host's address on its route to ``target`` (the kernel's choice; a UDP connect sends
    no packet). For this host's own address it is that address, not loopback."""
    address = resolve(target)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
        except OSError as exc:
            raise ValueError(f"LMC-E202: this host has no route to {target} ({address}): "
                             f"{exc}") from None
        return sock.getsockname()[0]


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface that holds ``address`` (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def pin_socket_interfaces(address: str, environ=None) -> Optional[str]:
    """Make gloo and NCCL open their sockets on the interface that holds ``address`` (this
    host's address on the route to its peers), by setting ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` where the user has not. Without them gloo binds the address the host
    name resolves to -- loopback where /etc/hosts maps the name to 127.0.1.1, and then no other
    host can connect. Returns the interface pinned (None: a loopback address, or none found)."""
    import os

    environ = os.environ if environ is None else environ
    if is_loopback(address) or is_unspecified(address):
        return None
    name = interface_of(resolve(address))
    if name is None:
        return None
    for key in SOCKET_IFNAME_ENVS:
        environ.setdefault(key, name)
    return name
