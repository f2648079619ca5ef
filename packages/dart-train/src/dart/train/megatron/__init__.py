"""The megatron-core trainer backend (optional extra ``dart-train[megatron]``, megatron-core 0.16.1).

Only this subpackage imports megatron. :mod:`.convert` is pure torch (Hugging Face <-> Megatron
weights for any TP size); :mod:`.attention` is the core attention of its layers (PyTorch's SDPA);
:mod:`.model` builds the GPTModel and the vision-language forward pass;
:mod:`.backend` is the tensor-parallel trainer backend, built from the trainer config
(:meth:`~dart.train.megatron.backend.MegatronBackend.create`).
"""

from dart.train.megatron.backend import MegatronBackend
from dart.train.megatron.convert import LMSpec, hf_to_megatron, megatron_to_hf

__all__ = ["LMSpec", "MegatronBackend", "hf_to_megatron", "megatron_to_hf"]
