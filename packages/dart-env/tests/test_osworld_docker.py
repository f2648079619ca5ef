"""The docker VM provider against a real docker daemon, with a stand-in for OSWorld's VM image.

OSWorld's image boots an Ubuntu disk (``Ubuntu.qcow2``, about 24 GB) under QEMU and wants KVM; neither is
here. The stand-in is DART's own ``dart-env`` image (built by ``scripts/build-images.sh``, the compose stack's
build, shared through the root conftest's ``built_images``) running Xvfb and DART's desktop VM server on
port 5000: the same HTTP API the provider health-checks and the env drives. So the container's creation,
the health check, the revert (the container removed and a new one run from the image: a file written in the
episode is gone) and the teardown run for real; booting the qcow2 under KVM does not.

Skipped, with the reason, where root, docker, mmdebstrap or a daemon is missing; ``DART_REQUIRE_DOCKER=1``
(set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.env.osworld.client import VMServerClient
from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.env import OSWorldEnv
from dart.env.osworld.errors import OSWorldVMError, ProviderError
from dart.env.osworld.providers import CONTAINER_LABEL, DockerProvider, DockerProviderConfig, docker_client
from dart.protocol.messages import TaskSpec

pytestmark = pytest.mark.integration

PROTOCOL_PYPROJECT = Path(__file__).resolve().parents[2] / "dart-protocol" / "pyproject.toml"
STAND_IN = f"dart-env:{tomllib.loads(PROTOCOL_PYPROJECT.read_text())['project']['version']}"
"""The image scripts/build-images.sh tags with the workspace version."""
SERVE_VM_API = [
    "sh",
    "-c",
    "Xvfb :1 -screen 0 640x480x24 -nolisten tcp & "
    "until xdpyinfo -display :1 >/dev/null 2>&1; do sleep 0.1; done; "
    "exec python -m dart.env.desktop.server --display :1 --host 0.0.0.0 --port 5000 --home /tmp/vm-home "
    "--token-env DART_DESKTOP_TOKEN",
]
"""The stand-in VM: an X server and DART's VM server (OSWorld's API: /screenshot, /execute ...) on port 5000."""


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    absent = [t for t in ("docker", "mmdebstrap") if shutil.which(t) is None]
    if absent:
        return f"missing {absent}"
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        return "no docker daemon answers"
    return None


@pytest.fixture(scope="module")
def stand_in_image(request: pytest.FixtureRequest) -> Iterator[str]:
    """The stand-in image, built once per session with the compose stack's images."""
    missing = _missing()
    if missing is not None:
        reason = f"the docker provider test needs root, docker, mmdebstrap and a daemon: {missing}"
        if os.environ.get("DART_REQUIRE_DOCKER") == "1":
            pytest.fail(f"{reason}, and DART_REQUIRE_DOCKER=1")
        pytest.skip(reason)
    code, log = request.getfixturevalue("built_images")
    assert code == 0, f"scripts/build-images.sh failed ({log}):\n{Path(log).read_text()[-3000:]}"
    yield STAND_IN
    client = docker_client()
    try:  # nothing this module started may outlive it
        for container in client.containers.list(all=True, filters={"label": CONTAINER_LABEL}):
            container.remove(force=True)
    finally:
        client.close()


def stand_in(image: str, **overrides: Any) -> DockerProviderConfig:
    settings: dict[str, Any] = {"image": image, "qemu": False, "command": SERVE_VM_API, "ready_timeout_s": 120}
    return DockerProviderConfig(**{**settings, **overrides})


def vm_containers() -> list[str]:
    client = docker_client()
    try:
        return [c.id for c in client.containers.list(all=True, filters={"label": CONTAINER_LABEL})]
    finally:
        client.close()


def test_create_health_check_revert_and_teardown(stand_in_image: str, built_images: Any) -> None:
    provider = DockerProvider(stand_in(stand_in_image))
    try:
        url = provider.start()
        assert provider.alive() and vm_containers() == [provider.container_id]
        first = provider.container_id
        assert provider.token
        stranger = VMServerClient(url, timeout=30)
        with pytest.raises(OSWorldVMError, match="401"):  # the desktop in the container requires its token
            stranger.screen_size()
        stranger.close()
        client = VMServerClient(url, timeout=30, token=provider.token)
        try:
            assert client.screen_size() == (640, 480)
            assert client.execute(["sh", "-c", "echo dirty > /tmp/vm-home/episode-state"])["returncode"] == 0
            assert client.execute(["cat", "/tmp/vm-home/episode-state"])["output"].strip() == "dirty"
            assert provider.revert() == url  # a new container on the same host port
            assert provider.container_id != first and vm_containers() == [provider.container_id]
            answer = client.execute(["sh", "-c", "test -e /tmp/vm-home/episode-state && echo kept || echo gone"])
            assert answer["output"].strip() == "gone"
        finally:
            client.close()
    finally:
        provider.stop()
    assert not provider.alive() and vm_containers() == []
    provider.stop()  # idempotent


def test_osworld_env_on_a_docker_vm_reverts_between_episodes(stand_in_image: str, built_images: Any) -> None:
    # Each episode's setup records what HOME held when it began, then leaves a marker there.
    setup = "ls -A /tmp/vm-home > /tmp/seen; touch /tmp/vm-home/marker"
    task = TaskSpec(
        task_id="osworld/test/docker",
        backend="osworld",
        instruction="x",
        params={
            "id": "docker",
            "instruction": "x",
            "config": [{"type": "execute", "parameters": {"command": ["sh", "-c", setup]}}],
            "evaluator": {"func": "infeasible"},
        },
    )
    env = OSWorldEnv(OSWorldConfig(provider="docker", docker=stand_in(stand_in_image), request_timeout_s=30))

    async def two_episodes() -> list[tuple[str | None, str]]:
        seen = []
        try:
            for _ in range(2):
                await env.reset(task)
                assert isinstance(env.provider, DockerProvider) and env.client is not None
                found = str(env.client.execute(["cat", "/tmp/seen"])["output"])
                seen.append((env.provider.container_id, found))
        finally:
            await env.close()
        return seen

    (first, first_seen), (second, second_seen) = asyncio.run(two_episodes())
    assert "marker" not in first_seen and "marker" not in second_seen, "the second episode saw the first's state"
    assert first != second and vm_containers() == []


def test_a_failed_start_is_a_clear_error_and_leaves_nothing(stand_in_image: str, built_images: Any) -> None:
    provider = DockerProvider(stand_in(stand_in_image, command=["sh", "-c", "exit 3"], ready_timeout_s=30))
    with pytest.raises(ProviderError, match="stopped before its server"):
        provider.start()
    assert vm_containers() == []
