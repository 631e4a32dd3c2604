"""The tool sandbox with real child processes: limits, no network, nothing left running, errors
as tool messages, the calculator, and many calls at once. Time limits are generous (2 shared
cores); no test asserts speed."""

import asyncio
import os
import select
import signal
import socket
import time

import pytest

from laminar_mcore.agents.sandbox import (SandboxLimits, ToolResult, calculator,
                                          calculator_program, run_python)

MARK = b"laminar-sandbox-"  # in every sandbox process's command line (the call's tag)


def run(coro):
    return asyncio.run(coro)


def _sandbox_processes(needle: bytes = MARK) -> set:
    """Live (not zombie) processes whose command line holds ``needle``."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state not in (b"Z", b"X"):
            found.add(int(name))
    return found


def _wait_gone(needle: bytes, timeout: float = 10.0) -> set:
    deadline = time.monotonic() + timeout
    while (left := _sandbox_processes(needle)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def no_leftovers():
    """Fails a test that leaves a sandbox process behind, and kills it (also on failure)."""
    before = _sandbox_processes()
    yield
    left = _wait_gone(MARK) - before
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"sandbox processes survived: {sorted(left)}"


MODES = ("bubblewrap", "unsafe-local")


def test_limits_are_checked():
    for bad, kind in [(dict(cpu_s=0), ValueError), (dict(wall_s=float("inf")), ValueError),
                      (dict(memory_mb=8), ValueError), (dict(max_concurrency=0), ValueError),
                      (dict(sandbox="netns"), ValueError), (dict(wall_s="5"), TypeError),
                      (dict(tmpfs_mb=0), ValueError),
                      (dict(max_output_bytes=1.5), TypeError)]:
        with pytest.raises(kind, match=next(iter(bad))):
            SandboxLimits(**bad)


@pytest.mark.parametrize("mode", MODES)
def test_normal_result_inputs_and_clean_process(no_leftovers, monkeypatch, mode):
    monkeypatch.setenv("LAMINAR_SANDBOX_TEST_TOKEN", "secret")
    code = ("import os, sys\nprint(sum(inputs['xs']), inputs['name'])\n"
            "print(sorted(k for k in os.environ if k != 'PWD'))\n"
            "print(os.getcwd())\nprint(sys.flags.isolated, sys.flags.no_site)")
    limits = SandboxLimits(sandbox=mode)
    r = run(run_python(code, inputs={"xs": [1, 2, 39], "name": "ok"}, limits=limits))
    assert r.ok and r.error is None, r
    total, env, cwd, flags = r.output.splitlines()
    assert total == "42 ok" and r.as_tool_message().startswith("42 ok\n")
    assert "LAMINAR_SANDBOX_TEST_TOKEN" not in env and env == "['LANG', 'PATH']"
    assert flags == "1 1"
    if mode == "bubblewrap":  # its own tmpfs
        assert cwd == "/tmp"
    else:  # a temporary directory, removed afterwards
        assert os.path.basename(cwd).startswith("laminar-sandbox-") and not os.path.exists(cwd)
    assert r.isolation == mode and r.wall_s > 0
    assert run(run_python("", limits=limits)).as_tool_message() == "(no output)"


def test_exception_stdin_and_exit_become_errors(no_leftovers):
    r = run(run_python("print('before')\nx = 1\nx / 0"))
    assert not r.ok and r.error == "exception: ZeroDivisionError: division by zero"
    assert r.output == "before\n" and "x / 0" in r.stderr
    message = r.as_tool_message()
    assert message.startswith("before\n") and message.endswith("Error: " + r.error)
    r = run(run_python("input()"))  # stdin is closed
    assert r.error.startswith("exception: EOFError")
    assert run(run_python("exit(3)")).error == "exit status 3"
    assert run(run_python("exit(0)")).ok
    r = run(run_python("1", inputs={"f": object()}))
    assert not r.ok and "JSON" in r.error and r.isolation == ""


def test_endless_loop_hits_the_cpu_limit(no_leftovers):
    r = run(run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=20)))
    assert not r.ok and r.error.startswith("CPU time limit 1 s exceeded"), r


def test_sleeping_code_hits_the_wall_limit(no_leftovers):
    r = run(run_python("import time\nprint('started', flush=True)\ntime.sleep(60)",
                       limits=SandboxLimits(wall_s=1.5)))
    assert not r.ok and r.error == "timeout after 1.5 s wall" and r.output == "started\n"
    assert r.wall_s < 15


def test_unbounded_allocation_hits_the_memory_limit(no_leftovers):
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 20))"
    r = run(run_python(code, limits=SandboxLimits(memory_mb=128, wall_s=20)))
    assert not r.ok and r.error == "memory limit 128 MiB exceeded (MemoryError)", r


def test_a_long_file_write_fails(no_leftovers):
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (3 << 20))"
    for mode in MODES:
        r = run(run_python(code, limits=SandboxLimits(max_file_mb=1, sandbox=mode)))
        assert not r.ok and "File too large" in r.error, r


def test_output_is_truncated(no_leftovers):
    limits = SandboxLimits(max_output_bytes=1000)
    r = run(run_python("import sys\nprint('x' * 1_000_000)\nsys.stderr.write('e' * 5000)",
                       limits=limits))
    assert r.ok and r.truncated and r.output == "x" * 1000 and len(r.stderr) == 1000
    assert r.as_tool_message().endswith("[output truncated]")
    assert not run(run_python("print('short')", limits=limits)).truncated


FORKS = """
import os, sys, time
print(sys.argv[-1], flush=True)
forked = 0
for _ in range(50):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        {child}
        time.sleep(60)
        os._exit(0)
    forked += 1
print("forked", forked, flush=True)
{parent}
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("child,parent", [("pass", "pass"),  # the code ends, children sleep
                                          ("pass", "time.sleep(60)"),  # the wall limit
                                          ("os.setsid()", "pass")])  # children leave the group
def test_forked_processes_do_not_survive(no_leftovers, mode, child, parent):
    if child == "os.setsid()" and mode == "unsafe-local":
        pytest.skip("documented: unsafe-local's group kill misses a child that called setsid")
    code = FORKS.format(child=child, parent=parent)
    r = run(run_python(code, limits=SandboxLimits(wall_s=3, sandbox=mode)))
    root, forked = r.output.splitlines()[:2]
    assert root.startswith("laminar-sandbox-") and int(forked.split()[1]) >= 1, r
    assert r.ok == (parent == "pass"), r
    if parent != "pass":
        assert r.error.startswith("timeout")
    assert not _wait_gone(root.encode()), "a forked process outlived the tool call"


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server
    finally:
        server.close()


def test_no_network(no_leftovers, listener):
    port = listener.getsockname()[1]
    code = ("import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=3)\n"
            "s.sendall(b'escaped')\nprint('connected')" % port)
    r = run(run_python(code))
    assert not r.ok and r.isolation == "bubblewrap" and "connected" not in r.output
    assert r.error.startswith("exception: ") and ("Error" in r.error), r
    readable, _, _ = select.select([listener], [], [], 0.3)
    assert not readable, "the listener received a connection from the sandbox"


def test_signals_are_reported(no_leftovers):
    for mode in MODES:
        r = run(run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                           limits=SandboxLimits(sandbox=mode)))
        assert r.error == "killed by signal 9 (SIGKILL)", r


def test_many_calls_at_once_are_bounded(no_leftovers):
    limits = SandboxLimits(max_concurrency=3)
    code = ("import time\nt0 = time.time()\ntime.sleep(0.2)\n"
            "print(inputs['i'] ** 2, t0, time.time())")

    async def many():
        return await asyncio.gather(*(run_python(code, inputs={"i": i}, limits=limits)
                                      for i in range(12)))

    results = run(many())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    spans = []
    for i, r in enumerate(results):
        square, t0, t1 = r.output.split()
        assert int(square) == i * i
        spans.append((float(t0), float(t1)))
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= 3, f"{most} children ran at once with max_concurrency=3"


def test_cancelled_call_kills_its_child(no_leftovers):
    async def cancel():
        task = asyncio.ensure_future(run_python("import time\ntime.sleep(60)",
                                                limits=SandboxLimits(wall_s=60)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel())


@pytest.mark.parametrize("expression,value", [
    ("12345678+87654321", "99999999"), ("2 * (3 + 4) - -1", "15"), ("7 // 2 + 7 % 2", "4"),
    ("2 ** 100", str(2 ** 100)), ("7/2", "3.5"), ("6/3", "2"), ("0.1 + 0.2", "0.3"),
    ("1/3", "0." + "3" * 50)])
def test_calculator_values(no_leftovers, expression, value):
    r = run(calculator(expression))
    assert r.ok and r.output.strip() == value and r.as_tool_message() == value, r


@pytest.mark.parametrize("expression,error", [
    ("__import__('os')", "refused: 'Call' is not arithmetic"),
    ("(1).__class__", "refused: 'Attribute'"), ("x + 1", "refused: 'Name'"),
    ("'a' * 3", "refused: 'a' is not a number"), ("True + 1", "refused: True"),
    ("2 **", "invalid expression"), ("", "empty expression"), ("1" * 3000, "longer than"),
    ("1/0", "exception: ZeroDivisionError: division by zero"),
    ("10 ** 10 ** 10", "limit")])  # a 4 GB integer: memory or CPU, either way no answer
def test_calculator_refusals_and_errors(no_leftovers, expression, error):
    r = run(calculator(expression, limits=SandboxLimits(cpu_s=1, wall_s=20)))
    assert not r.ok and error in r.error, r
    assert r.as_tool_message() == f"Error: {r.error}"


def test_calculator_program_never_evaluates_in_the_caller():
    program = calculator_program("1.5 * 2 / 3")
    assert "D('1.5')" in program and "_div(" in program
    assert calculator_program("1 + 2") == "print(1 + 2)\n"


def test_many_calculator_calls_at_once(no_leftovers):
    async def many():
        return await asyncio.gather(*(calculator(f"{i} * {i} + 1") for i in range(24)))

    results = run(many())
    assert [r.output.strip() for r in results] == [str(i * i + 1) for i in range(24)]
    assert isinstance(results[0], ToolResult)


def test_bench_writes_its_keys(no_leftovers, tmp_path):
    import json

    from laminar_mcore.bench.sandbox import main

    path = tmp_path / "sandbox.json"
    figures = main(["--calls", "10", "--json", str(path)])
    assert json.loads(path.read_text()) == figures
    assert figures["isolation"] == "bubblewrap"
    assert isinstance(figures["bubblewrap_overhead_median_ms"], float)
    for key in ("bare_start_median_ms", "calculator_median_ms", "calculator_p90_ms",
                "calculator_unsafe_local_median_ms", "run_python_median_ms", "run_python_p90_ms",
                "calls_per_s_concurrency_1", "calls_per_s_concurrency_8"):
        assert figures[key] > 0, key
