"""Data types shared by every role (Trajectory) and the controller's pools."""

from .trajectory import FINISH_REASONS, Trajectory

__all__ = ["Trajectory", "FINISH_REASONS"]
