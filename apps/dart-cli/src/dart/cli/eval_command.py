"""``dart eval``: success of a policy on a task suite, with confidence intervals and pass@k."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dart.protocol.errors import ConfigError, DartError
from dart.protocol.messages import Sampling

if TYPE_CHECKING:
    from rich.table import Table

    from dart.cli.evaluation import Policy
    from dart.cli.stack.config import RunConfig
    from dart.rollout.eval import EvalReport

EVAL_POOL = "eval"


def eval_command(
    policy: Annotated[
        str,
        typer.Argument(
            help="A run directory (with --version), a checkpoint directory, or a published weights URI (with --base)."
        ),
    ],
    version: Annotated[
        int | None, typer.Option("--version", "-v", help="Run directory: the version to evaluate (default: newest).")
    ] = None,
    base: Annotated[
        Path | None, typer.Option("--base", help="Weights URI: the checkpoint the weights belong to.", file_okay=False)
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Run config for env, engine and runner settings (default: the run's).",
            dir_okay=False,
        ),
    ] = None,
    suite: Annotated[
        str | None,
        typer.Option(
            "--suite",
            "-s",
            help="Task suite, as in a run config (default: the held-out suite if validation is on, else suite).",
        ),
    ] = None,
    episodes: Annotated[int, typer.Option("--episodes", "-k", min=1, help="Episodes per task (K).")] = 1,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy; above 0 samples.")
    ] = 0.0,
    top_p: Annotated[
        float, typer.Option("--top-p", min=0.01, max=1.0, help="Nucleus mass when sampling; 1 = off.")
    ] = 1.0,
    instances: Annotated[int, typer.Option("--instances", min=1, help="Env instances (episodes in flight).")] = 4,
    nats_url: Annotated[
        str | None, typer.Option("--nats-url", help="An existing nats-server (default: start an embedded one).")
    ] = None,
) -> None:
    """Evaluate a policy: K episodes per task; a per-task table, then one JSON object as the last line."""
    logging.basicConfig(level=logging.WARNING)
    try:
        sampling = Sampling(temperature=temperature, top_p=top_p)
        result = asyncio.run(_eval(policy, version, base, config, suite, episodes, sampling, instances, nats_url))
    except (ConfigError, DartError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    report, line = result
    from rich.console import Console

    Console().print(report_table(report))
    typer.echo(json.dumps(line))


async def _eval(
    target: str,
    version: int | None,
    base: Path | None,
    config_path: Path | None,
    suite: str | None,
    episodes: int,
    sampling: Sampling,
    instances: int,
    nats_url: str | None,
) -> tuple[EvalReport, dict[str, Any]]:
    # Reading configs, manifests and suites, and starting nats-server, block: off the event loop.
    config, policy, tasks, chosen = await asyncio.to_thread(_resolve, target, version, base, config_path, suite)
    if nats_url is not None:
        return await _on_bus(config, nats_url, policy, tasks, chosen, episodes, sampling, instances, target)
    from dart.embedded.nats import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="dart-eval-nats-") as tmp:
        nats = EmbeddedNats(store_dir=Path(tmp))
        await asyncio.to_thread(nats.start)
        try:
            return await _on_bus(config, nats.url, policy, tasks, chosen, episodes, sampling, instances, target)
        finally:
            await asyncio.to_thread(nats.stop)


def _resolve(
    target: str, version: int | None, base: Path | None, config_path: Path | None, suite: str | None
) -> tuple[RunConfig, Policy, list[Any], str]:
    """The run config, the policy, the suite's tasks and the suite's name ``dart eval`` works on."""
    from dart.cli.evaluation import resolve_policy
    from dart.cli.stack.config import RunConfig, load_run_config, load_tasks
    from dart.rollout.service.config import resolve_runner

    given = load_run_config(config_path) if config_path else None
    policy, run_config = resolve_policy(target, base=base, version=version, store=given.store if given else None)
    config: RunConfig = given or run_config or RunConfig()
    # The prompt as the policy's checkpoint decides it: its family's chat, its image processor's pixel bounds.
    runner = resolve_runner(config.rollout.runner, policy.base)
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"runner": runner})})
    chosen = suite or eval_suite(config)
    return config, policy, load_tasks(config.model_copy(update={"suite": chosen})), chosen


async def _on_bus(
    config: RunConfig,
    url: str,
    policy: Policy,
    tasks: list[Any],
    suite: str,
    episodes: int,
    sampling: Sampling,
    instances: int,
    target: str,
) -> tuple[EvalReport, dict[str, Any]]:
    from dart.cli.evaluation import EvalEnv, evaluate_policy, start_engine
    from dart.cli.stack.config import store_config
    from dart.data.tasks import runnable_on_pool
    from dart.runtime.bus import Bus

    bus_config = config.bus.model_copy(update={"url": url, "run": config.run.name, "name": "dart-eval"})
    bus = await Bus.connect(bus_config)
    try:
        # The run's eval engine when it configured one, else one like its rollout engines (hf on their
        # device, or a vLLM server): never a silent stand-in.
        engine = await start_engine(config, policy, engine_config=config.validation.engine)
        served_by = engine.describe()
        try:
            # A run's store: large screenshots go by reference, as in the run.
            store = config.store or (store_config(config) if config.run.run_dir is not None else None)
            async with EvalEnv(config, bus, pool=EVAL_POOL, suite=suite, instances=instances, store=store):
                # As the data manager does: only the tasks this pool can set up count (the rest are reported).
                runnable = await runnable_on_pool(bus, tasks, EVAL_POOL, timeout_s=config.data.capabilities_timeout_s)
                report = await evaluate_policy(
                    config,
                    bus,
                    engine,
                    list(runnable.tasks),
                    pool=EVAL_POOL,
                    episodes_per_task=episodes,
                    sampling=sampling,
                    concurrency=instances,
                    label=f"v{policy.version}",
                    store=store,
                )
        finally:
            await engine.close()
    finally:
        await bus.close()
    line = {
        "policy": target,
        "base": str(policy.base),
        "version": policy.version,
        "suite": suite,
        "engine": served_by,
        **report.to_dict(),
        "excluded": runnable.excluded,
        "excluded_by": dict(runnable.excluded_by),
    }
    return report, line


def eval_suite(config: RunConfig) -> str:
    """The suite ``dart eval`` uses by default: the run's held-out suite when it validated on one, else its suite."""
    return config.validation.suite if config.validation.enabled else config.suite


def report_table(report: EvalReport) -> Table:
    """Per-task rows, then the overall row and pass@k."""
    from rich.table import Table

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    def ci(bounds: tuple[float, float]) -> str:
        return f"[{bounds[0]:.0%}, {bounds[1]:.0%}]"

    sampling = report.sampling
    mode = "greedy" if sampling.temperature == 0 else f"T={sampling.temperature:g}, top-p={sampling.top_p:g}"
    table = Table(title=f"policy v{report.policy_version}, {mode}, K={report.episodes_per_task}")
    for column in ("task", "n", "success", "95% CI", "errors", "of them setup", "steps"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for t in report.tasks:
        row = (str(t.n), pct(t.success), ci(t.ci95), str(t.errors), str(t.setup_failures), f"{t.mean_steps:.1f}")
        table.add_row(t.task_id, *row)
    table.add_section()
    overall = (str(report.n), pct(report.success), ci(report.ci95), str(report.errors), str(report.setup_failures))
    table.add_row("overall", *overall, "")
    passes = ", ".join(f"pass@{k} {pct(v)}" for k, v in report.pass_at().items())
    table.caption = f"{passes}; {report.seconds:.1f}s"
    return table


def register(app: typer.Typer) -> None:
    """Add ``dart eval``."""
    app.command("eval")(eval_command)
