"""Writes one JSON object per event to ``metrics.jsonl`` and scalars to TensorBoard, and draws
the run's plot (reward, staleness, throughput) at the end."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import List, Optional


class MetricsWriter:
    def __init__(self, out_dir: str, tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.path, "a")
        self._lock = threading.Lock()
        self.records: List[dict] = []
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except Exception:  # noqa: BLE001 - metrics must never stop a run
                self._tb = None

    def log(self, kind: str, step: Optional[int] = None, **values) -> None:
        record = {"kind": kind, "time": time.time(), **({"step": step} if step is not None else {}),
                  **values}
        with self._lock:
            self.records.append(record)
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None and step is not None:
                for key, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(f"{kind}/{key}", value, step)

    def plot(self, filename: str = "summary.png") -> Optional[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception:  # noqa: BLE001
            return None
        steps = [r for r in self.records if r["kind"] == "train"]
        if not steps:
            return None
        # the train/inference mismatch panel, on steps with tokens of the trainer's own version
        mism = [r for r in steps if r.get("mismatch_tokens", 0) > 0]
        fig, axes = plt.subplots(1, 4 if mism else 3, figsize=(17 if mism else 13, 3.6))
        x = [r["step"] for r in steps]
        axes[0].plot(x, [r.get("reward_mean", 0.0) for r in steps], label="batch reward")
        evals = sorted((r for r in self.records if r["kind"] == "eval"), key=lambda r: r["step"])
        if evals:
            axes[0].plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-",
                         label="eval accuracy (sampled)")
            greedy = [r for r in evals if "accuracy_greedy" in r]
            if greedy:
                axes[0].plot([r["step"] for r in greedy], [r["accuracy_greedy"] for r in greedy],
                             "s--", label="eval accuracy (greedy)")
        axes[0].set_title("reward")
        axes[0].legend()
        axes[1].plot(x, [r.get("staleness_mean", 0.0) for r in steps], label="mean")
        axes[1].plot(x, [r.get("staleness_max", 0.0) for r in steps], label="max")
        axes[1].set_title("staleness at consumption (versions)")
        axes[1].legend()
        axes[2].plot(x, [r.get("tokens_per_s", 0.0) for r in steps])
        axes[2].set_title("trainer-consumed tokens/s")
        if mism:
            mx = [r["step"] for r in mism]
            for key, label in (("mismatch_mean", "mean"), ("mismatch_p99", "p99"),
                               ("mismatch_max", "max")):
                axes[3].plot(mx, [max(r.get(key, 0.0), 1e-9) for r in mism], "o-", label=label)
            axes[3].set_yscale("log")
            axes[3].set_title("|log pi_engine - log pi_trainer| (same version)")
            axes[3].legend()
        for ax in axes:
            ax.set_xlabel("step")
        fig.tight_layout()
        path = os.path.join(self.out_dir, filename)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
