"""The names a run's processes show in ``top``, ``ps -o comm``, ``pgrep`` and ``/proc/PID/comm``.

A trainer rank started by torchrun's API is a ``multiprocessing`` spawn child whose command
line and start-up environment say nothing of what it is (torchrun's variables are set after it
starts), so it would look like any other spawned helper (the reward workers). Each trainer rank
names itself ``laminar-trainer`` (Linux ``prctl(PR_SET_NAME)``, at most 15 characters); tools
that look for the trainer (``testing/chaos.py``, an operator's ``pgrep -x laminar-trainer``)
read that name.
"""

from __future__ import annotations

import ctypes
import ctypes.util

TRAINER = "laminar-trainer"
_PR_SET_NAME = 15


def set_process_name(name: str) -> bool:
    """Name the calling process (its main thread) ``name``, cut to 15 bytes; False where the
    platform has no ``prctl`` (the name then stays as it was)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_name(pid: int) -> str:
    """The name ``pid`` runs under ("" when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
