"""The run's trace: one JSON line per trajectory, written when it leaves the system.

``outputs/<run>/trajectories.jsonl`` holds a record for every trajectory the trainer consumed
and every one discarded (with the reason), and, when the run stops, every one still buffered or
in flight (a resumed run later writes their final record: a reader keeps each id's last), so
after a run anyone can see which trajectories
were long, which engines and weight versions generated them, where they were repacked or
resumed, and where their time went. ``python -m laminar_mcore.tools.trace outputs/<run>``
tells that story and draws it. This module is plain data and a file: it never decides anything
about a trajectory and never raises into the run that writes it.

A record::

    {"id", "group", "outcome": "consumed" | "discarded" | "buffered" | "in_flight",
     "discard_reason",
     "prompt_tokens", "response_tokens", "finish_reason", "reward",
     "version",                 # the weight version that generated it (exactly one)
     "versions",                # the distinct versions of its engine-reported spans
     "version_spans",           # [{"version", "start", "end"}] over the response's tokens
     "engines",                 # the engines that generated it, in order
     "segments",                # one per engine request: {"engine", "version", "start", "end",
                                #   "tokens", "how": "new" | "turn" | "resume" | "repack" |
                                #   "interrupt"} (epoch s; "turn": a multi-turn episode's next)
     "repacks", "resumes",      # requests moved by repack; resumed after a failure/interrupt
     "timings",                 # submitted, first_token (the first streamed chunk: rollout
                                # stream_interval tokens' resolution), finished, rewarded,
                                # consumed (epoch s)
     "staleness",               # trainer version - version at consumption (None if discarded)
     "trainer_version"}
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Iterable, List, Optional

from .trajectory import Trajectory

logger = logging.getLogger(__name__)

TRACE_FILE = "trajectories.jsonl"


def trace_record(traj: Trajectory, outcome: str, *, reason: Optional[str] = None,
                 trainer_version: Optional[int] = None) -> dict:
    """The trace line of ``traj`` as it leaves the system (``outcome``: consumed or discarded)."""
    segments = list(traj.metadata.get("segments", ()))
    engines: List[str] = []
    for seg in segments:
        if seg.get("engine") is not None and (not engines or engines[-1] != seg["engine"]):
            engines.append(seg["engine"])
    return {
        "id": traj.uid, "group": traj.group_id, "outcome": outcome,
        "discard_reason": reason if outcome == "discarded" else None,
        "prompt_tokens": len(traj.prompt_ids), "response_tokens": len(traj.response_ids),
        "finish_reason": traj.finish_reason, "reward": traj.reward,
        "version": traj.weight_version, "versions": traj.versions_seen(),
        "version_spans": list(traj.version_spans), "engines": engines, "segments": segments,
        "repacks": int(traj.metadata.get("repacks", 0)),
        "resumes": int(traj.metadata.get("resumes", 0)),
        "timings": dict(traj.timings),
        "staleness": (trainer_version - traj.weight_version
                      if outcome == "consumed" and trainer_version is not None else None),
        "trainer_version": trainer_version,
    }


class TrajectoryTrace:
    """Writes trace records to ``<out_dir>/trajectories.jsonl``, created with the first record:
    a fresh run starts it anew, a resumed run (``resume``) continues it, on a line of its own
    even after a crash cut the last one short. Thread-safe; a failing disk is logged once and
    never stops the run."""

    def __init__(self, out_dir: str, resume: bool = False):
        self.path = os.path.join(out_dir, TRACE_FILE)
        self.resume = resume
        self._file = None
        self._closed = False
        self._lock = threading.Lock()
        self._failed = False
        self.written = 0

    def consumed(self, batch: Iterable[Trajectory], trainer_version: int) -> None:
        self._write([trace_record(t, "consumed", trainer_version=trainer_version) for t in batch])

    def discarded(self, trajs: Iterable[Trajectory], reason: str,
                  trainer_version: Optional[int] = None) -> None:
        self._write([trace_record(t, "discarded", reason=reason, trainer_version=trainer_version)
                     for t in trajs])

    def left_over(self, buffered: Iterable[Trajectory], in_flight: Iterable[Trajectory],
                  trainer_version: Optional[int] = None) -> None:
        """When the run stops: what is still buffered and in flight (so the trace holds every
        trajectory of the books)."""
        self._write([trace_record(t, "buffered", trainer_version=trainer_version)
                     for t in buffered] +
                    [trace_record(t, "in_flight", trainer_version=trainer_version)
                     for t in in_flight])

    def _open(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if not self.resume:
            return open(self.path, "w")
        cut = False
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"  # a crash cut the last record short
        f = open(self.path, "a")
        if cut:
            f.write("\n")
        return f

    def _write(self, records: List[dict]) -> None:
        if not records:
            return
        with self._lock:
            if self._closed or self._failed:
                return
            try:
                if self._file is None:
                    self._file = self._open()
                self._file.write("".join(json.dumps(r) + "\n" for r in records))
                self._file.flush()
                self.written += len(records)
            except (OSError, TypeError, ValueError) as exc:
                if not self._failed:
                    self._failed = True
                    logger.warning("the trajectory trace %s stopped: %r (the run goes on)",
                                   self.path, exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()


def read_trace(path: str) -> List[dict]:
    """The records of a trace file, or of ``<run dir>/trajectories.jsonl``, one per trajectory:
    the last written of each id (a resumed run's record of a trajectory that was buffered at a
    stop supersedes it); a line cut short by a crash is skipped with a warning."""
    if os.path.isdir(path):
        path = os.path.join(path, TRACE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"LMC-E708: {path}: no trajectory trace here (a run writes "
                                f"{TRACE_FILE} in its output directory, outputs/<run>/)")
    records: dict = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d: not a JSON trace record (cut short by a crash?); skipped",
                               path, i)
                continue
            records.pop(record["id"], None)  # the last of an id, in its place in the file
            records[record["id"]] = record
    return list(records.values())
