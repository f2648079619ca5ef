"""A headless Chromium showing MiniWoB++ task pages, driven through Selenium (blocking calls).

Everything here blocks; :class:`~dart.env.miniwob.env.MiniWoBEnv` calls it from one worker thread
per instance. The task pages are the ``miniwob`` package's own HTML files, loaded by ``file://``
URL, so no network is needed beyond chromedriver on loopback.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.actions.action_builder import ActionBuilder
from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
from selenium.webdriver.common.keys import Keys

from dart.env.miniwob.dom import SNAPSHOT_JS, DomSnapshot
from dart.env.miniwob.errors import BrowserError
from dart.runtime.lifetime import reap_group_with_this_process, release_group

TASK_WIDTH = 160
"""Width of the MiniWoB++ task area (instruction bar and task), CSS pixels."""
TASK_HEIGHT = 210
"""Height of the MiniWoB++ task area, CSS pixels."""
SCROLL_PX = 50
"""Pixels per wheel click (MiniWoB++'s own default scroll amount)."""
_MOVE_MS = 10
"""Duration of each pointer move, milliseconds (Selenium's default of 250 makes every click slow)."""
_PARK_AT = (TASK_WIDTH + 10, 10)
"""Where the pointer rests between episodes: inside the page, right of the task area."""

CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--no-default-browser-check",
    "--mute-audio",
    "--hide-scrollbars",
    "--window-size=500,400",
)
"""Flags of every browser: headless, offline (no update/sync/metrics traffic), container-safe."""

_KEYS = {
    "ctrl": Keys.CONTROL,
    "control": Keys.CONTROL,
    "shift": Keys.SHIFT,
    "alt": Keys.ALT,
    "meta": Keys.META,
    "cmd": Keys.META,
    "super": Keys.META,
    "win": Keys.META,
    "enter": Keys.ENTER,
    "return": Keys.ENTER,
    "tab": Keys.TAB,
    "backspace": Keys.BACKSPACE,
    "delete": Keys.DELETE,
    "del": Keys.DELETE,
    "escape": Keys.ESCAPE,
    "esc": Keys.ESCAPE,
    "space": Keys.SPACE,
    "up": Keys.ARROW_UP,
    "down": Keys.ARROW_DOWN,
    "left": Keys.ARROW_LEFT,
    "right": Keys.ARROW_RIGHT,
    "home": Keys.HOME,
    "end": Keys.END,
    "pageup": Keys.PAGE_UP,
    "pagedown": Keys.PAGE_DOWN,
    "insert": Keys.INSERT,
    **{f"f{i}": getattr(Keys, f"F{i}") for i in range(1, 13)},
}


def html_dir() -> Path:
    """The directory of the ``miniwob`` package's task pages (``<dir>/<task>.html``)."""
    import miniwob  # type: ignore[import-untyped]  # deferred: it registers gymnasium envs on import

    return Path(miniwob.__file__).parent / "html" / "miniwob"


def find_binary(env_var: str, *names: str) -> str | None:
    """``$env_var`` if set, else the first of ``names`` on ``PATH``, else None."""
    if value := os.environ.get(env_var):
        return value
    for name in names:
        if path := shutil.which(name):
            return path
    return None


def key_name(name: str) -> str:
    """The WebDriver key for a :class:`~dart.protocol.messages.Hotkey` key name.

    Raises:
        ValueError: Not a known key name nor a single character.
    """
    lowered = name.lower()
    if lowered in _KEYS:
        return str(_KEYS[lowered])
    if len(name) == 1:
        return name
    raise ValueError(f"unknown key {name!r}: use a single character or one of {', '.join(sorted(_KEYS))}")


class Browser:
    """One Chromium + chromedriver pair showing one MiniWoB++ task page at a time.

    Lifecycle: ``Browser(...)`` launches the browser; :meth:`load` opens a task page;
    :meth:`begin` starts an episode on it (repeatable); :meth:`quit` ends the browser.
    Every method blocks and raises :class:`BrowserError` when the browser is gone.
    """

    def __init__(self, chrome: str, chromedriver: str, scale: int, episode_max_time_s: float) -> None:
        options = webdriver.ChromeOptions()
        options.binary_location = chrome
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--force-device-scale-factor={scale}")
        self.scale = scale
        self.episode_max_time_s = episode_max_time_s
        self.subdomain: str | None = None
        self._pages = html_dir()
        # chromedriver leads a group of its own that Chromium's processes join, and that group is killed
        # when this process ends, however it ends: a killed env service leaves no browser behind.
        service = ChromeService(executable_path=chromedriver, popen_kw={"start_new_session": True})
        try:
            # Both paths given: Selenium Manager never runs (it would try to download a driver).
            self.driver: Any = webdriver.Chrome(service=service, options=options)
        except Exception as exc:
            raise BrowserError(f"cannot start {chrome} with {chromedriver}: {exc}") from exc
        reap_group_with_this_process(self.driver_pid)
        self.driver.set_script_timeout(10)

    @property
    def driver_pid(self) -> int:
        """Process id of chromedriver (the browser is its child)."""
        return int(self.driver.service.process.pid)

    def load(self, subdomain: str) -> None:
        """Open the page of task ``subdomain`` (no-op when it is open already)."""
        if subdomain == self.subdomain:
            return
        page = self._pages / f"{subdomain}.html"
        if not page.is_file():
            raise BrowserError(f"no MiniWoB++ page {page}")
        self.subdomain = None
        self._call(self.driver.get, page.as_uri())
        deadline = time.monotonic() + 10.0
        while not self._script("return typeof core !== 'undefined' && !!document.getElementById('sync-task-cover');"):
            if time.monotonic() > deadline:
                raise BrowserError(f"the MiniWoB++ page {page} did not load")
            time.sleep(0.05)
        self.subdomain = subdomain

    def begin(self, seed: int | str) -> None:
        """End any running episode and start a new one with ``seed`` (MiniWoB++'s own protocol).

        The pointer is parked outside the task area first and the focus dropped: the page is reused between
        episodes of a task, and the last episode's pointer would otherwise hover over (and restyle) whatever
        the new episode puts under it, so the same task and seed would not always show the same first screen.
        """
        builder = ActionBuilder(self.driver, duration=0)
        builder.pointer_action.move_to_location(*_PARK_AT)  # type: ignore[no-untyped-call]
        self._call(builder.perform)
        self._script("if (document.activeElement) { document.activeElement.blur(); }")
        self._script("core.endEpisode(0);")
        self._script(f"Math.seedrandom({seed!r}); core.setDataMode('train');")
        self._script(f"core.EPISODE_MAX_TIME = {int(self.episode_max_time_s * 1000)};")
        self._script("core.startEpisodeReal();")
        deadline = time.monotonic() + 5.0
        while not self._script("return WOB_TASK_READY;"):
            if time.monotonic() > deadline:
                raise BrowserError(f"MiniWoB++ task {self.subdomain} did not become ready")
            time.sleep(0.05)

    def utterance(self) -> str:
        """The task's instruction."""
        response = self._script("return core.getUtterance();")
        return str(response["utterance"] if isinstance(response, dict) else response)

    def metadata(self) -> dict[str, Any]:
        """``done``, ``env_reward`` (time-discounted), ``raw_reward`` and ``reason`` of the episode."""
        result: dict[str, Any] = self._script(
            "return {done: WOB_DONE_GLOBAL, env_reward: WOB_REWARD_GLOBAL, "
            "raw_reward: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON};"
        )
        return result

    def snapshot(self) -> DomSnapshot:
        """The visible elements of the task area (for oracles only)."""
        return DomSnapshot.from_js(self._script(SNAPSHOT_JS))

    def screenshot(self) -> bytes:
        """The task area as PNG bytes, ``(160 * scale) x (210 * scale)`` pixels."""
        png: bytes = self._call(self.driver.get_screenshot_as_png)
        width, height = TASK_WIDTH * self.scale, TASK_HEIGHT * self.scale
        image = Image.open(io.BytesIO(png)).convert("RGB").crop((0, 0, width, height))
        out = io.BytesIO()
        image.save(out, format="PNG", compress_level=1)
        return out.getvalue()

    def click(self, x: float, y: float, *, button: str = "left", count: int = 1) -> None:
        """Click at task-area CSS pixel ``(x, y)``: ``button`` left or right, ``count`` 1 or 2."""
        builder = ActionBuilder(self.driver, duration=_MOVE_MS)
        pointer = builder.pointer_action.move_to_location(int(x), int(y))  # type: ignore[no-untyped-call]
        if button == "right":
            pointer.context_click()
        elif count == 2:
            pointer.double_click()
        else:
            pointer.click()
        self._call(builder.perform)

    def drag(self, x1: float, y1: float, x2: float, y2: float, steps: int = 5) -> None:
        """Press at ``(x1, y1)``, move to ``(x2, y2)`` in ``steps`` moves, release."""
        builder = ActionBuilder(self.driver, duration=_MOVE_MS)
        pointer = builder.pointer_action.move_to_location(int(x1), int(y1))  # type: ignore[no-untyped-call]
        pointer.pointer_down()
        for i in range(1, steps + 1):
            x, y = int(x1 + (x2 - x1) * i / steps), int(y1 + (y2 - y1) * i / steps)
            pointer.move_to_location(x, y)
        pointer.pointer_up()
        self._call(builder.perform)

    def type_text(self, text: str) -> None:
        """Type ``text`` at the keyboard focus; newlines press Enter.

        Characters beyond the Basic Multilingual Plane (emoji) are dropped: chromedriver cannot type them.
        """
        text = "".join(c for c in text if ord(c) <= 0xFFFF)
        self._call(ActionChains(self.driver, duration=_MOVE_MS).send_keys(text.replace("\n", Keys.ENTER)).perform)

    def hotkey(self, keys: tuple[str, ...]) -> None:
        """Press ``keys`` (WebDriver key codes, see :func:`key_name`) together; release in reverse."""
        codes = list(keys)
        chain = ActionChains(self.driver, duration=_MOVE_MS)
        for code in codes:
            chain.key_down(code)
        for code in reversed(codes):
            chain.key_up(code)
        self._call(chain.perform)

    def scroll(self, x: float, y: float, dx: int, dy: int) -> None:
        """Turn the wheel at ``(x, y)`` by ``(dx, dy)`` CSS pixels."""
        origin = ScrollOrigin.from_viewport(int(x), int(y))
        self._call(ActionChains(self.driver, duration=_MOVE_MS).scroll_from_origin(origin, dx, dy).perform)

    def quit(self) -> None:
        """End the browser and chromedriver (best effort, idempotent): whatever of their group is left is killed."""
        group = self.driver_pid
        try:
            self.driver.quit()
        except Exception:  # a crashed browser cannot quit cleanly; its driver process is gone anyway
            pass
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
        release_group(group)

    def _script(self, script: str) -> Any:
        return self._call(self.driver.execute_script, script)

    def _call(self, func: Any, *args: Any) -> Any:
        try:
            return func(*args)
        except BrowserError:
            raise
        except Exception as exc:
            raise BrowserError(f"browser call {getattr(func, '__name__', func)} failed: {exc}") from exc
