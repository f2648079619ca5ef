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
    collectives.barrier(size=1)


def test_a_one_rank_group_gets_the_collective_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert collectives.init_process_group("cpu", 42.0) == (0, 1, 0)
    try:
        assert dist.get_backend() == "gloo"
        gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert gloo.options._timeout.total_seconds() == 42.0
    finally:
        dist.destroy_process_group()


def test_followers_read_commands_in_order_across_idle_wake_ups(one_rank_group: None) -> None:
    """The command channel on a real store: numbered commands, read in order by a follower that wakes up on the
    store every 0.1 s while nothing comes, and removed two numbers later."""
    import threading
    import time

    from dart.train.distributed import COMMAND_PREFIX, Commander, CommandReader

    received: list[tuple[object, ...]] = []
    reader = CommandReader(wait_s=0.1)
    follower = threading.Thread(target=lambda: received.extend(reader.receive() for _ in range(4)))
    follower.start()
    follower.join(timeout=0.5)  # five wake-ups with nothing to read
    assert follower.is_alive() and received == []
    for n, command in enumerate([("train", [], 4), ("publish",), ("save", "/ckpt", 3), ("stop",)]):
        Commander(world_size=2).send(*command)  # another instance each time: the numbering is the store's
        # As after a collective: the follower has read the command before the next but one is sent.
        deadline = time.monotonic() + 30
        while len(received) <= n and time.monotonic() < deadline:
            time.sleep(0.01)
    follower.join(timeout=30)
    assert received == [("train", [], 4), ("publish",), ("save", "/ckpt", 3), ("stop",)]
    store = collectives.command_store()
    assert not store.check([f"{COMMAND_PREFIX}0"]) and not store.check([f"{COMMAND_PREFIX}1"])
    assert store.check([f"{COMMAND_PREFIX}3"])
