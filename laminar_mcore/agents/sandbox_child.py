"""The child side of ``agents.sandbox``, run as a script, never imported:

    python -I -S sandbox_child.py STATUS ISOLATION CPU_S MEMORY_BYTES FILE_BYTES NPROC \
        CODE_PATH INPUTS_PATH

The outer process enters private network and PID namespaces (``ISOLATION == "netns"``) and forks;
the inner one (that namespace's init, where there is one) sets its limits, reads the code and its
inputs (INPUTS_PATH: their marshal form, '' for none), installs the audit hook (``ISOLATION ==
"audit-hook"``) and runs the code. The inner writes how the code ended to STATUS as a Python
literal tuple; the outer writes it instead when the inner was killed by a signal. Every tool call
pays for this file's imports, so it imports little, and only what ``-S`` leaves at hand.
"""

import os
import resource
import _signal  # not signal: its enum import costs milliseconds per call
import sys

CLONE_NEWNET_NEWPID = 0x40000000 | 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
# in the fallback: no sockets, and no other program (which the hook would not follow) or C code
REFUSED_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                  "ctypes.dlopen", "ctypes.dlsym")
# modules that start programs or load C code without an audited call of their own
# (_posixsubprocess.fork_exec runs any program)
REFUSED_MODULES = ("_posixsubprocess", "subprocess", "_ctypes", "ctypes", "multiprocessing",
                   "_multiprocessing", "_socket", "socket")


class CpuLimit(BaseException):
    """Raised in the code at the soft CPU limit (not an Exception: ``except Exception`` in the
    code does not swallow it; the hard limit a second later kills whatever does)."""


def write_status(path, *fields):
    with open(path, "w") as f:
        f.write(repr(fields))


def enter_namespaces(status_path):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # (a mount namespace too, where the inner mounts its own /proc: the code sees no process
    # of the host's, so not the environment of the controller that started it)
    if libc.unshare(CLONE_NEWNET_NEWPID | CLONE_NEWNS) != 0:
        write_status(status_path, "setup", "unshare(CLONE_NEWNET|CLONE_NEWPID) failed: "
                     + os.strerror(ctypes.get_errno()))
        os._exit(0)


def private_proc(status_path):
    """In the new PID namespace: mounts private, and a /proc of that namespace only."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0 or libc.mount(
            b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
        write_status(status_path, "setup", "cannot mount a private /proc: "
                     + os.strerror(ctypes.get_errno()))
        os._exit(0)


def wait_for_inner(status_path, pid):
    _, how, usage = os.wait4(pid, 0)
    if os.WIFSIGNALED(how):
        write_status(status_path, "signal", os.WTERMSIG(how), usage.ru_utime + usage.ru_stime)
    os._exit(0)


def set_limits(cpu_s, memory_bytes, file_bytes, nproc):
    def on_xcpu(signum, frame):
        raise CpuLimit()

    _signal.signal(_signal.SIGXCPU, on_xcpu)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # a write past the limit fails (EFBIG)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    except (ValueError, OSError):
        pass


def refuse_network(event, args):
    if event.startswith("socket.") or event in REFUSED_EVENTS or (
            event == "import" and args[0].partition(".")[0] in REFUSED_MODULES):
        raise PermissionError(f"no network and no other programs in this sandbox ({event})")


def describe(error, source):
    """One line for the status, and a traceback of the code's own frames on stderr."""
    detail = f"{type(error).__name__}: {error}"[:500]
    lines, tb, source_lines = [], error.__traceback__, source.splitlines()
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<tool>":
            n = tb.tb_lineno
            lines.append(f"  line {n}, in {tb.tb_frame.f_code.co_name}\n")
            if 0 < n <= len(source_lines):
                lines.append(f"    {source_lines[n - 1].strip()}\n")
        tb = tb.tb_next
    sys.stderr.write("Traceback (most recent call last):\n" + "".join(lines) + detail + "\n")
    return detail


def run_code(source, inputs_path, isolation):
    """Run the code; how it ended, as a status tuple."""
    scope = {"__name__": "__main__", "__builtins__": __builtins__,
             "exit": sys.exit, "quit": sys.exit}  # -S leaves out site's exit() and quit()
    if inputs_path:
        import marshal  # built in; the parent checked that the inputs are JSON-able

        with open(inputs_path, "rb") as f:
            scope["inputs"] = marshal.load(f)
    if isolation == "audit-hook":
        sys.addaudithook(refuse_network)
    try:
        exec(compile(source, "<tool>", "exec"), scope)
    except MemoryError:
        return ("memory",)
    except CpuLimit:
        return ("cpu",)
    except SystemExit as e:
        if e.code in (None, 0):
            return ("ok",)
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        return ("exit", e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - whatever the code raised is its result
        try:
            return ("exception", describe(e, source))
        except BaseException:  # noqa: BLE001 - e.g. a __str__ that raises
            return ("exception", type(e).__name__)
    return ("ok",)


def main():
    status_path, isolation, cpu_s, memory_bytes, file_bytes, nproc, code_path, inputs_path = \
        sys.argv[1:]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if isolation == "netns":
        enter_namespaces(status_path)
    pid = os.fork()
    if pid:
        wait_for_inner(status_path, pid)
    inner = os.getpid()
    if isolation == "netns":
        private_proc(status_path)
    try:
        set_limits(int(cpu_s), int(memory_bytes), int(file_bytes), int(nproc))
    except (ValueError, OSError) as e:  # e.g. above the hard limits of a non-root caller
        write_status(status_path, "setup", f"cannot set the limits: {e}")
        os._exit(0)
    with open(code_path, encoding="utf-8") as f:
        source = f.read()
    end = run_code(source, inputs_path, isolation)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - a closed or broken stream changes nothing here
        pass
    if os.getpid() == inner:  # not a process the code forked that ran on to here
        write_status(status_path, *end)
    os._exit(0)  # threads the code left running end with it


if __name__ == "__main__":
    main()
