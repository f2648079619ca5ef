"""Which tasks an env pool can run: its capabilities, asked over the bus, against each task's requirements.

A task names what it needs (:attr:`TaskSpec.requires <dart.protocol.messages.TaskSpec.requires>`, e.g.
``app:chrome``, ``metric:compare_table``); an env pool says what it has (:class:`EnvCapabilities`, answered
on ``subjects.env_capabilities(pool)`` by any env service of the pool, from its backend and provider). The
data manager keeps the tasks whose requirements the pool meets and counts the others by what they lacked,
so the runnable set is decided where the tasks run, not where the suite was read.

Usage::

    caps = await request_capabilities(bus, "osworld", timeout_s=60)
    runnable = runnable_tasks(tasks, caps)
    runnable.tasks, runnable.excluded, runnable.excluded_by   # kept; how many left out; by requirement
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from dart.protocol.errors import EnvPoolUnreachableError, NoRespondersError, NoRunnableTaskError, RequestTimeoutError
from dart.protocol.messages import CapabilitiesRequest, EnvCapabilities, TaskSpec
from dart.runtime.bus import Bus
from dart.runtime.retry import Backoff, retry


@dataclass(frozen=True)
class RunnableTasks:
    """The tasks an env pool runs, and what kept the others out.

    Attributes:
        tasks: The tasks kept, in suite order.
        excluded: Number of tasks left out.
        excluded_by: Requirement -> tasks that needed it and the pool lacks, most first (a task lacking
            several counts under each).
        capabilities: What the pool said it has.
    """

    tasks: tuple[TaskSpec, ...]
    excluded: int
    excluded_by: dict[str, int] = field(default_factory=dict)
    capabilities: EnvCapabilities | None = None


def runnable_tasks(tasks: Sequence[TaskSpec], capabilities: EnvCapabilities) -> RunnableTasks:
    """Keep the tasks whose every requirement the pool has; count the others by their missing requirements.

    Raises:
        NoRunnableTaskError: Tasks were given and none is left.
    """
    features = frozenset(capabilities.features)
    kept: list[TaskSpec] = []
    missing: Counter[str] = Counter()
    for task in tasks:
        lacks = [r for r in dict.fromkeys(task.requires) if r not in features]
        if lacks:
            missing.update(lacks)
        else:
            kept.append(task)
    excluded_by = dict(sorted(missing.items(), key=lambda kv: (-kv[1], kv[0])))
    if tasks and not kept:
        raise NoRunnableTaskError(capabilities.pool, capabilities.provider, excluded_by)
    return RunnableTasks(tuple(kept), len(tasks) - len(kept), excluded_by, capabilities)


def needs_capabilities(tasks: Sequence[TaskSpec]) -> bool:
    """Whether any task has requirements (else every env of its backend runs them and no query is needed)."""
    return any(task.requires for task in tasks)


async def request_capabilities(bus: Bus, pool: str, *, timeout_s: float) -> EnvCapabilities:
    """Ask an env pool what it runs, waiting up to ``timeout_s`` for one of its env services to be serving.

    Raises:
        EnvPoolUnreachableError: Nobody answered within ``timeout_s``.
        RemoteError: The env service answered with an error.
    """
    subject = bus.subjects.env_capabilities(pool)

    async def ask() -> EnvCapabilities:
        return await bus.request(subject, CapabilitiesRequest(), EnvCapabilities, timeout=min(10.0, timeout_s))

    try:
        return await retry(
            ask,
            backoff=Backoff(0.1, max_s=2.0),
            retryable=lambda exc: isinstance(exc, NoRespondersError | RequestTimeoutError),
            what=f"ask env pool {pool!r} what it runs",
            timeout_s=timeout_s,
        )
    except (NoRespondersError, RequestTimeoutError) as exc:
        raise EnvPoolUnreachableError(pool, timeout_s, str(exc)) from None
