"""``dart nats``: a foreground nats-server with JetStream that stops cleanly on a signal."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import nats
import pytest

from dart.runtime.ports import free_port

pytestmark = pytest.mark.integration


async def start_dart_nats(*args: str) -> tuple[asyncio.subprocess.Process, str, int, list[str]]:
    """Start ``dart nats`` and wait for its URL and server pid."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dart.cli", "nats", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    url = pid = None
    while url is None or pid is None:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
        if not line:
            raise AssertionError(f"dart nats exited early:\n{''.join(lines)}")
        lines.append(line)
        if m := re.search(r"listening on (nats://\S+)", line):
            url = m.group(1)
        if m := re.search(r"pid (\d+)", line):
            pid = int(m.group(1))
    return proc, url, pid, lines


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie would still answer kill(0); dart reaps its child, so this should not happen.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
async def test_serves_jetstream_and_stops_on_signal(sig: signal.Signals, tmp_path: Path) -> None:
    proc, url, server_pid, _ = await start_dart_nats("--port", "0", "--store-dir", str(tmp_path / "js"))
    try:
        nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
        try:
            sub = await nc.subscribe("dart.test")
            await nc.publish("dart.test", b"hello")
            assert (await sub.next_msg(timeout=5)).data == b"hello"
            js = nc.jetstream()
            await js.add_stream(name="T", subjects=["t.>"])
            ack = await js.publish("t.1", b"x")
            assert ack.stream == "T" and ack.seq == 1
        finally:
            await nc.close()
        assert alive(server_pid)
    finally:
        proc.send_signal(sig)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, out.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["url"] == url and summary["stopped_by"] == sig.name
    assert not alive(server_pid)
    assert (tmp_path / "js" / "jetstream").is_dir()  # an explicit --store-dir is kept


async def test_port_in_use_is_reported(nats_url: str) -> None:
    port = nats_url.rsplit(":", 1)[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dart.cli", "nats", "--port", port,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 1
    assert "already in use" in out.decode()


async def test_fixed_port_is_used(tmp_path: Path) -> None:
    port = free_port()
    proc, url, _, _ = await start_dart_nats("--port", str(port))
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.communicate(), timeout=30)
    assert url == f"nats://127.0.0.1:{port}"
    assert proc.returncode == 0


async def test_exits_non_zero_when_the_server_dies() -> None:
    proc, _, server_pid, _ = await start_dart_nats("--port", "0")
    os.kill(server_pid, signal.SIGKILL)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 1
    text = out.decode()
    assert "nats-server stopped unexpectedly" in text
    assert json.loads(text.strip().splitlines()[-1])["stopped_by"] == "nats-server stopped unexpectedly"


async def test_users_dir_admits_only_per_service_users(tmp_path: Path) -> None:
    from dart.protocol.errors import BusAuthError, PermissionDeniedError
    from dart.runtime.bus import Bus, BusConfig
    from dart.runtime.testing import all_messages
    from dart.runtime.topology import ensure_topology, open_topology

    users_dir = tmp_path / "users"
    proc, url, _, _ = await start_dart_nats("--port", "0", "--users-dir", str(users_dir), "--run", "r1")
    try:
        assert sorted(p.name for p in users_dir.iterdir()) == [
            f"nats-{r}.password" for r in sorted(("env", "rollout", "data", "train", "run", "eval"))
        ]
        with pytest.raises(BusAuthError):
            await Bus.connect(BusConfig(url=url))
        admin = BusConfig(url=url, run="r1", user="run", password_file=users_dir / "nats-run.password")
        async with await Bus.connect(admin) as run:  # the run role makes the run's streams; services bind
            await ensure_topology(run)
        config = BusConfig(url=url, run="r1", user="rollout", password_file=users_dir / "nats-rollout.password")
        async with await Bus.connect(config) as bus:
            await open_topology(bus)
            traj = next(m for m in all_messages() if m.kind == "trajectory")  # type: ignore[attr-defined]
            await bus.js_publish(bus.subjects.stream_subject("traj"), traj, msg_id="t1")
            with pytest.raises(PermissionDeniedError):
                await bus.js_publish(bus.subjects.stream_subject("work"), traj, msg_id="w1")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, out.decode()


async def test_a_cluster_serves_replicated_streams_and_stops_every_node(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dart.cli", "nats", "--cluster", "3", "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    while not any("Press Ctrl-C" in line for line in lines):
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=120)).decode()
        if not line:
            raise AssertionError(f"dart nats --cluster exited early:\n{''.join(lines)}")
        lines.append(line)
    text = "".join(lines)
    urls = re.findall(r"nats://127\.0\.0\.1:\d+", text.split("listening on", 1)[1].splitlines()[0])
    pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
    assert len(set(urls)) == 3 and len(set(pids)) == 3 and all(alive(p) for p in pids)
    assert "DART_BUS__REPLICAS=3" in text
    try:
        nc = await nats.connect(urls, connect_timeout=5)
        try:
            js = nc.jetstream()
            await js.add_stream(name="T", subjects=["t.>"], num_replicas=3)
            ack = await js.publish("t.1", b"x")
            assert ack.stream == "T" and ack.seq == 1
            info = await js.stream_info("T")
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2  # and its leader: 3 copies
        finally:
            await nc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, text + out.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["urls"] == urls and summary["pids"] == pids and summary["stopped_by"] == "SIGTERM"
    assert not any(alive(p) for p in pids)
