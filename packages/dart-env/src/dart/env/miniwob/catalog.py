"""MiniWoB++ task suites: the ones shipped with the package, and how to regenerate them.

Shipped suites live in ``dart/env/miniwob/suites/`` (included in the wheel):

- ``smoke``: 8 tasks with scripted oracles (click-test, click-test-2, click-button, focus-text,
  click-link, click-dialog, enter-text, click-checkboxes), each pinned to one seed so every
  rollout of a task sees the same episode (GRPO compares rollouts of one task).
- ``train`` and ``heldout``: the same 8 task types on disjoint seeds (train 1-3, held-out 100-101),
  for training on one split and validating on episodes (labels, positions, texts) never trained on.

Each task's ``instruction`` is a copy of what MiniWoB++ shows for that seed (the page is
authoritative; the copy feeds tokenizer training and reports). They are generated files:
regenerate them with ``uv run python -m dart.env.miniwob.catalog`` (needs Chromium).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from dart.env.suite import TaskSuite, load_suite, shipped_suite_path
from dart.env.suite import suite_yaml as generic_suite_yaml

SMOKE_TASKS: tuple[tuple[str, int, int], ...] = (
    ("click-test", 0, 3),
    ("click-test-2", 0, 3),
    ("click-button", 0, 3),
    ("focus-text", 0, 3),
    ("click-link", 0, 3),
    ("click-dialog", 0, 3),
    ("enter-text", 0, 6),
    ("click-checkboxes", 0, 8),
)
"""``(task name, seed, max_steps)`` of the ``smoke`` suite: the oracle's solution plus slack."""

TRAIN_SEEDS = (1, 2, 3)
"""Seeds of the ``train`` split."""
HELDOUT_SEEDS = (100, 101)
"""Seeds of the ``heldout`` split (disjoint from ``TRAIN_SEEDS`` and from ``smoke``'s seed 0)."""


def _on_seeds(seeds: tuple[int, ...]) -> tuple[tuple[str, int, int], ...]:
    return tuple((name, seed, max_steps) for seed in seeds for name, _, max_steps in SMOKE_TASKS)


BUILTIN_SUITES: dict[str, tuple[tuple[str, int, int], ...]] = {
    "smoke": SMOKE_TASKS,
    "train": _on_seeds(TRAIN_SEEDS),
    "heldout": _on_seeds(HELDOUT_SEEDS),
}
"""Name -> tasks of each shipped suite."""


def builtin_suite_path(name: str) -> Path:
    """Path of a shipped MiniWoB++ suite file.

    Raises:
        KeyError: No shipped suite has that name.
    """
    return shipped_suite_path("dart.env.miniwob", "miniwob", BUILTIN_SUITES, name)


def load_builtin_suite(name: str) -> TaskSuite:
    """Load a shipped suite (see :func:`builtin_suite_path`)."""
    return load_suite(builtin_suite_path(name))


async def generate_suite(name: str, entries: tuple[tuple[str, int, int], ...]) -> TaskSuite:
    """Build a suite, reading each task's instruction off its page in a real browser.

    Raises:
        BrowserError: Chromium is missing or does not start.
        TaskParamsError: A task name is not a MiniWoB++ task.
    """
    from dart.env.miniwob.env import MiniWoBEnv, miniwob_task

    tasks = []
    async with MiniWoBEnv() as env:
        for task_name, seed, max_steps in entries:
            spec = miniwob_task(task_name, seed, max_steps=max_steps)
            _, instruction = await env.reset(spec)
            tasks.append(spec.model_copy(update={"instruction": instruction}))
    return TaskSuite(name=name, tasks=tuple(tasks))


def suite_yaml(suite: TaskSuite) -> str:
    """A miniwob suite as YAML text in the suite file format (``backend: miniwob`` stated once)."""
    return generic_suite_yaml(suite, "miniwob", "python -m dart.env.miniwob.catalog")


def write_builtin_suites(directory: Path) -> list[Path]:
    """(Re)generate every shipped suite file into ``directory`` (starts a browser); returns the paths written."""

    async def generate() -> dict[str, TaskSuite]:
        return {name: await generate_suite(f"miniwob-{name}", entries) for name, entries in BUILTIN_SUITES.items()}

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, suite in asyncio.run(generate()).items():
        path = directory / f"{name}.yaml"
        path.write_text(suite_yaml(suite))
        written.append(path)
    return written


if __name__ == "__main__":
    for written in write_builtin_suites(Path(__file__).parent / "suites"):
        print(f"wrote {written}")
