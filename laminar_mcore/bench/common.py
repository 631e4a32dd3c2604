"""Shared helpers of the benchmarks: figures printed one per line and written as flat JSON;
time to a target accuracy and accuracy curves (``bench.convergence`` and its stored reference)."""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional


def report(figures: Dict[str, object], json_path: Optional[str], lines: Dict[str, str]) -> None:
    """Print ``name: value unit (ratio ...)`` lines and write ``figures`` to ``json_path``."""
    for name, line in lines.items():
        print(f"{name}: {line}", flush=True)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2)


# the targets of bench.convergence's speedup curve, in % of sync's gain
# (laminar_time_speedup_vs_sync_at_<pct>; make demo prints the stored ones)
CURVE = (30, 50, 70, 90, 100)


def crossing(evals: List[dict], target: float,
             steps_of: Callable[[dict], float] = lambda e: e["step"]) -> Optional[dict]:
    """When the accuracy first crossed ``target``, interpolated linearly between the last
    evaluation below it and the first at or above it (in wall time), so that a time to target
    is not rounded up to the next evaluation (``trainer.eval_interval``): ``{"wall_s",
    "steps", "eval"}`` (``eval``: that first evaluation at or above; ``steps`` by
    ``steps_of``). None if no evaluation reached it; the first evaluation's own time if it
    did at once."""
    timed = sorted((e for e in evals if e.get("wall_s") is not None), key=lambda e: e["wall_s"])
    for i, e in enumerate(timed):
        if e["accuracy"] >= target - 1e-12:
            if i == 0:
                return {"wall_s": float(e["wall_s"]), "steps": float(steps_of(e)), "eval": e}
            b = timed[i - 1]
            f = (target - b["accuracy"]) / (e["accuracy"] - b["accuracy"])
            f = min(max(f, 0.0), 1.0)
            return {"wall_s": b["wall_s"] + f * (e["wall_s"] - b["wall_s"]),
                    "steps": steps_of(b) + f * (steps_of(e) - steps_of(b)), "eval": e}
    return None


def plot_accuracy(results: Dict[str, dict], target: float, path: str) -> Optional[str]:
    """Accuracy against wall time, one curve per run, to ``path`` (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode, summary in results.items():
        evals = sorted((e for e in summary["evals"] if e.get("wall_s") is not None),
                       key=lambda e: e["wall_s"])
        ax.plot([e["wall_s"] for e in evals], [e["accuracy"] for e in evals], "o-", label=mode,
                linewidth=2.4 if mode == "laminar" else 1.4)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
    ax.set_xlabel("wall time since the first batch request (s)")
    ax.set_ylabel("held-out accuracy (sampled)")
    ax.set_title("same task, seed and steps: accuracy against wall time")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
