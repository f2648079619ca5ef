"""Shared fixtures of dart-policy's tests: one tiny checkpoint per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dart.policy.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL checkpoint, written once per session (tests must not modify it)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(path, seed=0)
    return path
