"""The warm start's thread count: measured on its own steps each period, the fastest count kept."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dart.cli.stack.warmstart_threads import ThreadChooser, candidate_counts

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_candidates_are_one_half_and_all_of_the_cores() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [1, 2]
    assert candidate_counts(16) == [1, 8, 16]


def test_each_period_probes_every_count_then_runs_on_the_fastest() -> None:
    """Quiet: 2 threads faster; then the machine gets busy and 1 thread is faster, found at the next period."""
    chooser = ThreadChooser([1, 2], period=10, probe_steps=2)
    seconds = {1: 0.40, 2: 0.27}
    ran = []
    for step in range(20):
        if step == 10:
            seconds = {1: 0.41, 2: 0.78}
        threads = chooser.before_step()
        assert torch.get_num_threads() == threads
        ran.append(threads)
        chooser.after_step(seconds[threads])
    assert ran == [1, 1, 2, 2, *[2] * 6, 1, 1, 2, 2, *[1] * 6]
    assert chooser.choices == [2, 1]
    assert chooser.report() == {
        "warm_start_threads_chosen": [2, 1],
        "warm_start_steps_by_threads": {"1": 10, "2": 10},
    }


def test_one_count_runs_every_step() -> None:
    chooser = ThreadChooser([1], period=4, probe_steps=2)
    for _ in range(6):
        assert chooser.before_step() == 1
        chooser.after_step(0.1)
    assert chooser.report() == {"warm_start_threads_chosen": [1, 1], "warm_start_steps_by_threads": {"1": 6}}


def test_a_period_too_short_for_its_probes_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 2 probe steps per candidate"):
        ThreadChooser([1, 2, 4], period=5, probe_steps=2)
    with pytest.raises(ValueError, match="at least 1"):
        ThreadChooser([0, 2])
