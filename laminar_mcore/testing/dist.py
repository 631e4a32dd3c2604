"""Spawn and reap a real torchrun group on loopback, for tests and benchmarks.

One helper for every multi-process test: it picks a free port, starts
``python -m torch.distributed.run`` in its own session, passes each rank an output directory,
collects the JSON each rank wrote, and always kills the whole process group on exit, timeout or
failure, so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..netutil import free_port  # noqa: F401  (re-exported for tests)


class TorchrunError(RuntimeError):
    """A torchrun group failed or timed out; the message carries the tail of its output."""


def rank_output_path(out_dir: str | os.PathLike, rank: Optional[int] = None) -> Path:
    """Where a rank writes its JSON result (``rank`` defaults to $RANK)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    return Path(out_dir) / f"rank{rank}.json"


def write_rank_result(out_dir: str | os.PathLike, result: dict) -> None:
    """Called by a worker: write this rank's result atomically."""
    path = rank_output_path(out_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def run_torchrun(script: str | os.PathLike, nproc: int, args: Sequence[str] = (),
                 timeout: float = 600.0, env: Optional[Dict[str, str]] = None,
                 out_dir: Optional[str] = None) -> List[dict]:
    """Run ``script`` under torchrun with ``nproc`` local ranks; return each rank's JSON.

    The script receives ``--out DIR`` after ``args`` and must write ``DIR/rank{RANK}.json``
    (``write_rank_result``). Raises ``TorchrunError`` on a non-zero exit or timeout.
    """
    own_dir = out_dir is None
    out_dir = out_dir or tempfile.mkdtemp(prefix="laminar-torchrun-")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           "--local-addr=127.0.0.1", "--max-restarts=0", str(script), *args, "--out", out_dir]
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    child_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        raise TorchrunError(f"torchrun {script} timed out after {timeout}s:\n{output[-6000:]}")
    finally:
        _kill_group(proc)
    if proc.returncode != 0:
        raise TorchrunError(f"torchrun {script} exited with {proc.returncode}:\n{output[-6000:]}")
    results = []
    for rank in range(nproc):
        path = rank_output_path(out_dir, rank)
        if not path.exists():
            raise TorchrunError(f"rank {rank} wrote no result ({path}):\n{output[-6000:]}")
        results.append(json.loads(path.read_text()))
    if own_dir:
        for path in Path(out_dir).glob("*"):
            path.unlink(missing_ok=True)
        os.rmdir(out_dir)
    return results


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill torchrun and every process it started (they share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
