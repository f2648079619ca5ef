"""The megatron-core trainer backend (optional extra ``dart-train[megatron]``, megatron-core 0.16.1).

Only this subpackage imports megatron. :mod:`.convert` is pure torch (Hugging Face <-> Megatron
weights for any TP size); :mod:`.model` builds the GPTModel and the vision-language forward pass;
:mod:`.backend` is the tensor-parallel trainer backend and its torchrun entry point
:func:`~dart.train.megatron.backend.build_backend`.
"""

from dart.train.megatron.backend import MegatronBackend, MegatronSettings, build_backend
from dart.train.megatron.convert import LMSpec, hf_to_megatron, megatron_to_hf

__all__ = ["LMSpec", "MegatronBackend", "MegatronSettings", "build_backend", "hf_to_megatron", "megatron_to_hf"]
