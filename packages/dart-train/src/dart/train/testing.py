"""Helpers for tests that feed engine output to a trainer: a screenshot stored as the rollout stores it, a
training sample made of one generation result, as the data manager would batch it, and a count of the operators
a computation ran."""

from __future__ import annotations

import io
from collections import Counter
from typing import TYPE_CHECKING, Any

from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from dart.protocol.messages import ImageRef, TrainingSample

if TYPE_CHECKING:
    from dart.rollout.engine.interface import GenerationResult
    from dart.runtime.store import ArtifactStore


def store_png(store: ArtifactStore, key: str, image: Image.Image) -> ImageRef:
    """``image`` written to ``store`` under ``key`` as PNG, and the reference a step records for it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    info = store.put(key, buf.getvalue(), content_type="image/png")
    assert info.sha256 is not None
    return ImageRef(uri=info.uri, sha256=info.sha256, width=image.width, height=image.height)


def sample_of(result: GenerationResult, images: list[ImageRef], trajectory_id: str = "t") -> TrainingSample:
    """A one-step training sample (advantage 1, version 0) of an engine's ``result`` on a prompt with ``images``."""
    return TrainingSample(
        trajectory_id=trajectory_id,
        step_index=0,
        group_id="g",
        task_id="task",
        advantage=1.0,
        reward=1.0,
        policy_version=0,
        prompt_token_ids=result.prompt_token_ids,
        response_token_ids=result.response_token_ids,
        rollout_logprobs=result.response_logprobs,
        sampling=result.sampling,
        images=images,
    )


class OpCount(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's dispatch mode is unannotated
    """Counts the aten operators run while it is active, by name (``with OpCount() as ops: ...; ops.calls["silu"]``):
    what a test checks that a computation ran, or ran again."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's dispatch mode is unannotated
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
