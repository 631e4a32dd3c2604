"""CPU compatibility layer for Megatron-Core 0.19 on a CPU build of torch.

Owns every adaptation that lets Megatron-Core's model, pipeline schedules, tensor-parallel
layers, optimizer helpers and dist_checkpointing run with gloo on a machine without CUDA:

* ``torch.cuda.current_device()`` answers ``cpu`` instead of raising;
* inside ``megatron.core`` modules, the name ``torch`` is rebound to a thin namespace in which
  factory functions (``zeros``, ``empty``, ``tensor``, ...) map ``device="cuda"`` to the CPU and
  ``torch.cuda`` streams, events, synchronisation and NVTX ranges are no-ops;
* the CUDA RNG tracker is replaced by one that forks the CPU generator, so
  ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` keep their meaning,
  and activation recompute's save/restore of the device RNG state is empty;
* Megatron's torch norm takes sequence parallelism as Transformer Engine's does (its weights
  marked ``sequence_parallel``, their gradients summed over TP);
* the MoE dispatcher's host copies of its all-to-all split sizes (``maybe_move_tensor_to_cpu``,
  which leaves CPU tensors as they are) give numpy arrays, as they do from GPU tensors;
* gradient clipping (``clip_grad_by_total_norm_fp32``, which asserts CUDA tensors and uses an
  apex kernel) scales the CPU gradients with ``torch._foreach_mul_``;
* the tied-embedding set-up's and the distributed optimizer's DP gather's ``tensor.cuda()``
  keep the tensor on the CPU, and the distributed optimizer's ``tensor.type()`` check of its
  parameters sees the CUDA type name of their dtype.

It is applied only when CUDA is absent (``apply_cpu_compat()`` is a no-op otherwise) and it
never edits installed files: everything happens on module objects at run time. It must never be
imported by engine code: engines do not use Megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import sys
import types

import torch

__all__ = ["apply_cpu_compat", "is_applied", "CpuRNGStatesTracker"]

_APPLIED = False

# torch factory functions whose ``device`` argument Megatron hard-codes to "cuda".
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_strided", "as_tensor", "zeros_like", "ones_like", "empty_like", "full_like",
)

# Megatron-Core packages imported (so that their ``torch`` can be rebound) when the layer is
# applied. Modules imported later are rebound by a second ``apply_cpu_compat()`` call, which is
# cheap; ``laminar_mcore`` calls it again after building models and optimizers.
_MEGATRON_PACKAGES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
)


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare ordinal means a CUDA device in torch's API


def _to_cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _NullStream:
    """Stands in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _noop(*args, **kwargs):
    return None


def _cpu_device(*args, **kwargs):
    return torch.device("cpu")


def _build_cuda_namespace() -> types.ModuleType:
    ns = types.ModuleType("torch.cuda[laminar-cpu]")
    ns.__dict__.update(torch.cuda.__dict__)
    ns.current_device = _cpu_device
    ns.Stream = _NullStream
    ns.Event = _NullStream
    ns.ExternalStream = _NullStream
    ns.current_stream = lambda *a, **k: _NullStream()
    ns.default_stream = lambda *a, **k: _NullStream()
    ns.stream = lambda *a, **k: contextlib.nullcontext()
    ns.device = lambda *a, **k: contextlib.nullcontext()
    ns.set_stream = _noop
    ns.synchronize = _noop
    ns.empty_cache = _noop
    ns.set_device = _noop
    ns.memory_allocated = lambda *a, **k: 0
    ns.max_memory_allocated = lambda *a, **k: 0
    ns.memory_reserved = lambda *a, **k: 0
    ns.memory_stats = lambda *a, **k: {}
    ns.is_current_stream_capturing = lambda: False
    ns.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop,
                                    range=lambda *a, **k: contextlib.nullcontext(), mark=_noop)
    return ns


def _build_torch_namespace(cuda_ns: types.ModuleType) -> types.ModuleType:
    ns = types.ModuleType("torch[laminar-cpu]")
    ns.__dict__.update(torch.__dict__)
    for name in _FACTORIES:
        setattr(ns, name, _to_cpu_factory(getattr(torch, name)))
    ns.cuda = cuda_ns
    return ns


class CpuRNGStatesTracker:
    """The CPU twin of Megatron's ``CudaRNGStatesTracker``: named CPU generator states.

    ``fork(name)`` swaps the default CPU generator to the named state and back, which is what
    the CUDA tracker does with the device generator (dropout in tensor-parallel regions draws
    from the per-TP-rank state, everything else from the data-parallel one).
    """

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added to the tracker")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_TORCH_NS: types.ModuleType | None = None

# Megatron methods that call ``tensor.cuda()`` directly; on CPU the call keeps the tensor where
# it is, only for the duration of these methods.
_TENSOR_CUDA_CALLERS = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
    # the fully_reshardable optimizer checkpoint gathers the DP shards of Adam's state
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
     "get_parameter_state_dp_zero"),
)

# Megatron methods that accept parameters only if ``tensor.type()`` names a CUDA type (the
# distributed optimizer sorts its fp32 / fp16 / bf16 shards that way); on CPU ``type()``
# answers the CUDA name of the same dtype, only for the duration of these methods.
_TENSOR_TYPE_CALLERS = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def _tensor_type_is_cuda():
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA-only assertion and apex
    kernel: scale every gradient in place by min(1, max_norm / total_norm)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
        if grads:
            torch._foreach_mul_(grads, clip_coeff.to(grads[0].device))
    elif clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    for module in (clip_grads, moptimizer):
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu


def _move_to_host_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu`` for a process whose tensors are already on the
    host: the same result as the GPU path (a numpy array with ``as_numpy``: the MoE all-to-all
    dispatcher's split sizes, which ``all_to_all_single`` takes as a sequence of ints)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _patch_torch_norm_sequence_parallel() -> None:
    """Megatron's local-spec norm (``WrappedTorchNorm``, torch's RMSNorm/LayerNorm) refuses
    sequence parallelism, which on GPUs comes with Transformer Engine's ``TENorm``. Under SP a
    norm is per token, so the only thing TE adds is marking its weights ``sequence_parallel``
    (each TP rank sees a slice of the tokens; ``finalize_model_grads`` sums those gradients over
    TP). This does the same with torch's norm, so CPU runs train the SP code path -- Megatron's
    sequence scatter/gather, reduce-scatter linears and MoE layers with TP > 1 -- as GPUs do."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_laminar_cpu", False):
        return

    def __new__(cls, config, hidden_size, *args, **kwargs):
        sp = bool(getattr(config, "sequence_parallel", False))
        if sp:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original(cls, config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sp
        return norm

    __new__._laminar_cpu = True
    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_moe_host_copies() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = _move_to_host_cpu


def _wrap_tensor_cuda_callers() -> None:
    callers = [(c, _tensor_cuda_is_identity) for c in _TENSOR_CUDA_CALLERS]
    callers += [(c, _tensor_type_is_cuda) for c in _TENSOR_TYPE_CALLERS]
    for (module_name, cls_name, method_name), context in callers:
        cls = getattr(importlib.import_module(module_name), cls_name)
        method = getattr(cls, method_name)
        if getattr(method, "_laminar_cpu", False):
            continue

        @functools.wraps(method)
        def wrapper(*args, __method=method, __context=context, **kwargs):
            with __context():
                return __method(*args, **kwargs)

        wrapper._laminar_cpu = True
        setattr(cls, method_name, wrapper)


def _rebind_megatron_modules() -> int:
    """Point the ``torch`` global of every loaded megatron.core module at the CPU namespace."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        if module.__dict__.get("torch") is torch:
            module.torch = _TORCH_NS
            count += 1
    return count


def _import_megatron_packages() -> None:
    for pkg_name in _MEGATRON_PACKAGES:
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=pkg_name + "."):
            # Transformer-Engine/Apex-only and experimental modules may fail to import on CPU.
            if any(part in info.name for part in ("transformer_engine", "apex", "experimental",
                                                  "fsdp", "cuda_graphs", "inference")):
                continue
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - optional modules with GPU-only dependencies
                pass


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute saves and restores "all" RNG states: the CPU one (torch's, real) and
    # the device one, which a CPU process does not have (an empty state, a no-op restore).
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = _noop

    original = mrandom.initialize_rng_tracker

    if getattr(original, "_laminar_cpu", False):
        return

    @functools.wraps(original)
    def initialize_rng_tracker(*args, force_reset=False, **kwargs):
        # A forced reset must still produce the CPU tracker, never the CUDA one.
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker._laminar_cpu = True
    mrandom.initialize_rng_tracker = initialize_rng_tracker


def is_applied() -> bool:
    return _APPLIED


def apply_cpu_compat(force: bool = False) -> bool:
    """Adapt Megatron-Core to a CPU-only process. Returns True when the layer is active.

    Idempotent; a no-op when CUDA is available (unless ``force``). Call it before building any
    Megatron object; calling it again later also covers megatron modules imported since.
    """
    global _APPLIED, _TORCH_NS
    if torch.cuda.is_available() and not force:
        return False
    if _TORCH_NS is None:
        _TORCH_NS = _build_torch_namespace(_build_cuda_namespace())
    if not _APPLIED:
        torch.cuda.current_device = _cpu_device  # raises on a CPU build; Megatron calls it often
        _import_megatron_packages()
        _install_rng_tracker()
        _wrap_tensor_cuda_callers()
        _patch_grad_clipping()
        _patch_moe_host_copies()
        _patch_torch_norm_sequence_parallel()
        _APPLIED = True
    _rebind_megatron_modules()
    return True
