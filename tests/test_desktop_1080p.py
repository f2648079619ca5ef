"""A real X desktop at 1920x1080: its screenshot travels by reference through the env service over NATS.

The env service (osworld backend, local desktop provider) writes the ~1 MB PNG to the artifact store
and replies with an ImageRef; a rollout-side cache reads back exactly the bytes the reference names.
"""

from __future__ import annotations

import io
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from PIL import Image

from dart.env.osworld import load_local_suite
from dart.env.service import EnvService, EnvServiceConfig
from dart.protocol.messages import ImageRef
from dart.protocol.messages.codec import encode
from dart.rollout.service.config import RunnerConfig
from dart.rollout.service.env_client import EnvClient
from dart.rollout.service.images import ImageCache
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.store import LocalStore

pytestmark = pytest.mark.integration

MISSING = [p for p in ("Xvfb", "openbox", "xterm", "mousepad") if shutil.which(p) is None]


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    config = BusConfig(url=nats_url, run=f"r{uuid.uuid4().hex[:8]}", connect_timeout_s=2.0, request_timeout_s=30.0)
    async with await Bus.connect(config) as connected:
        yield connected


@pytest.mark.skipif(bool(MISSING), reason=f"local desktop programs missing: {MISSING} (.ci/run installs them)")
async def test_a_1080p_desktop_screenshot_travels_by_reference(bus: Bus, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "artifacts", fsync=False)
    pool = f"desk{uuid.uuid4().hex[:6]}"
    config = EnvServiceConfig(
        pool=pool,
        backend="osworld",
        instances=1,
        osworld={"provider": "local", "desktop": {"width": 1920, "height": 1080}, "request_timeout_s": 60},
        suites=("builtin:osworld/local",),
    )
    task = load_local_suite()[0]
    images = ImageCache()
    async with EnvService(config, bus, store=store) as env:
        client = EnvClient(bus, "holder-t", RunnerConfig(pool=pool, env_request_timeout_s=120))
        try:
            await client.lease(task.task_id)
            reply = await client.reset(task)
        finally:
            await client.release("test over")
        assert env.screenshots.referenced == 1
    shot = reply.observation.screenshot
    assert isinstance(shot, ImageRef) and (shot.width, shot.height) == (1920, 1080)
    assert shot.uri.endswith(f"/screenshots/{shot.sha256}.png")
    png = await images.fetch(shot)
    images.close()
    assert len(png) > config.inline_max_bytes  # type: ignore[operator]
    assert Image.open(io.BytesIO(png)).size == (1920, 1080)
    # The reply itself stays small: the megapixels are in the store, not on the bus.
    assert len(encode(reply)) < 4096 < len(png)
    print(f"1920x1080 desktop screenshot: {len(png)} bytes PNG, reset reply {len(encode(reply))} bytes")
