"""The AdamW every built-in backend steps, as ``train`` configures it (hyperparameters and kernel choice)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dart.train.config import TrainerConfig


def adamw(params: Sequence[torch.nn.Parameter] | Sequence[torch.Tensor], config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (the float32 masters, or float32 parameters) with ``config``'s learning rate, betas,
    weight decay and ``optimizer_impl`` (``auto`` leaves the kernel to torch)."""
    impl: dict[str, Any] = {
        "auto": {},
        "for_loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }[config.optimizer_impl]
    return torch.optim.AdamW(list(params), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, **impl)
