"""The ``osworld`` env backend: OSWorld tasks on a VM server (local desktop, docker VM, or a URL)."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from dart.env.errors import TaskParamsError
from dart.env.interface import BackendState, EnvBackend
from dart.env.osworld.actions import pyautogui_command, to_dart_json, to_pyautogui
from dart.env.osworld.client import VMServerClient
from dart.env.osworld.config import OSWorldConfig
from dart.env.osworld.errors import OSWorldVMError, ProviderError, SetupStepError, UnsupportedStepError
from dart.env.osworld.evaluate import evaluate_task
from dart.env.osworld.getters import GetterContext
from dart.env.osworld.paths import PathMap, inside
from dart.env.osworld.providers import (
    DockerProvider,
    LocalDesktopProvider,
    RemoteProvider,
    VMProvider,
)
from dart.env.osworld.setup import SetupRunner
from dart.env.osworld.suites import local_solutions
from dart.env.osworld.support import provider_features
from dart.env.osworld.tasks import BACKEND, OSWorldTask
from dart.protocol.messages import TERMINAL_ACTION_KINDS, Action, InlineImage, Observation, TaskSpec, Wait
from dart.protocol.messages.observation import MetadataValue
from dart.protocol.png import png_size

T = TypeVar("T")


class OSWorldEnv(EnvBackend):
    """OSWorld tasks on a VM server, implementing :class:`~dart.env.interface.EnvBackend`.

    Lifecycle: that of :class:`~dart.env.interface.EnvBackend`. :meth:`start` starts the provider
    (a local desktop, a docker VM) once; each :meth:`reset` after the first reverts it (a fresh VM is
    clean already), runs the task's setup steps and takes the first screenshot. A provider that cannot
    revert serves one episode: the backend is then :attr:`spent` (the env service replaces it) and a
    further reset raises ``ProviderError``; so does a failed revert. The episode ends on
    ``finished``/``fail``; :meth:`evaluate` runs the task's evaluator (postconfig, getters, metrics) and
    may be called repeatedly.

    Tasks: ``params`` is the OSWorld task JSON (:func:`~dart.env.osworld.tasks.to_task_spec`).
    Actions go to ``/dart/action`` where the server has DART extensions, else they become pyautogui
    code run through ``/execute`` as OSWorld's own controller does. ``wait`` sleeps here.

    Every VM call runs on this instance's worker thread with a request timeout; a dead VM raises
    :class:`~dart.env.osworld.errors.OSWorldVMError` or ``ProviderError`` (both EnvErrors),
    so the env service replaces the instance.
    """

    name = BACKEND

    def __init__(self, config: OSWorldConfig | None = None, *, stream: int = 0) -> None:
        super().__init__()
        self.config = config or OSWorldConfig()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"osworld-{stream}")
        self._provider: VMProvider | None = None
        self._closing = threading.Lock()
        """Orders :meth:`close` against a VM start finishing on the worker."""
        self._client: VMServerClient | None = None
        self._size = (self.config.desktop.width, self.config.desktop.height)
        self._dart = False
        self._cache_root = Path(tempfile.mkdtemp(prefix="dart-osworld-"))
        self._task: OSWorldTask | None = None
        self._task_id = ""
        self._instruction = ""
        self._history: list[Action] = []
        self._paths = PathMap.identity()
        self._dirty = False
        """Whether a reset has touched the VM since it started or was last reverted."""

    @property
    def screen_size(self) -> tuple[int, int]:
        """Screenshot size ``(width, height)`` in pixels."""
        return self._size

    @property
    def provider(self) -> VMProvider | None:
        """The VM provider, once started (tests and tools)."""
        return self._provider

    @property
    def client(self) -> VMServerClient | None:
        """The VM server client, once started."""
        return self._client

    @property
    def spent(self) -> bool:
        """Whether the VM ran an episode and cannot revert: the env service replaces this backend."""
        return self._dirty and self._provider is not None and not self._provider.can_revert

    @property
    def provider_name(self) -> str | None:
        """The provider :attr:`OSWorldConfig.provider` names."""
        return self.config.provider

    def features(self) -> frozenset[str]:
        """What this backend's provider can run (:func:`dart.env.osworld.support.provider_features`)."""
        return provider_features(self.config)

    def make_provider(self) -> VMProvider:
        """The provider :attr:`OSWorldConfig.provider` names."""
        match self.config.provider:
            case "local":
                return LocalDesktopProvider(self.config.desktop)
            case "docker":
                return DockerProvider(self.config.docker)
            case _:
                assert self.config.remote is not None  # the config's validator
                return RemoteProvider(self.config.remote)

    async def start(self) -> None:
        """Start the provider and connect (``created -> ready``); a no-op once started.

        Raises:
            ProviderError: The VM could not be started.
            OSWorldVMError: Its server does not answer.
        """
        self._require("start", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state != BackendState.CREATED:
            return

        def launch() -> None:
            provider = self.make_provider()
            url = provider.start()
            with self._closing:
                if self._state == BackendState.CLOSED:
                    # close() ran while the VM started (a service stopping mid-start): stop it here,
                    # or nobody will.
                    provider.stop()
                    raise ProviderError(self.config.provider, "the env was closed while its VM started")
                self._provider = provider
            client = VMServerClient(url, timeout=self.config.request_timeout_s, token=provider.token)
            self._client = client
            self._size = client.screen_size()
            self._dart = self.config.dart_actions and client.has_dart_extensions()
            home = provider.home
            local = isinstance(provider, LocalDesktopProvider)
            if local and home is not None:
                self._paths = PathMap(source=self.config.home_map, target=home)

        await self._run(launch)
        self._state = BackendState.READY

    async def reset(self, task: TaskSpec, seed: int | None = None) -> tuple[Observation, str]:
        """Revert the VM, run the task's setup, and return the first screenshot.

        Raises:
            TaskParamsError: Not an osworld task, invalid task JSON, or a setup step that cannot run
                here (unsupported or malformed).
            OSWorldVMError, ProviderError: The VM failed.
            EpisodeStateError: The env is closed.
        """
        self._require("reset", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        parsed = self.parse_params(task)
        if self._state == BackendState.CREATED:
            await self.start()
        self._state = BackendState.READY  # a failed reset leaves no episode behind
        png = await self._run(functools.partial(self._begin, task.task_id, parsed))
        self._task, self._task_id = parsed, task.task_id
        self._instruction = str(self._paths.map_str(parsed.instruction))
        self._history = []
        self._state = BackendState.IN_EPISODE
        return self._observation(png), self._instruction

    def _begin(self, task_id: str, task: OSWorldTask) -> bytes:
        provider, client = self._current()
        self._check_alive(provider)
        if self._dirty:
            if not provider.can_revert:
                raise ProviderError(provider.name, "this VM cannot revert and has served its episode; use a fresh one")
            url = provider.revert()
            if url != client.url:
                client.close()
                client = self._client = VMServerClient(url, timeout=self.config.request_timeout_s, token=provider.token)
        # From here on the VM holds this task's state, whatever happens to the setup.
        self._dirty = True
        cache = self._cache_dir(task_id, fresh=True)
        try:
            self._runner(client, cache).run(task.config)
        except (UnsupportedStepError, SetupStepError) as exc:
            raise TaskParamsError(task_id, self.name, str(exc)) from exc
        if self.config.settle_s:
            time.sleep(self.config.settle_s)
        return client.screenshot()

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        """Execute one action and screenshot.

        Returns:
            The observation, whether the episode ended (``finished``/``fail``), and info: ``event``
            (``ok``, or the error the action's command printed), ``step``.

        Raises:
            EpisodeStateError: No episode is running.
            OSWorldVMError, ProviderError: The VM failed (a dead desktop raises within the request timeout).
        """
        self._require("step", BackendState.IN_EPISODE)
        event, png = await self._run(functools.partial(self._act, action))
        self._history.append(action)
        done = action.kind in TERMINAL_ACTION_KINDS
        if done:
            self._state = BackendState.DONE
        return self._observation(png), done, {"event": event, "step": len(self._history)}

    def _act(self, action: Action) -> tuple[str, bytes]:
        provider, client = self._current()
        self._check_alive(provider)
        event = "ok"
        if isinstance(action, Wait):
            time.sleep(action.seconds)
        elif action.kind not in TERMINAL_ACTION_KINDS:
            if self._dart:
                client.dart_action(to_dart_json(action))
            else:
                code = to_pyautogui(action, self._size)
                if code is not None:
                    answer = client.execute(pyautogui_command(code))
                    if answer.get("returncode") not in (0, None):
                        event = f"error: {str(answer.get('error') or '').strip()[-200:]}"
            if self.config.settle_s:
                time.sleep(self.config.settle_s)
        return event, client.screenshot()

    async def evaluate(self) -> tuple[float, bool, dict[str, MetadataValue]]:
        """Run the task's evaluator in the VM's current state.

        Returns:
            The metric score as reward (1.0/0.0 for most metrics), success (score 1), and details:
            per-metric scores (``metric.<i>.<name>``), errors, ``steps``, ``last_action``.

        Raises:
            EpisodeStateError: There is no episode.
            TaskParamsError: The evaluator uses a getter, metric or postconfig step that cannot run here.
            OSWorldVMError, ProviderError: The VM failed.
        """
        self._require("evaluate", BackendState.IN_EPISODE, BackendState.DONE)
        task = self._task
        assert task is not None
        last = self._history[-1].kind if self._history else None

        def run() -> tuple[float, dict[str, MetadataValue]]:
            provider, client = self._current()
            self._check_alive(provider)
            cache = self._cache_dir(self._task_id, fresh=False)
            ctx = GetterContext(client=client, cache_dir=cache, network=self.config.network)
            try:
                result = evaluate_task(task, runner=self._runner(client, cache), ctx=ctx, last_action=last)
            except (UnsupportedStepError, SetupStepError) as exc:
                raise TaskParamsError(self._task_id, self.name, str(exc)) from exc
            return result.score, result.details

        value, details = await self._run(run)
        details.update({"steps": len(self._history), "last_action": last})
        return value, value >= 1.0, details

    async def close(self) -> None:
        """Stop the provider (the local desktop, the container); idempotent."""
        with self._closing:
            self._state = BackendState.CLOSED
            provider, self._provider = self._provider, None
        client, self._client = self._client, None
        if client is not None:
            client.close()
        if provider is not None:
            # Not on the worker: it may be stuck on a dead VM; stopping unblocks it.
            await asyncio.to_thread(provider.stop)
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(shutil.rmtree, self._cache_root, True)

    def process_ids(self) -> list[int]:
        """The provider's local processes (a local desktop's; none for a VM elsewhere)."""
        return self._provider.process_ids() if self._provider is not None else []

    def oracle_action(self) -> tuple[str, Action] | None:
        """The next scripted ``(thought, action)`` of a shipped local-suite task, or None."""
        if self._state != BackendState.IN_EPISODE or self._task is None:
            return None
        script = local_solutions().get(self._task.id)
        if script is None or len(self._history) >= len(script):
            return None
        return script[len(self._history)]

    @classmethod
    def parse_params(cls, task: TaskSpec) -> OSWorldTask:
        """The OSWorld task in a spec's params.

        Raises:
            TaskParamsError: Not an osworld task, or params are not a valid OSWorld task.
        """
        if task.backend != cls.name:
            raise TaskParamsError(task.task_id, cls.name, f"it is a {task.backend!r} task")
        try:
            return OSWorldTask.model_validate(task.params)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise TaskParamsError(
                task.task_id, cls.name, f"params are not an OSWorld task: {where}: {err['msg']}"
            ) from None

    # --- helpers -------------------------------------------------------------------------------

    def _runner(self, client: VMServerClient, cache: Path) -> SetupRunner:
        local = isinstance(self._provider, LocalDesktopProvider)
        root_sudo = self.config.root_sudo if self.config.root_sudo is not None else os.geteuid() == 0
        return SetupRunner(
            client=client,
            paths=self._paths,
            cache_dir=cache,
            network=self.config.network,
            root_sudo=root_sudo,
            local=local,
            client_password=self.config.client_password,
        )

    def _cache_dir(self, task_id: str, *, fresh: bool) -> Path:
        try:  # a task id of ".." must not make the cleanup below remove the temp root's parent
            path = inside(self._cache_root, task_id.replace("/", "_"))
        except ValueError as exc:
            raise TaskParamsError(task_id, self.name, f"task id: {exc}") from None
        if fresh and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _current(self) -> tuple[VMProvider, VMServerClient]:
        if self._provider is None or self._client is None:
            raise ProviderError(self.config.provider, "the VM is not running")
        return self._provider, self._client

    def _check_alive(self, provider: VMProvider) -> None:
        if isinstance(provider, LocalDesktopProvider) and not provider.alive():
            raise ProviderError("local", "the desktop died (Xvfb or its server exited)")

    def _observation(self, png: bytes) -> Observation:
        # The image's own size (a VM may capture at another scale than the screen it reports):
        # readers decode a screenshot only when it is the size its observation declares.
        try:
            width, height = png_size(png)
        except ValueError as exc:
            raise ProviderError(self.config.provider, f"the VM's screenshot is unusable: {exc}") from None
        return Observation(
            screenshot=InlineImage(png=png, width=width, height=height),
            text=self._instruction,
            metadata={"task_id": self._task_id, "step": len(self._history)},
        )

    async def _run(self, func: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, func)
        except RuntimeError as exc:
            if "shutdown" in str(exc):
                raise OSWorldVMError("(worker)", None, "the env was closed") from None
            raise
