"""Command-line tools that read a run's outputs (``python -m laminar_mcore.tools.trace``)."""
