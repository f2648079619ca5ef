"""dart-train's collectives module: tensors on the group's device, and strict mode at one rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dart.train import collectives

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank (this process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Record each call of torch.distributed's ``name`` (which still runs)."""
    calls: list[Any] = []
    real = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, name, counted)
    return calls


def test_a_group_of_one_skips_collectives_unless_strict(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    reduces, gathers = _counting(monkeypatch, "all_reduce"), _counting(monkeypatch, "all_gather_object")
    monkeypatch.delenv(collectives.STRICT_ENV, raising=False)
    assert not collectives.needed(1) and collectives.needed(2)
    assert collectives.sum_values([1.0, 2.5], size=1) == [1.0, 2.5]
    assert collectives.gather_objects("mine", size=1) == ["mine"]
    assert reduces == [] and gathers == []

    monkeypatch.setenv(collectives.STRICT_ENV, "1")
    assert collectives.needed(1)
    assert collectives.sum_values([1.0, 2.5], size=1) == [1.0, 2.5]
    assert collectives.gather_objects("mine", size=1) == ["mine"]
    assert collectives.min_int(0) == 0
    assert len(reduces) == 2 and len(gathers) == 1  # they ran, through the process group


def test_strict_mode_without_a_process_group_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-process backend (no process group) stays as it was in strict mode."""
    monkeypatch.setenv(collectives.STRICT_ENV, "1")
    assert not dist.is_initialized()
    assert not collectives.needed(1)
    assert collectives.sum_values([4.0], size=1) == [4.0]


def test_tensors_come_back_where_they_were(one_rank_group: None) -> None:
    """gloo reduces on the CPU; a tensor of another dtype or layout comes back as the caller had it."""
    assert collectives.group_device() == torch.device("cpu")
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    assert collectives.all_reduce(t) is t and t.tolist() == [1.5, -2.0]
    parts = collectives.all_gather(torch.arange(6.0).reshape(2, 3)[:, 1:], size=1)  # not contiguous
    assert [p.tolist() for p in parts] == [[[1.0, 2.0], [4.0, 5.0]]]
    assert collectives.broadcast_object(("step", 3)) == ("step", 3)
    collectives.barrier(size=1)
