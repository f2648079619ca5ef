"""Service supervision on real processes: restart after a backoff that doubles, give up past the limit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dart.cli.stack.supervisor import ServiceSupervisor
from dart.embedded.nats import EmbeddedNats
from dart.protocol.messages import Sampling, TaskSpec, WorkItem
from dart.runtime.bus import Bus, BusConfig
from dart.runtime.topology import ensure_topology

WORK = WorkItem(
    work_id="w-1",
    task=TaskSpec(task_id="sim/click", backend="sim"),
    group_id="g",
    rollout_index=0,
    group_size=1,
    max_steps=3,
    min_policy_version=0,
    sampling=Sampling(temperature=1.0),
    created_at=1.0,
)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def procs() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    live: dict[str, subprocess.Popen[bytes]] = {}
    yield live
    for proc in live.values():
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_a_killed_service_is_restarted_after_its_backoff(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    clock, notes = Clock(), []
    procs["data"] = subprocess.Popen(SLEEPER)
    procs["train"] = subprocess.Popen(SLEEPER)
    spawned: list[subprocess.Popen[bytes]] = []

    def respawn(name: str) -> subprocess.Popen[bytes]:
        spawned.append(subprocess.Popen(SLEEPER))
        return spawned[-1]

    sup = ServiceSupervisor(procs, respawn, max_restarts=3, backoff_s=2.0, notify=notes.append, clock=clock)
    assert sup.check() is None and sup.restarts == []
    first = procs["train"]
    first.send_signal(signal.SIGKILL)
    first.wait()
    clock.now = 10.0
    assert sup.check() is None  # death seen: restart due at 12.0
    assert procs["train"] is first and not spawned
    assert sup.report() == [{"service": "train", "exit_code": -9, "died_after_s": 10.0, "restarted_after_s": None}]
    clock.now = 11.9
    assert sup.check() is None and not spawned
    clock.now = 12.0
    assert sup.check() is None
    assert procs["train"] is spawned[0] and procs["train"].poll() is None
    assert sup.restarts[0].restarted_after_s == 12.0
    assert procs["data"].poll() is None and sup.deaths("data") == 0  # the others are left alone
    assert notes == [
        "train exited with code -9; restarting it in 2.0s",
        f"train restarted (pid {spawned[0].pid})",
    ]


@pytest.mark.unit
def test_the_backoff_doubles_and_the_supervisor_gives_up_past_max_restarts(
    procs: dict[str, subprocess.Popen[bytes]],
) -> None:
    clock = Clock()
    crasher = [sys.executable, "-c", "raise SystemExit(3)"]
    procs["env"] = subprocess.Popen(crasher)
    sup = ServiceSupervisor(
        procs, lambda name: subprocess.Popen(crasher), max_restarts=2, backoff_s=1.0, notify=lambda _: None, clock=clock
    )
    procs["env"].wait()
    assert sup.check() is None  # death 1 at 0.0: restart at 1.0
    clock.now = 0.99
    assert sup.check() is None and sup.restarts[0].restarted_after_s is None
    clock.now = 1.0
    assert sup.check() is None and sup.restarts[0].restarted_after_s == 1.0
    procs["env"].wait()
    assert sup.check() is None  # death 2 at 1.0: restart at 3.0 (the backoff doubled)
    clock.now = 2.99
    assert sup.check() is None and sup.restarts[1].restarted_after_s is None
    clock.now = 3.0
    assert sup.check() is None and sup.restarts[1].restarted_after_s == 3.0
    procs["env"].wait()
    assert sup.check() == "env exited with code 3 and was restarted 2 time(s) already: giving up"
    assert [r.exit_code for r in sup.restarts] == [3, 3, 3] and sup.restarts[2].restarted_after_s is None


@pytest.mark.integration
async def test_a_killed_nats_server_comes_back_on_its_port_with_its_streams(tmp_path: Path) -> None:
    nats = EmbeddedNats(store_dir=tmp_path / "nats").start()
    try:
        async with await Bus.connect(BusConfig(url=nats.url, run="sup")) as bus:
            await ensure_topology(bus)
            subject = bus.subjects.stream_subject("work")
            await bus.js_publish(subject, WORK, msg_id=WORK.work_id)
            old_pid = nats.pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            clock = Clock()
            sup = ServiceSupervisor(
                {}, _no_service, max_restarts=1, backoff_s=1.0, servers={"nats-server": nats}, clock=clock
            )
            await asyncio.to_thread(_until_exited, nats)  # the kill is delivered asynchronously
            assert sup.check() is None and sup.restarts[0].exit_code == -9
            clock.now = 1.0
            assert sup.check() is None
            assert nats.pid not in (None, old_pid) and nats.poll() is None
            # The client reconnects by itself; the stream kept the message published before the kill.
            again = WORK.model_copy(update={"work_id": "w-2"})
            await bus.js_publish(subject, again, msg_id=again.work_id)
            assert (await bus.stream_state("work")).messages == 2
    finally:
        nats.stop()


def _no_service(name: str) -> subprocess.Popen[bytes]:
    raise AssertionError(f"no service to respawn, got {name}")


def _until_exited(nats: EmbeddedNats) -> None:
    while nats.poll() is None:
        time.sleep(0.05)
