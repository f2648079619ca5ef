"""Configuration of the env service (the backends it can host are in :data:`dart.env.interface.ENV_BACKENDS`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from dart.env.miniwob import MiniWoBConfig
from dart.env.osworld.config import OSWorldConfig
from dart.env.service.health import RecycleConfig
from dart.env.sim import SimConfig
from dart.protocol.config import ConfigModel
from dart.protocol.permissions import ENV_OP_TIMEOUT_MAX_S
from dart.protocol.subjects import Subjects
from dart.runtime.store.images import DEFAULT_PREFIX, DEFAULT_REFRESH_S


class EnvServiceConfig(ConfigModel):
    """One pool of env instances served over NATS by one process.

    Example (YAML)::

        env:
          pool: sim
          backend: sim
          instances: 16
          sim:
            latency: {step: {kind: lognormal, median_s: 0.5}}

    A crashed instance is replaced under the same id. With ``warm_spares`` > 0 the service keeps
    that many backends started ahead of need: a crashed slot takes a spare at once (leasable again
    as soon as the crashed backend is dropped, without waiting for a browser or desktop to start)
    and a new spare starts in the background.
    """

    pool: str = "sim"
    """Pool name: the lease subject is ``subjects.env_lease(pool)``."""
    backend: str = "sim"
    """Backend name, a key of :data:`dart.env.interface.ENV_BACKENDS` (``sim``, ``miniwob``, ``osworld``, or
    one another package registers)."""
    instances: int = Field(default=4, ge=1, le=4096)
    """Number of env instances this process hosts."""
    suites: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    """The suites whose tasks this pool runs, in the forms of a run config's ``suite`` (``builtin:<name>``,
    ``osworld:<dir>``, a suite file path), resolved on this host when the service starts. A reset names a
    task by its id and the pool runs its own copy of it: a task in none of these suites, or one whose body
    differs from the suite's, is refused (:mod:`dart.env.service.pool_tasks`). When this is empty, ``dart run``,
    ``dart serve`` and ``dart-env serve`` set the run config's ``suite``, and an evaluation's pool (held-out
    validation, ``dart eval``) the suite it evaluates. Empty: only the tasks the backend generates from their
    ids (the sim's and MiniWoB++'s); an OSWorld pool then runs none."""
    instance_prefix: str | None = None
    """Instance ids are ``<instance_prefix>-<i>``; defaults to the pool name. Processes sharing a
    pool must use distinct prefixes (the service refuses to start on an id already served)."""
    max_lease_ttl_s: float = Field(default=600.0, gt=0.0, le=3600.0)
    """Upper bound on a lease's lifetime without a heartbeat, seconds (requests ask for their own
    ``ttl_s``; larger values are capped so a vanished holder cannot pin an instance for long)."""
    heartbeat_interval_s: float = Field(default=10.0, gt=0.0, le=600.0)
    """Heartbeat interval suggested to holders, seconds (never more than a third of the lease ttl)."""
    reap_interval_s: float = Field(default=1.0, gt=0.0, le=60.0)
    """How often the reaper frees expired leases, seconds."""
    op_timeout_s: float = Field(default=120.0, gt=0.0, le=ENV_OP_TIMEOUT_MAX_S)
    """Deadline of one backend reset/step/evaluate, seconds; past it the instance counts as crashed."""
    max_consecutive_failures: int = Field(default=3, ge=1, le=1000)
    """Crashes and failed restarts in a row after which an instance slot is retired instead of
    restarted again (a circuit breaker against a backend that cannot run). A completed episode
    (a successful evaluate) resets the count."""
    restart_backoff_s: float = Field(default=1.0, ge=0.0, le=600.0)
    """Pause before retrying a failed restart, seconds (doubles with each further failure)."""
    warm_spares: int = Field(default=0, ge=0, le=256)
    """Backends kept started but unleased, to swap in for a crashed instance without a start wait
    (a Chromium or desktop start takes seconds). They are not counted as instances (their idle
    time is not in env utilization) and cost their memory while they wait."""
    recycle: RecycleConfig = Field(default_factory=RecycleConfig)
    """When an instance's backend is swapped for a fresh one between leases, before it rots: after a number
    of episodes, past a memory limit, or when its steps have slowed (:mod:`dart.env.service.health`).
    No limit by default."""
    inline_max_bytes: int | None = Field(default=16 * 1024, ge=0)
    """Largest screenshot PNG sent inside a reply, bytes. Larger ones are written to the artifact
    store (``<screenshot_prefix>/<sha256>.png``, once per distinct image) and sent as an ``ImageRef``,
    which keeps replies and trajectories far below ``bus.max_message_bytes``. Needs the service to
    have a store (``dart run`` / ``dart serve`` give it the run's); None sends every screenshot inline."""
    screenshot_prefix: str = DEFAULT_PREFIX
    """Key prefix of screenshots stored by reference."""
    screenshot_refresh_s: float = Field(default=DEFAULT_REFRESH_S, gt=0)
    """A stored screenshot is handed out by reference only while its last write is younger than this,
    seconds; an older one is written again first. The data manager's retention deletes unreferenced
    screenshots last written more than ``data.retention.image_grace_s`` ago, which must exceed this."""
    sim: SimConfig = Field(default_factory=SimConfig)
    """Settings of the ``sim`` backend."""
    miniwob: MiniWoBConfig = Field(default_factory=MiniWoBConfig)
    """Settings of the ``miniwob`` backend (Chromium paths, scale, episode time limit)."""
    osworld: OSWorldConfig = Field(default_factory=OSWorldConfig)
    """Settings of the ``osworld`` backend (provider, desktop, path mapping, network, timeouts)."""
    plugin: dict[str, Any] = Field(default_factory=dict)
    """Settings of a backend another package registers (its factory validates them); unused by the
    backends dart-env ships."""

    @field_validator("pool", "instance_prefix")
    @classmethod
    def _check_token(cls, value: str | None) -> str | None:
        if value is not None:
            # Both end up in subjects; reuse the one place that knows what a subject token is.
            Subjects().env_lease(value)
        return value

    @field_validator("backend")
    @classmethod
    def _registered(cls, backend: str) -> str:
        from dart.env.interface import ENV_BACKENDS  # the interface module refers to this one

        return ENV_BACKENDS.check_name(backend)

    @model_validator(mode="after")
    def _check_ids(self) -> EnvServiceConfig:
        Subjects().env_instance(self.pool, self.instance_id(self.instances - 1), "step")
        return self

    def instance_id(self, index: int) -> str:
        """The id of instance slot ``index``."""
        return f"{self.instance_prefix or self.pool}-{index}"
