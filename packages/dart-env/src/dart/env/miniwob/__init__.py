"""The ``miniwob`` env backend: MiniWoB++ web tasks in headless Chromium.

Use :class:`MiniWoBEnv` directly, or :func:`register` it so the env service can host it under
``backend: miniwob``. Needs Chromium and chromedriver (Debian: ``chromium chromium-driver``).
"""

from __future__ import annotations

from dart.env.miniwob.env import MiniWoBConfig, MiniWoBEnv, miniwob_task, task_names
from dart.env.miniwob.errors import BrowserError
from dart.env.miniwob.oracle import SOLVERS

__all__ = ["SOLVERS", "BrowserError", "MiniWoBConfig", "MiniWoBEnv", "miniwob_task", "register", "task_names"]


def register(config: MiniWoBConfig | None = None, *, replace: bool = False) -> None:
    """Register ``miniwob`` in the env service's backend registry.

    Args:
        config: Settings of every instance (default: :class:`MiniWoBConfig`'s defaults).
        replace: Allow overriding an existing registration.
    """
    from dart.env.service.config import EnvServiceConfig, register_backend

    settings = config or MiniWoBConfig()

    def factory(service_config: EnvServiceConfig, stream: int) -> MiniWoBEnv:
        return MiniWoBEnv(settings, stream=stream)

    register_backend(MiniWoBEnv.name, factory, replace=replace)
