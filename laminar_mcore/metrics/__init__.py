"""Run metrics: metrics.jsonl, TensorBoard events and a PNG summary plot."""

from .writer import MetricsWriter

__all__ = ["MetricsWriter"]
