"""The env backends dart-env ships, as the factories its entry points name (group ``dart.env_backends``).

Each imports its backend when first called, so choosing ``sim`` never imports Selenium or the desktop code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dart.env.interface import EnvBackend
    from dart.env.service.config import EnvServiceConfig


def sim(config: EnvServiceConfig, stream: int) -> EnvBackend:
    """The simulated GUI (``env.sim``)."""
    from dart.env.sim import SimEnv

    return SimEnv(config.sim, stream=stream)


def miniwob(config: EnvServiceConfig, stream: int) -> EnvBackend:
    """MiniWoB++ in headless Chromium (``env.miniwob``)."""
    from dart.env.miniwob import MiniWoBEnv

    return MiniWoBEnv(config.miniwob, stream=stream)


def osworld(config: EnvServiceConfig, stream: int) -> EnvBackend:
    """OSWorld-format tasks on a desktop provider (``env.osworld``)."""
    from dart.env.osworld.env import OSWorldEnv

    return OSWorldEnv(config.osworld, stream=stream)
