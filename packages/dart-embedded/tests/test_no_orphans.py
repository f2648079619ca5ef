"""A parent killed with SIGKILL takes its children along: no server outlives the run that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pid: int, limit_s: float = 60.0) -> bool:
    # A generous limit: the kernel signals at once, but a starved machine may take a while to reap.
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _kill(parent: subprocess.Popen[str]) -> None:
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    if parent.stdout is not None:
        parent.stdout.close()


def _start_parent(code: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """Run ``code`` in a parent process that prints one JSON line of child pids, then sleeps."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, f"parent exited early with {parent.wait()}"
    return parent, json.loads(line)


def test_plain_child_dies_with_its_killed_parent() -> None:
    parent, pids = _start_parent(
        """
        import json, subprocess, time
        from dart.runtime.lifetime import die_with_parent
        child = subprocess.Popen(["sleep", "600"], start_new_session=True, preexec_fn=die_with_parent())
        print(json.dumps({"child": child.pid}), flush=True)
        time.sleep(600)
        """
    )
    assert _alive(pids["child"])
    _kill(parent)
    assert _wait_gone(pids["child"]), "the child outlived its SIGKILLed parent"


def test_embedded_nats_dies_with_its_killed_parent(tmp_path: object) -> None:
    parent, pids = _start_parent(
        """
        import json, time
        from dart.embedded.nats import EmbeddedNats
        server = EmbeddedNats()
        server.start()
        print(json.dumps({"nats": server.pid}), flush=True)
        time.sleep(600)
        """
    )
    assert _alive(pids["nats"])
    _kill(parent)
    assert _wait_gone(pids["nats"]), "nats-server outlived the SIGKILLed process that started it"


def test_without_the_guard_a_child_would_outlive_its_parent() -> None:
    """Negative control: the tests above would fail without die_with_parent."""
    parent, pids = _start_parent(
        """
        import json, subprocess, time
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        print(json.dumps({"child": child.pid}), flush=True)
        time.sleep(600)
        """
    )
    _kill(parent)
    try:
        assert not _wait_gone(pids["child"], limit_s=1.0)
    finally:
        os.kill(pids["child"], signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``, from /proc."""
    members = []
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            with open(f"/proc/{stat}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat))
    return members


def _wait_group_gone(pgid: int, limit_s: float = 60.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not _group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def test_a_reaped_group_dies_with_its_killed_parent_grandchildren_included() -> None:
    """A launcher in its own session whose children stay in its group (chromedriver and Chromium)."""
    parent, pids = _start_parent(
        """
        import json, subprocess, time
        from dart.runtime.lifetime import reap_group_with_this_process
        launcher = subprocess.Popen(["sh", "-c", "sleep 600 & exec sleep 600"], start_new_session=True)
        reap_group_with_this_process(launcher.pid)
        print(json.dumps({"group": launcher.pid}), flush=True)
        time.sleep(600)
        """
    )
    deadline = time.monotonic() + 60
    while len(_group_members(pids["group"])) < 2:  # the launcher and the child it left running
        assert time.monotonic() < deadline, _group_members(pids["group"])
        time.sleep(0.05)
    _kill(parent)
    assert _wait_group_gone(pids["group"]), "the group outlived the SIGKILLed process that registered it"


def test_a_released_group_is_left_alone() -> None:
    parent, pids = _start_parent(
        """
        import json, subprocess, time
        from dart.runtime.lifetime import reap_group_with_this_process, release_group
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        reap_group_with_this_process(child.pid)
        release_group(child.pid)
        print(json.dumps({"group": child.pid}), flush=True)
        time.sleep(600)
        """
    )
    _kill(parent)
    try:
        assert not _wait_group_gone(pids["group"], limit_s=1.0)
    finally:
        os.killpg(pids["group"], signal.SIGKILL)
