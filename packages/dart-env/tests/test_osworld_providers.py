"""VM providers at their boundary: KVM detection, docker run arguments, an unreachable daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.env import OSWorldEnv
from dart.env.osworld.errors import ProviderError
from dart.env.osworld.providers import (
    SERVER_PORT,
    VNC_PORT,
    DockerProvider,
    DockerProviderConfig,
    RemoteProvider,
    RemoteProviderConfig,
    container_run_kwargs,
    docker_client,
    kvm_available,
)

pytestmark = pytest.mark.unit


def test_kvm_detection(tmp_path: Path) -> None:
    assert not kvm_available(tmp_path / "kvm")  # no device
    device = tmp_path / "kvm"
    device.write_bytes(b"")
    os.chmod(device, 0o600)
    assert kvm_available(device)
    if os.geteuid() != 0:  # root may open anything, so unreadable is only testable as a user
        os.chmod(device, 0o000)
        assert not kvm_available(device)


def test_container_run_arguments(tmp_path: Path) -> None:
    disk = tmp_path / "Ubuntu.qcow2"
    disk.write_bytes(b"qcow")
    config = DockerProviderConfig(disk_image=disk, ram="8G", cpus=2)
    kwargs = container_run_kwargs(config, server_port=15000, vnc_port=18006, kvm=True)
    assert kwargs["image"] == "happysixd/osworld-docker"
    assert kwargs["devices"] == ["/dev/kvm"]
    assert kwargs["environment"] == {"DISK_SIZE": "32G", "RAM_SIZE": "8G", "CPU_CORES": "2"}
    assert kwargs["ports"] == {SERVER_PORT: ("127.0.0.1", 15000), VNC_PORT: ("127.0.0.1", 18006)}
    assert kwargs["volumes"] == {str(disk.resolve()): {"bind": "/System.qcow2", "mode": "ro"}}
    assert kwargs["cap_add"] == ["NET_ADMIN"] and kwargs["detach"] is True
    slow = container_run_kwargs(config, server_port=1, vnc_port=2, kvm=False)
    assert slow["devices"] == [] and slow["environment"]["KVM"] == "N"


def test_a_desktop_container_gets_its_token_in_its_environment_only() -> None:
    config = DockerProviderConfig(image="dart-env:0", qemu=False, command=["serve"])
    kwargs = container_run_kwargs(config, server_port=15000, vnc_port=18006, kvm=False, token="t0ken")
    assert kwargs["environment"] == {"DART_DESKTOP_TOKEN": "t0ken"} and "t0ken" not in str(kwargs["command"])
    assert kwargs["ports"] == {SERVER_PORT: ("127.0.0.1", 15000)}


def test_container_run_needs_the_disk_image(tmp_path: Path) -> None:
    with pytest.raises(ProviderError, match="disk_image"):
        container_run_kwargs(DockerProviderConfig(), 1, 2, kvm=False)
    with pytest.raises(ProviderError, match="does not exist"):
        container_run_kwargs(DockerProviderConfig(disk_image=tmp_path / "missing.qcow2"), 1, 2, kvm=False)


def test_unreachable_docker_daemon_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")  # nothing listens there
    with pytest.raises(ProviderError) as err:
        docker_client()
    assert "docker daemon" in str(err.value) and "DOCKER_HOST" in str(err.value)
    with pytest.raises(ProviderError):
        DockerProvider(DockerProviderConfig(disk_image=tmp_path / "x.qcow2")).start()


def test_remote_provider_config_needs_a_clean_state_per_episode() -> None:
    with pytest.raises(ValidationError, match="osworld.remote"):
        OSWorldConfig(provider="remote")
    with pytest.raises(ValidationError, match="must be reverted between episodes"):
        RemoteProviderConfig(url="http://127.0.0.1:5000")  # a fixed VM that nothing reverts
    with pytest.raises(ValidationError, match="exactly one of url"):
        RemoteProviderConfig(url="http://h:5000", acquire_command=["get-vm"], revert_command=["x"])
    with pytest.raises(ValidationError, match="at most one of revert_url"):
        RemoteProviderConfig(url="http://h:5000", revert_url="{url}/r", revert_command=["x"])
    with pytest.raises(ValidationError, match="release_command"):
        RemoteProviderConfig(url="http://h:5000", revert_url="{url}/r", release_command=["x"])
    fixed = RemoteProviderConfig(url="http://127.0.0.1:5000/", revert_url="{url}/dart/revert")
    provider = OSWorldEnv(OSWorldConfig(provider="remote", remote=fixed)).make_provider()
    assert isinstance(provider, RemoteProvider) and provider.can_revert and provider.home is None
    single = RemoteProvider(RemoteProviderConfig(acquire_command=["get-vm"]))
    assert not single.can_revert
    with pytest.raises(ProviderError, match="not started"):
        single.revert()
