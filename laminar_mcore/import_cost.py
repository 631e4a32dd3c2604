"""Start-up cost: Megatron-Core's ``megatron.core.timers`` imports Weights & Biases at module level
(``try: import wandb``) for a timer writer laminar never hands it. Where wandb is installed that
import is about 2 of the 6 CPU-seconds ``import megatron.core`` takes, paid again by every trainer
rank, converter and benchmark process. :func:`install` (called when ``laminar_mcore`` is imported)
answers that one import with ``ImportError``, which Megatron already handles (its ``wandb`` is
``None``, as on a machine without it); every other ``import wandb`` -- laminar's own
``trainer.loggers=[wandb]`` -- is untouched. ``LAMINAR_MEGATRON_WANDB=1`` turns it off."""

import os
import sys

#: the modules whose module-level ``import wandb`` is answered with ImportError
SKIP_WANDB_FOR = ("megatron.core.timers",)


class _SkipWandbForMegatron:
    """A meta-path finder that refuses ``wandb`` only while one of SKIP_WANDB_FOR executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "wandb":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") in SKIP_WANDB_FOR:
                raise ImportError("wandb skipped for megatron.core.timers (laminar_mcore."
                                  "import_cost; LAMINAR_MEGATRON_WANDB=1 keeps it)")
            frame = frame.f_back
        return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once); False when turned off or wandb, or
    Megatron's timers, were imported already."""
    if os.environ.get("LAMINAR_MEGATRON_WANDB") == "1" or "megatron.core.timers" in sys.modules:
        return False
    if any(isinstance(f, _SkipWandbForMegatron) for f in sys.meta_path):
        return True
    sys.meta_path.insert(0, _SkipWandbForMegatron())
    return True
