"""Published architectures of every registered model family, by name: the sizes ``dart model init`` writes.

Each family's writer module keeps its own (:mod:`dart.policy.families`); this is the one index over
them, so ``--arch`` accepts a plug-in family's sizes as it does DART's.

Usage::

    arch = get_architecture("qwen3-vl-8b").cut(layers=2, vision_blocks=2)
    write_checkpoint("/tmp/qwen3-8b-2l", arch)
"""

from __future__ import annotations

from dart.policy.errors import ModelInitError
from dart.policy.families import FIRST_SPECIAL_ID, QWEN_VOCAB_SIZE, RealArchitecture, writer_of
from dart.policy.models import MODEL_FAMILIES

__all__ = ["FIRST_SPECIAL_ID", "QWEN_VOCAB_SIZE", "architectures", "get_architecture"]


def architectures() -> dict[str, RealArchitecture]:
    """Every registered family's published sizes by name (imports each family's writer module)."""
    found: dict[str, RealArchitecture] = {}
    for name in MODEL_FAMILIES.names():
        found.update(writer_of(MODEL_FAMILIES.get(name)).ARCHITECTURES)
    return found


def get_architecture(name: str) -> RealArchitecture:
    """The architecture called ``name``.

    Raises:
        ModelInitError: No such architecture; the message lists the known names.
    """
    known = architectures()
    try:
        return known[name]
    except KeyError:
        raise ModelInitError(f"unknown architecture {name!r}: choose one of {', '.join(known)}") from None
