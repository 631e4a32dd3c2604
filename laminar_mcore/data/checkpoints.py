"""The on-disk layout of a run's training checkpoints, as every role reads it.

``<root>/step_XXXXXXXX/`` is one checkpoint; ``COMPLETE.json`` in it, written last, marks a save
that finished; ``extra_state.json`` is the controller's state saved with it. This module finds
checkpoints and picks the one ``trainer.resume`` names; writing and loading the model and the
optimizer is the trainer's (``trainer/checkpoint.py``). Nothing here imports Megatron, so the
controller resumes its data without the trainer's code.
"""

from __future__ import annotations

import os
import re
from typing import Optional

COMPLETE = "COMPLETE.json"
EXTRA_STATE = "extra_state.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def latest_complete(root: str) -> Optional[str]:
    """The newest checkpoint under ``root`` whose save finished, or None."""
    if not os.path.isdir(root):
        return None
    steps = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, COMPLETE)):
            steps.append((int(m.group(1)), name))
    return os.path.join(root, max(steps)[1]) if steps else None


def resolve_resume(resume: str, root: str) -> Optional[str]:
    """``trainer.resume``: none, auto (newest complete under ``root``) or a directory."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        return latest_complete(root)
    if not os.path.isfile(os.path.join(resume, COMPLETE)):
        raise FileNotFoundError(f"LMC-E207: trainer.resume={resume!r} is not a complete "
                                f"checkpoint (no {COMPLETE}); use auto, none or a step_* "
                                "directory")
    return resume
