"""Errors with codes (laminar_mcore/errors.py): every code the package raises has exactly one
entry in docs/troubleshooting.md and every entry names a code the package raises; the
user-facing errors carry a code where their message is written (read from the source with
``ast``, so a new raise without one fails here); the launcher and our servers show it."""

import ast
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Dict, List

import pytest

from laminar_mcore.errors import CODE

from .conftest import running_controller

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the package (and its conversion tool); errors.py only formats codes (its docstring's
# examples are no codes of ours)
SOURCE_DIRS = ("laminar_mcore", "kernels", "tools")
NOT_SCANNED = {os.path.join("laminar_mcore", "errors.py")}
DOC = os.path.join(ROOT, "docs", "troubleshooting.md")
ENTRY = re.compile(r"^### (LMC-E\d{3}) · \S.*$", re.M)

# The error classes a user meets, and which argument is the message (EngineError and its
# subclass take the endpoint and the status first). Wherever one is made with a message
# written there, the message carries a code; one passed through (an inner error's, a remote
# server's answer) carries the code it came with.
USER_FACING = {name: 0 for name in (
    "ConfigError", "ClusterError", "ControllerError", "ServerStartError", "EngineStartError",
    "NodeError", "PublishError", "CheckpointMismatch", "AdapterError", "NonFiniteLossError",
    "VersionError", "BusyError", "StoreFull", "ShmFull", "PushRefused", "RendezvousRefused",
    "DeltaError", "TransportUnavailable", "MooncakeUnavailable", "TemplateError",
    "LoggerUnavailable", "RelayError", "WeightApplyError")}
USER_FACING.update(EngineError=2, StreamProtocolError=2)
# In these modules (configuration, launch, the roles' entry points, the relay's command line,
# the server processes, the conversion tool) the plain exceptions are the user's errors too.
PLAIN = {"ValueError", "RuntimeError", "SystemExit", "FileNotFoundError", "TypeError", "fail",
         "error"}  # (tools' fail(), argparse's ap.error())
PLAIN_SCOPE = ("laminar_mcore/config/", "laminar_mcore/launch/", "laminar_mcore/controller/role.py",
               "laminar_mcore/rollout/node.py", "laminar_mcore/trainer/loop.py",
               "laminar_mcore/relay/server.py", "laminar_mcore/server_process.py",
               "tools/convert_checkpoint.py")
# The problem lists of the checks before a run starts: each problem carries its own code.
PROBLEM_LISTS = {"laminar_mcore/config/validate.py": "problems",
                 "laminar_mcore/config/plan.py": "problems",
                 "laminar_mcore/metrics/loggers.py": "problems",
                 "laminar_mcore/algos/spec.py": "out"}
# Messages written without a code of their own, and why: programming errors (a bug of ours,
# not the user's) raised as a user-facing class, the headings over problems that each carry
# their code, and what no user of a run meets.
INTERNAL = {
    ("laminar_mcore/models/base.py", "already has an adapter"): "an adapter registered twice",
    ("laminar_mcore/models/moe.py", "needs the TransformerConfig"): "a caller's mistake",
    ("laminar_mcore/models/hf.py", "written twice"): "the converter writes a tensor once",
    ("laminar_mcore/config/paths.py", "conf/ directory is missing"): "a broken package",
    ("laminar_mcore/config/reference.py", "--check needs --out"): "the docs' own generator",
    ("laminar_mcore/sim/engine.py", "machine failed"): "a failure the simulator models",
    ("laminar_mcore/config/validate.py", "invalid configuration:\\n"): "over coded problems",
    ("laminar_mcore/config/overrides.py", "invalid override:\\n"): "over coded problems",
}


def _sources() -> Dict[str, str]:
    found = {}
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and rel not in NOT_SCANNED:
                    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                        found[rel.replace(os.sep, "/")] = fh.read()
    return found


SOURCES = _sources()


def _raised_codes() -> Dict[str, List[str]]:
    """code -> where it appears (path:line)."""
    codes: Dict[str, List[str]] = {}
    for path, text in SOURCES.items():
        for n, line in enumerate(text.splitlines(), 1):
            for code in CODE.findall(line):
                codes.setdefault(code, []).append(f"{path}:{n}")
    return codes


def _entries() -> List[str]:
    with open(DOC, encoding="utf-8") as f:
        return ENTRY.findall(f.read())


def test_every_code_raised_has_an_entry():
    entries = set(_entries())
    missing = {code: where[:3] for code, where in sorted(_raised_codes().items())
               if code not in entries}
    assert not missing, ("codes raised with no '### LMC-Exxx · title' entry in "
                         f"docs/troubleshooting.md: {missing}")


def test_every_entry_names_a_code_that_is_raised():
    raised = _raised_codes()
    stale = [code for code in _entries() if code not in raised]
    assert not stale, f"entries of docs/troubleshooting.md for codes nothing raises: {stale}"


def test_no_code_has_two_entries():
    entries = _entries()
    twice = sorted({code for code in entries if entries.count(code) > 1})
    assert not twice, f"codes with more than one entry: {twice}"
    with open(DOC, encoding="utf-8") as f:
        headings = [line for line in f if line.startswith("### LMC-")]
    assert len(headings) == len(entries), [h for h in headings if not ENTRY.match(h)]


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else \
        func.attr if isinstance(func, ast.Attribute) else ""


def _writes_text(node: ast.AST) -> bool:
    """Whether ``node`` holds a message written here (a string or f-string literal)."""
    return any(isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant)
                                                and isinstance(n.value, str))
               for n in ast.walk(node))


def _uncoded(path: str, text: str, calls) -> List[str]:
    """``calls``: (call node, its message argument) pairs; those whose written message has
    no code and that are not listed as INTERNAL."""
    out = []
    for call, message in calls:
        if message is None or not _writes_text(message):
            continue
        source = ast.get_source_segment(text, message) or ""
        if CODE.search(source):
            continue
        if any(p == path and fragment in source for p, fragment in INTERNAL):
            continue
        out.append(f"{path}:{call.lineno}: {source[:90]}")
    return out


def _message_of(call: ast.Call, index: int):
    return call.args[index] if len(call.args) > index else None


def test_user_facing_errors_carry_a_code_where_they_are_written():
    """Every construction of a user-facing error (raised, or handed on to be raised), and
    every plain exception of the launch path, whose message is written at that line."""
    missing = []
    for path, text in SOURCES.items():
        tree = ast.parse(text, path)
        calls = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            if name in USER_FACING:
                calls.append((node, _message_of(node, USER_FACING[name])))
        plain_scope = path.startswith(PLAIN_SCOPE)
        for node in ast.walk(tree):
            if plain_scope and isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and _name(node.exc.func) in PLAIN:
                calls.append((node.exc, _message_of(node.exc, 0)))
            elif plain_scope and isinstance(node, ast.Call) and _name(node.func) in ("fail",
                                                                                    "error"):
                calls.append((node, _message_of(node, 0)))
        missing += _uncoded(path, text, calls)
    assert not missing, "user-facing errors written without a code:\n" + "\n".join(missing)


def test_every_problem_of_the_checks_before_a_run_carries_a_code():
    missing = []
    for path, name in PROBLEM_LISTS.items():
        text = SOURCES[path]
        calls = [(node, _message_of(node, 0)) for node in ast.walk(ast.parse(text, path))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr == "append" and _name(node.func.value) == name]
        assert calls, f"{path} has no {name}.append(...): update PROBLEM_LISTS"
        missing += _uncoded(path, text, calls)
    assert not missing, "problems written without a code:\n" + "\n".join(missing)


def test_the_internal_list_is_not_stale():
    for path, fragment in INTERNAL:
        assert fragment in SOURCES[path], f"INTERNAL lists {fragment!r}, gone from {path}"


def test_a_bad_request_and_an_engine_error_lead_with_their_code():
    from laminar_mcore.errors import code_of, split, within
    from laminar_mcore.netutil import BadRequest, EngineError

    assert split(BadRequest("step", "must be an integer")) == \
        ("LMC-E400", "'step' must be an integer")
    assert str(EngineError("/generate", 503, "LMC-E601: busy")) == \
        "LMC-E601: /generate: busy (HTTP 503)"
    assert within("stage 0", ValueError("LMC-E503: refused"), "LMC-E504") == \
        "LMC-E503: stage 0: refused"
    assert within("stage 0", ValueError("refused"), "LMC-E504") == "LMC-E504: stage 0: refused"
    assert code_of("no code here") is None


def test_the_launcher_exits_2_with_the_code_of_an_invalid_value(tmp_path):
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.launch", "rollout.num_engines=0",
                          f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "LMC-E103: rollout.num_engines=0 must be >= 1" in out.stderr, out.stderr[-2000:]
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert set(written) <= {"__main__.log", "overrides.yaml", "hydra.yaml", "config.yaml"}, \
        written  # Hydra's own record only: refused before anything started


TOKEN = "errors-token-0123"


@pytest.fixture
def controller(tmp_path):
    yield from running_controller(tmp_path, TOKEN)


def _post(url: str, body: bytes, token: str = TOKEN):
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_controller_answers_a_malformed_request_with_its_code(controller):
    status, body = _post(controller.url + "/trained", json.dumps({"step": "x",
                                                                 "version": 1}).encode())
    assert status == 400 and body["code"] == "LMC-E400" and body["field"] == "step", body
    assert body["error"].startswith("LMC-E400: bad request: 'step'"), body
    status, body = _post(controller.url + "/trained", b"{}", token="wrong")
    assert status == 401 and body["code"] == "LMC-E401", body
