"""The ``miniwob`` env backend: MiniWoB++ web tasks in a headless Chromium."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import Field

from dart.env.errors import TaskParamsError
from dart.env.interface import BackendState, EnvBackend
from dart.env.miniwob.browser import SCROLL_PX, TASK_HEIGHT, TASK_WIDTH, Browser, find_binary, key_name
from dart.env.miniwob.dom import DomSnapshot
from dart.env.miniwob.errors import BrowserError
from dart.env.miniwob.oracle import SOLVERS
from dart.protocol.config import ConfigModel
from dart.protocol.messages import (
    TERMINAL_ACTION_KINDS,
    Action,
    Click,
    DoubleClick,
    Drag,
    Hotkey,
    InlineImage,
    Observation,
    RightClick,
    Scroll,
    TaskSpec,
    Type,
    Wait,
)
from dart.protocol.messages.actions import ScrollDirection
from dart.protocol.messages.observation import MetadataValue

T = TypeVar("T")


class MiniWoBConfig(ConfigModel):
    """Configuration of MiniWoB++ env instances."""

    chrome_binary: str | None = None
    """Chromium executable; default ``$MINIWOB_CHROME_BINARY``, else ``chromium`` on ``PATH``."""
    chromedriver: str | None = None
    """chromedriver executable; default ``$MINIWOB_CHROMEDRIVER``, else ``chromedriver`` on ``PATH``."""
    scale: int = Field(default=1, ge=1, le=4)
    """Device scale factor: screenshots are ``(160 * scale) x (210 * scale)`` pixels, rendered sharp."""
    episode_max_time_s: float = Field(default=120.0, gt=0.0, le=3600.0)
    """MiniWoB++'s episode clock, seconds (its own default is 10 s, too short for a model that thinks
    for seconds per step). An episode that runs out ends with raw reward -1."""
    settle_s: float = Field(default=0.05, ge=0.0, le=10.0)
    """Pause after each action before the screenshot, seconds (lets handlers and repaints run)."""


@functools.cache
def task_names() -> frozenset[str]:
    """Every MiniWoB++ task the installed ``miniwob`` package registers (``click-test`` ...).

    Imports ``miniwob`` (about a second, once): call it off the event loop.
    """
    import miniwob.envs.miniwob_envs as envs  # type: ignore[import-untyped]

    return frozenset(
        str(getattr(cls, "subdomain"))  # noqa: B009
        for cls in vars(envs).values()
        if isinstance(cls, type) and isinstance(getattr(cls, "subdomain", None), str)
    )


def miniwob_task(name: str, seed: int | None = None, *, max_steps: int = 15) -> TaskSpec:
    """A :class:`TaskSpec` for MiniWoB++ task ``name`` (``click-test``), fixed to ``seed`` if given."""
    params: dict[str, Any] = {"env_id": f"miniwob/{name}-v1"}
    task_id = f"miniwob/{name}"
    if seed is not None:
        params["seed"] = seed
        task_id += f"/{seed}"
    return TaskSpec(task_id=task_id, backend="miniwob", params=params, max_steps=max_steps, tags=("miniwob", name))


_ENV_ID = re.compile(r"^(?:miniwob/)?(?P<name>[a-z0-9][a-z0-9-]*?)(?:-v\d+)?(?:/\d+)?$")
_TASK_ID = re.compile(r"^miniwob/(?P<name>[a-z0-9][a-z0-9-]*)(?:/(?P<seed>0|[1-9][0-9]{0,8}))?$")


class MiniWoBEnv(EnvBackend):
    """A MiniWoB++ task page in headless Chromium, implementing :class:`~dart.env.interface.EnvBackend`.

    Lifecycle: that of :class:`~dart.env.interface.EnvBackend`. :meth:`start` launches one browser,
    reused for every episode; a reset to another task loads its page. The episode ends (``step``
    returns ``done=True``) when MiniWoB++ ends it (the task was answered, right or wrong, or its
    clock ran out) or on ``finished``/``fail``.

    Tasks: ``params.env_id`` (``miniwob/click-test-v1``, ``click-test``) or else the task id
    (``miniwob/click-test`` or ``miniwob/click-test/7``) names the task; ``params.seed`` fixes the
    episode, else the ``seed`` of :meth:`reset` does (default 0).

    Observations: a PNG of the 160x210 task area (instruction bar included), scaled by
    :attr:`MiniWoBConfig.scale`, and the instruction as text. Action coordinates are fractions of
    that area. The DOM is read only for :meth:`oracle_action`.

    Reward: MiniWoB++'s raw reward is in [-1, 1]; :meth:`evaluate` returns reward 1.0 and success
    when it is positive, else 0.0, with ``raw_reward`` and the time-discounted ``env_reward`` in
    the details.

    Every browser call runs on this instance's own worker thread, never on the event loop. A dead
    browser makes the call raise :class:`~dart.env.miniwob.errors.BrowserError`.
    """

    name = "miniwob"
    forks = True
    """By replay: the same task and seed, then the prefix's actions; the env service checks every replayed screen
    against the parent's, so a page whose timing shows (an animation mid-way) refuses rather than diverges."""

    def __init__(self, config: MiniWoBConfig | None = None, *, stream: int = 0) -> None:
        """Create an instance (nothing starts until :meth:`start`).

        Args:
            config: Browser paths, scale and timing; defaults to :class:`MiniWoBConfig`'s defaults.
            stream: Instance number, used to name the worker thread.
        """
        super().__init__()
        self.config = config or MiniWoBConfig()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"miniwob-{stream}")
        self._browser: Browser | None = None
        self._task_name = ""
        self._task_id = ""
        self._utterance = ""
        self._dom = DomSnapshot(())
        self._history: list[Action] = []

    @property
    def screen_size(self) -> tuple[int, int]:
        """Screenshot size ``(width, height)`` in pixels."""
        return TASK_WIDTH * self.config.scale, TASK_HEIGHT * self.config.scale

    @property
    def browser(self) -> Browser | None:
        """The browser, once started (for tests and tools)."""
        return self._browser

    async def start(self) -> None:
        """Launch the browser (``created -> ready``); a no-op once started.

        Raises:
            BrowserError: Chromium or chromedriver is missing or does not start.
            EpisodeStateError: The env is closed.
        """
        self._require("start", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state != BackendState.CREATED:
            return
        chrome = self.config.chrome_binary or find_binary("MINIWOB_CHROME_BINARY", "chromium", "chromium-browser")
        driver = self.config.chromedriver or find_binary("MINIWOB_CHROMEDRIVER", "chromedriver")
        if chrome is None or driver is None:
            raise BrowserError(
                "Chromium or chromedriver not found: install them (apt-get install chromium chromium-driver) "
                "or set MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER"
            )

        def launch() -> Browser:
            task_names()  # import miniwob here, off the loop
            return Browser(chrome, driver, self.config.scale, self.config.episode_max_time_s)

        self._browser = await self._run(launch)
        self._state = BackendState.READY

    async def reset(self, task: TaskSpec, seed: int | None = None) -> tuple[Observation, str]:
        """Start an episode of a MiniWoB++ task.

        Returns:
            The first observation and MiniWoB++'s instruction for this episode.

        Raises:
            TaskParamsError: Not a miniwob task, or no such task.
            BrowserError: The browser died.
            EpisodeStateError: The env is closed.
        """
        self._require("reset", BackendState.CREATED, BackendState.READY, BackendState.IN_EPISODE, BackendState.DONE)
        if self._state == BackendState.CREATED:
            await self.start()
        name, task_seed = await self._run(functools.partial(self.parse_params, task))
        episode_seed = task_seed if task_seed is not None else (seed or 0)
        browser = self._current()

        def begin() -> tuple[str, DomSnapshot, bytes]:
            browser.load(name)
            browser.begin(episode_seed)
            return browser.utterance(), browser.snapshot(), browser.screenshot()

        self._utterance, self._dom, png = await self._run(begin)
        self._task_name, self._task_id = name, task.task_id
        self._history = []
        self._state = BackendState.IN_EPISODE
        return self._observation(png), self._utterance

    async def step(self, action: Action) -> tuple[Observation, bool, dict[str, MetadataValue]]:
        """Execute an action in the page.

        Returns:
            The observation, whether the episode is done, and info: ``event`` (``ok``, or why the
            action did nothing, e.g. an unknown key name), ``step`` (1-based), ``raw_reward``
            (MiniWoB++'s, 0 until done) and ``reason``.

        Raises:
            EpisodeStateError: No episode is running.
            BrowserError: The browser died.
        """
        self._require("step", BackendState.IN_EPISODE)
        browser = self._current()

        def act() -> tuple[str, dict[str, Any], DomSnapshot, bytes]:
            event = "ignored: the episode had ended"  # the clock may run out while the policy thinks
            if not browser.metadata()["done"]:
                event = self._perform(browser, action)
            meta = browser.metadata()
            return event, meta, browser.snapshot(), browser.screenshot()

        event, meta, self._dom, png = await self._run(act)
        self._history.append(action)
        done = bool(meta["done"]) or action.kind in TERMINAL_ACTION_KINDS
        if done:
            self._state = BackendState.DONE
        info: dict[str, MetadataValue] = {
            "event": event,
            "step": len(self._history),
            "raw_reward": float(meta["raw_reward"] or 0.0),
            "reason": str(meta["reason"]) if meta["reason"] is not None else None,
        }
        return self._observation(png), done, info

    async def evaluate(self) -> tuple[float, bool, dict[str, MetadataValue]]:
        """Score the episode by MiniWoB++'s own reward.

        Returns:
            Reward 1.0 if MiniWoB++ ended the episode with a positive raw reward, else 0.0; success
            likewise; details ``raw_reward``, ``env_reward``, ``miniwob_done``, ``reason``, ``steps``.

        Raises:
            EpisodeStateError: There is no episode.
            BrowserError: The browser died.
        """
        self._require("evaluate", BackendState.IN_EPISODE, BackendState.DONE)
        meta = await self._run(self._current().metadata)
        finished = bool(meta["done"])
        raw = float(meta["raw_reward"] or 0.0) if finished else 0.0
        success = raw > 0.0
        details: dict[str, MetadataValue] = {
            "raw_reward": raw,
            "env_reward": float(meta["env_reward"] or 0.0) if finished else 0.0,
            "miniwob_done": finished,
            "reason": str(meta["reason"]) if meta["reason"] is not None else "episode not ended by the task",
            "steps": len(self._history),
        }
        return (1.0 if success else 0.0), success, details

    async def close(self) -> None:
        """Quit the browser; further calls raise (idempotent)."""
        self._state = BackendState.CLOSED
        browser, self._browser = self._browser, None
        if browser is not None:
            # Not on the worker: it may be stuck in a call to the dead browser; quit unblocks it.
            await asyncio.to_thread(browser.quit)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def process_ids(self) -> list[int]:
        """chromedriver, whose descendants are the browser's processes."""
        return [self._browser.driver_pid] if self._browser is not None else []

    def task_from_id(self, task_id: str) -> TaskSpec | None:
        """The MiniWoB++ task an id names (``miniwob/<name>`` or ``miniwob/<name>/<seed>``, as
        :func:`miniwob_task` writes it), or None. Whether ``<name>`` is installed is checked at reset."""
        match = _TASK_ID.fullmatch(task_id)
        if match is None:
            return None
        seed = match.group("seed")
        return miniwob_task(match.group("name"), int(seed) if seed is not None else None)

    def oracle_action(self) -> tuple[str, Action] | None:
        """The next correct ``(thought, action)`` from the page's DOM, or None.

        None when no episode is running, the task has no oracle (see
        :data:`~dart.env.miniwob.oracle.SOLVERS`), or the oracle has nothing left to do.
        """
        if self._state != BackendState.IN_EPISODE:
            return None
        solver = SOLVERS.get(self._task_name)
        return solver(self._utterance, self._dom, self._history) if solver else None

    @classmethod
    def parse_params(cls, task: TaskSpec) -> tuple[str, int | None]:
        """The task name and fixed seed (or None) of a task; blocks on the first call (imports miniwob).

        Raises:
            TaskParamsError: Not a miniwob task, or no such task.
        """
        if task.backend != cls.name:
            raise TaskParamsError(task.task_id, cls.name, f"it is a {task.backend!r} task")
        unknown = set(task.params) - {"env_id", "seed"}
        if unknown:
            raise TaskParamsError(task.task_id, cls.name, f"unknown params {sorted(unknown)} (expected env_id, seed)")
        env_id = task.params.get("env_id", task.task_id)
        seed = task.params.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TaskParamsError(task.task_id, cls.name, f"params.seed must be an integer, not {seed!r}")
        match = _ENV_ID.match(str(env_id))
        if match is None or match["name"] not in task_names():
            raise TaskParamsError(
                task.task_id, cls.name, f"no MiniWoB++ task {env_id!r} (use e.g. 'miniwob/click-test-v1')"
            )
        return match["name"], seed

    def _current(self) -> Browser:
        if self._browser is None:
            raise BrowserError("the browser is not running")
        return self._browser

    def _observation(self, png: bytes) -> Observation:
        width, height = self.screen_size
        return Observation(
            screenshot=InlineImage(png=png, width=width, height=height),
            text=self._utterance,
            metadata={"task_id": self._task_id, "task": self._task_name, "step": len(self._history)},
        )

    def _perform(self, browser: Browser, action: Action) -> str:
        """Execute ``action`` (blocking; on the worker thread); returns the step's ``event``."""
        match action:
            case Click(x=x, y=y):
                browser.click(x * TASK_WIDTH, y * TASK_HEIGHT)
            case DoubleClick(x=x, y=y):
                browser.click(x * TASK_WIDTH, y * TASK_HEIGHT, count=2)
            case RightClick(x=x, y=y):
                browser.click(x * TASK_WIDTH, y * TASK_HEIGHT, button="right")
            case Drag(x1=x1, y1=y1, x2=x2, y2=y2):
                browser.drag(x1 * TASK_WIDTH, y1 * TASK_HEIGHT, x2 * TASK_WIDTH, y2 * TASK_HEIGHT)
            case Type(text=text):
                browser.type_text(text)
            case Hotkey(keys=keys):
                try:
                    keys = tuple(key_name(k) for k in keys)
                except ValueError as exc:  # the policy's mistake, not a broken browser
                    return f"ignored: {exc}"
                browser.hotkey(keys)
            case Scroll(x=x, y=y, direction=direction, amount=amount):
                dx = {ScrollDirection.LEFT: -1, ScrollDirection.RIGHT: 1}.get(direction, 0) * amount * SCROLL_PX
                dy = {ScrollDirection.UP: -1, ScrollDirection.DOWN: 1}.get(direction, 0) * amount * SCROLL_PX
                browser.scroll(x * TASK_WIDTH, y * TASK_HEIGHT, dx, dy)
            case Wait(seconds=seconds):
                time.sleep(seconds)
            case _:  # finished / fail: nothing to do in the page
                return "ok"
        if self.config.settle_s:
            time.sleep(self.config.settle_s)
        return "ok"

    async def _run(self, func: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, func)
