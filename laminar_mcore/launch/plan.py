"""The `plan` job: print and write the capacity plan of a run (``config/plan.py``).

    python -m laminar_mcore.launch job=plan experiment=qwen2_5_72b_math

Needs no checkpoint, no cluster and no GPU; writes ``<output_dir>/<run_name>/plan.json``.
"""

from __future__ import annotations

import json
import os


def run_plan(cfg) -> dict:
    from ..config.plan import capacity_plan
    from ..config.plan_text import format_plan

    plan = capacity_plan(cfg)
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f, indent=2)
    print(format_plan(plan))
    print(f"wrote {path}", flush=True)
    return plan
