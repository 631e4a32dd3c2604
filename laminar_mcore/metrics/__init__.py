"""Run metrics: the loggers of ``trainer.loggers`` (metrics.jsonl, TensorBoard, W&B, MLflow)
and a PNG summary plot."""

from .loggers import LOGGERS, LoggerUnavailable
from .writer import MetricsWriter

__all__ = ["LOGGERS", "LoggerUnavailable", "MetricsWriter"]
