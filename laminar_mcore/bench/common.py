"""Shared helpers of the benchmarks: figures printed one per line and written as flat JSON."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional


def report(figures: Dict[str, object], json_path: Optional[str], lines: Dict[str, str]) -> None:
    """Print ``name: value unit (ratio ...)`` lines and write ``figures`` to ``json_path``."""
    for name, line in lines.items():
        print(f"{name}: {line}", flush=True)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2)
