"""The child side of ``agents.sandbox``, passed to the interpreter as ``-c`` text, never imported:

    python -I -S -c "<this file>" STATUS_FD CPU_S MEMORY_BYTES FILE_BYTES NPROC CODE_FD TAG

Under bubblewrap (agents/bubblewrap.py) the namespaces, the filesystem view and the cleared
environment are already in place when it starts. The outer process forks; the inner sets its
limits, reads the code and its inputs (CODE_FD: a memory file holding their marshal form) and
runs the code. The inner writes how the code ended to STATUS_FD (a memory file) as a Python
literal tuple; the outer writes it instead when the inner was killed by a signal. TAG (the
call's id) is only there to name the call's processes. Every tool call pays for this file's
imports, so it imports little, and only what ``-S`` leaves at hand.
"""

import os
import resource
import _signal  # not signal: its enum import costs milliseconds per call
import sys


class CpuLimit(BaseException):
    """Raised in the code at the soft CPU limit (not an Exception: ``except Exception`` in the
    code does not swallow it; the hard limit a second later kills whatever does)."""


def write_status(fd, *fields):
    os.ftruncate(fd, 0)
    os.pwrite(fd, repr(fields).encode(), 0)


def wait_for_inner(status_fd, pid):
    _, how, usage = os.wait4(pid, 0)
    if os.WIFSIGNALED(how):
        write_status(status_fd, "signal", os.WTERMSIG(how), usage.ru_utime + usage.ru_stime)
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


def run_code(source, inputs):
    """Run the code; how it ended, as a status tuple."""
    scope = {"__name__": "__main__", "__builtins__": __builtins__,
             "exit": sys.exit, "quit": sys.exit}  # -S leaves out site's exit() and quit()
    if inputs is not None:
        scope["inputs"] = inputs
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
    status_fd, cpu_s, memory_bytes, file_bytes, nproc, code_fd = map(int, sys.argv[1:7])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    pid = os.fork()
    if pid:
        wait_for_inner(status_fd, pid)
    inner = os.getpid()
    try:
        set_limits(cpu_s, memory_bytes, file_bytes, nproc)
    except (ValueError, OSError) as e:  # e.g. above the hard limits of a non-root caller
        write_status(status_fd, "setup", f"cannot set the limits: {e}")
        os._exit(0)
    import marshal  # built in; the parent checked that the inputs are JSON-able

    source, inputs = marshal.loads(os.pread(code_fd, os.fstat(code_fd).st_size, 0))
    os.close(code_fd)
    end = run_code(source, inputs)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - a closed or broken stream changes nothing here
        pass
    if os.getpid() == inner:  # not a process the code forked that ran on to here
        write_status(status_fd, *end)
    os._exit(0)  # threads the code left running end with it


if __name__ == "__main__":
    main()
