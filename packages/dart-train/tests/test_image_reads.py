"""Screenshot reads: a store that fails its first reads is retried and the batch trains; permanent faults are typed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dart.protocol.errors import StoreError
from dart.protocol.messages import ImageRef, TrainingSample
from dart.runtime.retry import RetryPolicy
from dart.runtime.store import ArtifactStore, LocalStore, StoreConfig, file_uri, parse_uri
from dart.runtime.testing import png_header, tiny_png
from dart.train.backend import TorchBackend
from dart.train.batching import StoreImageSource, decode_screenshot
from dart.train.config import TrainerConfig
from dart.train.errors import ImageCorruptError, ImageFetchError, ImageMissingError

pytestmark = pytest.mark.unit

# No waiting between tries: the backoff itself is tested in dart-runtime's test_retry.py.
RETRY = RetryPolicy(attempts=4, initial_delay_s=0.0, jitter=0.0)


class FlakyLocalStore(LocalStore):
    """The real local store, with fault injection: its first reads fail as a failing disk's would.

    ``counts`` is shared by every store one opener opens: ``failures``, how many first reads raise;
    ``reads``, the reads attempted, failed ones included.
    """

    def __init__(self, root: str, counts: dict[str, int]) -> None:
        super().__init__(root, fsync=False, create=False)
        self.counts = counts

    def get(self, key: str, *, verify: bool = True) -> bytes:
        self.counts["reads"] += 1
        if self.counts["reads"] <= self.counts["failures"]:
            raise StoreError(f"cannot read {self.uri(key)}: [Errno 5] Input/output error")
        return super().get(key, verify=verify)


def _flaky_source(failures: int) -> tuple[StoreImageSource, dict[str, int]]:
    counts = {"failures": failures, "reads": 0}

    def opener(uri: str) -> tuple[ArtifactStore, str]:
        parsed = parse_uri(uri)
        return FlakyLocalStore(parsed.root, counts), parsed.key

    return StoreImageSource(retry=RETRY, opener=opener), counts


def test_a_store_failing_its_first_reads_is_retried_and_the_batch_trains(
    tiny_checkpoint: Path, rollout_samples: list[TrainingSample]
) -> None:
    images, counts = _flaky_source(failures=3)  # fewer than RETRY.attempts in a row, all on the first image
    config = TrainerConfig(model_path=str(tiny_checkpoint), lr=1e-3, num_threads=2)
    backend = TorchBackend.load(config, image_source=images)
    metrics = backend.train_step(rollout_samples)
    assert metrics.step == 1 and metrics.samples == len(rollout_samples)
    # Every image was read once it could be: 3 failed reads, then one per distinct image.
    distinct = {ref.sha256 for s in rollout_samples for ref in s.images}
    assert counts["reads"] == 3 + len(distinct)


def test_a_store_failing_past_the_retries_is_reported_as_unavailable_not_as_a_bad_sample(
    rollout_samples: list[TrainingSample],
) -> None:
    images, counts = _flaky_source(failures=100)
    ref = rollout_samples[0].images[0]
    with pytest.raises(ImageFetchError) as raised:
        images(ref)
    assert type(raised.value) is ImageFetchError and not raised.value.permanent
    assert "Input/output error" in raised.value.detail and counts["reads"] == RETRY.attempts


def test_a_missing_or_corrupt_screenshot_is_a_permanent_typed_error(rollout_samples: list[TrainingSample]) -> None:
    images, counts = _flaky_source(failures=0)
    ref = rollout_samples[0].images[0]
    missing = ref.model_copy(update={"uri": ref.uri.replace(".png", "-gone.png")})
    with pytest.raises(ImageMissingError) as gone:
        images(missing)
    assert gone.value.permanent and gone.value.uri == missing.uri and counts["reads"] == RETRY.attempts
    counts["reads"] = 0
    with pytest.raises(ImageCorruptError) as corrupt:
        images(ref.model_copy(update={"sha256": "0" * 64}))
    # A digest mismatch is not read again: the same bytes would come back.
    assert corrupt.value.permanent and counts["reads"] == 1


def test_an_image_is_decoded_only_at_the_size_its_reference_declares(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    source = StoreImageSource(StoreConfig(uri=file_uri(store.root)))
    bomb = png_header(13000, 13000)
    ref = ImageRef(uri=store.put("s/bomb.png", bomb).uri, sha256=hashlib.sha256(bomb).hexdigest(), width=4, height=4)
    with pytest.raises(ImageCorruptError, match="the PNG is 13000x13000, its message declares 4x4"):
        decode_screenshot(source(ref), ref)
    # And a reference outside the run's store is not read at all: a permanent fault of its sample.
    outside = ImageRef(uri="file:///etc/hostname", sha256="0" * 64, width=4, height=4)
    with pytest.raises(ImageMissingError, match="outside the run's store"):
        source(outside)
    assert decode_screenshot(tiny_png(4, 4), ref.model_copy(update={"width": 4})).size == (4, 4)
