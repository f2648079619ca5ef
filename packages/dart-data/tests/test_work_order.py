"""The work planner's task order: seeded shuffled passes, so the work in flight mixes the suite."""

from __future__ import annotations

from collections import Counter

import pytest

from dart.data.config import CurationConfig, EmissionConfig
from dart.data.work import WorkPlanner
from dart.protocol import messages as m
from dart.runtime.testing import TASK

pytestmark = pytest.mark.unit

FAMILIES = ("click-button", "select-item", "type-text", "toggle")
# Shaped like the built-in train suite: 4 families x 16 tasks, written family by family.
SUITE = [TASK.model_copy(update={"task_id": f"sim/{f}/{i}", "tags": (f,)}) for f in FAMILIES for i in range(16)]
PASSES = 8


def planned(seed: int, groups: int) -> list[m.TaskSpec]:
    planner = WorkPlanner(SUITE, CurationConfig(), EmissionConfig(seed=seed), {})
    return [planner.next_group(0, None)[0].task for _ in range(groups)]


def distance_to_suite(window: list[m.TaskSpec]) -> float:
    """Total-variation distance between the window's family shares and the suite's (equal shares)."""
    counts = Counter(t.tags[0] for t in window)
    return 0.5 * sum(abs(counts[f] / len(window) - 1 / len(FAMILIES)) for f in FAMILIES)


def windows(seq: list[m.TaskSpec], length: int) -> list[list[m.TaskSpec]]:
    return [seq[i : i + length] for i in range(len(seq) - length + 1)]


# The bounds hold for each of seeds 0-299 (checked when they were chosen), not for a lucky seed;
# the suite's own order scores 0.56 mean and 0.75 worst on quarter-pass windows.
@pytest.mark.parametrize("seed", range(5))
def test_every_window_mixes_the_suites_families(seed: int) -> None:
    seq = planned(seed, PASSES * len(SUITE))
    # A quarter pass (16 groups) is about the work in flight and in one batch of a quickstart run.
    quarter = [distance_to_suite(w) for w in windows(seq, len(SUITE) // 4)]
    assert sum(quarter) / len(quarter) <= 0.25
    assert max(quarter) <= 0.6
    # A pass's length, across pass boundaries too: shares near the suite's.
    assert max(distance_to_suite(w) for w in windows(seq, len(SUITE))) <= 0.25


def test_each_pass_is_a_new_permutation_fixed_by_the_seed() -> None:
    seq = planned(7, PASSES * len(SUITE))
    passes = [seq[i : i + len(SUITE)] for i in range(0, len(seq), len(SUITE))]
    ids = [[t.task_id for t in p] for p in passes]
    assert all(sorted(p) == sorted(t.task_id for t in SUITE) for p in ids)  # every task once per pass
    assert len({tuple(p) for p in ids}) == PASSES  # a different order each pass
    # Same seed, same plan: also what a restarted data manager plans (from the first pass again).
    assert [t.task_id for t in planned(7, len(seq))] == [t.task_id for t in seq]
    assert ids[0] != [t.task_id for t in planned(8, len(SUITE))]  # another seed, another plan
