"""CPU twins of the fused Adam optimizers Megatron-Core picks on GPU machines.

Megatron-Core 0.19.2 chooses its Adam at import time (``megatron/core/optimizer/__init__.py``
and ``distrib_optimizer.py``): Transformer Engine's ``FusedAdam`` when
``transformer_engine.pytorch.optimizers`` imports, else Apex's, else torch's ``Adam``/``AdamW``.
Neither fused optimizer runs without CUDA, and the two keep their state differently from torch's
(the step count lives in each *param group*, not in each parameter's state), which is exactly where
checkpoint code breaks. These classes follow each one's state contract as its source defines it,
with the same Adam arithmetic as their CUDA kernels, so that the trainer's save/resume can be run
on CPU with the optimizer class a GPU machine gets:

- ``TEFusedAdamTwin``: ``transformer_engine/pytorch/optimizers/fused_adam.py`` of
  transformer-engine 2.20.2 (the ``[gpu]`` pin in setup.py). ``state_dict`` returns
  ``get_unscaled_state(param, name)`` for every key of a parameter's state and
  ``load_state_dict`` calls ``set_scaled_state`` for every key; both look the key up in
  ``name_to_dtype_map`` (``exp_avg``, ``exp_avg_sq``, ``master_param``), so any other key
  (a torch-style ``step``) raises ``KeyError``. ``step`` advances ``group["step"]`` (an int) for
  every group, empty or not, and initialises a parameter's state with ``initialize_state``.
- ``ApexFusedAdamTwin``: ``apex/optimizers/fused_adam.py`` of NVIDIA/apex (commit 004da4e; Apex
  has no PyPI release): torch's own ``state_dict``/``load_state_dict``, ``group["step"]`` advanced
  before the parameters are visited, ``exp_avg``/``exp_avg_sq`` created as fp32 zeros at a
  parameter's first step, ``zero_grad()`` without arguments; an empty param group fails (it
  reads the group's first parameter's device before anything else).

Both kernels' bindings take ``int step`` (a float step, as torch's Adam saves it, is a
TypeError).

Only fp32 optimizer states are covered (Megatron's default: no precision-aware optimizer); the
twins refuse the other options instead of computing something else.

``megatron_selects(kind)`` sets what Megatron-Core's import-time selection sets when that package
imports: the ``Adam`` class and the ``USING_*``/``HAVE_APEX_OR_TE`` flags of both modules.
"""

from __future__ import annotations

import contextlib
from copy import deepcopy
from itertools import chain
from typing import Iterator

import torch


def _adam_update(p, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, step, adam_w_mode,
                 bias_correction, weight_decay):
    """One element-wise Adam step, as TE's and Apex's ``multi_tensor_adam`` kernels compute it
    (fp32 math): ADAM_MODE_0 adds L2 to the gradient, ADAM_MODE_1 (AdamW) decays the update."""
    g = grad.float()
    param = p.data.float()
    if not adam_w_mode and weight_decay != 0:
        g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
    update = (exp_avg / bc1) / denom
    if adam_w_mode and weight_decay != 0:
        update = update + weight_decay * param
    p.data.copy_(param - lr * update)


def _kernel_int(step) -> None:
    """TE's and Apex's ``multi_tensor_adam`` bindings take ``const int step``: pybind11 refuses
    a float (a step restored from a checkpoint torch's Adam wrote) with a TypeError."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"multi_tensor_adam(): incompatible function arguments: step={step!r} "
                        f"({type(step).__name__}), expected int")


class TEFusedAdamTwin(torch.optim.Optimizer):
    """Transformer Engine 2.20.2's ``FusedAdam`` state contract on CPU (fp32 states only)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction=True,
                 adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False,
                 store_param_remainders=False, set_grad_none=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        unsupported = {"capturable": capturable, "master_weights": master_weights,
                       "use_decoupled_grad": use_decoupled_grad,
                       "store_param_remainders": store_param_remainders,
                       "exp_avg_dtype": exp_avg_dtype != torch.float32,
                       "exp_avg_sq_dtype": exp_avg_sq_dtype != torch.float32}
        if any(unsupported.values()):
            raise NotImplementedError(
                f"the CPU twin of TE's FusedAdam covers fp32 states only, not "
                f"{[k for k, v in unsupported.items() if v]}")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas,
                                  "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = False
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales = {}

    def get_unscaled_state(self, param, state_name: str, skip_unscale: bool = False):
        dtype = self.name_to_dtype_map[state_name]  # TE: a KeyError for any other key
        unscaled = self.state[param][state_name]
        assert dtype == torch.float32 and unscaled.dtype == torch.float32
        return unscaled

    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False)
        dtype = self.name_to_dtype_map[state_name]
        assert dtype == torch.float32
        state[state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        dtype = self.name_to_dtype_map[state_name]
        data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders: bool) -> None:
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def _id_map(self, saved_groups):
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        state_dict = super().state_dict()
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state_dict["state"][k] = {name: self.get_unscaled_state(param, name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        id_map = self._id_map(deepcopy(state_dict["param_groups"]))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is None:
                        continue
                    self.set_scaled_state(param, name, v[name].float())

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            # TE advances every group's step, empty or not, before it skips empty groups.
            group["step"] = group["step"] + 1 if "step" in group else 1
            _kernel_int(group["step"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p, False)
                if p.grad is None:
                    continue
                _adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                             beta1=beta1, beta2=beta2, eps=group["eps"], step=group["step"],
                             adam_w_mode=self.adam_w_mode, weight_decay=group["weight_decay"],
                             bias_correction=group["bias_correction"])
        return loss


class ApexFusedAdamTwin(torch.optim.Optimizer):
    """Apex's ``FusedAdam`` state contract on CPU (torch's own state_dict; step per group)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, use_master=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or use_master:
            raise NotImplementedError("the CPU twin of Apex's FusedAdam covers the default "
                                      "(not capturable, no master params) only")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas,
                                  "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = False

    def zero_grad(self):  # Apex's signature: no set_to_none argument
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
             grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["params"][0].device  # Apex (004da4e) reads it first: an empty group fails
            group["step"] = group["step"] + 1 if "step" in group else 1
            _kernel_int(group["step"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data).float()
                    state["exp_avg_sq"] = torch.zeros_like(p.data).float()
                _adam_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                             beta1=beta1, beta2=beta2, eps=group["eps"], step=group["step"],
                             adam_w_mode=self.adam_w_mode, weight_decay=group["weight_decay"],
                             bias_correction=group["bias_correction"])
        return loss


TWINS = {"te": TEFusedAdamTwin, "apex": ApexFusedAdamTwin}


@contextlib.contextmanager
def megatron_selects(kind: str) -> Iterator[type]:
    """Within the block, Megatron-Core builds its Adam as it does when ``kind``'s package imports
    (``te``: ``transformer_engine.pytorch.optimizers``; ``apex``: ``apex.optimizers``): the module
    globals its import-time ``try`` sets, in ``megatron.core.optimizer`` and
    ``megatron.core.optimizer.distrib_optimizer``. Restored on exit."""
    if kind not in TWINS:
        raise ValueError(f"optimizer twin {kind!r} is not one of {sorted(TWINS)}")
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    values = {mopt: {"Adam": TWINS[kind], "USING_PYTORCH_OPTIMIZER": False},
              dopt: {"Adam": TWINS[kind], "HAVE_APEX_OR_TE": True,
                     "USING_TE_OPTIMIZER": kind == "te", "USING_APEX_OPTIMIZER": kind == "apex"}}
    saved = {mod: {k: getattr(mod, k) for k in kv} for mod, kv in values.items()}
    for mod, kv in values.items():
        for k, v in kv.items():
            setattr(mod, k, v)
    try:
        yield TWINS[kind]
    finally:
        for mod, kv in saved.items():
            for k, v in kv.items():
                setattr(mod, k, v)

