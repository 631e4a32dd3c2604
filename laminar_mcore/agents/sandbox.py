"""The tool sandbox: untrusted Python (a model's tool call) run in a fresh child process under
bubblewrap, whose every crash, timeout or exception comes back as a ``ToolResult`` (a tool
message for the model), never as an exception into the episode that called it.

    result = await run_python("print(sum(inputs['xs']))", inputs={"xs": [1, 2]})
    result.output == "3\\n"; result.as_tool_message() == "3"

Convention: a tool's output is what its code printed to stdout (a notebook cell's convention:
``print(x)``, not a ``result`` variable). ``inputs`` (a JSON-able dict) is a global of the code.

**What it guarantees** (``sandbox="bubblewrap"``, the default and the only isolation; see
agents/bubblewrap.py for the command line): each call runs under ``bwrap`` in namespaces of its
own (user, PID, network, mount, IPC, UTS): no network interface at all, a ``/proc`` with only
its own processes, no capabilities, an environment of ``PATH`` and ``LANG`` only (never the run
token or the run's configuration), uid 65534 inside and an unprivileged user on the host, a
read-only view of the interpreter and the system libraries and nothing else of the host's
files, a private tmpfs of ``tmpfs_mb`` as ``/tmp`` and working directory. The code and its
inputs reach it through a memory file, not the filesystem. Every process it starts dies with
the call (``setsid`` or not: the PID namespace goes). Then the limits (``SandboxLimits``):
CPU time (``RLIMIT_CPU``: a ``CPU time limit`` error at ``cpu_s``, killed a second later),
address space (``RLIMIT_AS``: ``MemoryError``), file size (``RLIMIT_FSIZE``), no core files,
``RLIMIT_NPROC`` (counted over the sandbox's host user), stdout and stderr each truncated at
``max_output_bytes``, and a wall-clock limit the parent enforces by killing it.

**What it does not**: a kernel exploit escapes any namespace sandbox (a VM or gVisor is the
next boundary; a remote sandbox service is how to get one, docs/agents.md); code can read the
system's libraries and the interpreter's standard library (not its site-packages).

``sandbox="unsafe-local"`` (``rollout.sandbox=unsafe-local``) is a plain child process with the
same limits and a cleared environment: no boundary at all (it can read and write what the
controller's user can), for code you trust or a machine without bubblewrap; ``isolation`` in
every ``ToolResult`` says which ran. A call never falls back from one to the other: where
bubblewrap is missing or cannot make its namespaces, the call fails (and an agent job refuses
to start, agents/episode.py).

Calls run concurrently (asyncio subprocesses), at most ``max_concurrency`` children at a time
per event loop and value. ``calculator`` is the arithmetic tool of the CPU agent demo built on
``run_python``: its expression is parsed and checked in the caller (only numbers, ``+ - * / //
% **``, unary signs and parentheses), then evaluated in the sandbox.

The child's side is ``sandbox_child.py``, passed to the interpreter as ``-c`` text (no file of
the project's tree is in the sandbox). This module must never raise out of ``run_python`` or
``calculator`` for anything the tool's code or expression does (cancellation of the caller's
task still propagates, after the child is killed).
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import marshal
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Dict, Optional

from . import bubblewrap
from .bubblewrap import SANDBOXES, SandboxUnavailable

logger = logging.getLogger(__name__)
_default = ["bubblewrap"]


def use_sandbox(kind: str) -> str:
    """Make ``kind`` (``rollout.sandbox``) the sandbox of every call whose limits name none,
    in this process; for bubblewrap, check that it runs here first (raises SandboxUnavailable,
    naming the fix). Returns ``kind``."""
    if kind not in SANDBOXES:
        raise ValueError(f"LMC-E102: rollout.sandbox={kind!r} must be one of "
                         f"{', '.join(SANDBOXES)}")
    if kind == "bubblewrap":
        bubblewrap.check()
    else:
        logger.warning("rollout.sandbox=unsafe-local: tool code runs as a plain child process "
                       "of the controller, with no isolation (it can read and write what the "
                       "controller's user can); only for code you trust")
    _default[0] = kind
    return kind


@dataclass(frozen=True)
class SandboxLimits:
    """What one tool call may use. Checked when built: a wrong value fails here, not in a child."""

    cpu_s: float = 2.0
    """CPU seconds (``RLIMIT_CPU``, rounded up to whole seconds)."""
    memory_mb: int = 256
    """Address space in MiB (``RLIMIT_AS``); the interpreter itself needs about 20."""
    wall_s: float = 5.0
    """Wall-clock seconds from start to kill, enforced by the parent."""
    max_output_bytes: int = 16384
    """Bytes of stdout (and, separately, of stderr) kept; the rest is dropped."""
    max_file_mb: int = 64
    """Size of any one file the code writes (``RLIMIT_FSIZE``; past it a write fails)."""
    tmpfs_mb: int = 64
    """Size of the sandbox's private tmpfs (``/tmp``, the working directory): all its files."""
    max_processes: int = 64
    """``RLIMIT_NPROC``: processes of the sandbox's host user (calls at once share it)."""
    max_concurrency: int = 8
    """Children running at once, per event loop, among calls with this value."""
    sandbox: Optional[str] = None
    """``bubblewrap`` or ``unsafe-local``; None: the process's (``use_sandbox``, from
    ``rollout.sandbox``; bubblewrap unless set)."""

    def __post_init__(self):
        def positive(name, value, kind=(int, float)):
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is int else "a number"
                raise TypeError(f"SandboxLimits.{name} must be {what}, got {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SandboxLimits.{name} must be positive and finite, got {value!r}")

        positive("cpu_s", self.cpu_s)
        positive("wall_s", self.wall_s)
        for name in ("memory_mb", "max_output_bytes", "max_file_mb", "tmpfs_mb",
                     "max_processes", "max_concurrency"):
            positive(name, getattr(self, name), int)
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb}: the interpreter alone "
                             "needs about 20 MiB; give at least 32")
        if self.sandbox is not None and self.sandbox not in SANDBOXES:
            raise ValueError(f"SandboxLimits.sandbox={self.sandbox!r}: "
                             f"choose one of {', '.join(SANDBOXES)}")

    @property
    def kind(self) -> str:
        return self.sandbox or _default[0]


@dataclass
class ToolResult:
    """What a tool call produced. ``ok`` is False for a timeout, a limit, an exception, a
    refused input or a child that died; ``error`` then says which, in one line."""

    ok: bool
    output: str
    """What the code printed to stdout (possibly truncated)."""
    error: Optional[str] = None
    wall_s: float = 0.0
    isolation: str = ""
    """Which sandbox ran: ``bubblewrap`` or ``unsafe-local`` ('' if no child ran)."""
    stderr: str = ""
    truncated: bool = False
    """True if stdout or stderr passed ``max_output_bytes``."""

    def as_tool_message(self) -> str:
        """The text the model sees as the tool's answer."""
        parts = [self.output.rstrip("\n")] if self.output.strip() else []
        if self.truncated:
            parts.append("[output truncated]")
        if not self.ok:
            if self.stderr.strip():
                parts.append(self.stderr.rstrip("\n"))
            parts.append(f"Error: {self.error}")
        return "\n".join(parts) if parts else "(no output)"


with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py"),
          encoding="utf-8") as _f:
    _CHILD = _f.read()
TAG = "laminar-sandbox-"  # + a call's id: the last argument of its every process
_semaphores: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[int, asyncio.Semaphore]]"
_semaphores = weakref.WeakKeyDictionary()


def _semaphore(n: int) -> asyncio.Semaphore:
    by_size = _semaphores.setdefault(asyncio.get_running_loop(), {})
    if n not in by_size:
        by_size[n] = asyncio.Semaphore(n)
    return by_size[n]


class _ChildProtocol(asyncio.SubprocessProtocol):
    """Keeps the first ``cap`` bytes of stdout and of stderr and drops the rest; says when the
    child exited (``exited``) and when, besides, every holder of its pipes is gone (``closed``)
    (``Process.wait`` of Python 3.11 waits for both, and a forked descendant can hold a pipe)."""

    def __init__(self, cap: int):
        loop = asyncio.get_running_loop()
        self.cap = cap
        self.kept = {1: bytearray(), 2: bytearray()}
        self.total = {1: 0, 2: 0}
        self.exited, self.closed = loop.create_future(), loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.total[fd] += len(data)
        kept = self.kept[fd]
        if len(kept) < self.cap:
            kept += data[:self.cap - len(kept)]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_status(fd: int):
    try:
        return ast.literal_eval(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except (OSError, ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _verdict(status, limits: SandboxLimits, returncode: Optional[int]) -> Optional[str]:
    """The one-line error for how the child ended (None: it ran to its end)."""
    cpu_s = math.ceil(limits.cpu_s)
    if not status or not isinstance(status, tuple):
        return f"the sandbox ended without a report (exit code {returncode})"
    kind = status[0]
    if kind == "ok":
        return None
    if kind == "memory":
        return f"memory limit {limits.memory_mb} MiB exceeded (MemoryError)"
    if kind == "cpu":
        return f"CPU time limit {cpu_s} s exceeded"
    if kind == "exception":
        return f"exception: {status[1]}"
    if kind == "exit":
        return f"exit status {status[1]}"
    if kind == "signal":
        sig, used = status[1], status[2]
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        if sig in (signal.SIGKILL, signal.SIGXCPU) and used >= cpu_s - 0.05:
            return f"CPU time limit {cpu_s} s exceeded (killed by signal {sig}, {name})"
        return f"killed by signal {sig} ({name})"
    if kind == "setup":
        return f"sandbox setup failed: {status[1]}"
    return f"sandbox reported {status!r}"


async def run_python(code: str, *, inputs: Optional[dict] = None,
                     limits: Optional[SandboxLimits] = None) -> ToolResult:
    """Run ``code`` in a fresh sandboxed child and return what it printed (see the module
    docstring for the limits and the isolation). ``inputs``, if given, must be JSON-able and is
    the global ``inputs`` of the code. Never raises for anything the code does."""
    limits = limits or SandboxLimits()
    if not isinstance(code, str):
        return ToolResult(False, "", f"code must be a string, got {type(code).__name__}")
    inputs_obj = None
    if inputs is not None:
        try:  # what JSON would carry (tuples become lists); the child reads marshal's form
            inputs_obj = json.loads(json.dumps(inputs))
        except (TypeError, ValueError) as e:
            return ToolResult(False, "", f"inputs are not JSON-able: {e}")
    try:
        payload = marshal.dumps((code, inputs_obj))
    except ValueError as e:  # e.g. nested too deeply for marshal
        return ToolResult(False, "", f"inputs cannot be passed to the sandbox: {e}")
    kind = limits.kind
    if kind == "bubblewrap":
        try:
            setup = bubblewrap.check()
        except SandboxUnavailable as e:
            return ToolResult(False, "", str(e))
    async with _semaphore(limits.max_concurrency):
        start = time.monotonic()
        if kind == "bubblewrap":
            prefix = bubblewrap.argv(setup, limits.tmpfs_mb << 20)
            result = await _run_child(prefix, payload, limits, kind, None,
                                      bubblewrap.popen_user(bubblewrap.host_ids()))
        else:
            workdir = tempfile.mkdtemp(prefix=TAG)
            try:
                result = await _run_child([sys.executable], payload, limits, kind, workdir, {})
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    result.wall_s = time.monotonic() - start
    return result


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name)
    if data:
        os.write(fd, data)
    return fd


async def _run_child(prefix: list, payload: bytes, limits: SandboxLimits, kind: str,
                     workdir: Optional[str], popen: dict) -> ToolResult:
    transport = None
    code_fd, status_fd = _memfd("laminar-tool-code", payload), _memfd("laminar-tool-status")
    try:
        loop = asyncio.get_running_loop()
        try:
            transport, child = await loop.subprocess_exec(
                lambda: _ChildProtocol(limits.max_output_bytes),
                *prefix, "-I", "-S", "-c", _CHILD, str(status_fd),
                str(math.ceil(limits.cpu_s)), str(limits.memory_mb << 20),
                str(limits.max_file_mb << 20), str(limits.max_processes), str(code_fd),
                TAG + uuid.uuid4().hex[:12],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir or "/", env=dict(bubblewrap.ENV), start_new_session=True,
                pass_fds=(code_fd, status_fd), **popen)
        except OSError as e:
            return ToolResult(False, "", f"sandbox could not start: {e}", isolation=kind)
        os.close(code_fd)
        code_fd = -1
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(child.exited), timeout=limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        # bwrap's sandbox dies with it (--die-with-parent, then its PID namespace); a plain
        # child's descendants go with its process group
        _kill_group(transport.get_pid())
        await child.exited
        try:
            await asyncio.wait_for(asyncio.shield(child.closed), timeout=1.0)
        except asyncio.TimeoutError:  # (unsafe-local) a descendant that left the group
            pass
        if timed_out:
            error = f"timeout after {limits.wall_s:g} s wall"
        else:
            error = _verdict(_read_status(status_fd), limits, transport.get_returncode())
        out, err = (child.kept[fd].decode("utf-8", "replace") for fd in (1, 2))
        return ToolResult(error is None, out, error, isolation=kind, stderr=err,
                          truncated=max(child.total.values()) > limits.max_output_bytes)
    finally:
        if transport is not None:
            if transport.get_returncode() is None:  # cancelled: still kill it
                _kill_group(transport.get_pid())
            transport.close()
        for fd in (code_fd, status_fd):
            if fd >= 0:
                os.close(fd)


# -- calculator ------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 2000
_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY_OPS = (ast.UAdd, ast.USub)
# evaluated in the child only when the expression has a decimal or a '/': integers stay exact
# Python ints, decimals are Decimals (0.1 + 0.2 == 0.3), and '/' is exact where it can be
_DECIMAL_PRELUDE = """from decimal import Decimal as D, getcontext
getcontext().prec = 50
def _div(a, b):
    if b == 0:
        raise ZeroDivisionError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return D(a) / D(b)
"""


class _Refused(ValueError):
    pass


class _ToProgram(ast.NodeTransformer):
    """Checks that an expression is only arithmetic and rewrites decimals and '/'."""

    def __init__(self, text: str):
        self.text = text
        self.decimal = False

    def generic_visit(self, node):
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant) + _BINARY_OPS + _UNARY_OPS
        if not isinstance(node, allowed):
            raise _Refused(f"'{type(node).__name__}' is not arithmetic")
        return super().generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise _Refused(f"{node.value!r} is not a number")
        if isinstance(node.value, float):
            self.decimal = True
            literal = ast.get_source_segment(self.text, node) or repr(node.value)
            return ast.Call(ast.Name("D", ast.Load()), [ast.Constant(literal)], [])
        return node

    def visit_BinOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Div):
            self.decimal = True
            return ast.Call(ast.Name("_div", ast.Load()), [node.left, node.right], [])
        return node


def calculator_program(expression: str) -> str:
    """The Python program ``calculator`` runs for ``expression``; raises ValueError with a
    message for the model if the expression is not plain arithmetic."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"invalid expression: {getattr(e, 'msg', None) or e}") from None
    rewrite = _ToProgram(text)
    try:
        tree = ast.fix_missing_locations(rewrite.visit(tree))
    except _Refused as e:
        raise ValueError(f"refused: {e}; only numbers, + - * / // % ** and parentheses "
                         "are allowed") from None
    except RecursionError:
        raise ValueError("invalid expression: nested too deeply") from None
    body = f"print({ast.unparse(tree.body)})\n"
    return _DECIMAL_PRELUDE + body if rewrite.decimal else body


async def calculator(expression: str, limits: Optional[SandboxLimits] = None) -> ToolResult:
    """Evaluate an arithmetic expression on integers and decimals (``+ - * / // % **``,
    parentheses) in the sandbox; ``output`` is the value's text. Integers are exact; a decimal
    literal or a '/' that does not divide evenly gives a 50-digit Decimal."""
    try:
        program = calculator_program(expression)
    except ValueError as e:
        return ToolResult(False, "", str(e))
    result = await run_python(program, limits=limits)
    result.stderr = ""  # a traceback of the generated program says nothing to the model
    return result
