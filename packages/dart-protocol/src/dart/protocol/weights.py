"""The layout of a published weight version: file names, the manifest, and which files hold the tensors.

Written by dart-train (:mod:`dart.train.publish`), read by the rollout service's fetch and by the engines.
A version lives under ``<prefix>/v<N>/`` in the artifact store, in Hugging Face's safetensors layout::

    model.safetensors                          one shard: the whole state dict
    model-00001-of-00003.safetensors ...       or several shards,
    model.safetensors.index.json               with the index mapping each tensor to its shard
    manifest.json                              WeightManifest: every shard's uri, size and sha256

A directory in this layout (a version's directory in a ``file://`` store, a download, an engine's staged
copy, a ``save_pretrained`` checkpoint) is read through :func:`shard_files`.

A LoRA run publishes adapters instead of full weights: a version is then one ``model.safetensors`` of the
adapter's tensors, named as peft names them (``base_model.model.<module>.lora_A.weight``), over the run's base
checkpoint. The file says so itself: its safetensors metadata holds the :class:`AdapterSpec` under
:data:`ADAPTER_METADATA_KEY` (and the manifest repeats it), so everything that moves, verifies and retains
versions treats an adapter like any one-shard version, and an engine that loads the file knows how to apply
it (:func:`adapter_spec_of`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

WEIGHTS_NAME = "model.safetensors"
"""File name of a version published as one shard."""
INDEX_NAME = "model.safetensors.index.json"
"""File name of the index of a sharded version (``weight_map``: tensor name -> shard file name)."""
MANIFEST_NAME = "manifest.json"
"""File name of a version's :class:`WeightManifest`."""
SHARD_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$"
"""What a shard's file name may be: no directory part, no ``..``, not hidden."""
ADAPTER_METADATA_KEY = "dart_adapter"
"""Safetensors metadata key of an adapter version's :class:`AdapterSpec` (JSON)."""


class AdapterSpec(BaseModel):
    """What a LoRA adapter version is, for whoever applies it to the base model (the engines, ``dart model merge``).

    The adapted module ``W x`` becomes ``W x + (alpha / rank) * B A x`` with ``A`` ``(rank, in)`` and ``B``
    ``(out, rank)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=1)
    """Rank ``r`` of the update."""
    alpha: int = Field(ge=1)
    """Scale numerator: updates are multiplied by ``alpha / rank``."""
    target_modules: str = Field(min_length=1)
    """Regular expression (full match) of the adapted modules' names in the base model."""
    base_model: str = Field(min_length=1)
    """The checkpoint the adapter applies to (its directory name)."""


def shard_name(index: int, count: int) -> str:
    """File name of shard ``index`` (1-based) of ``count``, as ``save_pretrained`` names them."""
    if count == 1:
        return WEIGHTS_NAME
    return f"model-{index:05d}-of-{count:05d}.safetensors"


class WeightShard(BaseModel):
    """One safetensors file of a published version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=255, pattern=SHARD_NAME_PATTERN)
    """File name (``model.safetensors`` or ``model-0000i-of-0000K.safetensors``): a plain name, since a
    fetch writes the shard under it in its download directory (no separator, no leading dot)."""
    uri: str = Field(min_length=1)
    """Artifact URI of the file."""
    size_bytes: int = Field(ge=0)
    """Size of the file."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex digest of the file, computed while it was written."""


class WeightManifest(BaseModel):
    """The JSON manifest stored beside each published version.

    ``weights_uri`` and ``sha256`` name the version's entry file: the safetensors file of a one-shard
    version, the index of a sharded one; ``shards`` lists every safetensors file with its digest
    (empty in manifests written before sharding, where the entry file is the only one).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int
    """Policy version of the weights."""
    sha256: str
    """Hex digest of the entry file (the safetensors file, or the index of a sharded version)."""
    size_bytes: int
    """Bytes of all safetensors files together."""
    weights_uri: str
    """Artifact URI of the entry file."""
    base_model: str
    """The checkpoint training started from."""
    trainer_step: int
    """Optimizer steps taken when the weights were saved."""
    created_at: float
    """Unix time, seconds."""
    format: Literal["safetensors"] = "safetensors"
    """File format of the weights."""
    dtype: str | None = None
    """Torch dtype of the floating-point tensors (``bfloat16``, ``float32``); None in older manifests."""
    shards: list[WeightShard] = Field(default_factory=list)
    """Every safetensors file of the version, in order."""
    adapter: AdapterSpec | None = None
    """Set when the version is a LoRA adapter over ``base_model`` rather than full weights."""

    @model_validator(mode="after")
    def _entry_matches_shards(self) -> WeightManifest:
        if len(self.shards) == 1 and (self.shards[0].uri, self.shards[0].sha256) != (self.weights_uri, self.sha256):
            raise ValueError("a one-shard manifest's weights_uri and sha256 must be those of its shard")
        if len(self.shards) > 1 and not self.weights_uri.endswith(INDEX_NAME):
            raise ValueError(f"a sharded manifest's weights_uri must name its {INDEX_NAME}, not {self.weights_uri}")
        return self


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of an index file.

    Raises:
        ValueError: The file is not an index (no ``weight_map`` of names to file names).
        OSError: The file cannot be read.
    """
    doc = json.loads(path.read_text())
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path} has no weight_map of tensor names to shard files")
    return weight_map


def shard_files(weights: Path) -> list[Path]:
    """The safetensors files that hold ``weights``: a file itself, or a directory's shards in index order.

    A directory holds ``model.safetensors.index.json`` and the shards it names, or one ``model.safetensors``.

    Raises:
        ValueError: A directory with neither, or an index naming a file outside the directory.
        OSError: The index cannot be read.
    """
    if not weights.is_dir():
        return [weights]
    index = weights / INDEX_NAME
    if index.is_file():
        names = list(dict.fromkeys(read_index(index).values()))
        if any(Path(n).name != n for n in names):
            raise ValueError(f"{index} names shards outside its directory: {names}")
        return [weights / n for n in names]
    if (weights / WEIGHTS_NAME).is_file():
        return [weights / WEIGHTS_NAME]
    raise ValueError(f"{weights} holds neither {INDEX_NAME} nor {WEIGHTS_NAME}")


def adapter_spec_of(weights: Path) -> AdapterSpec | None:
    """The :class:`AdapterSpec` of a version file or directory when it holds an adapter, else None.

    Reads only the safetensors header of the first file (no tensors).

    Raises:
        ValueError: The file is not safetensors, or its metadata names an adapter but does not parse as one.
        OSError: The file cannot be read.
    """
    text = safetensors_metadata(shard_files(weights)[0]).get(ADAPTER_METADATA_KEY)
    return None if text is None else AdapterSpec.model_validate_json(text)


MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest safetensors header read (the format's own limit)."""


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets; ``__metadata__``): an
    8-byte little-endian length, then the JSON. No tensor is read.

    Raises:
        ValueError: The file does not start with a safetensors header.
        OSError: The file cannot be read.
    """
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file (header length {size})")
        header = f.read(size)
    try:
        doc = json.loads(header)
    except ValueError as exc:
        raise ValueError(f"{path} is not a safetensors file: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} has a malformed safetensors header")
    return doc


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (:func:`read_safetensors_header`).

    Raises:
        ValueError: The file does not start with a safetensors header.
        OSError: The file cannot be read.
    """
    metadata = read_safetensors_header(path).get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{path} has a malformed safetensors header")
    return {str(k): str(v) for k, v in metadata.items()}
