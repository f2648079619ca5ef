"""Held-out validation during ``dart run``: greedy evaluations of published versions.

Who serves the episodes (``validation.engine``):

- unset: the run's own engines. The validator sends an :class:`~dart.protocol.messages.EvalRequest`
  naming the version by number to the rollout service, which reads that version's announcement on the
  ``model`` stream, holds one of its engines at it (loading it when that engine serves another), runs
  the episodes with its own runners, and releases the engine to its weight sync
  (:meth:`dart.rollout.service.sync.WeightSyncController.hold`). What is measured is what the run
  serves: the same engine kind, device, dtype and server, vLLM included; training keeps going on the
  other engines meanwhile, and on the held one only at the newest version (held at an older one, once
  the weight sync has brought it back).
- an engine config: the validator starts that engine itself (an hf engine on its device, or a vLLM
  server) and loads each version into it: one more model, but the run's engines never pause an update.

Either way the episodes lease from an env pool the validator hosts (``validation.pool``), never a
training slot, and one fixed decoding setup (greedy by default) is used whatever the rollout settings.

Validator lifecycle::

    start() -> env pool ``validation.pool`` serving (and its own engine, when configured); the held-out
         tasks the pool cannot set up left out, as the data manager does (counted by what they need)
      -> running: evaluate version 0 (unless ``at_start`` is off); then whenever the newest published
         version is at least ``every_versions`` past the last evaluated one, evaluate it
         (versions published during an evaluation are skipped, never queued)
    finish(final_version) -> the running evaluation completes, the final version is evaluated
         unless it already was -> engine closed, env pool stopped

With the run's engines, ``dart run`` calls ``finish`` before it stops the rollout service (the final
evaluation needs its engines), so the final version is the newest one when RL ends.

Each evaluation appends one line to ``<run_dir>/heldout.jsonl`` (the full report, with ``served_by`` and
``engine``: which engine served it; ``excluded`` and ``excluded_by``: the tasks left out) and writes a
``validation.heldout`` telemetry event (version, success, 95% interval, n).

With ``validation.train_split`` the training suite is evaluated too, the same way and on the same pool, at
version 0 (with ``at_start``) and at the final version, in one evaluation with the held-out suite (one engine
held once: engines leave version 0, which is never loaded back, at their first update after it); each
suite's report is its part of it (``evaluated_with`` names the other; ``seconds`` and ``statuses`` are the
whole evaluation's): ``<run_dir>/train_greedy.jsonl`` and ``validation.train`` events. On the tasks RL
trained on, that is the effect RL has at sizes too small to generalize, beside the held-out figures that say
whether it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dart.cli.evaluation import EvalEnv, Policy, evaluate_policy, load_version, published_version, start_engine
from dart.cli.stack.config import RunConfig, load_tasks, store_config
from dart.data.tasks import runnable_on_pool
from dart.protocol.errors import ConfigError
from dart.protocol.messages import EvalRequest, EvalResult, ModelVersion, TaskSpec
from dart.protocol.topology import LATEST_MODEL_KEY
from dart.rollout.eval import EvalReport
from dart.runtime.bus import Bus, KeyValueStore
from dart.runtime.telemetry import Telemetry, setup_telemetry
from dart.runtime.waiting import wait_event

if TYPE_CHECKING:
    from dart.rollout.engine.interface import InferenceEngine

log = logging.getLogger(__name__)
HELDOUT_FILE = "heldout.jsonl"
TRAIN_FILE = "train_greedy.jsonl"
HELDOUT, TRAIN = "heldout", "train"
"""The splits validation evaluates: the held-out suite, and (``validation.train_split``) the training suite."""


def heldout_tasks(config: RunConfig) -> list[TaskSpec]:
    """The held-out suite's tasks, checked against the training suite.

    Raises:
        ConfigError: A held-out task is also a training task (same backend and params), so its
            success would measure memory, not generalization.
    """
    train = load_tasks(config)
    held = load_tasks(config.model_copy(update={"suite": config.validation.suite}))
    seen = {(t.backend, json.dumps(t.params, sort_keys=True)) for t in train}
    shared = [t.task_id for t in held if (t.backend, json.dumps(t.params, sort_keys=True)) in seen]
    if shared:
        raise ConfigError(
            "run config",
            "validation.suite",
            f"{len(shared)} held-out task(s) are training tasks too (e.g. {shared[0]}): pick disjoint seeds",
        )
    return held


def compact(entry: dict[str, Any]) -> dict[str, Any]:
    """The summary's view of one evaluation: version, success, 95% interval, n, and who served it."""
    keys = ("version", "success", "ci95", "n", "successes", "errors", "seconds", "served_by", "engine")
    return {k: entry[k] for k in keys if k in entry}


def gain(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Final minus first success of compacted evaluations, with a 95% Newcombe interval; None with fewer
    than two evaluations or one that counted no episode."""
    from dart.rollout.eval import difference_interval

    if len(entries) < 2 or not entries[0]["n"] or not entries[-1]["n"]:
        return None
    first, final = entries[0], entries[-1]
    low, high = difference_interval(first["successes"], first["n"], final["successes"], final["n"])
    return {
        "from_version": first["version"],
        "to_version": final["version"],
        "difference": final["success"] - first["success"],
        "ci95": [low, high],
    }


def heldout_summary(results: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The summary's held-out keys: ``heldout`` (per evaluated version), the first and final
    success, and ``heldout_gain`` (final minus first with a 95% Newcombe interval); empty when
    validation was off."""
    if results is None:
        return {}
    entries = [compact(r) for r in results]
    served = sorted({f"{e['served_by']}: {e['engine']}" for e in entries if "served_by" in e})
    return {
        "heldout": entries,
        "heldout_served_by": served,
        "heldout_success_first": entries[0]["success"] if entries else None,
        "heldout_success_final": entries[-1]["success"] if entries else None,
        "heldout_gain": gain(entries),
    }


def train_summary(results: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The summary's training-suite keys (``validation.train_split``): ``train_greedy`` (version 0 and the
    final version) and ``train_greedy_gain``; empty when the training suite was not evaluated."""
    if not results:
        return {}
    entries = [compact(r) for r in results]
    return {"train_greedy": entries, "train_greedy_gain": gain(entries)}


def learning_line(summary: dict[str, Any]) -> str | None:
    """What the run learned, one line from its summary: greedy success first -> final with 95% intervals, on
    the training suite and on the held-out one; None when neither was evaluated."""

    def split(name: str, entries: list[dict[str, Any]] | None) -> str | None:
        if not entries:
            return None
        ends = [entries[0]] if len(entries) == 1 else [entries[0], entries[-1]]
        parts = []
        for e in ends:
            success = "-" if e["success"] is None else f"{e['success']:.0%}"
            parts.append(f"v{e['version']} {success} [{e['ci95'][0]:.0%}, {e['ci95'][1]:.0%}]")
        return f"{name} {' -> '.join(parts)} (n={ends[-1]['n']})"

    parts = [split("train split", summary.get("train_greedy")), split("held-out", summary.get("heldout"))]
    shown = [p for p in parts if p]
    return "learning (greedy): " + "; ".join(shown) if shown else None


class HeldOutValidator:
    """Evaluates published versions on the held-out suite while the run trains; see the module docstring.

    Args:
        config: The finalized run config (bus URL, engine config, run directory set).
        env_bus: The connection its env pool serves on (the ``env`` role where NATS has users).
        bus: The connection its runners lease and drive envs on (the ``eval`` role where NATS has users).
        state: The run's ``state`` KV bucket (where the newest version is announced).
        console: Where one line per evaluation is logged.
    """

    def __init__(self, config: RunConfig, env_bus: Bus, bus: Bus, state: KeyValueStore, console: Console) -> None:
        assert config.run.run_dir is not None
        self._config = config
        self._env_bus = env_bus
        self._bus = bus
        self._state = state
        self._console = console
        self._tasks = {HELDOUT: heldout_tasks(config)}
        if config.validation.train_split:
            self._tasks[TRAIN] = load_tasks(config)
            shared = {t.task_id for t in self._tasks[HELDOUT]} & {t.task_id for t in self._tasks[TRAIN]}
            if shared:  # one evaluation runs both suites and is split by task id
                raise ConfigError(
                    "run config",
                    "validation.train_split",
                    f"the held-out and training suites share task ids ({sorted(shared)[:3]}): rename them, or "
                    "set validation.train_split false",
                )
        self._excluded: dict[str, dict[str, Any]] = {}
        """Per split, the tasks the validation pool cannot run, left out (set at start)."""
        self._out = {HELDOUT: config.run.run_dir / HELDOUT_FILE, TRAIN: config.run.run_dir / TRAIN_FILE}
        self._store = store_config(config)
        self._env: EvalEnv | None = None
        self._engine: InferenceEngine | None = None
        self._telemetry: Telemetry | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.results: list[dict[str, Any]] = []
        """One full report dict per held-out evaluation, in order."""
        self.train_results: list[dict[str, Any]] = []
        """One full report dict per evaluation of the training suite (version 0 and the final), in order."""
        self.failed: list[int] = []
        """Versions whose evaluation failed (the rollout service could not hold an engine, say)."""

    @property
    def on_run_engines(self) -> bool:
        """Whether the run's rollout service serves the evaluations (``validation.engine`` unset)."""
        return self._config.validation.engine is None

    @property
    def evaluated(self) -> list[int]:
        """Versions evaluated so far."""
        return [int(r["version"]) for r in self.results]

    async def start(self) -> None:
        """Start the env pool and the engine, then the evaluation loop (version 0 first, if ``at_start``)."""
        from dart.cli import __version__

        run_dir = self._config.run.run_dir
        assert run_dir is not None
        tel = self._config.telemetry.model_copy(update={"jsonl_path": run_dir / "telemetry" / "validation.jsonl"})
        self._telemetry = setup_telemetry(
            "dart-validation", version=__version__, run_id=self._config.run.name, config=tel
        )
        v = self._config.validation
        also = (self._config.suite,) if TRAIN in self._tasks else ()
        self._env = EvalEnv(
            self._config, self._env_bus, pool=v.pool, suite=v.suite, instances=v.instances, store=self._store, also=also
        )
        await self._env.__aenter__()
        # As the data manager does: only the tasks the pool can set up count (the rest are reported).
        for split, tasks in self._tasks.items():
            runnable = await runnable_on_pool(
                self._bus, tasks, v.pool, timeout_s=self._config.data.capabilities_timeout_s
            )
            self._tasks[split] = list(runnable.tasks)
            self._excluded[split] = {"excluded": runnable.excluded, "excluded_by": dict(runnable.excluded_by)}
        if v.engine is not None:
            engine_cfg = self._config.rollout.engine
            assert engine_cfg is not None and engine_cfg.model_path, "finalize() sets rollout.engine and its model"
            policy = Policy(base=Path(engine_cfg.model_path))
            self._engine = await start_engine(self._config, policy, engine_config=v.engine)
        self._task = asyncio.create_task(self._loop(), name="heldout-validation")

    async def finish(self, final_version: int) -> list[dict[str, Any]]:
        """Let the running evaluation end, evaluate ``final_version`` if it was not, and close."""
        self._stop.set()
        try:
            if self._task is not None:
                await asyncio.wait_for(self._task, self._config.validation.final_timeout_s)
            done = {HELDOUT: self.results, TRAIN: self.train_results}
            due = tuple(s for s in self._tasks if final_version not in [r["version"] for r in done[s]])
            if due:
                version = await self._published(final_version)
                await asyncio.wait_for(self._evaluate(version, due), self._config.validation.final_timeout_s)
        except TimeoutError:
            self._console.log("held-out validation: the final evaluation ran out of time")
        except Exception as exc:  # a failed validation must not lose the run's summary
            log.exception("held-out validation failed")
            self._console.log(f"held-out validation failed: {type(exc).__name__}: {exc}")
        finally:
            await self.close()
        return self.results

    async def close(self) -> None:
        """Stop the loop, the engine and the env pool (idempotent)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._engine is not None:
            await self._engine.close()
            self._engine = None
        if self._env is not None:
            await self._env.__aexit__(None, None, None)
            self._env = None
        if self._telemetry is not None:
            self._telemetry.shutdown()
            self._telemetry = None

    async def _loop(self) -> None:
        if self._config.validation.at_start:
            await self._try(None, tuple(self._tasks))  # every split at version 0, in one hold of one engine
        every = self._config.validation.every_versions
        while not self._stop.is_set():
            latest = await self._state.get(LATEST_MODEL_KEY, ModelVersion)
            last = max([*self.evaluated, *self.failed], default=0)
            if latest is not None and latest.version >= last + every:
                await self._try(latest)
                continue
            await wait_event(self._stop, 1.0)

    async def _try(self, version: ModelVersion | None, splits: tuple[str, ...] = (HELDOUT,)) -> None:
        """:meth:`_evaluate`, a failure logged and remembered (the next due version is tried, not this one)."""
        try:
            await self._evaluate(version, splits)
        except Exception as exc:  # one failed evaluation must not end validation for the run
            number = version.version if version else 0
            self.failed.append(number)
            log.warning("evaluation %s of version %d failed: %s", "+".join(splits), number, exc)
            self._console.log(f"{'+'.join(splits)} v{number}: evaluation failed: {type(exc).__name__}: {exc}")

    async def _published(self, version: int) -> ModelVersion | None:
        return None if version == 0 else await asyncio.to_thread(published_version, self._store, version)

    async def _evaluate(self, version: ModelVersion | None, splits: tuple[str, ...] = (HELDOUT,)) -> None:
        """Evaluate ``version`` (None: version 0) on the tasks of ``splits`` in one evaluation; record each
        split's part."""
        v = self._config.validation
        number = version.version if version else 0
        label = f"{'+'.join(splits)}-v{number}"
        tasks = [t for split in splits for t in self._tasks[split]]
        if self._engine is None:
            request = EvalRequest(
                label=label,
                version=number,  # the rollout service reads the version's record from the model stream
                tasks=tasks,
                pool=v.pool,
                episodes_per_task=v.episodes_per_task,
                sampling=v.sampling,
                concurrency=v.instances,
                hold_timeout_s=v.final_timeout_s,
            )
            result = await self._bus.request(
                self._bus.subjects.eval_request(), request, EvalResult, timeout=v.final_timeout_s
            )
            report = EvalReport.from_result(result)
            served = {"served_by": "run engines", "engine": f"{result.engine_id}, {result.engine}"}
        else:
            if version is not None:
                await load_version(self._engine, version, self._store)
            report = await evaluate_policy(
                self._config,
                self._bus,
                self._engine,
                tasks,
                pool=v.pool,
                episodes_per_task=v.episodes_per_task,
                sampling=v.sampling,
                concurrency=v.instances,
                label=label,
                store=self._store,
            )
            served = {"served_by": "eval engine", "engine": self._engine.describe()}
        for split in splits:
            ids = {t.task_id for t in self._tasks[split]}
            others = [other for other in splits if other != split]
            self._record(split, number, report.part(ids, f"{split}-v{number}"), served, others)

    def _record(self, split: str, number: int, report: EvalReport, served: dict[str, str], others: list[str]) -> None:
        """Keep one split's evaluation of version ``number``: results, its file, telemetry, one console line."""
        entry = {"version": number, **report.to_dict(), **self._excluded[split], **served}
        if others:
            entry["evaluated_with"] = others
        (self.results if split == HELDOUT else self.train_results).append(entry)
        with self._out[split].open("a") as f:
            f.write(json.dumps(entry) + "\n")
        lo, hi = report.ci95
        if self._telemetry is not None:
            self._telemetry.event(
                f"validation.{split}",
                version=number,
                success=report.success,
                ci95_low=lo,
                ci95_high=hi,
                n=report.n,
                errors=report.errors,
                seconds=round(report.seconds, 2),
            )
        success = "-" if report.success is None else f"{report.success:.0%}"
        name = "held-out" if split == HELDOUT else "train split"
        self._console.log(f"{name} v{number}: success {success} [{lo:.0%}, {hi:.0%}] n={report.n} ({served['engine']})")
