"""The desktop's VM server process: OSWorld's HTTP protocol on a local X display, plus DART's ``/dart/`` routes.

Run as a process, one per desktop::

    python -m dart.env.desktop.server --display :N --port 0 --home DIR [--home-template DIR] [--desktop-user NAME]

It reads its token from the first line of stdin (never argv or the environment: the desktop's user must
not read it in ``/proc``), or with ``--token-env NAME`` from that variable (in a container, where the
launcher has no stdin to write to; the variable is not passed on), and answers only requests carrying
``Authorization: Bearer <token>`` (``GET /dart/health`` excepted). Once listening it writes one JSON line
``{"port": P}`` to stdout (``--port 0`` picks a free port).
The routes are :mod:`dart.env.desktop.routes`, served by :mod:`dart.env.desktop.httpd`. The process
exits on SIGTERM, and when ``--parent-pid`` is gone (taking ``--reap-group`` process groups and
``--reap-dir`` along).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dart.env.desktop.errors import DesktopError
from dart.env.desktop.httpd import BearerToken, serve
from dart.env.desktop.routes import DesktopRoutes
from dart.env.desktop.sandbox import resolve_desktop_user

OPEN_PATHS = ("/dart/health",)
"""Routes answered without the token: liveness and screen size, nothing the agent could use."""


def _watch_parent(parent_pid: int, stop: Callable[[], None]) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            stop()
            return
        if os.getppid() != parent_pid:
            stop()
            return


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, open the display, serve until killed."""
    parser = argparse.ArgumentParser(prog="python -m dart.env.desktop.server", description=__doc__.split("\n")[0])
    parser.add_argument("--display", required=True, help="X display, e.g. :1")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--home", default=None, help="the desktop's HOME (default: this process's HOME)")
    parser.add_argument("--home-template", default=None, help="directory HOME is reset to on /dart/revert")
    parser.add_argument("--desktop-user", default="nobody", help="account commands run as when this process is root")
    parser.add_argument("--python", default=sys.executable, help="interpreter of /run_python (the desktop's python3)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument(
        "--reap-group",
        type=int,
        action="append",
        default=[],
        help="process group to kill too when the parent is gone (Xvfb, window manager); repeatable",
    )
    parser.add_argument("--token-env", default=None, help="read the token from this variable instead of stdin")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.add_argument("--reap-dir", default=None, help="directory to remove too when the parent is gone")
    args = parser.parse_args(argv)
    token = os.environ.pop(args.token_env, "") if args.token_env else sys.stdin.readline()
    if not token.strip():
        where = f"set {args.token_env}" if args.token_env else "write it as the first line of its stdin"
        print(f"error: the server needs a token: {where}", file=sys.stderr)
        return 2

    home = Path(args.home or os.path.expanduser("~")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(home)
    os.environ["DISPLAY"] = args.display
    template = Path(args.home_template).resolve() if args.home_template else None
    try:
        desk = DesktopRoutes(args.display, home, template, resolve_desktop_user(args.desktop_user), args.python)
    except DesktopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    httpd = serve(
        desk.router(), args.host, args.port, token=BearerToken(token.strip(), OPEN_PATHS), verbose=args.verbose
    )

    stopping = threading.Event()

    def stop() -> None:
        if stopping.is_set():
            return
        stopping.set()
        desk.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=stop, daemon=True).start())

    def orphaned() -> None:
        # The owner died without closing us (e.g. kill -9): take its Xvfb and window manager along.
        desk.close()
        for group in args.reap_group:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(group, sig)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.2)
        if args.reap_dir:
            shutil.rmtree(args.reap_dir, ignore_errors=True)
        stop()

    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid, orphaned), daemon=True).start()
    print(json.dumps({"port": httpd.server_address[1]}), flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        desk.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
