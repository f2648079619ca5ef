"""Where an OSWorld VM server comes from: a local desktop, an OSWorld docker VM, or a remote VM.

Lifecycle of every provider::

    created --start()--> running --revert()--> running (a clean episode state)
                            |          |
                            |          +--fails--> ProviderError (the env service ends the instance)
                            +--stop()--> stopped  (idempotent)

All calls block; :class:`~dart.env.osworld.env.OSWorldEnv` runs them on its worker thread.

Every episode starts from a clean state: a provider either reverts (:attr:`VMProvider.can_revert`) or
serves one episode only, after which the env service ends the instance and starts a fresh one (a new VM).
A revert that fails raises :class:`ProviderError`; the instance is never used again.

- :class:`LocalDesktopProvider`: one :class:`~dart.env.desktop.XDesktop` per env instance (Xvfb,
  xterm, mousepad); revert kills what the episode launched and restores HOME. Task paths under the
  OSWorld VM home are mapped onto the desktop's own HOME (:attr:`home`).
- :class:`DockerProvider`: OSWorld's QEMU-in-docker VM through the docker SDK (``dart-env[docker]``):
  the server port 5000 and the VNC port 8006 are published on loopback, ``/dev/kvm`` is passed in
  when usable, the VM disk image is mounted read-only; revert removes the container and runs a new
  one from the image (the disk is a read-only snapshot), on the same host ports.
- :class:`RemoteProvider`: a VM server elsewhere: at a fixed URL with a revert endpoint or command, or
  acquired per instance by a command (one episode per VM when it cannot revert).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import requests
from pydantic import Field, model_validator

from dart.env.osworld.errors import ProviderError
from dart.protocol.config import ConfigModel
from dart.runtime.ports import free_ports
from dart.runtime.retry import Backoff

log = logging.getLogger("dart.env.osworld")

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

    @property
    def can_revert(self) -> bool:
        """Whether :meth:`revert` returns the VM to a clean state; False: the VM serves one episode."""
        return True

    @abstractmethod
    def revert(self) -> str:
        """Return the VM to a clean state and return its server URL (a recreated VM may move).

        Raises:
            ProviderError: The revert failed, or this provider cannot revert (:attr:`can_revert`).
        """

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

    @property
    def token(self) -> str | None:
        """The bearer token its server requires, or None for a server that checks none (OSWorld's own)."""
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

    def revert(self) -> str:
        from dart.env.desktop import DesktopError

        if self.desktop is None:
            raise ProviderError(self.name, "not started")
        try:
            self.desktop.revert()
        except DesktopError as exc:
            raise ProviderError(self.name, f"revert failed: {exc}") from exc
        return str(self.desktop.url)

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

    @property
    def token(self) -> str | None:
        return str(self.desktop.token) if self.desktop is not None else None


def wait_for_server(url: str, timeout_s: float, provider: str, *, alive: Any = None, token: str | None = None) -> None:
    """Wait until the VM server at ``url`` answers ``GET /screenshot`` with 200 (its health check).

    Args:
        url: The server URL.
        timeout_s: How long to wait, seconds.
        provider: The provider's name, for the error.
        alive: A callable that says whether the VM still runs; a dead one fails at once.
        token: The server's bearer token, if it requires one.

    Raises:
        ProviderError: No answer within ``timeout_s``, or the VM died.
    """
    deadline = time.monotonic() + timeout_s
    delays = Backoff(0.1, max_s=2.0).delays()
    last = "no answer"
    while True:
        try:
            answer = requests.get(url + "/screenshot", headers=bearer_headers(token), timeout=min(10.0, timeout_s))
            if answer.status_code == 200:
                return
            if answer.status_code in (401, 403):  # waiting will not bring the right token
                raise ProviderError(
                    provider, f"the VM server at {url} refused the request (HTTP {answer.status_code}): set token_file"
                )
            last = f"HTTP {answer.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        if alive is not None and not alive():
            raise ProviderError(provider, f"the VM stopped before its server at {url} answered ({last})")
        if time.monotonic() >= deadline:
            raise ProviderError(provider, f"the VM server at {url} did not answer within {timeout_s:g} s ({last})")
        time.sleep(min(next(delays), max(0.0, deadline - time.monotonic())))


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header of a server that requires ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def run_command(command: Sequence[str], *, env: Mapping[str, str], timeout_s: float, provider: str, what: str) -> str:
    """Run a provider command (no shell) and return its stdout.

    Raises:
        ProviderError: It could not start, exited non-zero, or ran past ``timeout_s``; the message has the
            end of its stderr.
    """
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env}, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProviderError(provider, f"the {what} command {list(command)} failed: {exc}") from None
    if done.returncode != 0:
        tail = done.stderr.strip()[-300:] or "no stderr"
        raise ProviderError(provider, f"the {what} command {list(command)} exited {done.returncode}: {tail}")
    return done.stdout


class RemoteProviderConfig(ConfigModel):
    """Settings of VM servers that run elsewhere (OSWorld VMs on another host or a cloud, DART desktops).

    Either one VM at a fixed ``url`` that can be reverted (``revert_url`` or ``revert_command``), or a
    VM per instance from ``acquire_command``: reverted the same way where configured, else used for one
    episode, then given back (``release_command``) and a fresh one acquired.

    Example (YAML)::

        osworld:
          provider: remote
          remote:
            url: http://osworld-vm-7:5000
            revert_command: [virsh, snapshot-revert, osworld-7, clean]

    Commands run without a shell; they get ``DART_VM_URL`` (the VM server URL) in their environment.
    """

    url: str | None = None
    """The VM server URL of one fixed VM; needs ``revert_url`` or ``revert_command``."""
    acquire_command: list[str] | None = Field(default=None, min_length=1)
    """Brings up a fresh VM and prints its server URL as the last line of its stdout."""
    release_command: list[str] | None = Field(default=None, min_length=1)
    """Gives an acquired VM back (``DART_VM_URL`` names it); only with ``acquire_command``."""
    revert_url: str | None = None
    """Called to revert the VM (``{url}`` is replaced by the VM server URL, e.g. ``{url}/dart/revert`` on a
    DART desktop); any answer but 2xx is a failed revert."""
    revert_method: Literal["POST", "PUT", "GET"] = "POST"
    """HTTP method of ``revert_url``."""
    revert_command: list[str] | None = Field(default=None, min_length=1)
    """Reverts the VM (e.g. a hypervisor's snapshot revert); a non-zero exit is a failed revert."""
    command_timeout_s: float = Field(default=600.0, gt=0)
    """Limit of each command and of the revert request, seconds."""
    ready_timeout_s: float = Field(default=600.0, gt=0)
    """How long the VM server may take to answer after an acquire or a revert, seconds."""
    token_file: str | None = None
    """File holding the bearer token the VM server requires (a DART desktop server run on its own reads
    its token from stdin); sent on every request to that server, ``revert_url``'s when it is on that server.
    None: a server that checks none (OSWorld's own)."""

    @model_validator(mode="after")
    def _one_clean_state_per_episode(self) -> RemoteProviderConfig:
        if (self.url is None) == (self.acquire_command is None):
            raise ValueError("set exactly one of url (a fixed VM) and acquire_command (a VM per instance)")
        if self.revert_url is not None and self.revert_command is not None:
            raise ValueError("set at most one of revert_url and revert_command")
        if self.release_command is not None and self.acquire_command is None:
            raise ValueError("release_command gives back what acquire_command acquired: set acquire_command")
        if self.url is not None and self.revert_url is None and self.revert_command is None:
            raise ValueError(
                "a VM at a fixed url must be reverted between episodes: set revert_url (a DART desktop: "
                "'{url}/dart/revert') or revert_command, or acquire_command for a fresh VM per episode"
            )
        return self

    @property
    def can_revert(self) -> bool:
        """Whether a revert is configured."""
        return self.revert_url is not None or self.revert_command is not None


class RemoteProvider(VMProvider):
    """A VM server that runs elsewhere (see :class:`RemoteProviderConfig`)."""

    name = "remote"

    def __init__(self, config: RemoteProviderConfig) -> None:
        self.config = config
        self.url = ""
        self._token: str | None = None

    @property
    def token(self) -> str | None:
        """The token in ``token_file`` (read at :meth:`start`)."""
        return self._token

    @property
    def can_revert(self) -> bool:
        return self.config.can_revert

    def start(self) -> str:
        if self.url:
            return self.url
        cfg = self.config
        self._token = _read_token(cfg.token_file, self.name)
        if cfg.url is not None:
            url = cfg.url.rstrip("/")
        else:
            assert cfg.acquire_command is not None
            out = run_command(
                cfg.acquire_command, env={}, timeout_s=cfg.command_timeout_s, provider=self.name, what="acquire"
            )
            lines = out.strip().splitlines()
            url = lines[-1].strip().rstrip("/") if lines else ""
            if not url.startswith(("http://", "https://")):
                raise ProviderError(self.name, f"the acquire command printed no VM server URL last (got {url!r})")
        self.url = url
        try:
            wait_for_server(url, cfg.ready_timeout_s, self.name, token=self._token)
        except ProviderError:
            self.stop()
            raise
        return url

    def revert(self) -> str:
        cfg = self.config
        if not self.url:
            raise ProviderError(self.name, "not started")
        if cfg.revert_url is not None:
            target = cfg.revert_url.replace("{url}", self.url)
            try:
                # The token goes only to the VM server itself, not to a hypervisor's API elsewhere.
                own = target == self.url or target.startswith(self.url + "/")
                headers = bearer_headers(self._token) if own else {}
                answer = requests.request(cfg.revert_method, target, headers=headers, timeout=cfg.command_timeout_s)
            except requests.RequestException as exc:
                raise ProviderError(self.name, f"revert {cfg.revert_method} {target} failed: {exc}") from None
            if not 200 <= answer.status_code < 300:
                raise ProviderError(
                    self.name, f"revert {cfg.revert_method} {target} answered HTTP {answer.status_code}"
                )
        elif cfg.revert_command is not None:
            env = {"DART_VM_URL": self.url}
            run_command(cfg.revert_command, env=env, timeout_s=cfg.command_timeout_s, provider=self.name, what="revert")
        else:
            raise ProviderError(
                self.name, "this VM cannot revert (no revert_url or revert_command): one episode per VM"
            )
        wait_for_server(self.url, cfg.ready_timeout_s, self.name, token=self._token)
        return self.url

    def stop(self) -> None:
        url, self.url = self.url, ""
        if url and self.config.release_command is not None:
            # Giving the VM back is best effort: a failure here must not keep the instance alive.
            try:
                run_command(
                    self.config.release_command,
                    env={"DART_VM_URL": url},
                    timeout_s=self.config.command_timeout_s,
                    provider=self.name,
                    what="release",
                )
            except ProviderError as exc:
                log.warning("%s", exc)


class DockerProviderConfig(ConfigModel):
    """Settings of OSWorld VMs run in docker (OSWorld's QEMU image, or an image that serves the VM-server API
    itself).

    Example (YAML)::

        osworld:
          provider: docker
          docker: {image: happysixd/osworld-docker, disk_image: /srv/osworld/Ubuntu.qcow2, ram: 4G, cpus: 4}
    """

    image: str = "happysixd/osworld-docker"
    """The docker image (OSWorld's default)."""
    qemu: bool = True
    """The image is OSWorld's QEMU image: it boots ``disk_image`` with ``ram``/``cpus``/``disk_size`` (KVM
    where usable) and forwards the VM server on port 5000. False: the container itself serves the VM-server
    API on :attr:`server_port` (a desktop image); the VM settings do not apply. Such a container gets a
    random token (one per provider, kept across reverts) in ``DART_DESKTOP_TOKEN`` and every request carries
    it (DART's desktop server reads it with ``--token-env DART_DESKTOP_TOKEN``)."""
    command: list[str] | None = None
    """The container's command (default: the image's)."""
    server_port: int = Field(default=SERVER_PORT, ge=1, le=65535)
    """The VM server's port inside the container."""
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


DESKTOP_TOKEN_ENV = "DART_DESKTOP_TOKEN"
"""Environment variable of a desktop container (``docker.qemu: false``) holding its server's token."""

CONTAINER_LABEL = "org.dart.osworld-vm"
"""Label of every container the docker provider runs (to find leftovers: ``docker ps -f label=...``)."""


def kvm_available(device: str | os.PathLike[str] = "/dev/kvm") -> bool:
    """Whether KVM can be used: the device exists and this user may read and write it."""
    return os.path.exists(device) and os.access(device, os.R_OK | os.W_OK)


def container_run_kwargs(
    config: DockerProviderConfig, server_port: int, vnc_port: int, kvm: bool, *, token: str | None = None
) -> dict[str, Any]:
    """The keyword arguments of ``docker.containers.run`` for one OSWorld VM (a desktop image: with ``token``
    in its environment as :data:`DESKTOP_TOKEN_ENV`).

    Ports are published on 127.0.0.1 only. Raises :class:`ProviderError` when the QEMU image's disk image
    is not configured or missing.
    """
    base: dict[str, Any] = {"image": config.image, "detach": True, "labels": {CONTAINER_LABEL: "1"}}
    if config.command is not None:
        base["command"] = list(config.command)
    if not config.qemu:
        environment = {DESKTOP_TOKEN_ENV: token} if token else {}
        return {**base, "environment": environment, "ports": {config.server_port: ("127.0.0.1", server_port)}}
    if config.disk_image is None:
        raise ProviderError("docker", "set osworld.docker.disk_image to the OSWorld VM disk (Ubuntu.qcow2)")
    disk = Path(config.disk_image).resolve()
    if not disk.is_file():
        raise ProviderError("docker", f"VM disk image {disk} does not exist")
    environment = {"DISK_SIZE": config.disk_size, "RAM_SIZE": config.ram, "CPU_CORES": str(config.cpus)}
    if not kvm:
        environment["KVM"] = "N"
    return {
        **base,
        "environment": environment,
        "cap_add": ["NET_ADMIN"],
        "devices": ["/dev/kvm"] if kvm else [],
        "volumes": {str(disk): {"bind": "/System.qcow2", "mode": "ro"}},
        "ports": {config.server_port: ("127.0.0.1", server_port), VNC_PORT: ("127.0.0.1", vnc_port)},
    }


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
    """One OSWorld VM in a docker container; a revert replaces the container by a new one from the image."""

    name = "docker"

    def __init__(self, config: DockerProviderConfig | None = None) -> None:
        self.config = config or DockerProviderConfig()
        self.container: Any = None
        self.url = ""
        self._client: Any = None
        self._ports: tuple[int, int] | None = None
        """Host ports of the server and VNC, chosen once: a recreated container keeps them."""
        self._token: str | None = None

    @property
    def token(self) -> str | None:
        """The running desktop container's token (None for OSWorld's QEMU image, whose server checks none)."""
        return self._token

    @property
    def container_id(self) -> str | None:
        """The id of the running container, or None."""
        return str(self.container.id) if self.container is not None else None

    def start(self) -> str:
        if self.container is not None:
            return self.url
        from docker.errors import DockerException

        if self._client is None:
            self._client = docker_client()
        kvm = kvm_available() if self.config.kvm is None else self.config.kvm
        if self._ports is None:
            server, vnc = free_ports(2)  # distinct: both are published
            self._ports = (server, vnc)
        server_port, vnc_port = self._ports
        if self._token is None and not self.config.qemu:  # chosen once too: a client outlives a revert
            self._token = secrets.token_urlsafe(32)
        kwargs = container_run_kwargs(self.config, server_port, vnc_port, kvm, token=self._token)
        try:
            self.container = self._client.containers.run(**kwargs)
        except DockerException as exc:
            raise ProviderError(self.name, f"cannot start {self.config.image}: {exc}") from None
        self.url = f"http://127.0.0.1:{server_port}"
        try:
            wait_for_server(self.url, self.config.ready_timeout_s, self.name, alive=self.alive, token=self._token)
        except ProviderError:
            self.stop()
            raise
        return self.url

    def revert(self) -> str:
        from docker.errors import DockerException, NotFound

        container, self.container = self.container, None
        if container is None:
            raise ProviderError(self.name, "not started")
        try:
            container.remove(force=True)
        except NotFound:
            pass  # already gone: nothing of the episode is left either
        except DockerException as exc:
            raise ProviderError(self.name, f"revert could not remove container {container.id[:12]}: {exc}") from None
        return self.start()

    def stop(self) -> None:
        container, self.container = self.container, None
        if container is not None:
            try:
                container.remove(force=True)
            except Exception as exc:  # a container that is already gone is stopped
                log.debug("removing container %s: %r", container.id[:12], exc)
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def alive(self) -> bool:
        if self.container is None:
            return False
        try:
            self.container.reload()
            return bool(self.container.status == "running")
        except Exception:
            return False


def _read_token(path: str | None, provider: str) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ProviderError(provider, f"cannot read token_file {path!r}: {exc}") from None
    if not token:
        raise ProviderError(provider, f"token_file {path!r} is empty: write the VM server's token")
    return token
