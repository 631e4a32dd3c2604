"""bubblewrap (``bwrap``, Debian's ``bubblewrap``, Flatpak's sandbox) for the tool sandbox: the
command line each tool call runs under, the interpreter it runs, and the check that it works.

Each call gets every namespace of its own (user, PID, network, mount, IPC, UTS, cgroup where
the kernel has it), ``--die-with-parent``, a cleared environment, no capabilities, no way to
make further user namespaces, uid/gid 65534 inside, a fresh ``/proc`` of its PID namespace, a
minimal read-only ``/dev`` (its devices work; no ``/dev/shm`` to fill), a private size-limited tmpfs as ``/tmp`` and working directory, and read-only
binds of exactly the interpreter, its standard library (its site-packages hidden) and the
system's library directories. Nothing else of the host is there: not the project's tree, the
run's output directory, ``/root``, ``/home``, ``/etc`` or ``/dev/shm``. The root of the sandbox
is read-only.

The host user: started by root, ``bwrap`` itself runs as the dedicated system user
``SANDBOX_USER`` (``laminar-sandbox``: no home, no shell, no files; ``make setup`` creates it
where it runs as root, or ``useradd --system --no-create-home --shell /usr/sbin/nologin
laminar-sandbox``). Inside a user namespace root's uid 65534 would still be host uid 0, which
Linux exempts from ``RLIMIT_NPROC``; as its own user the sandbox is unprivileged on the host as
well, and the limit bounds a fork storm, counted over the sandbox's processes only (calls
running at once share it). Without that user it falls back to nobody (65534), which other
daemons may share, and says so once. Started by another user, ``bwrap`` runs as that user
(unprivileged user namespaces needed).

The interpreter: the caller's own (a venv's base interpreter, resolved), unless the sandbox's host user
cannot reach it (a Python under ``/root`` when started as root): then ``/usr/bin/python3``.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

SANDBOXES = ("bubblewrap", "unsafe-local")
SANDBOX_USER = "laminar-sandbox"  # bwrap's host user when the caller is root
HOST_UID = HOST_GID = 65534  # nobody / nogroup: the fallback without SANDBOX_USER
CREATE_USER = (f"useradd --system --no-create-home --home-dir /nonexistent "
               f"--shell /usr/sbin/nologin {SANDBOX_USER}")
INSIDE_ID = "65534"
LIB_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32",
            "/usr/libx32")
FALLBACK_PYTHON = "/usr/bin/python3"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
KERNEL_SETTINGS = ("kernel.unprivileged_userns_clone=1 (Debian, Ubuntu) and, on Ubuntu 24.04+, "
                   "kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile "
                   "for bwrap)")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot make its namespaces here (the message says the fix)."""


@dataclass(frozen=True)
class Interpreter:
    path: str  # the binary, resolved
    stdlib: Tuple[str, ...]  # its standard library directories (lib-dynload included)
    site: Tuple[str, ...]  # its site-packages directories (hidden in the sandbox)


def host_ids() -> Optional[Tuple[int, int]]:
    """(uid, gid) bwrap is started as when the caller is root: ``SANDBOX_USER``'s, or nobody's
    where that user does not exist; None (its own) for any other caller."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        return HOST_UID, HOST_GID
    if entry.pw_uid == 0 or entry.pw_gid == 0:  # a misconfigured "sandbox" user is root
        raise SandboxUnavailable(
            f"LMC-E710: the tool sandbox's host user {SANDBOX_USER} has uid {entry.pw_uid}, gid "
            f"{entry.pw_gid}: it must be unprivileged; recreate it ({CREATE_USER})")
    return entry.pw_uid, entry.pw_gid


def reachable(path: str, ids: Optional[Tuple[int, int]]) -> bool:
    """Whether a process of ``ids`` (None: this process) can open ``path`` for reading
    (every directory above it searchable, the file readable), by its mode bits."""
    if ids is None:
        return os.access(path, os.R_OK)
    uid, gid = ids

    def allows(st, bit: int) -> bool:  # bit: 4 read, 1 search/execute
        if st.st_uid == uid:
            return bool(st.st_mode >> 6 & bit)
        if st.st_gid == gid:
            return bool(st.st_mode >> 3 & bit)
        return bool(st.st_mode & bit)

    path = os.path.realpath(path)
    try:
        parts = path.split("/")
        for i in range(1, len(parts) - 1):
            if not allows(os.stat("/" + "/".join(parts[1:i + 1])), 1):
                return False
        return allows(os.stat(path), 4)
    except OSError:
        return False


_QUERY = ("import os, sys, site, sysconfig; print(repr((sorted({sysconfig.get_path('stdlib'), "
          "sysconfig.get_path('platstdlib'), os.path.dirname(os.__file__)}), "
          "sorted(set(site.getsitepackages()) | {sysconfig.get_path('purelib'), "
          "sysconfig.get_path('platlib')}))))")


@functools.lru_cache(maxsize=None)
def interpreter(ids: Optional[Tuple[int, int]], preferred: Optional[str] = None) -> Interpreter:
    """The interpreter tool code runs on (see the module docstring); ``preferred`` overrides the
    caller's own. Raises SandboxUnavailable when none is reachable by the sandbox's user."""
    own = getattr(sys, "_base_executable", None) or sys.executable  # a venv's base Python
    candidates = [preferred] if preferred else [os.path.realpath(own),
                                                os.path.realpath(FALLBACK_PYTHON)]
    for path in candidates:
        if not (os.path.isfile(path) and reachable(path, ids)):
            continue
        out = subprocess.run([path, "-I", "-S", "-c", _QUERY], capture_output=True, text=True,
                             timeout=60, env=dict(ENV))
        if out.returncode == 0:
            import ast

            stdlib, site = ast.literal_eval(out.stdout.strip())
            if all(reachable(d, ids) for d in stdlib):
                return Interpreter(path, tuple(stdlib), tuple(s for s in site if os.path.isdir(s)))
    who = f"uid {ids[0]}" if ids else "this user"
    raise SandboxUnavailable(
        f"LMC-E710: no Python interpreter that the tool sandbox's host user ({who}) can read: "
        f"tried {', '.join(candidates)}. Install Debian's python3 (apt-get install python3) or "
        "run the controller as a user other than root")


@dataclass(frozen=True)
class Setup:
    bwrap: str  # the binary, found on PATH
    python: Interpreter


def argv(setup: Setup, tmpfs_bytes: int) -> List[str]:
    """bwrap's command line up to the interpreter (its arguments follow)."""
    interp = setup.python
    args = [setup.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--clearenv", "--cap-drop", "ALL", "--uid", INSIDE_ID,
            "--gid", INSIDE_ID, "--hostname", "sandbox"]
    for key, value in ENV.items():
        args += ["--setenv", key, value]
    bound: List[str] = []
    for d in LIB_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            bound.append(d)

    def under_bound(path: str) -> bool:
        return any(path == b or path.startswith(b + "/") for b in bound)

    for d in interp.stdlib:
        if not under_bound(d):
            args += ["--ro-bind", d, d]
            bound.append(d)
    for d in interp.site:  # its packages (and the project's, in a venv) stay outside
        if under_bound(d):
            args += ["--tmpfs", d]
    args += ["--ro-bind", interp.path, interp.path, "--proc", "/proc", "--dev", "/dev",
             "--size", str(tmpfs_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
             "--remount-ro", "/dev", "--remount-ro", "/", interp.path]
    return args


_probed: dict = {}


def check() -> Setup:
    """That bubblewrap runs here, as the sandbox runs it (probed once per process and PATH);
    its binary and the interpreter it runs. Raises SandboxUnavailable naming the package or
    the kernel setting."""
    ids, path = host_ids(), os.environ.get("PATH", "")
    key = (ids, path)
    if key in _probed:
        if isinstance(_probed[key], Exception):
            raise _probed[key]
        return _probed[key]
    try:
        found = shutil.which("bwrap", path=path)
        if found is None:
            raise SandboxUnavailable(
                "LMC-E709: the tool sandbox needs bubblewrap, and bwrap is not on PATH: install "
                "it (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), "
                "or set rollout.sandbox=unsafe-local (no isolation at all: only for code you "
                "trust)")
        if ids == (HOST_UID, HOST_GID):
            logger.warning("the tool sandbox runs as nobody on the host (uid %d), which other "
                           "daemons may share, so its process limit is shared too: create its "
                           "own user (%s; make setup does, as root)", HOST_UID, CREATE_USER)
        setup = Setup(os.path.abspath(found), interpreter(ids))
        try:
            out = subprocess.run(argv(setup, 1 << 20) + ["-I", "-S", "-c",
                                                         "import os; print(os.getuid())"],
                                 capture_output=True, text=True, timeout=60, env=dict(ENV),
                                 **popen_user(ids))
        except (OSError, subprocess.SubprocessError) as exc:
            who = f"uid {ids[0]}" if ids else "this user"
            raise SandboxUnavailable(
                f"LMC-E709: bubblewrap ({setup.bwrap}) cannot be started as {who}: {exc}; "
                "install it where that user can run it (apt-get install bubblewrap puts it "
                "in /usr/bin)") from None
        if out.returncode != 0 or out.stdout.strip() != INSIDE_ID:
            why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
            raise SandboxUnavailable(
                f"LMC-E709: bubblewrap ({setup.bwrap}) cannot create the tool sandbox's "
                f"namespaces here ({why}). Unprivileged user namespaces must be allowed: "
                f"{KERNEL_SETTINGS}; in a container, allow them too -- or set "
                "rollout.sandbox=unsafe-local (no isolation at all: only for code you trust)")
        _probed[key] = setup
        return setup
    except SandboxUnavailable as exc:
        _probed[key] = exc
        raise


def popen_user(ids: Optional[Tuple[int, int]]) -> dict:
    """Popen's arguments that start bwrap as the sandbox's host user."""
    if ids is None:
        return {}
    return {"user": ids[0], "group": ids[1], "extra_groups": []}
