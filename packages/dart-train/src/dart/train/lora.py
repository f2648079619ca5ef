"""LoRA adapters on a trainer's model (``train.lora``): add them and read their tensors.

peft wraps the model: each adapted linear gets ``lora_A`` / ``lora_B`` parameters (``B`` zero at the start,
so step 0 is the base policy) and every other parameter is frozen, so the optimizer holds the adapters'
parameters (and their float32 masters under a low-precision dtype) only. The adapters' tensors are named
as peft saves them (``base_model.model.<module>.lora_A.weight``), the layout every peft-aware loader
reads (:func:`dart.policy.adapters.set_adapter_state` sets them); :class:`~dart.protocol.weights.AdapterSpec`
is what a loader needs besides them.
"""

from __future__ import annotations

from typing import Any

import torch

from dart.policy.adapters import with_adapters
from dart.protocol.weights import AdapterSpec
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


def adapter_state(model: Any, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapters' tensors on CPU, contiguous and detached, named as peft saves them; taken from
    ``state_dict`` (the model's parameter names: gathered shards, say) when given, else from the model."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=state_dict)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
