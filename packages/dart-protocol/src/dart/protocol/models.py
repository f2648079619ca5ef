"""Model families: which transformers classes a checkpoint is loaded with, found from its ``config.json``.

A family is data every service can read without importing the model code: the ``model_type`` values of
its checkpoints and the transformers class that loads them. The rollout engines and every trainer backend
load a checkpoint through :func:`family_of`, so a checkpoint of a family nobody registered is refused with
one clear error instead of being loaded with the wrong class. Families are registered in
:data:`MODEL_FAMILIES` (entry-point group ``dart.model_families``, see :mod:`dart.protocol.registry`);
dart-protocol registers ``qwen2.5-vl`` and ``qwen3-vl``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart.protocol.errors import ConfigError
from dart.protocol.registry import Registry


@dataclass(frozen=True)
class ModelFamily:
    """One family of vision-language checkpoints.

    Attributes:
        name: The family's registered name (``qwen2.5-vl``).
        model_types: ``config.json`` ``model_type`` values of its checkpoints.
        model_class: Name of the transformers class that loads them (an attribute of ``transformers``).
    """

    name: str
    model_types: tuple[str, ...]
    model_class: str

    def model_cls(self) -> Any:
        """The transformers class (imports transformers)."""
        import transformers

        return getattr(transformers, self.model_class)


QWEN2_5_VL = ModelFamily(
    name="qwen2.5-vl", model_types=("qwen2_5_vl",), model_class="Qwen2_5_VLForConditionalGeneration"
)
"""Qwen2.5-VL (3B/7B/32B/72B-Instruct, UI-TARS-1.5-7B, the tiny test model)."""

QWEN3_VL = ModelFamily(name="qwen3-vl", model_types=("qwen3_vl",), model_class="Qwen3VLForConditionalGeneration")
"""Qwen3-VL, dense (2B/4B/8B/32B): deepstack vision features, interleaved 3-D rope, 16 px patches."""


def _is_family(obj: object) -> None:
    if not isinstance(obj, ModelFamily):
        raise TypeError(f"a model family must be a ModelFamily, got {obj!r}")


MODEL_FAMILIES: Registry[ModelFamily] = Registry(
    "model_families", what="model family", config_field="model", check=_is_family
)
"""Model families by name."""


def family_of(checkpoint: str | Path) -> ModelFamily:
    """The registered family of the checkpoint directory ``checkpoint`` (by its ``config.json`` ``model_type``).

    Raises:
        FileNotFoundError: No ``config.json`` there.
        ConfigError: Its ``model_type`` belongs to no registered family (the message lists them).
    """
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint}: expected {path}")
    model_type = json.loads(path.read_text()).get("model_type")
    for name in MODEL_FAMILIES.names():
        family = MODEL_FAMILIES.get(name)
        if model_type in family.model_types:
            return family
    known = ", ".join(f"{n} ({', '.join(MODEL_FAMILIES.get(n).model_types)})" for n in MODEL_FAMILIES.names())
    raise ConfigError(
        str(checkpoint), "model_type", f"no model family registered for {model_type!r}; registered: {known}"
    )
