"""Configuration of the ``hf`` engine (:mod:`dart.rollout.engine.hf`), importable without torch: what reads a
run's config (``dart run``, ``dart serve env``, placement) needs the settings, not the engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dart.rollout.engine.interface import EngineConfigBase


class HFEngineConfig(EngineConfigBase):
    """Configuration of an :class:`HFEngine`."""

    kind: Literal["hf"] = "hf"
    device: str = "cpu"
    """Torch device, ``cpu`` or ``cuda[:n]``. ``cuda`` without an index spreads the engines over the visible GPUs,
    engine ``i`` on ``cuda:<i mod visible>`` (``dart run`` gives the rollout service one GPU per engine)."""
    dtype: str = "float32"
    """Weight dtype; float32 keeps log-probs reproducible to ~1e-5 on CPU."""
    max_batch_size: int = Field(default=8, ge=1)
    """Most requests served by one batch."""
    batch_wait_s: float = Field(default=0.005, ge=0)
    """How long the first request of a batch waits for others to join, seconds."""
    num_threads: int | None = Field(default=None, ge=1)
    """Torch intra-op CPU threads; None keeps torch's default (one per core)."""

    def serving(
        self, model_path: str, *, num_threads: int | None = None, log_dir: str | None = None, single: bool = False
    ) -> HFEngineConfig:
        """This config serving ``model_path`` as version 0, with ``num_threads`` unless it sets its own."""
        update = {"model_path": model_path, "initial_version": 0, "num_threads": self.num_threads or num_threads}
        return self.model_copy(update=update)
