"""How fast ``dart view``'s pages answer on a large index: 100,000 trajectories by default.

It writes a SQLite index with dart-data's own schema (migrated by :class:`~dart.data.index.TrajectoryIndex`;
rows with every column ``trajectory_row`` fills, inserted in bulk), then times each query the viewer runs
(:class:`~dart.cli.view.queries.RunIndex`) and each list page served whole (starlette's TestClient: query,
template, HTTP), the median of ``--repeats`` runs each: the overview, the first page, a page deep in the
list, filters that match many rows, few rows (a rare status) and none, a task, a group page.
The trajectory page itself is not timed here: it reads one row by primary key and then the store.

Usage::

    uv run python benchmarks/view_queries.py                  # 100,000 rows
    uv run python benchmarks/view_queries.py --rows 20000 --repeats 3

It prints one line per query and, as the last line, one JSON object with every figure (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from starlette.testclient import TestClient

from dart.cli.view.app import create_app
from dart.cli.view.queries import RunIndex, TrajectoryFilter, read_only_engine
from dart.cli.view.source import open_run
from dart.data.index import TrajectoryIndex
from dart.data.schema import rejected_trajectories, rollout_groups, trajectories

GROUP = 8
"""Rollouts per group."""
STATUSES = [("ok", 0.80), ("truncated", 0.17), ("aborted", 0.02), ("failed", 0.01)]
"""Status mix of the rows."""


def fill(db: Path, rows: int, seed: int = 0) -> None:
    """Write ``rows`` trajectories in groups of :data:`GROUP`, their groups and a few rejections."""
    index = TrajectoryIndex(f"sqlite:///{db}")
    index.migrate()
    rng = random.Random(seed)
    names, weights = zip(*STATUSES, strict=True)
    now = time.time()
    batch: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    gid = ""
    with index.engine.begin() as conn:
        for i in range(rows):
            group, rollout = divmod(i, GROUP)
            if rollout == 0:
                gid = f"g-{rng.getrandbits(64):016x}"  # random, as the data manager's are
                groups.append(_group_row(gid, group, now))
            batch.append(_trajectory_row(rng, gid, group, rollout, rng.choices(names, weights)[0], now + i))
            if len(batch) == 5000:
                conn.execute(insert(trajectories), batch)
                batch = []
        if batch:
            conn.execute(insert(trajectories), batch)
        conn.execute(insert(rollout_groups), groups)
        rejected = [
            {"stream": "trajectories", "stream_seq": n, "reason": "unknown_work", "detail": "-", "rejected_at": now}
            for n in range(50)
        ]
        conn.execute(insert(rejected_trajectories), rejected)
    index.close()


def _group_row(gid: str, group: int, now: float) -> dict[str, Any]:
    return {
        "group_id": gid,
        "task_id": f"sim/task/{group % 200}",
        "group_size": GROUP,
        "status": "emitted",
        "created_at": now,
    }


def _trajectory_row(rng: random.Random, gid: str, group: int, rollout: int, status: str, t: float) -> dict[str, Any]:
    tid = f"traj-{gid}-{rollout}"
    version = group // 500
    reward = float(status in ("ok", "truncated") and rng.random() < 0.4)
    return {
        "trajectory_id": tid,
        "work_id": f"w-{tid}",
        "task_id": f"sim/task/{group % 200}",
        "group_id": gid,
        "rollout_index": rollout,
        "group_size": GROUP,
        "status": status,
        "reward": reward,
        "success": reward > 0,
        "num_steps": rng.randint(1, 15),
        "parse_errors": 0,
        "mean_entropy": rng.random(),
        "min_policy_version": version,
        "max_policy_version": version,
        "started_at": t - 20,
        "finished_at": t,
        "runner_id": f"runner-{rollout}",
        "env_instance_id": f"sim-{rollout}",
        "blob_key": f"trajectories/{tid}/trajectory-0.json",
        "blob_uri": f"file:///nowhere/trajectories/{tid}/trajectory-0.json",
        "ingested_at": t,
        "pooled": False,
    }


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, milliseconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dart-view-bench-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "config.yaml").write_text("run: {name: bench}\n")
        started = time.perf_counter()
        fill(run_dir / "data.sqlite3", args.rows)
        fill_s = time.perf_counter() - started
        print(f"filled {args.rows} rows in {fill_s:.1f} s")
        index = RunIndex(read_only_engine(f"sqlite:///{run_dir / 'data.sqlite3'}"))
        middle = index.page(TrajectoryFilter(), after="traj-g-8")
        deep_cursor = middle.rows[0]["trajectory_id"]
        a_group = middle.rows[0]["group_id"]
        queries: dict[str, Callable[[], object]] = {
            "overview": index.overview,
            "first_page": lambda: index.page(TrajectoryFilter()),
            "deep_page": lambda: index.page(TrajectoryFilter(), after=deep_cursor),
            "previous_page": lambda: index.page(TrajectoryFilter(), before=deep_cursor),
            "status_ok": lambda: index.page(TrajectoryFilter(status="ok")),
            "status_failed": lambda: index.page(TrajectoryFilter(status="failed")),
            "success_and_versions": lambda: index.page(TrajectoryFilter(success=True, min_version=50, max_version=60)),
            "no_match": lambda: index.page(TrajectoryFilter(status="env_failed")),
            "task": lambda: index.page(TrajectoryFilter(task_id="sim/task/7")),
            "group": lambda: index.group(a_group),
            "neighbours": lambda: index.neighbours(deep_cursor),
        }
        figures: dict[str, Any] = {"rows": args.rows, "fill_s": round(fill_s, 1), "repeats": args.repeats}
        for name, fn in queries.items():
            figures[f"query_{name}_ms"] = round(median_ms(fn, args.repeats), 2)
            print(f"query {name:22s} {figures[f'query_{name}_ms']:8.2f} ms")
        index.close()
        pages = {
            "overview": "/",
            "first_page": "/trajectories",
            "status_failed": "/trajectories?status=failed",
            "task": "/trajectories?task=sim/task/7",
            "group": f"/groups/{a_group}",
        }
        with open_run(run_dir) as source, TestClient(create_app(source)) as client:
            for name, url in pages.items():

                def get(url: str = url) -> None:
                    assert client.get(url).status_code == 200, url

                figures[f"page_{name}_ms"] = round(median_ms(get, args.repeats), 2)
                print(f"page  {name:22s} {figures[f'page_{name}_ms']:8.2f} ms")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
