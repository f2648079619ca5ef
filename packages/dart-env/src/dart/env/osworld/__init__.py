"""OSWorld tasks: read the benchmark's task files, audit what DART can run, convert to TaskSpecs.

- :mod:`dart.env.osworld.tasks`: typed models of one OSWorld task file, loaders, TaskSpec conversion.
- :mod:`dart.env.osworld.support`: which setup steps, getters and metrics a local desktop supports.
- :mod:`dart.env.osworld.audit`: the audit over a task directory (``dart env osworld-audit``).
"""

from dart.env.osworld.audit import AuditReport, audit, audit_dir, load_osworld_suite
from dart.env.osworld.errors import OSWorldTaskError
from dart.env.osworld.support import LocalDesktop, Verdict
from dart.env.osworld.tasks import (
    Evaluator,
    Getter,
    OSWorldTask,
    OSWorldTaskFile,
    SetupStep,
    load_task_dir,
    load_task_file,
    to_task_spec,
)

__all__ = [
    "AuditReport",
    "Evaluator",
    "Getter",
    "LocalDesktop",
    "OSWorldTask",
    "OSWorldTaskError",
    "OSWorldTaskFile",
    "SetupStep",
    "Verdict",
    "audit",
    "audit_dir",
    "load_osworld_suite",
    "load_task_dir",
    "load_task_file",
    "to_task_spec",
]
