"""The evaluation stack shared by ``dart eval`` and ``dart run``'s held-out validation.

It composes, in one process, what a policy evaluation needs: an env service hosting its own pool
(so evaluation never takes a training env slot), one engine of the kind the run's rollout engine
config (or an explicit eval engine config) says, on its device (hf) or as a vLLM server, and
:func:`dart.rollout.eval.evaluate` driving trajectory runners over the bus. No trainer and no
dart-data are involved; nothing is published. During ``dart run`` the held-out validator can
instead have the run's rollout service evaluate on its own engines (``dart.cli.stack.validation``).

A policy is named in one of three ways (:func:`resolve_policy`):

- a checkpoint directory (holds ``config.json``): evaluated as it is, version 0;
- a weights URI (``file://`` or ``s3://`` ``.../v<N>/model.safetensors``, or the
  ``model.safetensors.index.json`` of a sharded version, as dart-train publishes them, or the version's
  ``manifest.json``) plus the base checkpoint it was trained from;
- a run directory (holds ``config.yaml``) and a version: the run's version-0 policy with the
  version's published weights loaded (version 0: the policy itself; default: the newest).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from dart.protocol.errors import ConfigError
from dart.protocol.messages import ModelVersion, Sampling, TaskSpec
from dart.runtime.bus import Bus
from dart.runtime.store import ArtifactStore, StoreConfig, open_store, resolve_uri

if TYPE_CHECKING:
    from dart.cli.stack.config import RunConfig
    from dart.env.service import EnvService
    from dart.rollout.engine.interface import InferenceEngine
    from dart.rollout.eval import EvalReport
    from dart.rollout.service.config import EngineConfig

WEIGHTS_PREFIX = "weights"
_VERSION_KEY = re.compile(rf"^{WEIGHTS_PREFIX}/v(\d+)/manifest\.json$")


@dataclass(frozen=True)
class Policy:
    """A policy to evaluate: a checkpoint, and optionally published weights loaded over it.

    Attributes:
        base: The checkpoint directory the engine loads (architecture, processor, weights).
        weights: Published weights to load over ``base``; None evaluates ``base`` as it is.
        store: Where ``weights`` are read from (``s3://`` endpoint and credentials).
    """

    base: Path
    weights: ModelVersion | None = None
    store: StoreConfig | None = None

    @property
    def version(self) -> int:
        """Policy version: that of the weights, 0 for the bare checkpoint."""
        return self.weights.version if self.weights else 0


def published_versions(store: StoreConfig) -> list[int]:
    """Versions with a manifest in the store (``weights/v<N>/manifest.json``), ascending."""
    with open_store(store) as s:
        found = {int(m.group(1)) for info in s.list(f"{WEIGHTS_PREFIX}/") if (m := _VERSION_KEY.match(info.key))}
    return sorted(found)


def published_version(store: StoreConfig, version: int) -> ModelVersion:
    """The announcement of a published version, rebuilt from its manifest in the store.

    Raises:
        ConfigError: The store has no such version.
    """
    return _from_manifest(store.uri.rstrip("/") + f"/{WEIGHTS_PREFIX}/v{version}/manifest.json", store)


def _from_manifest(manifest_uri: str, store: StoreConfig | None) -> ModelVersion:
    from dart.protocol.weights import WeightManifest

    try:
        s, key = resolve_uri(manifest_uri, store)
        with s:
            body = s.get(key)
        manifest = WeightManifest.model_validate_json(body)
    except Exception as exc:  # the store's own errors vary by backend; all mean "not readable"
        raise ConfigError("policy", "weights", f"cannot read manifest {manifest_uri}: {exc}") from None
    return ModelVersion(
        version=manifest.version,
        uri=manifest.weights_uri,
        sha256=manifest.sha256,
        manifest_uri=manifest_uri,
        manifest_sha256=hashlib.sha256(body).hexdigest(),
        shards=max(1, len(manifest.shards)),
        size_bytes=manifest.size_bytes,
        trainer_step=manifest.trainer_step,
        base_model=manifest.base_model,
        created_at=manifest.created_at,
    )


def resolve_policy(
    target: str, *, base: Path | None = None, version: int | None = None, store: StoreConfig | None = None
) -> tuple[Policy, RunConfig | None]:
    """Turn what the user named into a :class:`Policy` (see the module docstring).

    Returns:
        The policy, and the run's config when ``target`` is a run directory.

    Raises:
        ConfigError: ``target`` is none of the three forms, a URI without ``base``, or a version the
            run did not publish.
    """
    if "://" in target:
        if base is None:
            raise ConfigError("policy", "base", f"{target} is a weights URI: give --base, the checkpoint it belongs to")
        manifest_uri = target if target.endswith("manifest.json") else target.rsplit("/", 1)[0] + "/manifest.json"
        return Policy(base=base, weights=_from_manifest(manifest_uri, store), store=store), None
    path = Path(target)
    if (path / "config.yaml").is_file():
        from dart.cli.stack.config import load_run_config, store_config

        config = load_run_config(path / "config.yaml")
        if config.rollout.engine is None or config.rollout.engine.model_path is None:
            raise ConfigError("policy", "run", f"{path}/config.yaml has no rollout.engine: is it a finished run?")
        base = Path(config.rollout.engine.model_path)
        run_store = store_config(config)
        available = published_versions(run_store)
        chosen = version if version is not None else max(available, default=0)
        if chosen == 0:
            return Policy(base=base, store=run_store), config
        if chosen not in available:
            raise ConfigError("policy", "version", f"run {path} published versions {available}, not {chosen}")
        return Policy(base, published_version(run_store, chosen), run_store), config
    if (path / "config.json").is_file():
        return Policy(base=path), None
    raise ConfigError(
        "policy",
        "target",
        f"{target} is not a checkpoint directory (config.json), a run directory (config.yaml) or a weights URI",
    )


async def start_engine(
    config: RunConfig,
    policy: Policy,
    *,
    engine_config: EngineConfig | None = None,
) -> InferenceEngine:
    """One engine serving ``policy``, of the kind ``engine_config`` says (default: the run's rollout engine).

    An hf engine loads ``policy.base`` on its configured device and dtype; a vLLM engine is launched as
    the run launched its servers (or attached to the first ``attach`` URL). Either then loads the
    published weights through the rollout service's own fetch (sha256-verified), exactly as a rollout
    engine takes a new version. Nothing falls back to another kind or device.
    """
    from dart.rollout.engine.hf_config import HFEngineConfig
    from dart.rollout.engine.interface import ENGINES

    chosen = engine_config or config.rollout.engine or HFEngineConfig()
    engine_cfg = chosen.serving(str(policy.base), num_threads=config.run.torch_threads, single=True)
    (engine,) = (await ENGINES.get(engine_cfg.kind)(engine_cfg, 1)).values()
    if policy.weights is not None:
        try:
            await load_version(engine, policy.weights, policy.store)
        except BaseException:
            await engine.close()
            raise
    return engine


async def load_version(engine: InferenceEngine, version: ModelVersion, store: StoreConfig | None) -> None:
    """Fetch a published version's weights (every shard sha256-verified) and load them into ``engine``."""
    from dart.rollout.service.sync import fetch_weights

    path = await fetch_weights(version, store_config=store)
    await engine.update_weights(path, version.version)


class EvalEnv:
    """An env service hosting its own pool in this process, for evaluation episodes.

    Lifecycle: ``created --__aenter__--> serving`` (``pool`` leasable on ``bus``) ``--__aexit__-->
    stopped``. The pool name keeps its instances apart from any training pool on the same bus.

    Args:
        config: The run config (its ``env`` section gives the backend and its settings).
        bus: A connected bus.
        pool: Pool name of the evaluation instances.
        suite: The suite evaluated (a run config's ``suite`` form): the pool runs its tasks only (``env.suites``).
        also: Further suites the pool runs (the training suite, when validation checks it too).
        instances: How many env instances to host.
        store: Where screenshots above ``env.inline_max_bytes`` go (by reference, as in training); None
            sends every screenshot inline.
    """

    def __init__(
        self,
        config: RunConfig,
        bus: Bus,
        *,
        pool: str,
        suite: str,
        instances: int,
        store: StoreConfig | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        self.pool = pool
        self._env_config = config.env.model_copy(
            update={"pool": pool, "instance_prefix": pool, "instances": instances, "suites": (suite, *also)}
        )
        self._bus = bus
        self._store_config = store
        self._store: ArtifactStore | None = None
        self._service: EnvService | None = None

    async def __aenter__(self) -> EvalEnv:
        from dart.env.service import EnvService

        if self._store_config is not None:
            self._store = await asyncio.to_thread(open_store, self._store_config)
        self._service = EnvService(self._env_config, self._bus, store=self._store)
        await self._service.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._service is not None:
            await self._service.stop()
            self._service = None
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
            self._store = None


async def evaluate_policy(
    config: RunConfig,
    bus: Bus,
    engine: InferenceEngine,
    tasks: Sequence[TaskSpec],
    *,
    pool: str,
    episodes_per_task: int,
    sampling: Sampling,
    concurrency: int,
    label: str,
    store: StoreConfig | None = None,
) -> EvalReport:
    """Run :func:`dart.rollout.eval.evaluate` with ``engine`` on the env pool ``pool``.

    ``store`` is where screenshots sent by reference are read (the :class:`EvalEnv`'s store).

    The runners use the run's ``rollout.runner`` settings (prompt images, token budget) with
    ``pool`` as their env pool, so an episode is built exactly as in training.
    """
    from dart.rollout.eval import evaluate
    from dart.rollout.service.images import ImageCache
    from dart.rollout.service.router import EngineRouter

    runner_config = config.rollout.runner.model_copy(update={"pool": pool})
    router = EngineRouter({"eval-engine": engine})
    images = ImageCache(store)
    try:
        return await evaluate(
            bus,
            router,
            runner_config,
            tasks,
            episodes_per_task=episodes_per_task,
            sampling=sampling,
            concurrency=concurrency,
            label=label,
            images=images,
        )
    finally:
        await asyncio.to_thread(images.close)
