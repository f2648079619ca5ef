"""A run on a replicated bus: `dart run` on a 3-node JetStream cluster with `bus.replicas: 3` loses the node
that leads the trajectory stream in the middle of RL. The services, given every node's URL, move to the
others and carry on while it is down (trajectories stored, versions published); it comes back on its
store and catches up; the run ends with nothing lost, nothing stored twice and no service restarted."""

from __future__ import annotations

import functools
import json
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dart.embedded.nats import EmbeddedNats, EmbeddedNatsCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_support  # the end-to-end tests' shared helpers, beside them

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.e2e, pytest.mark.warm_start(ROOT / "examples" / "smoke.yaml")]
WAIT_S = 1500.0
"""Limit of one wait for a condition, the warm start included (catches a hung run, within the run's own
limit; a loaded machine is slow, not stuck)."""

wait_for = functools.partial(e2e_support.wait_for, limit_s=WAIT_S)
events = e2e_support.events
AFTER_RESTART = 1
"""Versions published after the node is back before the test ends the RL phase (SIGINT, as Ctrl-C would): the
run is asked to stop once the restarted cluster has carried it on, however fast the machine."""


def stored(run_dir: Path) -> int:
    stats = events(run_dir, "data", "data.stats")
    return int(stats[-1]["attributes"]["stored"]) if stats else 0


def stream_leader(nodes: list[EmbeddedNats], suffix: str) -> str | None:
    """The server leading the stream whose name ends with ``suffix``, from a live node's monitor."""
    for node in nodes:
        if node.poll() is not None:
            continue
        url = f"http://{node.host}:{node.monitor_port}/jsz?accounts=true&streams=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                jsz = json.load(resp)
        except OSError:
            continue
        for account in jsz.get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream["name"].endswith(suffix):
                    leader = stream.get("cluster", {}).get("leader")
                    return str(leader) if leader else None
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster(3, store_dir=tmp_path_factory.mktemp("nats-cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def cluster_run(
    dart_run: Callable[..., tuple[dict[str, Any], Path]], cluster: EmbeddedNatsCluster
) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def lose_a_node(run: subprocess.Popen[str], runs: Path) -> None:
        run_dir = wait_for(run, lambda: next(runs.glob("*/config.yaml"), None), "run directory").parent
        wait_for(run, lambda: events(run_dir, "train", "trainer.published"), "a published version")
        leader = wait_for(run, lambda: stream_leader(cluster.nodes, "_TRAJ"), "the trajectory stream's leader")
        seen["killed"] = leader
        victim = int(leader.rsplit("-", 1)[1])
        stored_at_kill = stored(run_dir)
        published_at_kill = len(events(run_dir, "train", "trainer.published"))
        cluster.kill(victim)
        # While it is down: trajectories stored and a version published through the other two.
        wait_for(run, lambda: stored(run_dir) >= stored_at_kill + 8, "trajectories stored with a node down")
        wait_for(
            run,
            lambda: len(events(run_dir, "train", "trainer.published")) > published_at_kill,
            "a version published with a node down",
        )
        seen["stored_while_down"] = stored(run_dir) - stored_at_kill

        # The live nodes' monitoring may name the dead leader for a moment after the election.
        def new_leader() -> str | None:
            named = stream_leader(cluster.nodes, "_TRAJ")
            return named if named != leader else None

        seen["new_leader"] = wait_for(run, new_leader, "the trajectory stream's new leader")
        cluster.restart(victim)
        seen["published_at_restart"] = published = len(events(run_dir, "train", "trainer.published"))
        stored_at_restart = stored(run_dir)
        wait_for(
            run,
            lambda: (
                len(events(run_dir, "train", "trainer.published")) >= published + AFTER_RESTART
                and stored(run_dir) > stored_at_restart
            ),
            f"{AFTER_RESTART} versions published and trajectories stored after the node came back",
        )
        run.send_signal(signal.SIGINT)

    summary, run_dir = dart_run(
        ROOT / "examples" / "smoke.yaml",
        env={
            "DART_RUN__NAME": "cluster",
            "DART_RUN__EMBEDDED_NATS": "false",
            "DART_BUS__URL": json.dumps(cluster.urls),
            "DART_BUS__REPLICAS": "3",
            "DART_RUN__RL_DURATION_S": "10",
            # The RL phase lasts until the test has seen what it waits for, and ends it.
            "DART_RUN__MIN_VERSIONS": "100000",
            "DART_RUN__MAX_RL_DURATION_S": "1200",
            "DART_VALIDATION__ENABLED": "false",
        },
        during=lose_a_node,
    )
    return summary, run_dir, seen


def test_the_run_rides_out_the_loss_of_a_node(cluster_run: tuple[dict[str, Any], Path, dict[str, Any]]) -> None:
    summary, run_dir, seen = cluster_run
    assert summary["error"] is None
    assert summary["rl_ended_by"] == "signal"  # the test ended it: the services then stopped in order
    assert summary["service_restarts"] == []  # no service died with the node
    assert summary["service_exit_codes"] == {"rollout": 0, "data": 0, "train": 0, "env": 0}
    assert seen["stored_while_down"] >= 8
    assert seen["new_leader"] not in (None, seen["killed"])  # the stream moved to another node
    assert summary["versions_published"] >= seen["published_at_restart"] + AFTER_RESTART  # and went on after


def test_nothing_lost_and_nothing_stored_twice(cluster_run: tuple[dict[str, Any], Path, dict[str, Any]]) -> None:
    summary, run_dir, _ = cluster_run
    assert summary["trajectories_produced"] > 0
    assert summary["trajectories_lost"] == 0
    assert summary["trajectories_produced"] == summary["trajectories_stored"]
    con = sqlite3.connect(f"file:{run_dir / 'data.sqlite3'}?mode=ro", uri=True)
    try:
        rows, distinct = con.execute("SELECT COUNT(*), COUNT(DISTINCT trajectory_id) FROM trajectories").fetchone()
    finally:
        con.close()
    assert rows == distinct == summary["trajectories_stored"]
    batched = [gid for e in events(run_dir, "data", "data.batch") for gid in e["attributes"]["group_ids"]]
    assert batched and len(batched) == len(set(batched))  # no group trained on twice
