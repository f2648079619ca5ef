"""LoRA adapters on a model, as a version's :class:`~dart.protocol.weights.AdapterSpec` describes them: the peft
configuration that builds them, wrapping a model with fresh ones, and setting them to a version's tensors. The
trainer builds its adapters with these; the hf engine and ``dart model merge`` apply published ones."""

from __future__ import annotations

from typing import Any

from dart.protocol.weights import AdapterSpec


def peft_config(spec: AdapterSpec) -> Any:
    """The ``peft.LoraConfig`` that builds ``spec``'s adapters on the base model (imports peft)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules, bias="none")


def with_adapters(model: Any, peft_config: Any, *, adapter_dtype_float32: bool = True) -> Any:
    """``model`` wrapped by peft with fresh adapters (``peft.get_peft_model``; imports peft).

    Args:
        model: A transformers model.
        peft_config: A ``peft.LoraConfig``.
        adapter_dtype_float32: Keep a low-precision model's adapters in float32 (peft's default); False
            creates them in the model's dtype.
    """
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a question through a name transformers has deprecated.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_config, autocast_adapter_dtype=adapter_dtype_float32)


class AdapterMismatchError(ValueError):
    """Adapter tensors that do not fit a model's adapters (nothing was set).

    Attributes:
        missing: Adapter tensors the model has that the state lacks.
        unexpected: Tensors in the state the model's adapters do not have.
        misshapen: Tensors whose shape differs from the model's.
    """

    def __init__(self, missing: list[str], unexpected: list[str], misshapen: list[str]) -> None:
        self.missing, self.unexpected, self.misshapen = missing, unexpected, misshapen
        super().__init__(
            f"adapter tensors do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}, shapes of {misshapen[:3]}"
        )


def set_adapter_state(model: Any, state: dict[str, Any]) -> None:
    """Set the adapters of a peft-wrapped ``model`` (:func:`with_adapters`) to ``state``, named as peft saves
    them; every name and shape is checked first (imports peft).

    Raises:
        AdapterMismatchError: ``state`` does not fit the model's adapters; nothing was set.
    """
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = get_peft_model_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshapen = [k for k, v in state.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if missing or unexpected or misshapen:
        raise AdapterMismatchError(missing, unexpected, misshapen)
    with torch.no_grad():
        set_peft_model_state_dict(model, state)
