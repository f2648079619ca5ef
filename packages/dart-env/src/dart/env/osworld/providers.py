"""Where an OSWorld VM server comes from: a local desktop, an OSWorld docker VM, or a given URL.

Lifecycle of every provider::

    created --start()--> running --revert()--> running (a fresh episode state)
                            |
                            +--stop()--> stopped  (idempotent)

All calls block; :class:`~dart.env.osworld.env.OSWorldEnv` runs them on its worker thread.

- :class:`LocalDesktopProvider`: one :class:`~dart.env.desktop.XDesktop` per env instance (Xvfb,
  xterm, mousepad); revert kills what the episode launched and restores HOME. Task paths under the
  OSWorld VM home are mapped onto the desktop's own HOME (:attr:`home`).
- :class:`DockerProvider`: OSWorld's QEMU-in-docker VM through the docker SDK (``dart-env[docker]``):
  the server port 5000 and the VNC port 8006 are published on loopback, ``/dev/kvm`` is passed in
  when usable, the VM disk image is mounted read-only; revert restarts the container (the disk is a
  read-only snapshot).
- :class:`RemoteProvider`: an already running VM server at a URL; revert only where it has DART
  extensions.
"""

from __future__ import annotations

import os
import socket
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import requests
from pydantic import Field

from dart.env.osworld.errors import ProviderError
from dart.protocol.config import ConfigModel

SERVER_PORT = 5000
"""The VM server's port inside an OSWorld VM."""
VNC_PORT = 8006
"""The VM's web VNC port inside OSWorld's docker image."""


class VMProvider(ABC):
    """Provides one VM server; see the module docstring for the lifecycle."""

    name: str

    @abstractmethod
    def start(self) -> str:
        """Bring the VM up and return its server URL.

        Raises:
            ProviderError: It cannot be started; the message says what is missing.
        """

    @abstractmethod
    def revert(self) -> None:
        """Return the VM to its episode-start state."""

    @abstractmethod
    def stop(self) -> None:
        """Shut the VM down (idempotent)."""

    def alive(self) -> bool:
        """Whether the VM is still running (as far as the provider can tell cheaply)."""
        return True

    def process_ids(self) -> list[int]:
        """Local processes of the VM whose memory counts as the instance's (none for a VM elsewhere)."""
        return []

    @property
    def home(self) -> str | None:
        """The home directory task paths map onto, or None when the VM has OSWorld's own home."""
        return None


class LocalDesktopProvider(VMProvider):
    """A local X desktop (``dart.env.desktop``) per env instance."""

    name = "local"

    def __init__(self, config: Any = None) -> None:
        """Args:
        config: A :class:`~dart.env.desktop.DesktopConfig` (default: its defaults).
        """
        self.config = config
        self.desktop: Any = None

    def start(self) -> str:
        from dart.env.desktop import DesktopConfig, DesktopError, XDesktop

        if self.desktop is None:
            desk = XDesktop(self.config or DesktopConfig())
            try:
                desk.start()
            except DesktopError as exc:
                raise ProviderError(self.name, f"the local desktop did not start: {exc}") from exc
            self.desktop = desk
        return str(self.desktop.url)

    def revert(self) -> None:
        from dart.env.desktop import DesktopError

        if self.desktop is None:
            raise ProviderError(self.name, "not started")
        try:
            self.desktop.revert()
        except DesktopError as exc:
            raise ProviderError(self.name, f"revert failed: {exc}") from exc

    def stop(self) -> None:
        desk, self.desktop = self.desktop, None
        if desk is not None:
            desk.close()

    def alive(self) -> bool:
        return self.desktop is not None and bool(self.desktop.alive())

    def process_ids(self) -> list[int]:
        """The X server, the window manager and the desktop's server (apps are their descendants)."""
        return [pid for pid in self.desktop.pids.values() if pid is not None] if self.desktop is not None else []

    @property
    def home(self) -> str | None:
        return str(self.desktop.home) if self.desktop is not None else None


class RemoteProvider(VMProvider):
    """A VM server that runs elsewhere (an OSWorld VM started by hand, another host's desktop)."""

    name = "remote"

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def start(self) -> str:
        return self.url

    def revert(self) -> None:
        # Only DART's desktop can revert over HTTP; a plain OSWorld VM keeps its state, and each
        # task's setup steps establish what the task needs.
        try:
            requests.post(self.url + "/dart/revert", timeout=self.timeout)
        except requests.RequestException:
            pass

    def stop(self) -> None:
        pass


class DockerProviderConfig(ConfigModel):
    """Settings of OSWorld VMs run in docker (OSWorld's QEMU image)."""

    image: str = "happysixd/osworld-docker"
    """The docker image (OSWorld's default)."""
    disk_image: Path | None = None
    """The VM disk (``Ubuntu.qcow2`` from OSWorld's release); mounted read-only as ``/System.qcow2``."""
    ram: str = "4G"
    """RAM_SIZE of the VM."""
    cpus: int = Field(default=4, ge=1, le=256)
    """CPU_CORES of the VM."""
    disk_size: str = "32G"
    """DISK_SIZE of the VM."""
    kvm: bool | None = None
    """Use ``/dev/kvm``: None detects it (:func:`kvm_available`); without KVM the VM is very slow."""
    ready_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the VM server to answer after the container starts, seconds."""


def kvm_available(device: str | os.PathLike[str] = "/dev/kvm") -> bool:
    """Whether KVM can be used: the device exists and this user may read and write it."""
    return os.path.exists(device) and os.access(device, os.R_OK | os.W_OK)


def container_run_kwargs(config: DockerProviderConfig, server_port: int, vnc_port: int, kvm: bool) -> dict[str, Any]:
    """The keyword arguments of ``docker.containers.run`` for one OSWorld VM.

    Ports are published on 127.0.0.1 only. Raises :class:`ProviderError` when the disk image is not
    configured or missing.
    """
    if config.disk_image is None:
        raise ProviderError("docker", "set osworld.docker.disk_image to the OSWorld VM disk (Ubuntu.qcow2)")
    disk = Path(config.disk_image).resolve()
    if not disk.is_file():
        raise ProviderError("docker", f"VM disk image {disk} does not exist")
    environment = {"DISK_SIZE": config.disk_size, "RAM_SIZE": config.ram, "CPU_CORES": str(config.cpus)}
    if not kvm:
        environment["KVM"] = "N"
    return {
        "image": config.image,
        "environment": environment,
        "cap_add": ["NET_ADMIN"],
        "devices": ["/dev/kvm"] if kvm else [],
        "volumes": {str(disk): {"bind": "/System.qcow2", "mode": "ro"}},
        "ports": {SERVER_PORT: ("127.0.0.1", server_port), VNC_PORT: ("127.0.0.1", vnc_port)},
        "detach": True,
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def docker_client() -> Any:
    """A docker SDK client from the environment.

    Raises:
        ProviderError: The SDK is not installed, or the daemon is unreachable.
    """
    try:
        import docker  # type: ignore[import-untyped,unused-ignore]
        from docker.errors import DockerException  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ProviderError("docker", "the docker SDK is not installed: pip install 'dart-env[docker]'") from None
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if where.startswith("unix://") and not Path(where.removeprefix("unix://")).exists():
        # Checked first: the SDK leaks a socket when it fails to connect to a missing one.
        raise ProviderError(
            "docker", f"cannot reach the docker daemon: no socket at {where}; start dockerd or set DOCKER_HOST"
        )
    try:
        return docker.from_env()
    except DockerException as exc:
        raise ProviderError(
            "docker", f"cannot reach the docker daemon at {where} ({exc}); start dockerd or set DOCKER_HOST"
        ) from None


class DockerProvider(VMProvider):
    """One OSWorld VM in a docker container."""

    name = "docker"

    def __init__(self, config: DockerProviderConfig | None = None) -> None:
        self.config = config or DockerProviderConfig()
        self.container: Any = None
        self.url = ""

    def start(self) -> str:
        if self.container is not None:
            return self.url
        client = docker_client()
        kvm = kvm_available() if self.config.kvm is None else self.config.kvm
        server_port, vnc_port = free_port(), free_port()
        kwargs = container_run_kwargs(self.config, server_port, vnc_port, kvm)
        from docker.errors import DockerException

        try:
            self.container = client.containers.run(**kwargs)
        except DockerException as exc:
            raise ProviderError(self.name, f"cannot start {self.config.image}: {exc}") from None
        self.url = f"http://127.0.0.1:{server_port}"
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/screenshot", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2.0)
        self.stop()
        raise ProviderError(self.name, f"the VM server did not answer within {self.config.ready_timeout_s:.0f} s")

    def revert(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        container, self.container = self.container, None
        if container is not None:
            try:
                container.stop(timeout=10)
                container.remove(force=True)
            except Exception:  # (a container that is already gone is stopped)
                pass

    def alive(self) -> bool:
        if self.container is None:
            return False
        try:
            self.container.reload()
            return bool(self.container.status == "running")
        except Exception:
            return False
