"""``dart run CONFIG``: the whole pipeline on one machine, with the code paths of a distributed run.

Phases: check the config (the GPUs it needs included: ``dart.cli.stack.placement``) and resolve the run
directory -> start an embedded nats-server -> write (or take) the initial policy -> warm start on oracle
demonstrations (its steps decide, ``dart.cli.stack.warmstart_guard`` stops a stuck one) -> start the four
services as ``dart serve`` processes, each on its GPUs -> RL (decoupled, or the coupled baseline with
``data.emission.mode: coupled``) until ``run.rl_duration_s`` and ``run.min_versions`` end it
(``dart.cli.stack.rl_clock``), with live progress -> (held-out validation on the run's engines: stop the
trainer, evaluate its last version on the rollout service's engines) -> stop rollout, let dart-data ingest
every published trajectory, stop the rest -> write ``summary.json`` and print it as the last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from dart.cli.cluster.launch import Launcher, LocalLauncher, ServiceProcess, stop_process
from dart.cli.stack.config import SERVICES, RunConfig, load_run_config, load_tasks, store_config, warm_start_on
from dart.cli.stack.embedded_store import embedded_s3_server, embedded_s3_store, run_store_prefixes
from dart.cli.stack.placement import on_given_gpus, placed, plan_placement
from dart.cli.stack.progress import RunProgress
from dart.cli.stack.real_checkpoint import check_real_checkpoint
from dart.cli.stack.rl_clock import RlPhaseClock
from dart.cli.stack.run_record import (
    RL_WINDOW_FILE,
    RUN_STATE_FILE,
    Resumed,
    RlWindow,
    RunState,
    read_window,
    resumable,
    write_json,
)
from dart.cli.stack.secrets import as_role, service_environment, write_bus_credentials
from dart.cli.stack.store_credentials import StoreKeyFiles, as_store_role, store_environment
from dart.cli.stack.summary import build_summary, phase_times
from dart.cli.stack.supervisor import Server, ServiceSupervisor
from dart.cli.stack.validation import HeldOutValidator, heldout_summary, learning_line, train_summary
from dart.cli.stack.warmstart_guard import WarmStartGuard, warm_start_row
from dart.protocol.config import dump_config
from dart.protocol.messages import ModelVersion
from dart.protocol.permissions import service_permissions
from dart.protocol.topology import LATEST_MODEL_KEY, ROLES, Role
from dart.runtime.bus import Bus, BusConfig, KeyValueStore
from dart.runtime.store import StoreConfig
from dart.runtime.store.grants import StoreRole
from dart.runtime.topology import durable_name, ensure_topology

if TYPE_CHECKING:
    from dart.cli.cluster.ray_launch import RaySession
    from dart.cli.stack.warmstart_cache import WarmStartCache
    from dart.embedded.nats import NatsUser
    from dart.embedded.s3 import EmbeddedS3
    from dart.protocol.messages import TaskSpec

console = Console(stderr=True)
log = logging.getLogger(__name__)


def check_for_dart_run(config: RunConfig, config_path: Path) -> None:
    """Refuse settings ``dart run`` would otherwise ignore (before anything is written).

    Raises:
        ConfigError: ``data.database_url`` is set (``dart run`` keeps the index in its run directory), the
            suite (or the held-out suite) does not resolve or does not suit the env backend, the prompt
            format cannot tell the model the configured coordinate space, or the run needs more GPUs than the
            machine has (``run.gpus``).
    """
    from dart.cli.stack.validation import heldout_tasks
    from dart.protocol.errors import ConfigError
    from dart.train.config import NodeSettings

    if "database_url" in config.data.model_fields_set:
        raise ConfigError(
            str(config_path),
            "data.database_url",
            f"is {config.data.database_url!r}, but dart run keeps the data manager's index in its run directory "
            "(<run_dir>/data.sqlite3, which the summary and dart report read); remove it, or run the services with "
            "dart serve (docs/deployment.md) to use another database",
        )
    load_tasks(config)
    if config.validation.enabled:
        heldout_tasks(config)
    config.rollout.runner.prompt.space()
    if config.cluster.kind == "local":  # a Ray cluster's fit is checked against its nodes (ray_session)
        plan_placement(config, str(config_path))
        backend = config.train.backend
        if isinstance(backend, NodeSettings) and backend.nnodes > 1 and backend.rdzv_endpoint is None:
            raise ConfigError(
                str(config_path),
                "train.backend.rdzv_endpoint",
                f"is unset, but nnodes is {backend.nnodes}: dart run runs node {backend.node_rank}'s ranks here and "
                "the others join at that host:port (or run the whole trainer on a Ray cluster: --ray)",
            )


def resolve(config: RunConfig, config_path: Path) -> RunConfig:
    """Give the run its directory (``<runs_root>/<name>-<UTC time>``)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_dir = (config.run.runs_root / f"{config.run.name}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "source-config.yaml").write_text(config_path.read_text())
    return config.model_copy(update={"run": config.run.model_copy(update={"run_dir": run_dir})})


def prepare_policy(config: RunConfig) -> tuple[Path, dict[str, Any]]:
    """Write the tiny checkpoint if needed, then warm-start it (or take it from ``warm_start.cache_dir``,
    waiting for a run on this host that is filling the same entry); returns the version-0 policy path and
    the figures for the summary."""
    from dart.cli.stack.warmstart_cache import WarmStartCache, warm_start_key

    tasks = load_tasks(config)
    ws = config.warm_start
    if not warm_start_on(config) or ws.cache_dir is None:
        return _make_policy(config, tasks, None, "")
    cache, key = WarmStartCache(ws.cache_dir), warm_start_key(config, tasks)
    with cache.filling(key):
        run_dir = config.run.run_dir
        assert run_dir is not None
        out = run_dir / "model" / "sft"
        cached = cache.get(key, out)
        if cached is not None:
            console.log(f"warm start: reused {cache.root / key} (warm_start.cache_dir)")
            return out, {"warm_start_cut": False, **cached, "warm_start_cached": True}
        return _make_policy(config, tasks, cache, key)


def prepare_warm_start(config_path: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """``dart warm-start``: fill ``warm_start.cache_dir`` with the warm start that ``dart run`` of the same config
    and overrides would compute, or find it there. Returns the entry's ``key``, ``cache_dir``, ``stored``
    (False only when the warm start was cut short, ``warm_start_cut``: such a policy is not kept) and the
    warm start's figures (``warm_start_cached``: it was there already).

    Raises:
        ConfigError: The config is invalid, does not warm-start, or has no ``warm_start.cache_dir``.
    """
    import tempfile

    from dart.cli.stack.warmstart_cache import warm_start_key
    from dart.protocol.errors import ConfigError

    config = load_run_config(config_path, overrides)
    check_for_dart_run(config, config_path)
    if not warm_start_on(config):
        raise ConfigError(str(config_path), "warm_start.enabled", "is off for this run: there is nothing to prepare")
    cache_dir = config.warm_start.cache_dir
    if cache_dir is None:
        raise ConfigError(
            str(config_path),
            "warm_start.cache_dir",
            "is not set, so the warm start would be thrown away: set it (or DART_WARM_START__CACHE_DIR)",
        )
    with tempfile.TemporaryDirectory(prefix="dart-warm-start-") as scratch:
        run = config.run.model_copy(update={"run_dir": Path(scratch)})
        _, info = prepare_policy(config.model_copy(update={"run": run}))
    key = warm_start_key(config, load_tasks(config))
    return {"key": key, "cache_dir": str(cache_dir.resolve()), "stored": (cache_dir / key).is_dir(), **info}


def _make_policy(
    config: RunConfig, tasks: list[TaskSpec], cache: WarmStartCache | None, key: str
) -> tuple[Path, dict[str, Any]]:
    """Write the tiny checkpoint if needed, then warm-start it, storing it in ``cache`` under ``key``."""
    import torch

    from dart.cli.stack.warmstart import load_for_sft, run_sft, save_policy, write_tiny_policy
    from dart.cli.stack.warmstart_threads import ThreadChooser, candidate_counts

    run_dir = config.run.run_dir
    assert run_dir is not None
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    info: dict[str, Any] = {}
    ws = config.warm_start
    out = run_dir / "model" / "sft"
    enabled = warm_start_on(config)
    if config.model.path is None:
        base = run_dir / "model" / "base"
        t0 = time.monotonic()
        write_tiny_policy(config, tasks, base)
        info["model_init_s"] = round(time.monotonic() - t0, 1)
        console.log(f"wrote tiny {config.model.family} checkpoint to {base}")
    else:
        base = config.model.path.resolve()
    if not enabled:
        return base, info
    t0 = time.monotonic()
    backend, demos, episodes = load_for_sft(config, tasks, base)
    console.log(f"warm start: {len(demos)} oracle steps from {episodes} episodes")

    def on_step(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0:
            console.log(f"warm start step {step}: loss {loss:.3f}")

    guard = WarmStartGuard(ws.steps, ws.max_slowdown, ws.guard_floor_s, ws.max_seconds)
    counts = candidate_counts(os.cpu_count() or 1) if ws.threads == "auto" else [ws.threads]
    threads = ThreadChooser(counts)
    steps, first, last = run_sft(
        backend,
        demos,
        steps=ws.steps,
        batch_size=ws.batch_size,
        guard=guard,
        seed=config.run.seed,
        on_step=on_step,
        threads=threads,
    )
    save_policy(backend, base, out)
    info.update(
        warm_start_demos=len(demos),
        warm_start_steps=steps,
        **guard.report(),
        **threads.report(),
        warm_start_first_loss=round(first, 4),
        warm_start_last_loss=round(last, 4),
        warm_start_s=round(time.monotonic() - t0, 1),
    )
    if guard.cut_by is not None:
        console.log(f"[yellow]warning:[/] warm start {warm_start_row(info)}")
    elif cache is not None:  # a warm start cut short is not reusable
        cache.put(key, out, info)
    return out, {**info, "warm_start_cached": False} if cache is not None else info


def finalize(config: RunConfig, policy: Path, nats_url: str | None) -> RunConfig:
    """Fill in what the services need: bus URL, policy path, database, engine config."""
    from dart.rollout.engine.hf_config import HFEngineConfig
    from dart.rollout.service.config import resolve_runner
    from dart.train.config import RUN_CHECKPOINT_EVERY

    run_dir = config.run.run_dir
    assert run_dir is not None
    threads = config.run.torch_threads
    chosen = config.rollout.engine or HFEngineConfig()
    # The run's policy, the run's thread budget for in-process engines, server logs next to the services'.
    engine = chosen.serving(str(policy), num_threads=threads, log_dir=str(run_dir / "logs"))
    train = config.train.model_copy(
        update={
            "model_path": str(policy),
            "num_threads": config.train.num_threads or threads,
            "checkpoint_dir": config.train.checkpoint_dir or str(run_dir / "checkpoints"),
            "checkpoint_every": config.train.checkpoint_every or RUN_CHECKPOINT_EVERY,
        }
    )
    bus = config.bus.model_copy(update={"url": nats_url}) if nats_url else config.bus
    data = config.data.model_copy(update={"database_url": f"sqlite:///{run_dir / 'data.sqlite3'}"})
    # ``image_size: model``: the checkpoint's pixel bounds, written into config.yaml for every reader.
    runner = resolve_runner(config.rollout.runner, policy)
    # The run's own weight cache: its pruning never touches another run's versions on the same host, and the
    # summary's weight_cache figure is this run's.
    sync = config.rollout.sync
    sync = sync.model_copy(update={"cache_dir": sync.cache_dir or str(run_dir / "weights")})
    return config.model_copy(
        update={
            "bus": bus,
            "train": train,
            "data": data,
            "rollout": config.rollout.model_copy(update={"engine": engine, "runner": runner, "sync": sync}),
        }
    )


def _table(
    progress: RunProgress,
    elapsed: float,
    produced: int,
    version: int,
    now_ns: int,
    min_versions: int = 0,
    warm_start: str | None = None,
) -> Table:
    table = Table(title=f"DART run: {elapsed:.0f}s of RL", show_header=False)
    stats = progress.last_events.get("data.stats", {})
    batch = progress.last_events.get("data.batch", {})
    step = progress.last_events.get("trainer.step", {})

    def pct(kind: str) -> str:
        u = progress.utilization(kind, now_ns)
        return "-" if u is None else f"{u:.0%}"

    rows = [
        *([("warm start", warm_start)] if warm_start else []),
        ("trajectories", f"{produced} ({produced / max(elapsed, 1e-9):.2f}/s)"),
        ("stored", str(stats.get("stored", "-"))),
        ("success rate (per-task EMA)", _fmt(_mean(stats.get("task_success")))),
        ("policy version", f"{version} of {min_versions}" if min_versions else str(version)),
        ("staleness (last batch)", str(batch.get("max_staleness", batch.get("staleness", "-")))),
        ("trainer step / loss", f"{step.get('step', '-')} / {_fmt(step.get('loss'))}"),
        ("engine weight updates", str(progress.updates)),
        ("utilization env / engine / trainer", f"{pct('env')} / {pct('engine')} / {pct('trainer')}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _mean(values: Any) -> float | None:
    if isinstance(values, dict) and values:
        return sum(float(v) for v in values.values()) / len(values)
    return None


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else ("-" if value is None else str(value))


async def create_topology(bus_config: BusConfig) -> None:
    """Create (or confirm) the run's streams, consumers and state bucket as ``bus_config``'s user."""
    async with await Bus.connect(bus_config) as bus:
        await ensure_topology(bus)


async def _wait_rollout_ready(config: RunConfig, supervisor: ServiceSupervisor, since_ns: int) -> str | None:
    """Wait for the rollout service's ``service.ready`` event written after ``since_ns`` (its engines are
    serving; a resumed run's file holds the first part's too); why not, if not."""
    from dart.runtime.telemetry import read_jsonl

    run_dir = config.run.run_dir
    assert run_dir is not None
    path = run_dir / "telemetry" / "rollout.jsonl"
    deadline = time.monotonic() + config.run.ready_timeout_s
    while time.monotonic() < deadline:
        failed = await asyncio.to_thread(supervisor.check)
        if failed is not None:
            return f"{failed} (see {run_dir / 'logs'})"
        if path.is_file():
            events = await asyncio.to_thread(lambda: list(read_jsonl(path, types={"event"})))
            if any(r["name"] == "service.ready" and r["ts_unix_ns"] >= since_ns for r in events):
                return None
        await asyncio.sleep(1.0)
    return f"the rollout service was not ready within {config.run.ready_timeout_s:g}s (see {run_dir / 'logs'})"


async def monitor(
    config: RunConfig,
    procs: dict[str, ServiceProcess],
    respawn: Callable[[str], ServiceProcess],
    credentials: Mapping[Role, Path] | None = None,
    servers: dict[str, Server] | None = None,
    warm_start: str | None = None,
    started_ns: int = 0,
) -> dict[str, Any]:
    """Show progress for the RL phase (restarting services and embedded ``servers`` that die,
    ``run.max_restarts`` times each; ``warm_start`` is the table's warm-start row), then stop the services
    in order; returns the summary figures. ``started_ns``: when the services were started (a resumed run goes
    on with the RL window of ``rl_window.json``)."""
    run_dir = config.run.run_dir
    assert run_dir is not None
    bus = await Bus.connect(config.bus.model_copy(update={"run": config.run.name, "name": "dart-run"}))
    validator = None
    validation_buses: list[Bus] = []
    supervisor = ServiceSupervisor(
        procs,
        respawn,
        max_restarts=config.run.max_restarts,
        backoff_s=config.run.restart_backoff_s,
        servers=servers,
        notify=console.log,
    )
    try:
        state = await ensure_topology(bus)
        # From the services' start: a Ctrl-C while the rollout service gets ready (a resumed trainer may
        # publish meanwhile) ends the run as one during RL does, the services stopping in order.
        with _ends_on_stop_signals() as asked:
            # vLLM servers take minutes to start: the RL window opens when the rollout service is ready.
            failed = await _wait_rollout_ready(config, supervisor, started_ns)
            if config.validation.enabled and failed is None and not asked.is_set():
                validator = await _start_validator(config, state, credentials, validation_buses)
            window = await _open_window(run_dir, state)
            earlier_restarts = list(window.service_restarts)
            start_ns = window.rl_start_unix_ns
            progress = RunProgress(run_dir / "telemetry", window_start_ns=start_ns)
            failed, ended_by = await _watch_rl_phase(
                config, supervisor, bus, state, progress, failed, asked, warm_start, window
            )
        end_ns = time.time_ns()
        heldout, codes = await _stop_services(config, procs, bus, state, validator)
        traj_stream = await bus.stream_state("traj")
        # Produced: distinct trajectories. A replayed message (the same trajectory id stored again) is a
        # duplicate, which dart-data's index stores once: counted as such, never as a loss.
        census = await bus.census("traj", "trajectory_id")
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        if validator is not None and not validator.on_run_engines:
            heldout = await validator.finish(latest.version if latest else 0)
        return {
            "produced": census.distinct,
            "duplicated": census.duplicates,
            # What a trajectory costs the bus (screenshots above env.inline_max_bytes go by reference).
            "bus_bytes_per_trajectory": round(traj_stream.bytes / census.messages) if census.messages else None,
            "largest_trajectory_message_bytes": census.largest_bytes,
            "versions": latest.version if latest else 0,
            "rl_start_ns": start_ns,
            "rl_end_ns": end_ns,
            "rl_ended_by": ended_by,
            "failed": failed,
            "exit_codes": {"rollout": procs["rollout"].returncode, **codes},
            "restarts": [*earlier_restarts, *supervisor.report()],
            "resumed": [r.model_dump() for r in window.resumed],
            "engine_updates": progress.updates,
            "heldout": heldout,
            "train_greedy": validator.train_results if validator is not None else None,
        }
    finally:
        if validator is not None:
            await validator.close()  # idempotent; here for a monitor that failed before finish()
        for extra in validation_buses:
            await extra.close()
        await bus.close()


async def _open_window(run_dir: Path, state: KeyValueStore) -> RlWindow:
    """Open the RL window (``rl_window.json``), or, in a resumed run, go on with the one it had."""
    window = read_window(run_dir)
    if window is None:
        window = RlWindow(rl_start_unix_ns=time.time_ns())
    else:
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        version = latest.version if latest else 0
        window.resumed.append(Resumed(at_unix_ns=time.time_ns(), version=version, rl_elapsed_s=window.rl_elapsed_s))
        console.log(f"resumed at version {version} after {window.rl_elapsed_s:.0f} s of RL")
    write_json(run_dir / RL_WINDOW_FILE, window)
    return window


async def _start_validator(
    config: RunConfig, state: KeyValueStore, credentials: Mapping[Role, Path] | None, buses: list[Bus]
) -> HeldOutValidator:
    """Start the held-out validator on buses of its own (appended to ``buses``, which the caller closes)."""
    # The validator hosts an env pool and drives it: with NATS users, as the env and eval roles.
    for role in ("env", "eval"):
        role_bus = config.bus if not credentials else as_role(config.bus, role, credentials[role])
        scoped = role_bus.model_copy(update={"run": config.run.name, "name": f"dart-run-{role}"})
        buses.append(await Bus.connect(scoped))
    validator = HeldOutValidator(config, buses[0], buses[1], state, console)
    await validator.start()
    return validator


@contextlib.contextmanager
def _ends_on_stop_signals() -> Iterator[asyncio.Event]:
    """While inside: SIGINT (Ctrl-C) and SIGTERM set the event yielded, which ends the RL phase early (the
    services then stop in order and the summary is written, as at the phase's planned end). Outside it a
    signal acts as usual: a second Ctrl-C while the services stop interrupts ``dart run``, whose cleanup
    kills them."""
    loop = asyncio.get_running_loop()
    asked = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, asked.set)
            installed.append(sig)
    try:
        yield asked
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _watch_rl_phase(
    config: RunConfig,
    supervisor: ServiceSupervisor,
    bus: Bus,
    state: KeyValueStore,
    progress: RunProgress,
    failed: str | None,
    asked_to_stop: asyncio.Event,
    warm_start: str | None = None,
    window: RlWindow | None = None,
) -> tuple[str | None, str]:
    """Show progress until the RL phase is over (at once when it ``failed`` already); why it failed, if it
    did, and what ended it: ``duration``, ``versions``, ``max_duration`` (see :mod:`dart.cli.stack.rl_clock`),
    ``signal`` (``asked_to_stop`` set) or ``failure`` (a service died past its restarts). The table shows
    ``warm_start``, the warm start's row, above the RL figures. ``window`` (``rl_window.json``) is kept current
    at every poll: the RL seconds so far (a resumed phase counts on from its ``rl_elapsed_s``) and the restarts.
    """
    run_dir = config.run.run_dir
    assert run_dir is not None
    if failed is not None:
        return failed, "failure"
    rl = config.run
    window = window or RlWindow(rl_start_unix_ns=time.time_ns())
    before = window.rl_elapsed_s
    began = time.monotonic() - before
    clock = RlPhaseClock.start(began, rl.rl_duration_s, rl.min_versions, rl.max_rl_duration_s)
    restarts_before = list(window.service_restarts)
    version = produced = 0
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while (ended := clock.ended_by(time.monotonic(), version)) is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asked_to_stop.wait(), 1.0)
            if asked_to_stop.is_set():
                console.log(f"asked to stop: the RL phase ends at version {version} (Ctrl-C again to interrupt)")
                return None, "signal"
            # Off the loop: restarting the embedded nats-server waits for it to be healthy.
            gave_up = await asyncio.to_thread(supervisor.check)
            if gave_up is not None:
                return f"{gave_up} (see {run_dir / 'logs'})", "failure"
            progress.poll()
            try:
                produced = (await bus.stream_state("traj")).messages
                latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
                version = latest.version if latest else 0
            except Exception as exc:  # the broker is down or restarting: show the last figures
                log.warning("progress from NATS unavailable: %s", exc)
            now = time.time_ns()
            window.rl_elapsed_s = round(time.monotonic() - began, 3)
            window.service_restarts = [*restarts_before, *supervisor.report()]
            write_json(run_dir / RL_WINDOW_FILE, window)
            live.update(_table(progress, window.rl_elapsed_s, produced, version, now, rl.min_versions, warm_start))
    return None, ended


async def _stop_services(
    config: RunConfig,
    procs: dict[str, ServiceProcess],
    bus: Bus,
    state: KeyValueStore,
    validator: HeldOutValidator | None,
) -> tuple[list[dict[str, Any]] | None, dict[str, int]]:
    """Stop the services in order: the held-out result when it ran on the run's engines, and exit codes.

    The rollout service stops first, then dart-data ingests everything published, then data, train
    and env stop.
    """
    heldout = None
    if validator is not None and validator.on_run_engines:
        # The final evaluation runs on the rollout service's engines, so before that service stops;
        # the trainer stops first, so the version it evaluates is the run's last.
        await asyncio.to_thread(stop_process, procs["train"], config.run.stop_timeout_s)
        latest = await state.get(LATEST_MODEL_KEY, ModelVersion)
        heldout = await validator.finish(latest.version if latest else 0)
    # Stop producing first, then let dart-data ingest everything that was published.
    # Off the loop: the held-out validator's env pool and runners live on it and must not freeze.
    await asyncio.to_thread(stop_process, procs["rollout"], config.run.stop_timeout_s)
    drain_deadline = time.monotonic() + config.run.stop_timeout_s
    while time.monotonic() < drain_deadline:
        consumer = await bus.consumer_state("traj", durable_name(bus, "traj"))
        if consumer.num_pending == 0 and consumer.num_ack_pending == 0:
            break
        await asyncio.sleep(0.5)
    codes = {
        name: await asyncio.to_thread(stop_process, procs[name], config.run.stop_timeout_s)
        for name in ("data", "train", "env")
    }
    return heldout, codes


def store_usage(config: StoreConfig, weights_prefix: str = "weights") -> dict[str, Any]:
    """The store's size when the run ends: ``store_uri``, ``store_bytes``, ``store_objects``,
    ``store_weights_bytes`` (published weights, after retention) and ``store_bytes_by_kind`` (bytes per
    top-level prefix: ``weights``, ``screenshots``, ``trajectories``, ...)."""
    from dart.protocol.errors import ConfigError, StoreError
    from dart.runtime.store import open_store

    try:
        with open_store(config) as store:
            infos = list(store.list(""))
    except (StoreError, ConfigError) as exc:  # the summary is still written, naming the problem
        return {"store_uri": config.uri, "store_error": str(exc)}
    by_kind: dict[str, int] = {}
    for info in infos:
        kind = info.key.split("/", 1)[0] if "/" in info.key else "(top level)"
        by_kind[kind] = by_kind.get(kind, 0) + info.size
    return {
        "store_uri": config.uri,
        "store_bytes": sum(i.size for i in infos),
        "store_bytes_by_kind": dict(sorted(by_kind.items())),
        "store_objects": len(infos),
        "store_weights_bytes": sum(i.size for i in infos if i.key.startswith(weights_prefix.strip("/") + "/")),
    }


def run(config_path: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Run the pipeline described by ``config_path`` with ``KEY=VALUE`` ``overrides``; returns the summary.

    With ``cluster.kind: ray`` the services run as actors on the Ray cluster (``dart.cli.cluster``), which is
    joined (or, for ``local``, started) first and checked for room before the run directory is made.

    Raises:
        ConfigError: The config is invalid, or names what ``dart run`` cannot run (before anything is written).
        ClusterError: The local Ray cluster did not come up.
    """
    config = load_run_config(config_path, overrides)
    check_for_dart_run(config, config_path)
    if config.cluster.kind == "ray":
        from dart.cli.cluster.ray_launch import ray_session

        with ray_session(config, str(config_path)) as session:
            return _run(resolve(config, config_path), config_path, session)
    return _run(resolve(config, config_path), config_path, None)


def resume(run_dir: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Continue the run in ``run_dir``, killed as a whole (``dart run --resume``); returns the summary.

    The embedded NATS server, S3 server and index restart on their data in the run directory; the services
    resume as they do after their own restart (the trainer from its newest checkpoint, the data manager from
    its index and the streams, the engines on the newest version); the RL phase counts on from the RL seconds
    already run (``rl_window.json``), and ``KEY=VALUE`` ``overrides`` apply over the run's ``config.yaml``.

    Raises:
        ConfigError: ``run_dir`` is not a run directory, finished, or was made by another DART version (see
            :func:`dart.cli.stack.run_record.resumable`), or the overrides are invalid.
    """
    from dart.cli import __version__
    from dart.cli.stack.embedded_store import EMBEDDED_S3_URI

    run_dir = run_dir.resolve()
    state = resumable(run_dir, __version__)
    config_path = run_dir / "config.yaml"
    config = load_run_config(config_path, overrides)
    run = config.run.model_copy(update={"run_dir": run_dir})
    # The embedded store's old address: it starts again on its data (and a new port).
    own_store = (
        config.run.artifacts == "embedded_s3" and config.store is not None and config.store.uri == EMBEDDED_S3_URI
    )
    # The index's URL is the one dart run itself set: dart run sets it again (finalize).
    data = type(config.data).model_validate(config.data.model_dump(exclude={"database_url"}))
    config = config.model_copy(update={"run": run, "store": None if own_store else config.store, "data": data})
    check_for_dart_run(config, config_path)
    console.log(f"resuming {run_dir}")
    if config.cluster.kind == "ray":
        from dart.cli.cluster.ray_launch import ray_session

        with ray_session(config, str(config_path)) as session:
            return _run(config, config_path, session, state)
    return _run(config, config_path, None, state)


def _run(
    config: RunConfig, config_path: Path, session: RaySession | None, resumed: RunState | None = None
) -> dict[str, Any]:
    """:func:`run` once the run has its directory (and, on Ray, its cluster); ``resumed``: the state of the run
    it continues."""
    from dart.embedded.nats import EmbeddedNats

    run_dir = config.run.run_dir
    assert run_dir is not None
    console.log(f"run directory: {run_dir}")
    started = time.monotonic()
    host = session.service_host if session is not None else "127.0.0.1"
    if session is not None and session.local is not None:  # which process is which node (to stop one by hand)
        local = session.local
        nodes = {"address": session.address, "node_pids": local.pids, "temp_dir": str(local.directory)}
        (run_dir / "ray-nodes.json").write_text(json.dumps(nodes) + "\n")
    credentials, users = _bus_users(config, run_dir, keep_existing=resumed is not None)
    nats = EmbeddedNats(store_dir=run_dir / "nats", users=users, host=host) if config.run.embedded_nats else None
    s3: EmbeddedS3 | None = None
    store_keys: dict[StoreRole, StoreKeyFiles] = {}
    if config.store is None and config.run.artifacts == "embedded_s3":
        s3, store_keys = embedded_s3_server(run_dir, run_store_prefixes(config), host=host)
    procs: dict[str, ServiceProcess] = {}
    launcher: Launcher | None = None
    info: dict[str, Any] = {}
    try:
        if nats is not None:
            nats.start()
            console.log(f"embedded nats-server at {nats.url}" + (" (one user per service)" if users else ""))
        if s3 is not None:
            config = _use_embedded_s3(s3, config)
        config, launcher = _prepare(config, config_path, session, nats.url if nats else None, info, resumed)

        def respawn(name: str) -> ServiceProcess:
            service = next(s for s in SERVICES if s == name)
            env = service_environment(service, credentials[service]) if credentials else {}
            if service in store_keys:  # the service's own store key pair
                env = {**env, **store_environment(store_keys[service])}
            assert launcher is not None
            proc = launcher.start(service, env)
            # Who runs where, kept current as services (re)start; the summary's placement at the end.
            placement_now = [p.model_dump(mode="json") for p in launcher.placement()]
            (run_dir / "placement.json").write_text(json.dumps(placement_now, indent=2) + "\n")
            return proc

        if credentials:  # the supervisor connects as the ``run`` role
            config = config.model_copy(update={"bus": as_role(config.bus, "run", credentials["run"])})
        if store_keys and config.store is not None:  # and opens the store as the ``run`` role
            config = config.model_copy(update={"store": as_store_role(config.store, store_keys["run"])})
        # The services only bind to the run's streams, consumers and bucket: the supervisor makes them first.
        asyncio.run(create_topology(config.bus.model_copy(update={"run": config.run.name, "name": "dart-run"})))
        started_ns = time.time_ns()
        for service in SERVICES:
            procs[service] = respawn(service)
        console.log(f"started services {', '.join(f'{s} (pid {p.pid})' for s, p in procs.items())}")
        servers: dict[str, Server] = {"nats-server": nats} if nats is not None else {}
        figures = asyncio.run(monitor(config, procs, respawn, credentials, servers, warm_start_row(info), started_ns))
        storage = store_usage(store_config(config), config.train.weights_prefix)
    finally:
        for proc in procs.values():
            stop_process(proc, 10.0)
        if launcher is not None:
            info["placement"] = [p.model_dump(mode="json") for p in launcher.placement()]
            launcher.close()
        if s3 is not None:
            s3.stop()
        if nats is not None:
            nats.stop()
    summary = _summary(run_dir, figures, info, storage, started)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.log(phase_times(summary))
    learned = learning_line(summary)
    if learned is not None:
        console.log(learned)
    return summary


def _bus_users(config: RunConfig, run_dir: Path, keep_existing: bool) -> tuple[dict[Role, Path], list[NatsUser]]:
    """Each role's NATS password file (kept where they exist, for a resumed run) and the embedded server's users:
    none when the run's NATS is not embedded or admits any local client (``run.nats_auth: false``)."""
    from dart.embedded.nats import NatsUser

    if not (config.run.embedded_nats and config.run.nats_auth):
        return {}, []
    credentials = write_bus_credentials(run_dir, ROLES, keep_existing=keep_existing)
    # The env user serves the run's pools only (its subscriptions name them): env.pool and the held-out one.
    pools = (config.env.pool, *((config.validation.pool,) if config.validation.enabled else ()))
    users = [
        NatsUser(r, f, service_permissions(r, config.bus.prefix, config.run.name, pools))
        for r, f in credentials.items()
    ]
    return credentials, users


def _prepare(
    config: RunConfig,
    config_path: Path,
    session: RaySession | None,
    nats_url: str | None,
    info: dict[str, Any],
    resumed: RunState | None = None,
) -> tuple[RunConfig, Launcher]:
    """The policy (its figures into ``info``; a ``resumed`` run's own), the config the services read (written to
    ``config.yaml``), and the launcher that starts them: on this machine's GPUs, or on the Ray cluster of
    ``session``."""
    from dart.cli import __version__

    run_dir = config.run.run_dir
    assert run_dir is not None
    if resumed is not None:
        policy = Path(resumed.policy)
        info.update(resumed.info)
    else:
        policy, prepared = prepare_policy(config)
        info.update(prepared)
        write_json(run_dir / RUN_STATE_FILE, RunState(dart_version=__version__, policy=str(policy), info=info))
    config = finalize(config, policy, nats_url)
    placement = None
    if session is None:
        placement = plan_placement(config, str(config_path))
        config = placed(config, placement)
    else:  # Ray gives each actor its GPUs
        config = on_given_gpus(config)
    # A real checkpoint under the tiny model's defaults: what cannot work is refused, the rest said once.
    warnings = check_real_checkpoint(config, policy)
    for warning in warnings:
        console.log(f"[yellow]warning:[/] {warning}")
    if warnings:
        info["config_warnings"] = warnings
    config_file = run_dir / "config.yaml"
    config_file.write_text(dump_config(config))
    (run_dir / "logs").mkdir(exist_ok=True)
    info["cluster"] = session.summary() if session is not None else {"kind": "local"}
    if session is not None:
        return config, session.launcher(config, config_file)
    assert placement is not None
    return config, LocalLauncher(config_file, run_dir, placement)


def _use_embedded_s3(s3: EmbeddedS3, config: RunConfig) -> RunConfig:
    """Start the embedded S3 server; ``config`` with the run's store on it."""
    s3.start()
    # Each service's key files are named in its environment, never in config.yaml.
    store = embedded_s3_store(s3)
    console.log(f"embedded S3 at {s3.url}: artifacts in {store.uri}")
    return config.model_copy(update={"store": store})


def _summary(
    run_dir: Path, figures: dict[str, Any], info: dict[str, Any], storage: dict[str, Any], started: float
) -> dict[str, Any]:
    """The run's summary from :func:`monitor`'s figures, the policy ``info`` and the store's usage."""
    return build_summary(
        run_dir,
        produced=figures["produced"],
        duplicated=figures["duplicated"],
        versions=figures["versions"],
        rl_start_ns=figures["rl_start_ns"],
        rl_end_ns=figures["rl_end_ns"],
        extra={
            **info,
            "engine_weight_updates": figures["engine_updates"],
            "bus_bytes_per_trajectory": figures["bus_bytes_per_trajectory"],
            "largest_trajectory_message_bytes": figures["largest_trajectory_message_bytes"],
            "rl_start_unix_ns": figures["rl_start_ns"],
            "rl_end_unix_ns": figures["rl_end_ns"],
            "rl_ended_by": figures["rl_ended_by"],
            **storage,
            "service_exit_codes": figures["exit_codes"],
            "service_restarts": figures["restarts"],
            "resumed": figures["resumed"],
            **heldout_summary(figures.get("heldout")),
            **train_summary(figures.get("train_greedy")),
            "error": figures["failed"],
            "total_seconds": round(time.monotonic() - started, 1),
        },
    )
