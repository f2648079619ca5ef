"""Configuration of ``osworld`` env instances: where the VM server comes from and how the episode talks to it.

Apart from :mod:`dart.env.osworld.env` (the backend) so that the env service's config and the support matrix
(:mod:`dart.env.osworld.support`) read it without importing the backend.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dart.env.desktop import DesktopConfig
from dart.env.osworld.paths import OSWORLD_HOME
from dart.env.osworld.providers import DockerProviderConfig, RemoteProviderConfig
from dart.protocol.config import ConfigModel


class OSWorldConfig(ConfigModel):
    """Configuration of ``osworld`` env instances.

    Example (YAML)::

        env:
          backend: osworld
          osworld:
            provider: local
            desktop: {width: 1280, height: 720}
    """

    provider: Literal["local", "docker", "remote"] = "local"
    """Where the VM server comes from (see :mod:`dart.env.osworld.providers`)."""
    desktop: DesktopConfig = Field(default_factory=DesktopConfig)
    """The local desktop's settings (``provider: local``)."""
    docker: DockerProviderConfig = Field(default_factory=DockerProviderConfig)
    """The docker VM's settings (``provider: docker``)."""
    remote: RemoteProviderConfig | None = None
    """The remote VMs' settings (``provider: remote``): a URL or an acquire command, and how they revert."""
    vm_apps: list[str] | None = None
    """Applications the VM image has (``provider: docker`` or ``remote``), which decides the tasks the pool
    runs (:func:`dart.env.osworld.support.vm_platform`); None: OSWorld's own VM image (every application
    OSWorld's tasks use). The local provider probes its host instead."""
    home_map: str | None = OSWORLD_HOME
    """The VM home directory that task paths name; under the local provider it is rewritten to the
    desktop's own HOME in setup-step and getter parameters (and the instruction). None: no rewriting.
    Real VMs (docker, remote) never rewrite."""
    network: bool = False
    """Whether ``download`` steps and ``cloud_file`` getters may reach the internet."""
    dart_actions: bool = True
    """Send actions to ``/dart/action`` where the server has DART extensions; False sends pyautogui
    code through ``/execute`` as on a real OSWorld VM (which needs pyautogui on the VM)."""
    settle_s: float = Field(default=0.3, ge=0.0, le=10.0)
    """Pause after each input action before the screenshot, seconds."""
    request_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0)
    """Limit of every VM server request, seconds (a dead VM raises within it)."""
    root_sudo: bool | None = None
    """Local provider: drop ``sudo`` prefixes from commands; None: when this process runs as root."""
    client_password: str = "password"
    """What OSWorld's ``{CLIENT_PASSWORD}`` placeholder becomes (the public OSWorld VM default)."""

    @model_validator(mode="after")
    def _remote_is_configured(self) -> OSWorldConfig:
        if self.provider == "remote" and self.remote is None:
            raise ValueError(
                "provider remote needs osworld.remote (url and revert_url/revert_command, or acquire_command)"
            )
        return self
