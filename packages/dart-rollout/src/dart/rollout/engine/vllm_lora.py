"""LoRA adapter versions on a vLLM server: each version is an adapter of its own, loaded beside the one before.

A LoRA run publishes adapters (:mod:`dart.protocol.weights`). The vllm engine serves version ``v`` as the
adapter named ``<served_model_name>-v<v>``; its servers start with the base checkpoint and LoRA enabled
(``rollout.engine.lora``)::

    update to v: stage the adapter (its file hard-linked as adapter_model.safetensors, adapter_config.json
                 from its spec) -> check its names and shapes against the base -> POST /v1/load_lora_adapter
                 -> new requests name v
    requests in flight on v-1 finish on v-1 and are labelled v-1 (nothing straddles a version)
    the last of them ends -> POST /v1/unload_lora_adapter v-1, its staged files removed

No pause and no prefix-cache reset: every load gets an adapter id of its own, and the server's cached prefixes
are keyed by it. Before the first adapter the base model serves version 0, and the first update waits for
the base requests in flight to finish: vLLM's CPU LoRA kernels may apply an adapter to a request without one
batched beside adapter requests, so base and adapter requests never share a batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dart.protocol.weights import AdapterSpec, read_safetensors_header
from dart.rollout.engine.vllm_wire import checkpoint_name, link_or_copy

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""peft's prefix of adapter tensor names: ``base_model.model.<module>.lora_A.weight``."""


@dataclass
class ServedAdapter:
    """One adapter version loaded on the server.

    Attributes:
        name: The name requests give as their model.
        version: Policy version it is.
        directory: Its staged files (kept while it may be loaded again).
        users: Requests in flight on it.
    """

    name: str
    version: int
    directory: Path
    users: int = 0


class AdapterVersions:
    """Which adapter new requests use, and which older ones still have requests in flight."""

    def __init__(self) -> None:
        self.current: ServedAdapter | None = None
        self._finishing: dict[str, ServedAdapter] = {}

    def acquire(self) -> ServedAdapter | None:
        """The adapter a request starting now uses (None: the base model), counted until :meth:`release`."""
        adapter = self.current
        if adapter is not None:
            adapter.users += 1
        return adapter

    def release(self, adapter: ServedAdapter) -> ServedAdapter | None:
        """A request on ``adapter`` ended; returns ``adapter`` when it is superseded and this was its last."""
        adapter.users -= 1
        if adapter is not self.current and adapter.users == 0:
            return self._finishing.pop(adapter.name, None)
        return None

    def switch(self, adapter: ServedAdapter) -> ServedAdapter | None:
        """New requests use ``adapter``; returns the one it supersedes when no request is left on it."""
        previous, self.current = self.current, adapter
        if previous is None:
            return None
        if previous.users == 0:
            return previous
        self._finishing[previous.name] = previous
        return None

    def finishing(self) -> list[ServedAdapter]:
        """Superseded adapters whose requests are still in flight."""
        return list(self._finishing.values())


def adapter_name(served_model_name: str, version: int) -> str:
    """The adapter name of ``version`` on a server answering to ``served_model_name``."""
    return f"{served_model_name}-v{version}"


def stage_adapter(directory: Path, weights: Path, spec: AdapterSpec) -> Path:
    """``directory`` as vLLM loads an adapter: ``weights``' bytes as ``adapter_model.safetensors`` (a hard
    link where possible: :func:`~dart.rollout.engine.vllm_wire.link_or_copy`) and the peft
    ``adapter_config.json`` of ``spec``.

    Raises:
        OSError: ``weights`` is unreadable or ``directory`` cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    link_or_copy(weights, directory / ADAPTER_WEIGHTS)
    config = {
        "peft_type": "LORA",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": spec.target_modules,
        "bias": "none",
        "base_model_name_or_path": spec.base_model,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return directory


def check_adapter(
    weights: Path, spec: AdapterSpec, base: dict[str, tuple[str, tuple[int, ...]]] | None, max_rank: int
) -> None:
    """Refuse an adapter the server would serve differently from the trainer, before the server sees it.

    Every tensor must be a ``lora_A`` / ``lora_B`` of a language-model module of the base (``base``: the start
    checkpoint's header in checkpoint form; None skips the name and shape check) with ``A`` ``(rank, in)``
    and ``B`` ``(out, rank)``. vLLM applies no LoRA to the vision tower: an adapter on it is refused.

    Raises:
        ValueError: Says which tensors and why.
    """
    if spec.rank > max_rank:
        raise ValueError(f"adapter rank {spec.rank} is above the servers' --max-lora-rank {max_rank}")
    header = {k: v for k, v in read_safetensors_header(weights).items() if k != "__metadata__"}
    vision = [k for k in header if ".visual." in k]
    if vision:
        raise ValueError(
            f"the adapter adapts the vision tower ({vision[:3]}), which vLLM serves without LoRA: its answers "
            "would not be the trainer's; train adapters on the language model (train.lora.adapt_vision false)"
        )
    wrong: list[str] = []
    for key, entry in header.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or kind not in ("A.weight", "B.weight"):
            wrong.append(f"{key} (not a peft lora_A / lora_B tensor)")
            continue
        if base is None:
            continue
        target = base.get(checkpoint_name(module + ".weight"))
        if target is None or len(target[1]) != 2:
            wrong.append(f"{key} (no such linear module in the base checkpoint)")
            continue
        out_features, in_features = target[1]
        expected = (spec.rank, in_features) if kind == "A.weight" else (out_features, spec.rank)
        if tuple(entry["shape"]) != expected:
            wrong.append(f"{key} (shape {tuple(entry['shape'])}, the base needs {expected})")
    if wrong:
        raise ValueError(f"adapter tensors do not fit the served base model: {wrong[:5]}")
