"""Mixed precision as Megatron-LM runs it: weights and activations in the plan's ``dtype``, gradients kept and
reduced in its ``reduce_dtype``, AdamW on fp32 master weights.

With bf16 or fp16 weights (outside FSDP: ``Plan.main_grads``) every parameter
gets a ``main_grad`` in the reduce dtype (Megatron-LM's gradient buffer): a
post-accumulate hook adds each backward's ``.grad`` into it and frees ``.grad``
(``megatron/core/distributed/distributed_data_parallel.py``,
``param.main_grad.add_(param.grad.data); param.grad = None``), so gradients
add up over microbatches in the reduce dtype. The data-parallel sync, the
sequence-parallel norms' sum and the tied embeddings' sum then read
:func:`gradient` and reduce it as it is. :class:`MasterWeightsAdamW` steps
fp32 copies of the weights on those gradients and copies them back
(``Float16OptimizerWithFloat16Params``); ZeRO-1/2 keeps its own fp32 shards
(:mod:`executor.train.zero`), FSDP2 its ``MixedPrecisionPolicy``
(:mod:`executor.train.fsdp`). fp32 plans keep plain autograd gradients and
plain AdamW.
"""

from __future__ import annotations

from typing import Any

from .._torch import require_torch

torch = require_torch()


def attach_main_grads(params: list, dtype: Any) -> None:
    """Give every parameter a ``main_grad`` in ``dtype`` that collects its gradients. Call it before any
    other post-accumulate hook is registered: those run after this one and see the sum so far."""
    for p in params:
        p.main_grad = None
        p.register_post_accumulate_grad_hook(lambda param, dtype=dtype: _accumulate(param, dtype))


def _accumulate(param: Any, dtype: Any) -> None:
    if param.main_grad is None:
        param.main_grad = param.grad.to(dtype, copy=True)
    else:
        param.main_grad.add_(param.grad)
    param.grad = None


def gradient(param: Any) -> Any:
    """The gradient the sync reduces and the optimizer steps on: ``main_grad`` where there is one."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def drop_gradient(param: Any) -> None:
    """Free ``param``'s gradient (a new step, or ZeRO-2 once its shard is reduced)."""
    param.grad = None
    if hasattr(param, "main_grad"):
        param.main_grad = None


def reduced(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in the dtype a collective reduces it in (itself when it already is)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def adamw(params: list, lr: float, fused: bool = False) -> Any:
    """torch's AdamW as the plan names it: ``fused`` (one kernel for many tensors), else torch's default
    implementation, the multi-tensor ``foreach`` one on GPUs. Passing ``fused=False`` would not do: torch
    then takes the choice as the user's and runs its one-tensor-at-a-time loop (torch/optim/adam.py,
    ``if fused is None and foreach is None``), ten eager ops per tensor."""
    return torch.optim.AdamW(params, lr=lr, fused=True) if fused else torch.optim.AdamW(params, lr=lr)


class MasterWeightsAdamW:
    """AdamW on fp32 master copies of low-precision parameters, which get the updated weights after each step.

    The masters take :func:`gradient` of their parameters as theirs (cast to
    fp32 when the gradients are kept in bf16 or fp16); the moments are fp32.
    """

    def __init__(self, params: list, lr: float, fused: bool = False):
        self.params = params
        self.masters = [p.detach().float() for p in params]
        self.adamw = adamw(self.masters, lr, fused)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            drop_gradient(p)
        self.adamw.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            grad = gradient(p)
            master.grad = None if grad is None else reduced(grad, master.dtype)
        self.adamw.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)
