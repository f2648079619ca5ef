"""Float32 master weights for a model that computes in bfloat16 (or float16).

AdamW's update of a weight is about ``lr`` (1e-6 here), while a bfloat16 weight of magnitude 1e-2 is
spaced about 6e-5 from its neighbours: updating bfloat16 weights in place rounds every update away.
:class:`MasterWeights` keeps a float32 copy of each trainable parameter for the optimizer (so its
moments are float32 too); the model itself stays in the low-precision dtype, the one the engines serve,
so the trainer's forward is the served model's and published weights need no conversion.

Gradients reach the masters as backward produces them: a hook adds each parameter's low-precision
gradient into its master's float32 gradient and frees it, so micro-batch accumulation runs in float32
and no low-precision gradient outlives its backward. After the optimizer steps the masters,
:meth:`MasterWeights.copy_to_model` rounds them into the model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Megatron's tensor-parallel markers: the TP-aware gradient norm reads them from the optimizer's tensors.
_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _accumulate(master: torch.Tensor, param: torch.Tensor) -> None:
    grad = param.grad
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(torch.float32)
    else:
        master.grad.add_(grad)
    param.grad = None


class MasterWeights:
    """Float32 masters of ``params``, which the optimizer updates instead of them.

    Build it before casting the model to its compute dtype to start from the exact float32 values (or
    after, from the values as loaded). Hooks on ``params`` move every gradient into the masters.

    Attributes:
        params: The model's parameters.
        masters: Their float32 copies (leaf parameters), in the same order; hand these to the optimizer.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.masters: list[torch.nn.Parameter] = []
        for p in self.params:
            master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            for name in _PARALLEL_ATTRIBUTES:
                if hasattr(p, name):
                    setattr(master, name, getattr(p, name))
            self.masters.append(master)
            p.register_post_accumulate_grad_hook(functools.partial(_accumulate, master))  # type: ignore[no-untyped-call]  # unannotated in torch

    def copy_to_model(self) -> None:
        """Round the masters into the model's parameters (after each optimizer step or load)."""
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.copy_(master)

    def load(self, values: Sequence[torch.Tensor]) -> None:
        """Set the masters to ``values`` (same order and shapes, any float dtype) and the model from them."""
        with torch.no_grad():
            for master, value in zip(self.masters, values, strict=True):
                master.copy_(value)
        self.copy_to_model()


def needs_master_weights(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` need float32 masters (anything below float32 precision)."""
    return dtype in (torch.bfloat16, torch.float16)
