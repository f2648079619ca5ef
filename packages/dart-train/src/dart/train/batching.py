"""Turn recorded samples back into the exact model inputs the rollout engine consumed.

The trainer never re-renders prompts: it feeds ``prompt_token_ids + response_token_ids`` as recorded,
and rebuilds only what the token ids do not carry: the image patches and ``mm_token_type_ids`` (1 on
image-pad tokens), from which transformers derives Qwen2.5-VL's multimodal rotary positions. The
images are the ones the step recorded as fed (``StepRecord.prompt_images``): PNGs whose RGB decode is
the exact pixel array the rollout's processor got, so nothing is resized here and no setting of the
rollout (image size, screenshots per prompt) is needed.
Without it the forward pass uses text positions for image tokens and log-probs drift by ~1e-2.

Each sample is one unpadded row: Qwen2.5-VL's rope positions depend on where images sit in the row,
and padding-free rows reproduce the engine's log-probs to float32 precision. :mod:`dart.train.packing` lays
several such rows end to end, each keeping its own positions.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from dart.protocol.errors import (
    ArtifactNotFoundError,
    ConfigError,
    IntegrityError,
    InvalidURIError,
    StoreAuthError,
    StoreError,
)
from dart.protocol.messages import ImageRef
from dart.protocol.png import check_png
from dart.runtime.retry import RetryPolicy, retry_call
from dart.runtime.store import StoreConfig
from dart.runtime.store.cache import ArtifactCache, StoreOpener
from dart.train.errors import ImageCorruptError, ImageFetchError, ImageMissingError, SampleError

ImageSource = Callable[[ImageRef], bytes]
"""Returns the PNG bytes of a screenshot reference (verified against its sha256)."""


def _transient(exc: BaseException) -> bool:
    """Whether reading the artifact again may succeed: an unreachable or failing store, or an object not
    there yet. A digest mismatch, refused credentials, a bad URI or a config error will not go away."""
    return isinstance(exc, StoreError) and not isinstance(exc, IntegrityError | StoreAuthError | InvalidURIError)


class StoreImageSource:
    """Reads screenshot references by URI from the artifact store, checking each against its sha256.

    ``file://`` URIs are read from the local file system; ``s3://`` URIs with ``config``'s endpoint and
    credentials. One store client per location is kept open, and recently read images are cached
    (a sample's images recur across its passes and the next steps' prompts). A read that fails with a
    transient store error (unreachable, I/O error, not found) is retried with ``retry``'s backoff.

    Args:
        config: The run's store config, for ``s3://`` references; None reads ``file://`` (and
            environment-configured S3) only.
        max_bytes: Bound of the image cache, bytes.
        retry: Backoff of reads that failed with a transient store error (default :class:`RetryPolicy`).
        opener: Opens the store of a URI (default: the run's stores); tests pass one with injected faults.
    """

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        max_bytes: int = 256 * 1024 * 1024,
        retry: RetryPolicy | None = None,
        opener: StoreOpener | None = None,
    ) -> None:
        self._cache = ArtifactCache(config, max_bytes=max_bytes, opener=opener)
        self.retry = retry or RetryPolicy()

    def __call__(self, ref: ImageRef) -> bytes:
        """The PNG bytes of ``ref`` (blocking; retried while the store fails transiently).

        Raises:
            ImageMissingError: Nothing is stored at the URI after every retry, or the URI is invalid.
            ImageCorruptError: The bytes do not hash to ``ref.sha256``.
            ImageFetchError: The store stayed unreadable through every retry, or cannot be used (credentials, config).
        """
        try:
            return retry_call(
                lambda: self._cache.get(ref.uri, ref.sha256),
                policy=self.retry,
                retryable=_transient,
                what=f"reading screenshot {ref.uri}",
            )
        except IntegrityError as exc:
            raise ImageCorruptError(ref.uri, str(exc)) from exc
        except ArtifactNotFoundError as exc:
            raise ImageMissingError(ref.uri, f"{exc} (still after {self.retry.attempts} tries)") from exc
        except InvalidURIError as exc:
            raise ImageMissingError(ref.uri, str(exc)) from exc
        except (StoreError, ConfigError) as exc:
            tries = f" (after {self.retry.attempts} tries)" if _transient(exc) else ""
            raise ImageFetchError(ref.uri, f"{exc}{tries}") from exc

    def close(self) -> None:
        """Close the store clients."""
        self._cache.close()


def decode_screenshot(png: bytes, ref: ImageRef) -> Image.Image:
    """Decode a recorded prompt image's PNG bytes to the RGB pixels the rollout fed (no resize: it was fed as is).

    The PNG header is checked against the size ``ref`` declares (and :data:`MAX_IMAGE_PIXELS`) first, so a
    forged reference cannot make the trainer decode a huge image.

    Raises:
        ImageCorruptError: Not a PNG of the declared size, or too large.
    """
    try:
        check_png(png, ref.width, ref.height)
    except ValueError as exc:
        raise ImageCorruptError(ref.uri, str(exc)) from None
    return Image.open(io.BytesIO(png)).convert("RGB")


@dataclass(frozen=True)
class ModelInputs:
    """One sample's teacher-forced forward inputs.

    Attributes:
        input_ids: ``(1, P + R)`` prompt then response token ids.
        mm_token_type_ids: ``(1, P + R)``, 1 on image-pad tokens, 0 elsewhere.
        pixel_values: ``(num_patches, C * T * 14 * 14)`` image patches, or None without images.
        image_grid_thw: ``(num_images, 3)`` patch grid per image, or None.
        prompt_len: P, prompt tokens.
        response_len: R, response tokens.
    """

    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    prompt_len: int
    response_len: int

    def kwargs(self, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
        """Keyword arguments of the model's forward pass, on ``device`` (pixels in ``dtype``)."""
        out: dict[str, Any] = {
            "input_ids": self.input_ids.to(device),
            "attention_mask": torch.ones_like(self.input_ids, device=device),
            "mm_token_type_ids": self.mm_token_type_ids.to(device),
        }
        if self.pixel_values is not None:
            out["pixel_values"] = self.pixel_values.to(device=device, dtype=dtype)
            out["image_grid_thw"] = self.image_grid_thw.to(device) if self.image_grid_thw is not None else None
        return out


class InputBuilder:
    """Builds :class:`ModelInputs` from token ids and screenshots with a Qwen2.5-VL processor.

    Args:
        processor: The policy's processor (its image processor patches the screenshots).
        image_token_id: Id of ``<|image_pad|>`` (``model.config.image_token_id``).
        merge_size: Spatial merge of the vision tower (patches per visual token = merge_size**2).
    """

    def __init__(self, processor: Any, image_token_id: int, merge_size: int = 2) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.merge_size = merge_size

    def build(
        self,
        prompt_token_ids: Sequence[int],
        response_token_ids: Sequence[int],
        images: Sequence[Image.Image],
        *,
        sample_id: tuple[str, int] = ("?", 0),
    ) -> ModelInputs:
        """Inputs for one row; images must already be decoded (see :func:`decode_screenshot`).

        Raises:
            SampleError: The prompt's image-pad tokens do not match the images' visual token count.
        """
        ids = torch.tensor([list(prompt_token_ids) + list(response_token_ids)], dtype=torch.long)
        mm = (ids == self.image_token_id).to(torch.long)
        n_pad = int(mm[0, : len(prompt_token_ids)].sum())
        if int(mm[0, len(prompt_token_ids) :].sum()):
            raise SampleError(*sample_id, "the response contains image-pad tokens")
        pixel_values = grid = None
        if images:
            patches = self.processor.image_processor(images=list(images), return_tensors="pt")
            pixel_values, grid = patches["pixel_values"], patches["image_grid_thw"]
            expected = int(grid.prod(-1).sum()) // (self.merge_size**2)
            if expected != n_pad:
                raise SampleError(
                    *sample_id, f"{n_pad} image-pad tokens in the prompt but the images make {expected} visual tokens"
                )
        elif n_pad:
            raise SampleError(*sample_id, f"{n_pad} image-pad tokens in the prompt but the sample has no images")
        return ModelInputs(ids, mm, pixel_values, grid, len(prompt_token_ids), len(response_token_ids))


def pad_rows(rows: Sequence[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors into ``(B, T_max)``; returns ``(padded, mask)`` with mask 1 on real entries."""
    width = max(int(r.shape[0]) for r in rows)
    out = rows[0].new_full((len(rows), width), value)
    mask = torch.zeros((len(rows), width), dtype=torch.float32, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1.0
    return out, mask
