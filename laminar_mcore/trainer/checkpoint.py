"""Training checkpoints: save every ``trainer.save_interval`` steps, resume exactly.

A checkpoint directory ``step_XXXXXXXX`` holds the model as a dist_checkpointing (torch_dist)
checkpoint -- loadable at any TP/PP by the conversion tool -- and, per rank, the optimizer and
LR-scheduler states, the RNG states (CPU, CUDA and the model-parallel tracker) and the weight
version; rank 0 adds the controller's state (prompt pool position, experience buffer, partial
pool) as JSON. A save is written under a ``.partial`` name and renamed, then marked complete
last, so an interrupted save is never picked by ``trainer.resume=auto``. Resuming restores the
optimizer only at the same parallel layout (checked).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    state = {"cpu": torch.get_rng_state(),
             "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(state["cpu"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def latest_complete(root: str) -> Optional[str]:
    """The newest checkpoint under ``root`` whose save finished, or None."""
    if not os.path.isdir(root):
        return None
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
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
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint "
                                f"(no {COMPLETE}); use auto, none or a step_* directory")
    return resume


def save_checkpoint(root: str, step: int, actor, extra_state: Optional[dict] = None,
                    keep: int = 3) -> str:
    """Collective: every trainer rank calls it. Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.join(partial, "model"), exist_ok=True)
    dist.barrier()
    start = time.perf_counter()
    model = actor.model.module if hasattr(actor.model, "module") else actor.model
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(partial, "model"))
    torch.save({"optimizer": actor.optimizer.state_dict(), "scheduler": actor.scheduler.state_dict(),
                "rng": _rng_state(), "version": actor.version,
                "total_nonfinite": actor.total_nonfinite, "layout": _layout()},
               os.path.join(partial, f"rank_{rank:05d}.pt"))
    if rank == 0 and extra_state is not None:
        with open(os.path.join(partial, "extra_state.json"), "w") as f:
            json.dump(extra_state, f)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        with open(os.path.join(final, COMPLETE), "w") as f:  # written last: marks completeness
            json.dump({"step": step, "version": actor.version, "layout": _layout(),
                       "seconds": time.perf_counter() - start}, f)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: str, keep: int) -> None:
    complete = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n)
                      and os.path.isfile(os.path.join(root, n, COMPLETE)))
    for name in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_checkpoint(path: str, actor) -> Tuple[int, Optional[dict]]:
    """Restore ``actor`` from ``path``; returns (step, controller extra state or None)."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, COMPLETE)) as f:
        marker = json.load(f)
    if marker["layout"] != _layout():
        raise RuntimeError(f"checkpoint {path} was saved at layout {marker['layout']}, this run is "
                           f"{_layout()}; resume at the same layout (or convert the model with "
                           "tools/convert_checkpoint.py and start a new run from it)")
    model = actor.model.module if hasattr(actor.model, "module") else actor.model
    state = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(path, "model"))
    model.load_state_dict(state)
    per_rank = torch.load(os.path.join(path, f"rank_{dist.get_rank():05d}.pt"), weights_only=False)
    actor.optimizer.load_state_dict(per_rank["optimizer"])
    actor.scheduler.load_state_dict(per_rank["scheduler"])
    actor.version = per_rank["version"]
    actor.total_nonfinite = per_rank.get("total_nonfinite", 0)
    _set_rng_state(per_rank["rng"])
    extra = None
    extra_path = os.path.join(path, "extra_state.json")
    if os.path.isfile(extra_path):
        with open(extra_path) as f:
            extra = json.load(f)
    return int(marker["step"]), extra
