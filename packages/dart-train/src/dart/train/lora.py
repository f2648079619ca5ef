"""LoRA adapters on a trainer's model (``train.lora``): add them, read and write their tensors.

peft wraps the model: each adapted linear gets ``lora_A`` / ``lora_B`` parameters (``B`` zero at the start,
so step 0 is the base policy) and every other parameter is frozen, so the optimizer holds the adapters'
parameters (and their float32 masters under a low-precision dtype) only. The adapters' tensors are named
as peft saves them (``base_model.model.<module>.lora_A.weight``), the layout every peft-aware loader
reads; :class:`~dart.protocol.weights.AdapterSpec` is what a loader needs besides them.
"""

from __future__ import annotations

from typing import Any

import torch

from dart.protocol.weights import AdapterSpec, with_adapters
from dart.train.config import LoraSettings


def spec_of(settings: LoraSettings, base_model: str) -> AdapterSpec:
    """The published description of adapters trained with ``settings`` over ``base_model``."""
    return AdapterSpec(
        rank=settings.rank, alpha=settings.alpha, target_modules=settings.targets(), base_model=base_model
    )


def add_adapters(model: Any, settings: LoraSettings) -> Any:
    """``model`` wrapped by peft with fresh adapters on the modules ``settings`` names (all else frozen).

    Raises:
        ValueError: The expression matches no module of the model.
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.targets(),
        bias="none",
    )
    return with_adapters(model, config)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors on CPU, contiguous and detached, named as peft saves them."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Set the adapters of a peft-wrapped ``model`` to ``state`` (named as :func:`adapter_state` names them).

    Raises:
        ValueError: ``state`` lacks an adapter tensor of the model or has one the model does not.
    """
    from peft import set_peft_model_state_dict

    expected = set(adapter_state_names(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"adapter tensors differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        set_peft_model_state_dict(model, state)


def adapter_state_names(model: Any) -> list[str]:
    """Names of the adapter tensors of a peft-wrapped model (as :func:`adapter_state` names them)."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model))
