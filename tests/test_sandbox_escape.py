"""The escape suite: tool code that tries, under bubblewrap, what a policy under RL pressure could
try. The controller's side (this test process) holds a secret where a careless sandbox would
leak it: ``LAMINAR_RUN_TOKEN`` in its environment, a file it wrote, a file in ``/dev/shm``. Each
attempt is contained: the secret never appears in any output, no host file changes, nothing
connects, nothing outlives the call. Also: an agent job refuses to start without a working
bwrap, naming the fix, and ``rollout.sandbox=unsafe-local`` says so in the books."""

import asyncio
import os
import pathlib
import pwd
import select
import shutil
import socket
import tempfile
import time
import uuid

import pytest
from hydra import compose, initialize_config_dir

from laminar_mcore.agents import bubblewrap
from laminar_mcore.agents.sandbox import SandboxLimits, run_python
from laminar_mcore.config import register_configs
from laminar_mcore.config.paths import conf_dir
from laminar_mcore.config.sections import typed

from .test_sandbox import _sandbox_processes, _wait_gone, no_leftovers  # noqa: F401

register_configs()


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The controller's secrets and a listener on the host's loopback."""
    secret = "laminar-escape-" + uuid.uuid4().hex
    monkeypatch.setenv("LAMINAR_RUN_TOKEN", secret)
    token_file = tmp_path / "run_token"
    token_file.write_text(secret)
    shm = f"/dev/shm/laminar-escape-{uuid.uuid4().hex[:8]}"
    with open(shm, "w") as f:
        f.write(secret)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    try:
        yield {"secret": secret, "file": str(token_file), "dir": str(tmp_path), "shm": shm,
               "port": server.getsockname()[1], "server": server, "pid": os.getpid()}
    finally:
        server.close()
        os.unlink(shm)


def _contained(r, host):
    text = r.output + r.stderr + (r.error or "")
    assert host["secret"] not in text, f"the secret leaked: {text[:2000]}"
    assert r.isolation == "bubblewrap", r
    readable, _, _ = select.select([host["server"]], [], [], 0.2)
    assert not readable, "the host's listener received a connection from the sandbox"


TRY = """
import os
def attempt(name, f):
    try:
        print(name, "->", repr(f()))
    except BaseException as e:
        print(name, "refused:", type(e).__name__, e)
def read(path):
    with open(path, "rb") as f:
        return f.read()
"""

SCAN = """
def scan():
    found = {}
    for p in os.listdir("/proc"):
        if p.isdigit() or p == "self":
            try:
                found[p] = read(f"/proc/{p}/environ")
            except OSError as e:
                found[p] = str(e)
    return found
attempt("pids", lambda: sorted(p for p in os.listdir("/proc") if p.isdigit()))
attempt("environ of every /proc entry", scan)
attempt("the controller's environ", lambda: read("/proc/%(pid)d/environ"))
"""

ATTEMPTS = {
    "its own environment": "attempt('env', lambda: dict(os.environ))",
    "/proc/<parent>/environ and every /proc/*/environ": SCAN,
    "unmount /proc and scan again": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
attempt("umount2", lambda: (libc.umount2(b"/proc", 2), ctypes.get_errno()))
attempt("mount", lambda: (libc.mount(b"proc", b"/tmp", b"proc", 0, None), ctypes.get_errno()))
attempt("unshare a user namespace", lambda: (libc.unshare(0x10000000), ctypes.get_errno()))
""" + SCAN,
    "read a file the controller wrote": """
attempt("the token file", lambda: read(%(file)r))
attempt("its directory", lambda: os.listdir(%(dir)r))
for d in ("/", "/root", "/home", "/etc", "/work", "/dev/shm", "/proc/%(pid)d/root"):
    attempt(d, lambda: os.listdir(d))
attempt("/proc/%(pid)d/root/..", lambda: read("/proc/%(pid)d/root" + %(file)r))
attempt("the shm file", lambda: read(%(shm)r))
""",
    "write outside its directory": """
for path in (%(dir)r + "/escaped", "/escaped", "/usr/lib/escaped", "/dev/escaped",
             "/dev/shm/escaped", "/proc/escaped"):
    attempt(path, lambda: open(path, "w").write("x"))
""",
    "connect to the host's loopback": """
import socket
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", %(port)d), timeout=2))
attempt("interfaces", socket.if_nameindex)
""",
}


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_an_escape_attempt_is_contained(no_leftovers, host, name):
    code = TRY + ATTEMPTS[name] % host
    r = run(run_python(code, limits=SandboxLimits(wall_s=20)))
    assert r.ok, r  # every attempt ran (and printed how it was refused)
    _contained(r, host)
    out = r.output
    if name == "its own environment":
        assert out == "env -> {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'PWD': '/tmp'}\n"
    if "/proc" in name:  # its own PID namespace: bwrap's init, the child and the code
        assert "pids -> ['1', '2', '3']" in out, out
        assert "the controller's environ refused: FileNotFoundError" in out, out
    if name.startswith("unmount"):
        assert "umount2 -> (-1, 1)" in out and "mount -> (-1, 1)" in out, out  # EPERM
        assert "unshare a user namespace -> (-1, 28)" in out, out  # --disable-userns
    if name.startswith("read"):
        assert "the token file refused: FileNotFoundError" in out, out
        assert "/dev/shm -> []" in out and "/root refused" in out and "/etc refused" in out, out
    if name.startswith("write"):
        assert "->" not in out, out  # every write refused
        assert not os.path.exists(os.path.join(host["dir"], "escaped"))
        assert not os.path.exists("/escaped") and not os.path.exists("/dev/shm/escaped")
    if name.startswith("connect"):
        assert "tcp refused: ConnectionRefusedError" in out, out
        assert "interfaces -> [(1, 'lo')]" in out, out  # no interface but its own loopback


def test_a_setsid_child_does_not_outlive_the_call(no_leftovers, host):
    """A child that leaves the session and waits for the call to end, then tries to act."""
    late = os.path.join(host["dir"], "late")
    code = """
import os, socket, sys, time
print(sys.argv[-1], flush=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(2)
        try:
            open(%r, "w").write("escaped")
        finally:
            socket.create_connection(("127.0.0.1", %d), timeout=2)
    os._exit(0)
""" % (late, host["port"])
    r = run(run_python(code))
    assert r.ok, r
    tag = r.output.split()[0].encode()
    assert not _wait_gone(tag, timeout=5), "a process of the call outlived it"
    time.sleep(2.5)
    assert not os.path.exists(late)
    _contained(r, host)


def test_a_fork_storm_is_bounded_and_leaves_nothing(no_leftovers, host):
    code = """
import os, sys
print(sys.argv[-1], flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    # (RLIMIT_NPROC counts every process of the sandbox's host user: 16, below the default
    # 64, leaves room to tool calls running beside it, in this run or another test file's)
    r = run(run_python(code, limits=SandboxLimits(wall_s=3, max_processes=16)))
    assert not r.ok and (r.error.startswith("timeout") or "CPU time limit" in r.error), r
    tag = r.output.split()[0].encode()
    assert not _wait_gone(tag, timeout=10), "a process of the storm outlived the call"
    _contained(r, host)


def test_filling_its_tmpfs_stops_at_its_size(no_leftovers, host):
    code = """
import os
written = 0
try:
    for i in range(10_000):
        with open(f"/tmp/f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        written += 1
except OSError as e:
    print("stopped:", e.strerror)
print("MiB", written)
"""
    r = run(run_python(code, limits=SandboxLimits(tmpfs_mb=16, wall_s=20)))
    assert r.ok, r
    assert "stopped: No space left on device" in r.output, r.output
    assert int(r.output.split()[-1]) <= 16
    _contained(r, host)


def test_two_calls_do_not_see_each_other(no_leftovers, host):
    async def both():
        sleeper = asyncio.ensure_future(run_python(
            "import sys, time\nprint(sys.argv[-1], flush=True)\ntime.sleep(3)"))
        await asyncio.sleep(1.0)
        looker = await run_python(
            TRY + "attempt('cmdlines', lambda: [read(f'/proc/{p}/cmdline')[-40:] for p in "
            "os.listdir('/proc') if p.isdigit()])")
        return await sleeper, looker

    sleeper, looker = run(both())
    assert sleeper.ok and looker.ok, (sleeper, looker)
    assert sleeper.output.split()[0] not in looker.output


def test_the_sandbox_runs_as_its_own_unprivileged_host_user(no_leftovers, host):
    """Started by root, every process of a call (bwrap and the code) belongs on the host to the
    dedicated system user laminar-sandbox (which make setup creates): not root, whom Linux
    exempts from RLIMIT_NPROC, and not nobody, whose limit other daemons share."""
    if os.geteuid() != 0:
        pytest.skip("started by another user, bwrap runs as that user")
    try:
        entry = pwd.getpwnam(bubblewrap.SANDBOX_USER)
    except KeyError:
        pytest.fail(f"no {bubblewrap.SANDBOX_USER} user: make setup creates it "
                    f"({bubblewrap.CREATE_USER})")
    before = _sandbox_processes()

    async def watch():
        call = asyncio.ensure_future(run_python("import time\ntime.sleep(2)"))
        ids = {}
        while not call.done():
            for pid in _sandbox_processes() - before:
                try:
                    status = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
                except OSError:
                    continue
                ids[pid] = {tuple(line.split()[1:]) for line in status
                            if line.startswith(("Uid:", "Gid:"))}
            await asyncio.sleep(0.05)
        return await call, ids

    r, ids = run(watch())
    assert r.ok and len(ids) >= 2, (r, ids)  # bwrap and the interpreter, at least
    want = {(str(entry.pw_uid),) * 4, (str(entry.pw_gid),) * 4}  # real, effective, saved, fs
    assert all(v == want for v in ids.values()), (want, ids)
    _contained(r, host)


# -- no bubblewrap, no agent job -------------------------------------------------------------

def _agent_cfg(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return typed(compose(config_name="config",
                             overrides=["experiment=cpu_agent", *overrides]))


def _task():
    from laminar_mcore.controller.episode import TaskCodec
    from laminar_mcore.controller.server import TaskData
    from laminar_mcore.data.chat import ChatFormat, demo_tokenizer

    return TaskData([], [], TaskCodec(encode_prompt=lambda row: [1], decode=str), None,
                    chat=ChatFormat(demo_tokenizer()))


def test_an_agent_job_without_bubblewrap_refuses_to_start(tmp_path, monkeypatch, request):
    from laminar_mcore.agents.episode import build_episode

    monkeypatch.setattr(bubblewrap, "_probed", {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(bubblewrap.SandboxUnavailable,
                       match=r"LMC-E709: .*bwrap is not on PATH.*apt-get install bubblewrap.*"
                             r"rollout.sandbox=unsafe-local"):
        build_episode(_agent_cfg(), _task(), None)
    r = run(run_python("print(1)"))  # a tool call says the same, as its error
    assert not r.ok and r.error.startswith("LMC-E709")

    # a bwrap that cannot create its namespaces (as where the kernel refuses them), where the
    # sandbox's host user (nobody, as root) can run it
    bin_dir = tempfile.mkdtemp(prefix="laminar-test-bwrap-")
    os.chmod(bin_dir, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(bin_dir, ignore_errors=True))
    monkeypatch.setenv("PATH", bin_dir)
    fake = pathlib.Path(bin_dir) / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bubblewrap, "_probed", {})
    with pytest.raises(bubblewrap.SandboxUnavailable,
                       match=r"cannot create .* namespaces here \(bwrap: setting up uid map: "
                             r"Permission denied\).*kernel.unprivileged_userns_clone"):
        build_episode(_agent_cfg(), _task(), None)


def test_unsafe_local_runs_with_a_warning_in_the_books(tmp_path, monkeypatch, caplog):
    from laminar_mcore.agents import sandbox
    from laminar_mcore.agents.episode import build_episode

    monkeypatch.setattr(bubblewrap, "_probed", {})
    monkeypatch.setattr(sandbox, "_default", ["bubblewrap"])
    monkeypatch.setenv("PATH", str(tmp_path))
    episode = build_episode(_agent_cfg("rollout.sandbox=unsafe-local"), _task(), None)
    assert "no isolation" in caplog.text
    books = episode.books([])
    assert books["sandbox"] == "unsafe-local" and "no isolation" in books["sandbox_warning"]
    r = run(run_python("print(2)"))
    assert r.ok and r.isolation == "unsafe-local"
