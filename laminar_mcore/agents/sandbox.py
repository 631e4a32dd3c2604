"""The tool sandbox: untrusted Python (a model's tool call) run in a fresh child process, whose
every crash, timeout or exception comes back as a ``ToolResult`` (a tool message for the model),
never as an exception into the episode that called it.

    result = await run_python("print(sum(inputs['xs']))", inputs={"xs": [1, 2]})
    result.output == "3\\n"; result.as_tool_message() == "3"

Convention: a tool's output is what its code printed to stdout (a notebook cell's convention:
``print(x)``, not a ``result`` variable). ``inputs`` (a JSON-able dict) is a global of the code.

What each call gets (``SandboxLimits``):

* a fresh interpreter (``python -I -S``: no site-packages, no user site, no ``PYTHON*``
  variables), an environment holding only ``PATH`` and ``LANG`` (no inherited tokens), stdin
  closed, and a private temporary working directory that is removed afterwards;
* CPU time (``RLIMIT_CPU``: the code gets a ``CPU time limit`` error at ``cpu_s``, is killed a
  second later), address space (``RLIMIT_AS``: allocation fails with ``MemoryError``), file
  size (``RLIMIT_FSIZE``: a longer write fails), no core files, ``RLIMIT_NPROC`` (which Linux
  does not apply to root), and a wall-clock limit that the parent enforces by killing the
  child's whole process group;
* stdout and stderr each truncated at ``max_output_bytes`` (the rest is drained and dropped);
* no network. Where the process may (root, or ``CAP_SYS_ADMIN``), the child enters a private
  network namespace and a private PID namespace (``unshare(CLONE_NEWNET | CLONE_NEWPID)`` via
  ``ctypes``): it has no network interface at all (not even loopback up), and the code runs as
  the namespace's init, so every process it forks (even one that called ``setsid``) dies with
  it (as init, it also ignores signals it sends itself). ``isolation == "netns"``. Where that
  is refused, the fallback is an audit hook (``sys.addaudithook``) that refuses every
  ``socket.*`` event and every way to start another program (``os.exec*``, ``os.posix_spawn``,
  ``os.system``, ``subprocess.Popen``) or to load C code (``ctypes.dlopen``), and descendants
  are killed through the process group (one that leaves the group with ``setsid`` escapes
  that). ``isolation == "audit-hook"``.

What is *not* isolated: this is a guard against a model's accidents (endless loops, memory
blow-ups, fork storms, a stray HTTP call), not a security boundary against a determined attacker.
There is no seccomp filter and no filesystem isolation: the code runs as the caller's user and
can read (as root, write) the shared filesystem, and reach Unix-domain sockets on it even in a
network namespace; the audit hook can be bypassed by C extensions already importable.

Calls run concurrently (asyncio subprocesses), at most ``max_concurrency`` children at a time
per event loop and value. ``calculator`` is the arithmetic tool of the CPU agent demo built on
``run_python``: its expression is parsed and checked in the caller (only numbers, ``+ - * / //
% **``, unary signs and parentheses), then evaluated in the sandbox.

The child's side is ``sandbox_child.py``, run as a script. This module imports only the standard
library and must never raise out of ``run_python`` or ``calculator`` for anything the tool's code
or expression does (cancellation of the caller's task still propagates, after the child is
killed).
"""

from __future__ import annotations

import ast
import asyncio
import json
import marshal
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Dict, Optional

NETWORK_MODES = ("auto", "netns", "audit-hook")
_CLONE_NEWNET_NEWPID = 0x40000000 | 0x20000000
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


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
    max_processes: int = 64
    """``RLIMIT_NPROC`` (per user, and not applied by Linux to root: the group kill is what
    bounds a fork storm there)."""
    max_concurrency: int = 8
    """Children running at once, per event loop, among calls with this value."""
    network: str = "auto"
    """``auto`` (a network namespace where permitted, else the audit hook), ``netns`` (refuse to
    run without one) or ``audit-hook`` (always the fallback)."""

    def __post_init__(self):
        def positive(name, value, kind=(int, float)):
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is int else "a number"
                raise TypeError(f"SandboxLimits.{name} must be {what}, got {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SandboxLimits.{name} must be positive and finite, got {value!r}")

        positive("cpu_s", self.cpu_s)
        positive("wall_s", self.wall_s)
        for name in ("memory_mb", "max_output_bytes", "max_file_mb", "max_processes",
                     "max_concurrency"):
            positive(name, getattr(self, name), int)
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb}: the interpreter alone "
                             "needs about 20 MiB; give at least 32")
        if self.network not in NETWORK_MODES:
            raise ValueError(f"SandboxLimits.network={self.network!r}: "
                             f"choose one of {', '.join(NETWORK_MODES)}")


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
    """How the network was cut off: ``netns``, ``audit-hook`` ('' if no child ran)."""
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


_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_network_probe: Optional[bool] = None
_semaphores: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[int, asyncio.Semaphore]]"
_semaphores = weakref.WeakKeyDictionary()


async def _netns_permitted() -> bool:
    """Whether a child may enter private network and PID namespaces (probed once per process)."""
    global _network_probe
    if _network_probe is None:
        probe = ("import ctypes, sys; "
                 f"sys.exit(ctypes.CDLL(None).unshare({_CLONE_NEWNET_NEWPID}) != 0)")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", probe, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_ENV)
            _network_probe = await proc.wait() == 0
        except OSError:
            _network_probe = False
    return _network_probe


async def isolation_available(limits: Optional[SandboxLimits] = None) -> str:
    """The isolation ``run_python`` will use with ``limits``: ``netns`` or ``audit-hook`` (or
    '' when ``network="netns"`` is demanded and not permitted here)."""
    limits = limits or SandboxLimits()
    if limits.network == "audit-hook":
        return "audit-hook"
    if await _netns_permitted():
        return "netns"
    return "" if limits.network == "netns" else "audit-hook"


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


def _read_status(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return ast.literal_eval(f.read())
    except (OSError, ValueError, SyntaxError):
        return None


def _verdict(status, limits: SandboxLimits, returncode: Optional[int]) -> Optional[str]:
    """The one-line error for how the child ended (None: it ran to its end)."""
    cpu_s = math.ceil(limits.cpu_s)
    if not status:
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
    inputs_bytes = None
    if inputs is not None:
        try:  # what JSON would carry (tuples become lists), in marshal's form: the child reads
            # it without importing json (and re), a few milliseconds of every call
            inputs_bytes = marshal.dumps(json.loads(json.dumps(inputs)))
        except (TypeError, ValueError) as e:
            return ToolResult(False, "", f"inputs are not JSON-able: {e}")
    isolation = await isolation_available(limits)
    if not isolation:
        return ToolResult(False, "", "network namespace not permitted here and "
                          "SandboxLimits.network='netns' forbids the audit-hook fallback")
    async with _semaphore(limits.max_concurrency):
        start = time.monotonic()
        result = await _run_child(code, inputs_bytes, limits, isolation)
    result.wall_s = time.monotonic() - start
    return result


async def _run_child(code: str, inputs_bytes: Optional[bytes], limits: SandboxLimits,
                     isolation: str) -> ToolResult:
    root = tempfile.mkdtemp(prefix="laminar-sandbox-")
    transport = None
    try:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        code_path, inputs_path = os.path.join(root, "code.py"), ""
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        if inputs_bytes is not None:
            inputs_path = os.path.join(root, "inputs.marshal")
            with open(inputs_path, "wb") as f:
                f.write(inputs_bytes)
        status_path = os.path.join(root, "status")
        loop = asyncio.get_running_loop()
        try:
            transport, child = await loop.subprocess_exec(
                lambda: _ChildProtocol(limits.max_output_bytes),
                sys.executable, "-I", "-S", _CHILD, status_path, isolation,
                str(math.ceil(limits.cpu_s)), str(limits.memory_mb << 20),
                str(limits.max_file_mb << 20), str(limits.max_processes), code_path, inputs_path,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir, env=dict(_ENV), start_new_session=True)
        except OSError as e:
            return ToolResult(False, "", f"sandbox could not start: {e}", isolation=isolation)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(child.exited), timeout=limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        # the child's descendants (its process group; the PID namespace already took them
        # where there is one) go with it, so that nothing runs on or holds the pipes
        _kill_group(transport.get_pid())
        await child.exited
        try:
            await asyncio.wait_for(asyncio.shield(child.closed), timeout=1.0)
        except asyncio.TimeoutError:  # a descendant that left the group holds a pipe
            pass
        if timed_out:
            error = f"timeout after {limits.wall_s:g} s wall"
        else:
            error = _verdict(_read_status(status_path), limits, transport.get_returncode())
        out, err = (child.kept[fd].decode("utf-8", "replace") for fd in (1, 2))
        return ToolResult(error is None, out, error, isolation=isolation, stderr=err,
                          truncated=max(child.total.values()) > limits.max_output_bytes)
    finally:
        if transport is not None:
            if transport.get_returncode() is None:  # cancelled: still kill it
                _kill_group(transport.get_pid())
            transport.close()
        shutil.rmtree(root, ignore_errors=True)


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
