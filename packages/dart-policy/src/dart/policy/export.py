"""Export a published version as a standalone checkpoint: full weights loaded over the base, or a LoRA
adapter merged into it (``W + (alpha / rank) * B A`` written into each adapted weight).

The result is an ordinary checkpoint of the base's family (config, safetensors, processor, tokenizer) that
any loader takes without peft or DART: both engines serve it as a base checkpoint.

Usage::

    export_checkpoint(Path("runs/r/policy"), fetched_version_path, Path("exported/v12"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart.policy.adapters import AdapterMismatchError, peft_config, set_adapter_state, with_adapters
from dart.policy.errors import ModelInitError
from dart.protocol.weights import AdapterSpec, adapter_spec_of, shard_files


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        path: The checkpoint directory.
        adapter: The adapter merged in, or None when the version was full weights.
        num_parameters: Parameters of the exported model.
    """

    path: Path
    adapter: AdapterSpec | None
    num_parameters: int


def export_checkpoint(base: Path, weights: Path, out: Path) -> Exported:
    """Write the checkpoint of ``base`` with version ``weights`` applied (merged when it is an adapter).

    Args:
        base: The checkpoint the version was trained from.
        weights: The version's fetched file or directory (:func:`dart.rollout.service.fetch.fetch_weights`).
        out: Directory to write (created; existing files are overwritten).

    Raises:
        ModelInitError: The version's tensors do not fit the base (names or shapes).
    """
    import torch
    from safetensors.torch import load_file

    from dart.policy.loading import load_policy

    model, processor = load_policy(base)
    state: dict[str, Any] = {}
    for shard in shard_files(weights):
        state.update(load_file(str(shard)))
    spec = adapter_spec_of(weights)
    if spec is not None:
        model = _merged(model, spec, state)
    else:
        current = model.state_dict()
        unexpected = sorted(set(state) - set(current))
        bad = [k for k, v in state.items() if k in current and tuple(v.shape) != tuple(current[k].shape)]
        if unexpected or bad:
            raise ModelInitError(f"{weights} does not fit {base}: unexpected {unexpected[:3]}, shapes of {bad[:3]}")
        with torch.no_grad():
            model.load_state_dict(state, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return Exported(path=out, adapter=spec, num_parameters=sum(p.numel() for p in model.parameters()))


def _merged(model: Any, spec: AdapterSpec, state: dict[str, Any]) -> Any:
    """``model`` with the adapter ``state`` merged into its weights (peft's wrapper removed)."""
    wrapped = with_adapters(model, peft_config(spec))
    try:
        set_adapter_state(wrapped, state)
    except AdapterMismatchError as exc:
        raise ModelInitError(f"{exc} (targets {spec.target_modules}, rank {spec.rank})") from None
    return wrapped.merge_and_unload()
