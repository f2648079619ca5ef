"""Sim task suites: generate them, and find the ones shipped with the package.

Shipped suites live in ``dart/env/sim/suites/`` (included in the wheel):

- ``basic``: 40 tasks, 10 per family, difficulties easy / medium / hard in turn.
- ``smoke``: 8 easy tasks, 2 per family, for quick checks.
- ``train``: 64 easy tasks, 16 per family, layout seeds 2000-2015: what a run trains on.
- ``heldout``: 32 easy tasks, 8 per family, layout seeds 3000-3007: what a run validates on. Its
  seeds never occur in ``train`` (nor in ``basic`` or ``smoke``), so a policy that succeeds there
  reads the screen rather than recalling a memorized layout.

Every family draws its labels, distractors and positions from the layout seed, so tasks of one
family differ in where the target is and what surrounds it, not only in their instruction.

They are generated files; after changing a family or a word pool, regenerate them with
``uv run python -m dart.env.sim`` (a test fails while they are out of date).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dart.env.sim.families import DIFFICULTIES, FAMILIES, MAX_STEPS, Difficulty, FamilyName, SimTaskParams, build_task
from dart.env.suite import TaskSuite, load_suite, shipped_suite_path
from dart.env.suite import suite_yaml as generic_suite_yaml
from dart.protocol.messages import TaskSpec

BUILTIN_SUITES: dict[str, dict[str, Any]] = {
    "basic": {"per_family": 10, "difficulties": DIFFICULTIES, "seed": 0},
    "smoke": {"per_family": 2, "difficulties": ("easy",), "seed": 1},
    "train": {"per_family": 16, "difficulties": ("easy",), "seed": 2},
    "heldout": {"per_family": 8, "difficulties": ("easy",), "seed": 3},
}
"""Name -> :func:`generate_suite` arguments of each shipped suite."""

_SEED_STRIDE = 1000


def sim_task(family: FamilyName, difficulty: Difficulty, seed: int) -> TaskSpec:
    """The :class:`TaskSpec` of one sim task, with its generated instruction.

    The instruction does not depend on the screen size (only the layout does), so the spec runs
    on any configured screen.
    """
    params = SimTaskParams(family=family, difficulty=difficulty, seed=seed)
    built = build_task(params, seed, 224, 224)
    return TaskSpec(
        task_id=f"sim/{family}/{difficulty}/{seed}",
        backend="sim",
        instruction=built.instruction,
        params=params.model_dump(mode="json"),
        max_steps=MAX_STEPS[family],
        tags=(family, difficulty),
    )


_MAX_ID_SEED = 2**31 - 1
"""Largest layout seed :func:`sim_task_from_id` generates a task for."""


def sim_task_from_id(task_id: str) -> TaskSpec | None:
    """The task :func:`sim_task` makes for an id it writes (``sim/<family>/<difficulty>/<seed>``), or None for
    any other id (an unknown family or difficulty, a seed that is not a plain number)."""
    parts = task_id.split("/")
    if len(parts) != 4 or parts[0] != "sim":
        return None
    _, family, difficulty, seed = parts
    # isdigit alone accepts other scripts' digits; int() of those is not what the id says.
    if family not in FAMILIES or difficulty not in DIFFICULTIES or not (seed.isascii() and seed.isdigit()):
        return None
    if str(int(seed)) != seed or int(seed) > _MAX_ID_SEED:
        return None
    return sim_task(family, difficulty, int(seed))


def generate_suite(
    name: str,
    *,
    per_family: int = 10,
    families: Sequence[FamilyName] = FAMILIES,
    difficulties: Sequence[Difficulty] = DIFFICULTIES,
    seed: int = 0,
) -> TaskSuite:
    """A suite of ``per_family`` tasks of each family, cycling through ``difficulties``.

    Task ``i`` of a family gets layout seed ``seed * 1000 + i``, so suites with different seeds
    do not share tasks while ``per_family`` stays below 1000.

    Raises:
        ValueError: ``per_family`` is not in [1, 1000), or no families/difficulties are given.
    """
    if not 1 <= per_family < _SEED_STRIDE:
        raise ValueError(f"per_family must be in [1, {_SEED_STRIDE}), got {per_family}")
    if not families or not difficulties:
        raise ValueError("give at least one family and one difficulty")
    tasks = [
        sim_task(family, difficulties[i % len(difficulties)], seed * _SEED_STRIDE + i)
        for family in families
        for i in range(per_family)
    ]
    return TaskSuite(name=name, tasks=tuple(tasks))


def builtin_suite_path(name: str) -> Path:
    """Path of a shipped suite file (``basic``, ``smoke``, ``train``, ``heldout``).

    Raises:
        KeyError: No shipped suite has that name.
    """
    return shipped_suite_path("dart.env.sim", "sim", BUILTIN_SUITES, name)


def load_builtin_suite(name: str) -> TaskSuite:
    """Load a shipped suite (see :func:`builtin_suite_path`)."""
    return load_suite(builtin_suite_path(name))


def suite_yaml(suite: TaskSuite) -> str:
    """A sim suite as YAML text in the suite file format (``backend: sim`` stated once)."""
    return generic_suite_yaml(suite, "sim", "python -m dart.env.sim")


def write_builtin_suites(directory: Path) -> list[Path]:
    """(Re)generate every shipped suite file into ``directory``; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, kwargs in BUILTIN_SUITES.items():
        path = directory / f"{name}.yaml"
        path.write_text(suite_yaml(generate_suite(f"sim-{name}", **kwargs)))
        written.append(path)
    return written
