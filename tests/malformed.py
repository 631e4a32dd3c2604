"""One table of malformed requests for every HTTP server of a run (relay, controller, CPU engine).

A server's tests describe its endpoints once, as ``Endpoint`` lines (method, path, a well-formed
body or query and the kind of each field), and call ``check_server(base_url, token, endpoints)``.
It sends every endpoint every malformed variant ``cases`` derives -- non-JSON, JSON of the wrong
type, nesting too deep, bytes that are not UTF-8, unknown and missing fields, each field of the
wrong type, numbers JSON cannot hold (1e309), NaN and Infinity, negative and huge integers, huge
strings and lists, a body over the server's ``client_max_size``, bad query strings, missing and
wrong tokens, wrong methods -- and returns what went wrong: an answer that is not the 4xx the
case expects, or whose message does not name the field (or say what is wrong). A 5xx, a hang or
a closed connection is a failure, and so is a server that no longer answers ``/health`` after.

A new endpoint is covered by adding one line to its server's list; a new kind of malformed
input by adding it to ``cases``.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

# field kinds: how a well-formed value looks and which wrong values are sent instead
#   int     an integer (our servers take none below -1: -5 is out of range for every one)
#   number  a finite number, >= 0 and bounded (1e300 is out of range for every one)
#   str     a string (at most a few kB); url: an http(s) URL
#   list    a list (at most a few thousand items); list_str / list_int / list_url: of those
#   dict    a JSON object; bool: true or false
KINDS = ("int", "number", "str", "url", "bool", "list", "list_str", "list_int", "list_url",
         "dict")

MARK = "\u0000MALFORMED\u0000"  # replaced by a raw JSON text JSON itself cannot produce


@dataclass(frozen=True)
class Endpoint:
    """One endpoint: ``body`` a well-formed JSON body (None: it takes none), ``fields`` the
    kind of each body field (every key of ``body`` must be listed), ``required`` those it
    cannot do without; ``query`` a well-formed query's values and ``query_fields`` their
    kinds; ``open``: answered without the token (only method checks then)."""

    method: str
    path: str
    body: Optional[dict] = None
    fields: Mapping[str, str] = field(default_factory=dict)
    required: Tuple[str, ...] = ()
    query: Mapping[str, str] = field(default_factory=dict)
    query_fields: Mapping[str, str] = field(default_factory=dict)
    open: bool = False

    def url_path(self, query: Optional[Mapping[str, str]] = None, raw: str = "") -> str:
        q = dict(self.query if query is None else query)
        text = urllib.parse.urlencode(q)
        if raw:
            text = f"{text}&{raw}" if text else raw
        return self.path + (f"?{text}" if text else "")


@dataclass
class Case:
    """One malformed request and what it must get: a status in ``statuses`` and a message
    containing ``names`` (case-insensitive)."""

    name: str
    method: str
    path: str
    data: Optional[bytes]
    statuses: Tuple[int, ...]
    names: str
    headers: Dict[str, str] = field(default_factory=dict)
    token: bool = True


def _raw(body: dict, key: str, text: str) -> bytes:
    """``body`` as JSON with ``key``'s value replaced by the raw JSON text ``text``."""
    spoiled = dict(body)
    spoiled[key] = MARK
    return json.dumps(spoiled).replace(json.dumps(MARK), text).encode()


def _wrong_values(kind: str) -> List[Tuple[str, str]]:
    """(label, raw JSON text) of values a field of ``kind`` must refuse."""
    numbers = [("overflow 1e309", "1e309"), ("-1e309", "-1e309"), ("NaN", "NaN"),
               ("Infinity", "Infinity"), ("-Infinity", "-Infinity")]
    if kind == "int":
        return [("string", '"7"'), ("float", "1.5"), ("bool", "true"), ("list", "[1]"),
                ("object", "{}"), ("negative", "-5"), ("huge int", str(10**30)),
                ("huge negative int", str(-10**30))] + numbers
    if kind == "number":
        return [("string", '"7"'), ("bool", "true"), ("list", "[1]"), ("negative", "-5"),
                ("huge number", "1e300"), ("huge int", str(10**30))] + numbers
    if kind in ("str", "url"):
        out = [("int", "7"), ("bool", "false"), ("list", '["a"]'), ("object", "{}"),
               ("NaN", "NaN"), ("huge string", json.dumps("x" * 300_000))]
        if kind == "url":
            out.append(("not a URL", '"file:///etc/passwd"'))
        return out
    if kind == "bool":
        return [("string", '"yes"'), ("int", "1"), ("list", "[]")]
    if kind.startswith("list"):
        out = [("string", '"a"'), ("int", "3"), ("object", "{}"),
               ("huge list", json.dumps([0] * 100_000))]
        if kind in ("list_str", "list_url"):
            out.append(("list of ints", "[7]"))
        if kind == "list_url":
            out.append(("list of non-URLs", '["ftp://x"]'))
        if kind == "list_int":
            out += [("list of strings", '["x"]'), ("list with 1e309", "[1e309]"),
                    ("list with NaN", "[NaN]"), ("list with a negative", "[-5]")]
        return out
    if kind == "dict":
        return [("string", '"a"'), ("int", "3"), ("list", "[]")]
    raise ValueError(f"unknown field kind {kind!r}")


def _wrong_query_values(kind: str) -> List[Tuple[str, str]]:
    """(label, raw query value) of values a query parameter of ``kind`` must refuse."""
    if kind in ("int", "number"):
        return [("text", "soon"), ("empty", ""), ("nan", "nan"), ("inf", "inf"),
                ("-inf", "-inf"), ("1e309", "1e309"), ("negative", "-5"),
                ("huge", "9" * 40), ("bad percent-encoding", "%ff%fe"),
                ("hex", "0x10")] + ([("float", "1.5")] if kind == "int" else [])
    if kind in ("url", "list_url"):
        return [("not a URL", "ftp%3A%2F%2Fx"), ("huge", "http%3A%2F%2F" + "x" * 20_000)]
    if kind == "bool":
        return [("text", "yes"), ("empty", ""), ("number", "2"), ("huge", "x" * 20_000)]
    return [("huge", "x" * 20_000)]


def cases(ep: Endpoint, max_body: int = 1 << 20) -> Iterator[Case]:
    """Every malformed variant of a request to ``ep``."""
    m, path = ep.method, ep.url_path()
    other = "POST" if m == "GET" else "GET"
    yield Case("wrong method", other, path, b"{}" if other == "POST" else None, (405,),
               "method not allowed", token=True)
    yield Case("method PUT", "PUT", path, b"{}", (405,), "method not allowed")
    if ep.open:
        return
    body = json.dumps(ep.body).encode() if ep.body is not None else None
    for label, headers in [("no token", {}), ("wrong token", {"Authorization": "Bearer wrong"}),
                           ("token without Bearer", None), ("token with a suffix", None),
                           ("Basic scheme", None), ("empty bearer", {"Authorization": "Bearer "})]:
        yield Case(label, m, path, body, (401,), "token", headers=headers or {}, token=False)
    # query strings
    yield Case("unknown query parameter", m, ep.url_path(raw="zz_unknown=1"), body, (400,),
               "zz_unknown")
    for name, kind in ep.query_fields.items():
        for label, value in _wrong_query_values(kind):
            query = {k: v for k, v in ep.query.items() if k != name}
            raw = f"{name}={value}"
            yield Case(f"query {name}: {label}", m, ep.url_path(query, raw), body, (400,), name)
        if not kind.startswith("list"):
            good = ep.query.get(name, "1")
            yield Case(f"query {name} twice", m, ep.url_path(
                {k: v for k, v in ep.query.items() if k != name}, f"{name}={good}&{name}={good}"),
                body, (400,), name)
    if ep.body is None:
        return
    # bodies
    for label, data in [("not JSON", b"{not json"), ("a JSON list", b"[1, 2]"),
                        ("a JSON string", b'"text"'), ("a JSON number", b"3"),
                        ("JSON null", b"null"), ("truncated JSON", body[:-1] or b"{"),
                        ("not UTF-8", b'{"a": "\xff\xfe"}'),
                        ("nesting too deep", b"[" * 100_000 + b"]" * 100_000)]:
        yield Case(label, m, path, data, (400,), "json")
    yield Case("unknown field", m, path, json.dumps({**ep.body, "zz_unknown": 1}).encode(),
               (400,), "zz_unknown")
    for name in ep.required:
        rest = {k: v for k, v in ep.body.items() if k != name}
        yield Case(f"missing {name}", m, path, json.dumps(rest).encode(), (400,), name)
        yield Case(f"{name} null", m, path, json.dumps({**rest, name: None}).encode(), (400,),
                   name)
    for name, kind in ep.fields.items():
        for label, text in _wrong_values(kind):
            yield Case(f"{name}: {label}", m, path, _raw(ep.body, name, text), (400,), name)
    pad = max_body + 1024
    yield Case("body over client_max_size", m, path,
               b'{"pad": "' + b"x" * pad + b'"}', (413,), "body")


def send(base_url: str, case: Case, token: str, timeout: float = 30.0) -> Tuple[int, str]:
    """(status, text) of ``case``; (0, why) when no HTTP answer came."""
    parts = urllib.parse.urlsplit(base_url)
    headers = {"Content-Type": "application/json", **case.headers}
    if case.token:
        headers["Authorization"] = f"Bearer {token}"
    elif case.name == "token without Bearer":
        headers["Authorization"] = token
    elif case.name == "token with a suffix":
        headers["Authorization"] = f"Bearer {token}x"
    elif case.name == "Basic scheme":
        headers["Authorization"] = f"Basic {token}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        try:
            conn.request(case.method, case.path, body=case.data, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a server refusing a huge body may close before reading all of it
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"no answer: {exc!r}"
    finally:
        conn.close()


def check_server(base_url: str, token: str, endpoints: Sequence[Endpoint], *,
                 health: str = "/health", max_body: int = 1 << 20,
                 timeout: float = 30.0, twin: bool = False) -> List[str]:
    """Send every case of every endpoint; the failures, one line each (empty: all good).

    ``twin``: the server is a twin of another's protocol (the CPU engine of SGLang 0.5.23),
    which refuses what that server refuses and accepts what it accepts -- SGLang ignores
    unknown fields and coerces some types (pydantic's lax mode) -- so a case passes with any
    answer below 500; a 5xx, a hang or a closed connection still fails, and so does a server
    that stops answering ``health``."""
    failures = []
    for ep in endpoints:
        unknown = set(ep.body or {}) - set(ep.fields)
        assert not unknown, f"{ep.path}: body fields without a kind: {unknown}"
        for case in cases(ep, max_body):
            status, text = send(base_url, case, token, timeout)
            where = f"{case.method} {ep.path} [{case.name}]"
            if twin and 200 <= status < 500 and not (case.token is False and status != 401):
                continue
            if status not in case.statuses:
                failures.append(f"{where}: HTTP {status} (expected {case.statuses}): "
                                f"{text[:200]}")
            elif case.names.lower() not in text.lower():
                failures.append(f"{where}: HTTP {status} but the message does not name "
                                f"{case.names!r}: {text[:200]}")
        status, text = send(base_url, Case("health", "GET", health, None, (200,), ""), token,
                            timeout)
        if status != 200:
            failures.append(f"after {ep.method} {ep.path}: {health} answers {status}: "
                            f"{text[:200]}")
            break
    return failures


def tokenless_answers(base_url: str, paths: Sequence[str], timeout: float = 10.0) -> Dict[str, str]:
    """What each path answers a GET without a token (status and body), to check that nothing
    secret is in it."""
    out = {}
    for path in paths:
        status, text = send(base_url, Case("tokenless", "GET", path, None, (), "", token=False),
                            "", timeout)
        out[path] = f"{status} {text}"
    return out

