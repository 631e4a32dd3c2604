"""Shared helpers of the benchmarks: figures printed one per line and written as flat JSON;
time to a target accuracy and accuracy curves (``bench.convergence`` and its stored reference)."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional


def report(figures: Dict[str, object], json_path: Optional[str], lines: Dict[str, str]) -> None:
    """Print ``name: value unit (ratio ...)`` lines and write ``figures`` to ``json_path``."""
    for name, line in lines.items():
        print(f"{name}: {line}", flush=True)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2)


def time_to_target(evals: List[dict], target: float) -> Optional[dict]:
    """The first evaluation (in wall time) at or above ``target``; None if none reached it."""
    timed = sorted((e for e in evals if e.get("wall_s") is not None), key=lambda e: e["wall_s"])
    return next((e for e in timed if e["accuracy"] >= target - 1e-12), None)


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
