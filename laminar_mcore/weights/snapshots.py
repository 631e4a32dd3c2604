"""Evaluation snapshots (``trainer.eval_offline``): where the trainer and the controller meet.

At every ``trainer.eval_interval`` step the trainer writes its weights as a Hugging Face
checkpoint directory ``<run>/eval_snapshots/step_<step>`` (``trainer.export.save_snapshot``),
with ``laminar_snapshot.json`` naming the step and the weight version; after training the
controller loads each one into an engine from disk and evaluates it (``controller.role``), so
that evaluating takes no time from training. The engines load it by its path: on several
machines the directory must be on a filesystem that the trainer nodes write and the rollout
nodes read. A directory is complete once it has that name: it
is written as ``<name>.partial`` and renamed.
"""

from __future__ import annotations

import json
import os
from typing import List, Tuple

SNAPSHOTS = "eval_snapshots"
SNAPSHOT_META = "laminar_snapshot.json"


def snapshot_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, SNAPSHOTS, f"step_{step:06d}")


def list_snapshots(run_dir: str) -> List[Tuple[int, int, str]]:
    """(step, version, absolute directory: engines resolve it, not this process) of every
    complete snapshot of the run, by step."""
    root = os.path.abspath(os.path.join(run_dir, SNAPSHOTS))
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        meta = os.path.join(root, name, SNAPSHOT_META)
        if name.endswith(".partial") or not os.path.isfile(meta):
            continue
        with open(meta) as f:
            info = json.load(f)
        out.append((int(info["step"]), int(info["version"]), os.path.join(root, name)))
    return sorted(out)
