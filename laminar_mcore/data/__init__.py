"""Data types shared by every role (Trajectory), the controller's pools, the synthetic task and
its warm-up checkpoint, and the layout of training checkpoints (``checkpoints``)."""

from .trajectory import FINISH_REASONS, Trajectory

__all__ = ["Trajectory", "FINISH_REASONS"]
