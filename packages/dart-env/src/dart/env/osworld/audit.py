"""The OSWorld audit: which tasks of a task directory a platform (this host's local desktop, or OSWorld's
VM image under the docker and remote providers) can run, and why not.

A task is runnable when every setup step (``config`` and ``postconfig``), every getter and every
metric it uses is supported (:mod:`dart.env.osworld.support`), and every application it needs is
available on the platform.

Usage::

    report = audit_dir("shared/osworld")                      # this host's local desktop
    report = audit_dir("shared/osworld", VMImage())           # OSWorld's VM (docker, remote)
    report.runnable_ids()            # {"os": ["28cc3b7e-...", ...], ...}
    report.to_json()                 # counts per step type, getter, metric, app; totals
    suite = load_osworld_suite("shared/osworld")              # every task, each with its requirements
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dart.env.osworld.errors import OSWorldTaskError
from dart.env.osworld.support import (
    LocalDesktop,
    Platform,
    Verdict,
    VMImage,
    getter_support,
    metric_support,
    required_apps,
    step_support,
    task_requirements,
)
from dart.env.osworld.tasks import OSWorldTaskFile, load_task_dir, to_task_spec
from dart.env.suite import TaskSuite


@dataclass(frozen=True)
class NameUsage:
    """How the corpus uses one step type, getter, metric or application, and the verdict on it.

    Attributes:
        kind: ``step``, ``getter``, ``metric`` or ``app``.
        name: The step type / getter type / metric func / application name.
        tasks: Number of tasks using it at least once.
        uses: Number of uses over all tasks.
        supported: Whether the platform supports it (for an app: whether it is available).
        reason: Why (for an app: where it was found, or that it was not).
    """

    kind: str
    name: str
    tasks: int
    uses: int
    supported: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        """The usage as plain data (without ``kind`` and ``name``, which key it)."""
        return {"tasks": self.tasks, "uses": self.uses, "supported": self.supported, "reason": self.reason}


@dataclass(frozen=True)
class TaskVerdict:
    """Whether one task can run on the audited platform.

    Attributes:
        domain: The task's domain.
        id: The OSWorld task id.
        blockers: What stops it (``step download: ...``, ``app libreoffice: not installed``); empty
            when runnable.
    """

    domain: str
    id: str
    blockers: tuple[str, ...]

    @property
    def runnable(self) -> bool:
        """Whether nothing blocks the task."""
        return not self.blockers


@dataclass(frozen=True)
class AuditReport:
    """The audit of one task directory on one platform."""

    root: str
    network: bool
    usages: tuple[NameUsage, ...]
    """One entry per step type, getter, metric and app used, most used first within a kind."""
    tasks: tuple[TaskVerdict, ...]
    """One verdict per task, in load order (domain, then id)."""
    unknown_keys: dict[str, int] = field(default_factory=dict)
    """Task-file keys outside the known format -> number of tasks with them."""
    platform: str = "local"
    """``local`` (this host's desktop) or ``vm`` (an OSWorld VM image: docker, remote)."""

    @property
    def total(self) -> int:
        """Number of tasks parsed."""
        return len(self.tasks)

    @property
    def runnable(self) -> tuple[TaskVerdict, ...]:
        """The runnable tasks."""
        return tuple(t for t in self.tasks if t.runnable)

    def of_kind(self, kind: str) -> tuple[NameUsage, ...]:
        """The usages of one kind (``step``, ``getter``, ``metric``, ``app``)."""
        return tuple(u for u in self.usages if u.kind == kind)

    def usage(self, kind: str, name: str) -> NameUsage:
        """The usage of one name.

        Raises:
            KeyError: The corpus does not use it.
        """
        for u in self.usages:
            if u.kind == kind and u.name == name:
                return u
        raise KeyError(f"no {kind} named {name!r} in the audited tasks")

    def runnable_ids(self) -> dict[str, list[str]]:
        """Runnable task ids by domain (every domain present, possibly with an empty list)."""
        out: dict[str, list[str]] = {t.domain: [] for t in self.tasks}
        for t in self.runnable:
            out[t.domain].append(t.id)
        return out

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON-compatible object."""
        domains: dict[str, dict[str, int]] = {}
        for t in self.tasks:
            d = domains.setdefault(t.domain, {"tasks": 0, "runnable": 0})
            d["tasks"] += 1
            d["runnable"] += int(t.runnable)
        sections = {"step": "steps", "getter": "getters", "metric": "metrics", "app": "apps"}
        return {
            "root": self.root,
            "platform": self.platform,
            "network": self.network,
            "totals": {
                "tasks": self.total,
                "runnable": len(self.runnable),
                **{f"{key}_supported": sum(u.supported for u in self.of_kind(k)) for k, key in sections.items()},
                **{f"{key}_used": len(self.of_kind(k)) for k, key in sections.items()},
            },
            "domains": domains,
            **{key: {u.name: u.to_json() for u in self.of_kind(k)} for k, key in sections.items()},
            "runnable": self.runnable_ids(),
            "unknown_keys": self.unknown_keys,
        }


def _names(file: OSWorldTaskFile) -> dict[str, list[str]]:
    task = file.task
    return {
        "step": [s.type for s in task.setup_steps],
        "getter": [g.type for g in task.evaluator.getters],
        "metric": list(task.evaluator.funcs),
    }


def audit(files: Sequence[OSWorldTaskFile], desktop: Platform | None = None, root: str = "") -> AuditReport:
    """Audit parsed task files against a platform.

    Args:
        files: The tasks (from :func:`~dart.env.osworld.tasks.load_task_dir`).
        desktop: The platform: this host's local desktop (probed with :func:`shutil.which`, no network, by
            default) or an OSWorld VM image (:class:`~dart.env.osworld.support.VMImage`).
        root: The directory the tasks came from (reported only).
    """
    desktop = desktop or LocalDesktop()
    uses: dict[str, Counter[str]] = {k: Counter() for k in ("step", "getter", "metric", "app")}
    tasks_using: dict[str, Counter[str]] = {k: Counter() for k in uses}
    verdicts: dict[tuple[str, str], Verdict] = {}
    unknown: Counter[str] = Counter()
    results: list[TaskVerdict] = []
    for file in files:
        names = _names(file)
        names["app"] = sorted(required_apps(file.task))
        blockers: list[str] = []
        for kind, used in names.items():
            uses[kind].update(used)
            tasks_using[kind].update(set(used))
            for name in dict.fromkeys(used):
                if (kind, name) not in verdicts:
                    verdicts[kind, name] = _verdict(kind, name, desktop)
                verdict = verdicts[kind, name]
                if not verdict.supported:
                    blockers.append(f"{kind} {name}: {verdict.reason}")
        unknown.update(set(file.task.all_unknown_keys))
        results.append(TaskVerdict(domain=file.domain, id=file.task.id, blockers=tuple(blockers)))
    usages = [
        NameUsage(
            kind, name, tasks_using[kind][name], count, verdicts[kind, name].supported, verdicts[kind, name].reason
        )
        for kind in uses
        for name, count in sorted(uses[kind].items(), key=lambda kv: (-tasks_using[kind][kv[0]], kv[0]))
    ]
    return AuditReport(
        root=root,
        network=desktop.network,
        platform="vm" if isinstance(desktop, VMImage) else "local",
        usages=tuple(usages),
        tasks=tuple(results),
        unknown_keys=dict(unknown),
    )


def _verdict(kind: str, name: str, desktop: Platform) -> Verdict:
    if kind == "app":
        known = name in desktop.app_names()
        where = desktop.app_path(name) if known else None
        if where in ("provided", "in the VM image"):
            return Verdict(True, "provided by the local desktop" if where == "provided" else "in the VM image")
        if where is not None:
            return Verdict(True, f"installed at {where}")
        if not known:
            return Verdict(False, "not an application DART knows how to look for")
        return Verdict(
            False, "not installed on this host" if isinstance(desktop, LocalDesktop) else "not in the VM image"
        )
    if kind == "step":
        return step_support(name, desktop)
    if kind == "getter":
        return getter_support(name, desktop)
    return metric_support(name)


def audit_dir(root: str | Path, desktop: Platform | None = None) -> AuditReport:
    """Parse every task under ``root`` and audit them.

    Raises:
        OSWorldTaskError: ``root`` holds no tasks, or a task file is invalid.
    """
    return audit(load_task_dir(root), desktop, root=str(root))


def load_osworld_suite(
    root: str | Path,
    *,
    platform: Platform | None = None,
    name: str | None = None,
    max_steps: int = 15,
) -> TaskSuite:
    """A task suite of the OSWorld tasks under ``root`` (backend ``osworld``), each with its requirements
    (:attr:`TaskSpec.requires <dart.protocol.messages.TaskSpec.requires>`), so the data manager keeps the
    tasks the env pool it feeds reports it runs.

    Args:
        root: The task directory (see :func:`~dart.env.osworld.tasks.load_task_dir`).
        platform: Keep only the tasks this platform runs (tools and tests); None keeps every task.
        name: The suite name; ``osworld`` by default.
        max_steps: Step budget of every task.

    Raises:
        OSWorldTaskError: A task file is invalid, or no task is left after filtering.
    """
    files = load_task_dir(root)
    if platform is not None:
        report = audit(files, platform, root=str(root))
        keep = {(t.domain, t.id) for t in report.runnable}
        files = [f for f in files if (f.domain, f.task.id) in keep]
        if not files:
            raise OSWorldTaskError(str(root), "", f"no task is runnable on the {report.platform} platform")
    return TaskSuite(
        name=name or "osworld",
        tasks=tuple(to_task_spec(f, max_steps=max_steps, requires=task_requirements(f.task)) for f in files),
    )
