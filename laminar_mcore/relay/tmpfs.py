"""Room in ``/dev/shm`` (``weights.bucket.SHM_DIR``) for a relay's buffers, and the store's
errors: how much is free, the message that says how to make room, and allocating a buffer's
pages up front so that a full tmpfs is an error, never a SIGBUS."""

from __future__ import annotations

import errno
import os
from typing import Optional, Tuple

from ..weights.bucket import SHM_DIR, ShmBucket


class VersionError(ValueError):
    """A version that is not newer than what the relay already has."""


class BusyError(VersionError):
    """The version is being received from another source right now."""


class StoreFull(BusyError):
    """``max_versions`` versions hold buffers and none was released in time."""


class ShmFull(VersionError):
    """/dev/shm has no room for what the relay must hold."""


def shm_space() -> Tuple[int, int]:
    """(free, total) bytes of the filesystem the relay's buffers live in (``SHM_DIR``)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def shm_shortfall(need: int, what: str) -> Optional[str]:
    """None if ``SHM_DIR`` has ``need`` bytes free; else the message saying that ``what`` (a
    subject and its verb: "version 3 needs") needs them, and the mount size that would hold
    them beside what is there now."""
    free, total = shm_space()
    if need <= free:
        return None
    mount = total - free + need
    size = f"{-(-mount // 10**9)}G" if mount >= 10**9 else f"{-(-mount // 10**6)}M"
    return (f"LMC-E500: {SHM_DIR} has {size_text(free)} free of {size_text(total)}, but {what} "
            f"{size_text(need)}: enlarge it (mount -o remount,size={size} {SHM_DIR}; docker: "
            f"--shm-size={size.lower()}) and set cluster.shm_gb to its size (job=plan checks "
            "the run against it), or free what else fills it")


def size_text(nbytes: float) -> str:
    """``nbytes`` in GB (MB below 0.1 GB), for messages."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def reserve(shm: ShmBucket) -> None:
    """Allocate every page of ``shm``'s file now: a full tmpfs says ENOSPC here, where a write
    to a sparse page would kill the process with SIGBUS."""
    fd = os.open(shm.path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, shm.nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            return  # a filesystem without fallocate: nothing to reserve
        shm.close()
        raise ShmFull(shm_shortfall(shm.nbytes, "a weight bucket needs")
                      or f"LMC-E500: cannot allocate a {size_text(shm.nbytes)} weight bucket in "
                         f"{SHM_DIR}: "
                         f"{exc} (a memory limit on this container or cgroup?)") from None
    finally:
        os.close(fd)
