"""Sends each run record to the loggers of ``trainer.loggers`` (metrics/loggers.py: jsonl,
TensorBoard, W&B, MLflow), keeps the records in memory for the progress bar and the summary,
and draws the run's plot (reward, staleness, throughput) at the end. Logging never raises into
the run once the writer is built."""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional, Sequence

from .loggers import DEFAULT_LOGGERS, build_loggers, call_quietly


class MetricsWriter:
    def __init__(self, out_dir: str, loggers: Sequence[str] = DEFAULT_LOGGERS,
                 run_name: str = "default", wandb_project: Optional[str] = None,
                 mlflow_tracking_uri: Optional[str] = None,
                 mlflow_experiment: Optional[str] = None, run_config: Optional[dict] = None):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._lock = threading.Lock()
        self.records: List[dict] = []
        self._loggers = build_loggers(list(loggers), out_dir, run_name, wandb_project,
                                      mlflow_tracking_uri, mlflow_experiment, run_config)
        self._closed = False

    @classmethod
    def for_run(cls, cfg, out_dir: str) -> "MetricsWriter":
        """The writer of a run (``LaminarConfig``): its ``trainer.loggers`` and their settings."""
        from ..config import as_dict

        t = cfg.trainer
        return cls(out_dir, list(t.loggers), run_name=cfg.run_name,
                   wandb_project=t.wandb_project, mlflow_tracking_uri=t.mlflow_tracking_uri,
                   mlflow_experiment=t.mlflow_experiment, run_config=as_dict(cfg))

    def log(self, kind: str, step: Optional[int] = None, **values) -> None:
        record = {"kind": kind, "time": time.time(), **({"step": step} if step is not None else {}),
                  **values}
        with self._lock:
            self.records.append(record)
            if self._closed:
                return
            for backend in self._loggers:
                call_quietly(backend, "log", record)

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
        """Flush and close every logger (W&B and MLflow runs end here); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for backend in self._loggers:
                call_quietly(backend, "close")
