"""Start-up cost: Megatron-Core's ``megatron.core.timers`` imports Weights & Biases at module level
(``try: import wandb``) for a timer writer laminar never hands it. Where wandb is installed that
import is about 2 of the 6 CPU-seconds ``import megatron.core`` takes, paid again by every trainer
rank, converter and benchmark process. :func:`install` (called when ``laminar_mcore`` is imported)
answers that one import with ``ImportError``, which Megatron already handles (its ``wandb`` is
``None``, as on a machine without it); every other ``import wandb`` -- laminar's own
``trainer.loggers=[wandb]`` -- is untouched. ``LAMINAR_MEGATRON_WANDB=1`` turns it off.

Megatron applies ``torch.compile`` at import: ``megatron.core.jit.jit_fuser`` is ``torch.compile``
for every fusion module's functions, and the MoE router decorates one method with it. Each
decoration imports TorchDynamo and Inductor, about 1.5 of the 4 CPU-seconds the trainer's
imports take, for functions that are compiled on their first call anyway. While those two
modules execute, ``torch.compile`` is :func:`lazy_compile`: the same ``torch.compile`` with the
same arguments, applied at the function's first call instead of at import (where it only
wrapped). ``LAMINAR_MEGATRON_EAGER_COMPILE=1`` keeps Megatron's imports as they are."""

import importlib.abc
import importlib.machinery
import os
import sys

#: the modules whose module-level ``import wandb`` is answered with ImportError
SKIP_WANDB_FOR = ("megatron.core.timers",)


#: the Megatron modules that call ``torch.compile`` while they execute (module level)
LAZY_COMPILE_IN = ("megatron.core.jit", "megatron.core.transformer.moe.router")


def lazy_compile(model=None, **kwargs):
    """``torch.compile(model, **kwargs)`` made at ``model``'s first call: a function that
    compiles on first use, like torch.compile's own result, without importing TorchDynamo
    until then. Also usable as ``@lazy_compile(**kwargs)``."""
    import functools

    if model is None:
        return lambda fn: lazy_compile(fn, **kwargs)
    compiled = []

    @functools.wraps(model)
    def call(*args, **kw):
        if not compiled:
            import torch

            compiled.append(_TORCH_COMPILE.get("compile", torch.compile)(model, **kwargs))
        return compiled[0](*args, **kw)

    call.__laminar_lazy_compile__ = True
    return call


_TORCH_COMPILE: dict = {}  # the real torch.compile, while a module runs with lazy_compile


class _LazyCompileWhile(importlib.abc.Loader):
    """Executes a module of LAZY_COMPILE_IN with ``torch.compile`` = :func:`lazy_compile`,
    and puts the real one back after it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import torch

        real = _TORCH_COMPILE.setdefault("compile", torch.compile)
        torch.compile = lazy_compile
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real


class _MegatronImportCost:
    """A meta-path finder that refuses ``wandb`` only while one of SKIP_WANDB_FOR executes
    (``skip_wandb``), and runs the modules of LAZY_COMPILE_IN with :class:`_LazyCompileWhile`
    (``lazy``)."""

    def __init__(self, skip_wandb: bool = True, lazy: bool = True):
        self.skip_wandb, self.lazy = skip_wandb, lazy

    def find_spec(self, fullname, path=None, target=None):
        if fullname in LAZY_COMPILE_IN and self.lazy:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _LazyCompileWhile(spec.loader)
            return spec
        if fullname != "wandb" or not self.skip_wandb:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") in SKIP_WANDB_FOR:
                raise ImportError("wandb skipped for megatron.core.timers (laminar_mcore."
                                  "import_cost; LAMINAR_MEGATRON_WANDB=1 keeps it)")
            frame = frame.f_back
        return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once); False when Megatron was imported
    already (too late for either) or found installed."""
    if any(isinstance(f, _MegatronImportCost) for f in sys.meta_path):
        return True
    if "megatron.core.timers" in sys.modules or LAZY_COMPILE_IN[0] in sys.modules:
        return False
    sys.meta_path.insert(0, _MegatronImportCost(
        skip_wandb=os.environ.get("LAMINAR_MEGATRON_WANDB") != "1",
        lazy=os.environ.get("LAMINAR_MEGATRON_EAGER_COMPILE") != "1"))
    return True
