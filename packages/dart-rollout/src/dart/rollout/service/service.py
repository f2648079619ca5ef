"""The rollout service: engines, router, weight sync and concurrent trajectory runners on the bus.

Service lifecycle::

    created --start()--> running: R runner loops, each pulling ONE work item at a time
            --stop()--> stopping: no new pulls; running trajectories get ``stop_timeout_s`` to
                        finish, then are aborted (ABORTED trajectories are still published)
            --> stopped: sync controller stopped, owned engines closed (the bus stays open)

Work item lifecycle (per runner loop)::

    fetch(1) -> delivered -> run trajectory (in_progress() every in_progress_interval_s)
      -> js_publish(traj, msg_id=trajectory_id) -> ack
      publish failed -> nak (redelivered; the derived trajectory id dedupes a late duplicate)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

from dart.protocol.errors import DartError, JetStreamError, PayloadTooLargeError, ServiceError
from dart.protocol.messages import (
    ErrorCode,
    EvalRequest,
    EvalResult,
    ModelVersion,
    Trajectory,
    TrajectoryStatus,
    WorkItem,
)
from dart.rollout.engine.interface import ENGINES, InferenceEngine
from dart.rollout.errors import EngineError, NoEngineAtVersionError, WeightFetchError
from dart.rollout.service.config import RolloutConfig, resolve_runner
from dart.rollout.service.images import ImageCache
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner
from dart.rollout.service.sync import WeightSyncController
from dart.runtime.bus import Bus, Delivery, PullConsumer, Service
from dart.runtime.retry import Backoff, retry
from dart.runtime.store import StoreConfig, open_store
from dart.runtime.telemetry import GpuSampler, Telemetry
from dart.runtime.topology import announced_version, durable_name, open_topology
from dart.runtime.waiting import cancel_and_wait

log = logging.getLogger("dart.rollout.service")


@dataclass
class RolloutStats:
    """Counters of a rollout service since start.

    Attributes:
        trajectories: Published trajectories by status value.
        steps: Steps in published trajectories.
        publish_failures: Trajectories whose publish failed (their work items were nak'ed).
        engine_busy_s: Busy time per engine id, seconds.
    """

    trajectories: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    publish_failures: int = 0
    engine_busy_s: dict[str, float] = field(default_factory=dict)


class RolloutService:
    """Runs trajectories for work items from the ``work`` stream; see the module docstring.

    Example::

        async with await Bus.connect(BusConfig(url=url)) as bus:
            async with RolloutService(RolloutConfig(engine=HFEngineConfig(model_path=p), num_engines=2), bus):
                await stop_event.wait()

    Args:
        config: Engines, runners and sync settings.
        bus: A connected bus; the caller's, it stays open.
        engines: Engines to use instead of starting ``config.num_engines`` hf engines from
            ``config.engine``; the caller keeps ownership (they are not closed on stop).
        telemetry: Where busy intervals and engine update events go.
        store_config: Endpoint and credentials for ``s3://`` weights and screenshot references, and the
            store resized prompt images go to (``config.prompt_images``); None keeps those inline.
    """

    def __init__(
        self,
        config: RolloutConfig,
        bus: Bus,
        *,
        engines: dict[str, InferenceEngine] | None = None,
        telemetry: Telemetry | None = None,
        store_config: StoreConfig | None = None,
    ) -> None:
        if engines is None and config.engine is None:
            raise ValueError("RolloutConfig.engine is required unless engines are passed in")
        self.config = config
        self._bus = bus
        self._telemetry = telemetry
        self._store_config = store_config
        self.images = ImageCache(store_config, max_bytes=config.image_cache_mb * 1024 * 1024)
        """Screenshots read by reference, shared by the runners."""
        self._image_store = open_store(store_config) if store_config is not None else None
        self.prompt_images = config.prompt_images.offload(self._image_store)
        """Resized prompt images sent by reference, shared by the runners; its counters say how many."""
        self._given_engines = engines
        self._owned: list[InferenceEngine] = []
        self._router: EngineRouter | None = None
        self._sync: WeightSyncController | None = None
        self._runner_config = config.runner
        self._eval_service: Service | None = None
        self._loops: list[asyncio.Task[None]] = []
        self._running: dict[str, asyncio.Task[Trajectory]] = {}
        self._consumers: list[PullConsumer[WorkItem]] = []
        self._stopping = asyncio.Event()
        self._stats = RolloutStats()
        self._gpu: GpuSampler | None = None

    @property
    def router(self) -> EngineRouter:
        """The engine router (after :meth:`start`)."""
        if self._router is None:
            raise RuntimeError("the rollout service is not started")
        return self._router

    @property
    def sync(self) -> WeightSyncController:
        """The weight sync controller (after :meth:`start`)."""
        if self._sync is None:
            raise RuntimeError("the rollout service is not started")
        return self._sync

    @property
    def stats(self) -> RolloutStats:
        """Live counters (engine busy time is read now)."""
        if self._router is not None:
            self._stats.engine_busy_s = self._router.busy_seconds()
        return self._stats

    async def start(self) -> None:
        """Open the topology, start engines, the sync controller and the runner loops."""
        state = await open_topology(self._bus)
        if self._telemetry is not None and self.config.gpu_sample_interval_s is not None:
            # Records gpu.sample events when a GPU is visible; one gpu.unavailable event otherwise.
            self._gpu = GpuSampler(self._telemetry, interval_s=self.config.gpu_sample_interval_s, source="rollout")
            await self._gpu.start()
        engines = self._given_engines
        if engines is None:
            engines = await self._start_engines()
        self._sync = WeightSyncController(
            engines, self.config.sync, telemetry=self._telemetry, store_config=self._store_config
        )
        # Training goes only to engines no evaluation has borrowed (see WeightSyncController.hold).
        self._router = EngineRouter(engines, telemetry=self._telemetry, admits=self._sync.serves_training)
        await self._sync.start(state)
        durable = durable_name(self._bus, "work")
        engine = self.config.engine
        runner_config = resolve_runner(self.config.runner, engine.model_path if engine is not None else None)
        self._runner_config = runner_config
        for i in range(self.config.runners):
            # One subscription per runner: each fetches one item at a time, so nothing waits in a
            # local buffer while its ack_wait ticks (rollout-wise sampling, no batch barrier).
            consumer = await self._bus.pull_consumer("work", durable, WorkItem)
            self._consumers.append(consumer)
            runner = TrajectoryRunner(
                f"runner-{i}",
                self._bus,
                self._router,
                runner_config,
                telemetry=self._telemetry,
                images=self.images,
                offload=self.prompt_images,
            )
            self._loops.append(asyncio.create_task(self._loop(runner, consumer), name=runner.runner_id))
        # Evaluations on these engines (the run's held-out validation), one at a time.
        self._eval_service = await self._bus.serve(
            self._bus.subjects.eval_request(), EvalRequest, self._evaluate, max_concurrency=1
        )

    async def _evaluate(self, request: EvalRequest) -> EvalResult:
        """Run ``request``'s episodes on one engine held at its version (see :meth:`WeightSyncController.hold`).

        The version's weights are the ones the trainer announced under that number on the ``model``
        stream; a number never announced is refused (``not_found``) and no engine changes.
        """
        from dart.rollout.eval import evaluate

        if self._sync is None or self._stopping.is_set():
            raise ServiceError(ErrorCode.UNAVAILABLE, "the rollout service is not serving", retryable=True)
        version = await self._announced(request.version) if request.version else None
        runner_config = self._runner_config.model_copy(update={"pool": request.pool})
        try:
            async with self._sync.hold(version, timeout_s=request.hold_timeout_s) as (engine_id, engine):
                log.info("evaluation %s on %s at version %d", request.label, engine_id, engine.version)
                report = await evaluate(
                    self._bus,
                    EngineRouter({engine_id: engine}),
                    runner_config,
                    request.tasks,
                    episodes_per_task=request.episodes_per_task,
                    sampling=request.sampling,
                    concurrency=request.concurrency,
                    label=request.label,
                    images=self.images,
                )
        except NoEngineAtVersionError as exc:
            raise ServiceError(ErrorCode.CONFLICT, str(exc), {"version": exc.version}) from None
        except (WeightFetchError, EngineError, TimeoutError) as exc:
            raise ServiceError(ErrorCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}", retryable=True) from None
        return report.to_result(engine_id, engine.describe())

    async def _announced(self, version: int) -> ModelVersion:
        try:
            announced = await announced_version(self._bus, version)
        except JetStreamError as exc:
            raise ServiceError(
                ErrorCode.UNAVAILABLE, f"the model stream could not be read: {exc}", retryable=True
            ) from None
        if announced is None:
            raise ServiceError(
                ErrorCode.NOT_FOUND,
                f"version {version} was never announced on the model stream: evaluate a version the trainer "
                "published (or 0, the checkpoint the engines started from)",
                {"version": version},
            )
        return announced

    async def _start_engines(self) -> dict[str, InferenceEngine]:
        config = self.config.engine
        assert config is not None
        started = dict(await ENGINES.get(config.kind)(config, self.config.num_engines))
        self._owned = list(started.values())
        return started

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop gracefully: no new work, finish or abort running trajectories, publish them.

        Args:
            timeout_s: How long running trajectories may finish; default ``config.stop_timeout_s``.
        """
        self._stopping.set()
        timeout_s = self.config.stop_timeout_s if timeout_s is None else timeout_s
        if self._eval_service is not None:
            await self._eval_service.stop()
            self._eval_service = None
        if self._loops:
            _, pending = await asyncio.wait(self._loops, timeout=timeout_s)
            for task in list(self._running.values()):
                task.cancel()  # -> ABORTED trajectories, which the loops still publish
            if pending:
                await asyncio.wait(pending, timeout=self.config.abort_window_s)
            await cancel_and_wait(self._loops)
            self._loops = []
        for consumer in self._consumers:
            await consumer.close()
        self._consumers = []
        if self._sync is not None:
            await self._sync.stop()
        for engine in self._owned:
            await engine.close()
        self._owned = []
        if self._gpu is not None:
            await self._gpu.stop()
            self._gpu = None
        await asyncio.to_thread(self.images.close)
        if self._image_store is not None:
            await asyncio.to_thread(self._image_store.close)

    async def __aenter__(self) -> RolloutService:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- internals ------------------------------------------------------------------------------
    async def _loop(self, runner: TrajectoryRunner, consumer: PullConsumer[WorkItem]) -> None:
        while not self._stopping.is_set():
            try:
                deliveries = await consumer.fetch(1, timeout=self.config.fetch_timeout_s)
            except DartError as exc:
                log.warning("%s: fetching work failed: %s", runner.runner_id, exc)
                await asyncio.sleep(self.config.fetch_timeout_s)
                continue
            for delivery in deliveries:
                if self._stopping.is_set():
                    await delivery.nak()  # arrived as we stopped: hand it back now, not after ack_wait
                    continue
                await self._handle(runner, delivery)

    async def _handle(self, runner: TrajectoryRunner, delivery: Delivery[WorkItem]) -> None:
        with delivery.span():
            task = asyncio.create_task(runner.run(delivery.message), name=f"{runner.runner_id}-traj")
            self._running[runner.runner_id] = task
            # Kept in progress until the trajectory is stored, publishing retries included.
            keepalive = asyncio.create_task(self._keep_in_progress(delivery))
            try:
                try:
                    trajectory = await asyncio.shield(task)
                finally:
                    self._running.pop(runner.runner_id, None)
                await self._publish(trajectory, delivery)
            finally:
                keepalive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keepalive

    async def _publish(self, trajectory: Trajectory, delivery: Delivery[WorkItem]) -> None:
        subject = self._bus.subjects.stream_subject("traj")
        try:
            # A stream electing its leader (a cluster node died) refuses for a moment; the trajectory id
            # dedupes a publish stored whose ack was lost.
            await retry(
                lambda: self._bus.js_publish(subject, trajectory, msg_id=trajectory.trajectory_id),
                backoff=Backoff(0.5, max_s=5.0),
                retryable=lambda exc: isinstance(exc, JetStreamError),
                what=f"publishing {trajectory.trajectory_id}",
                timeout_s=self.config.publish_retry_s,
                logger=log,
            )
        except PayloadTooLargeError as exc:
            # Running the episode again would make the same message: it is answered as failed, without its
            # steps, so the work item settles and the data manager counts the failure.
            self._stats.publish_failures += 1
            log.error("trajectory %s is too large to publish, sending it as failed: %s", trajectory.trajectory_id, exc)
            if trajectory.steps:
                error = f"{len(trajectory.steps)} steps dropped: {exc}"
                failed = trajectory.model_copy(update={"steps": [], "status": TrajectoryStatus.FAILED, "error": error})
                await self._publish(failed, delivery)
            else:
                with contextlib.suppress(DartError):
                    await delivery.nak()
            return
        except DartError as exc:
            self._stats.publish_failures += 1
            log.error("publishing %s failed, handing its work item back: %s", trajectory.trajectory_id, exc)
            with contextlib.suppress(DartError):
                await delivery.nak()
            return
        self._stats.trajectories[trajectory.status.value] += 1
        self._stats.steps += len(trajectory.steps)
        try:
            await delivery.ack()
        except DartError as exc:
            # Redelivery reruns the item; its trajectory id is the same, so the stream dedupes it.
            log.warning("acking %s failed: %s", delivery.message.work_id, exc)

    async def _keep_in_progress(self, delivery: Delivery[WorkItem]) -> None:
        while True:
            await asyncio.sleep(self.config.in_progress_interval_s)
            try:
                await delivery.in_progress()
            except DartError as exc:
                log.warning("in_progress on %s failed: %s", delivery.message.work_id, exc)
