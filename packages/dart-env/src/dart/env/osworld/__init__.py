"""OSWorld tasks: read the benchmark's task files, audit what DART can run, convert to TaskSpecs.

- :mod:`dart.env.osworld.tasks`: typed models of one OSWorld task file, loaders, TaskSpec conversion.
- :mod:`dart.env.osworld.support`: which setup steps, getters and metrics a local desktop supports.
- :mod:`dart.env.osworld.audit`: the audit over a task directory (``dart env osworld-audit``).
- :mod:`dart.env.osworld.client`: the VM-server HTTP client; :mod:`~dart.env.osworld.actions`: typed
  actions as ``/dart/action`` JSON or pyautogui code.
- :mod:`dart.env.osworld.setup`, :mod:`~dart.env.osworld.getters`, :mod:`~dart.env.osworld.metrics`,
  :mod:`~dart.env.osworld.evaluate`: setup steps and evaluators; :mod:`~dart.env.osworld.paths`: the
  home-directory mapping.
- :mod:`dart.env.osworld.providers`: local desktop, docker VM, remote URL.
- :mod:`dart.env.osworld.env`: the ``osworld`` env backend; :mod:`dart.env.osworld.suites`: the shipped
  local-desktop suite (``load_local_suite``).
"""

from dart.env.osworld.audit import AuditReport, audit, audit_dir, load_osworld_suite
from dart.env.osworld.client import VMServerClient
from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.env import OSWorldEnv
from dart.env.osworld.errors import (
    EvaluatorError,
    OSWorldTaskError,
    OSWorldVMError,
    ProviderError,
    SetupStepError,
    UnsupportedStepError,
)
from dart.env.osworld.paths import OSWORLD_HOME, PathMap
from dart.env.osworld.providers import DockerProvider, DockerProviderConfig, LocalDesktopProvider, RemoteProvider
from dart.env.osworld.suites import load_local_suite, local_solutions
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
    "OSWORLD_HOME",
    "AuditReport",
    "DockerProvider",
    "DockerProviderConfig",
    "Evaluator",
    "EvaluatorError",
    "Getter",
    "LocalDesktop",
    "LocalDesktopProvider",
    "OSWorldConfig",
    "OSWorldEnv",
    "OSWorldTask",
    "OSWorldTaskError",
    "OSWorldTaskFile",
    "OSWorldVMError",
    "PathMap",
    "ProviderError",
    "RemoteProvider",
    "SetupStep",
    "SetupStepError",
    "UnsupportedStepError",
    "VMServerClient",
    "Verdict",
    "audit",
    "audit_dir",
    "load_local_suite",
    "load_osworld_suite",
    "load_task_dir",
    "load_task_file",
    "local_solutions",
    "to_task_spec",
]
