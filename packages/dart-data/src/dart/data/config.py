"""Configuration of the data manager, one model per concern, composed into :class:`DataConfig`.

Example (YAML, the ``data:`` section of a run file)::

    data:
      database_url: sqlite:///runs/r1/data.sqlite3
      ingest: {fetch_batch: 16, upload_concurrency: 8}
      grouping: {timeout_s: 120, max_staleness: 4}
      curation: {min_rollouts: 4, max_rollouts: 8}
      emission: {mode: decoupled, decoupled: {max_outstanding: 64}}
      batching: {min_samples: 64}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dart.protocol.config import ConfigModel
from dart.protocol.messages import Sampling


class IngestConfig(ConfigModel):
    """Trajectory ingestion (:class:`dart.data.ingest.Ingestor`)."""

    fetch_batch: int = Field(default=16, ge=1)
    """Trajectories fetched from the stream at once."""
    upload_concurrency: int = Field(default=8, ge=1)
    """Screenshots of one trajectory uploaded to the store at once."""
    retry_delay_s: float = Field(default=1.0, gt=0)
    """How long the stream waits before redelivering a trajectory whose storing failed, seconds."""


class GroupingConfig(ConfigModel):
    """How trajectories form GRPO groups (see :class:`dart.data.groups.GroupAssembler`)."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Close an incomplete group this long after its first trajectory at the earliest, seconds; longer when
    the task's episodes may take longer (``episode_slack``)."""
    episode_slack: float = Field(default=2.0, ge=0)
    """An incomplete group waits at least this many times the longest episode its task's step budget
    allows at the observed step time (the 90th percentile of recent trajectories' seconds per step), so
    the slow members of long desktop episodes (mostly failures, which run to the budget) are not dropped
    as late; 0 keeps ``timeout_s`` alone."""
    min_group_size: int = Field(default=2, ge=1)
    """Smallest group worth training on after filtering."""
    max_staleness: int | None = Field(default=4, ge=0)
    """Largest accepted policy lag in versions; None disables the limit (and work items then carry
    ``min_policy_version = 0``)."""
    drop_zero_variance: bool = True
    """Drop groups whose rewards are all equal (every advantage would be zero)."""
    poll_interval_s: float = Field(default=0.5, gt=0)
    """How often open groups are checked for timeouts and staleness, seconds."""


class BranchingConfig(ConfigModel):
    """Branching rollouts (:mod:`dart.data.branching`): fork finished episodes at their most uncertain steps."""

    enabled: bool = False
    """Ask for branches of every trainable rollout of a group (only where the env pool reports ``fork``)."""
    max_points: int = Field(default=1, ge=1, le=16)
    """Most branch points per trajectory (B): its steps with the highest uncertainty."""
    continuations: int = Field(default=2, ge=1, le=64)
    """Branches sampled at each branch point (K); with the parent they are the point's siblings."""
    min_quantile: float | None = Field(default=None, ge=0, le=1)
    """Only steps whose uncertainty is at or above this quantile of the trajectory's steps may be branch
    points (None: the ``max_points`` highest, whatever their rank)."""
    min_step: int = Field(default=1, ge=1, le=999)
    """Earliest step that may be a branch point (a branch at step 0 would be another rollout from the start)."""


class CurationConfig(ConfigModel):
    """Adaptive data curation (DART-GUI section 3): each feature can be switched off on its own."""

    dynamic_rollouts: bool = True
    """Vary the rollout count per task with its success rate (off: always ``default_rollouts``)."""
    default_rollouts: int = Field(default=8, ge=1, le=1024)
    """Rollouts per group for tasks without enough history, or when ``dynamic_rollouts`` is off."""
    min_rollouts: int = Field(default=4, ge=1, le=1024)
    """Fewest rollouts per group (solved and hopeless tasks)."""
    max_rollouts: int = Field(default=8, ge=1, le=1024)
    """Most rollouts per group (tasks with a success rate near 0.5, where GRPO learns most)."""
    min_attempts: int = Field(default=4, ge=0)
    """Attempts a task needs before its statistics steer rollout count and length."""
    stats_window: int = Field(default=32, ge=1)
    """Recent outcomes (and successful lengths) kept per task."""

    dynamic_max_steps: bool = True
    """Derive each task's step budget from its successful trajectories' lengths."""
    max_steps_margin: float = Field(default=0.5, ge=0)
    """Relative headroom over the longest recent success (0.5: 50 % more steps)."""
    max_steps_floor: int = Field(default=2, ge=1, le=1000)
    """Smallest step budget ever given."""
    max_steps_ceiling: int | None = Field(default=None, ge=1, le=1000)
    """Largest step budget ever given; None uses each task's own ``max_steps``."""

    experience_pool: bool = True
    """Fill a hard task's all-failure group with a stored success so the group has reward variance."""
    hard_task_threshold: float = Field(default=0.3, ge=0, le=1)
    """A task whose success rate is below this is hard: its successes are pooled."""
    pool_size_per_task: int = Field(default=4, ge=1)
    """Successes kept per task in the pool (newest first)."""

    branching: BranchingConfig = Field(default_factory=BranchingConfig)
    """Branching rollouts: sibling continuations from a trajectory's uncertain steps (off by default)."""

    @model_validator(mode="after")
    def _ordered(self) -> CurationConfig:
        if self.min_rollouts > self.max_rollouts:
            raise ValueError(f"min_rollouts ({self.min_rollouts}) must be <= max_rollouts ({self.max_rollouts})")
        return self


class DecoupledConfig(ConfigModel):
    """The decoupled emitter (:class:`dart.data.emit.DecoupledEmitter`): work with backpressure."""

    max_outstanding: int = Field(default=64, ge=1)
    """Most trajectories requested but not yet received; a whole group is emitted at once, so a
    group larger than this is emitted only when nothing is outstanding."""
    poll_interval_s: float = Field(default=0.2, gt=0)
    """How often a waiting emitter re-checks the outstanding count and the trainer's backlog, seconds."""
    max_queued_batches: int | None = Field(default=2, ge=0)
    """Pause emission while more than this many batches wait untrained on the ``batch`` stream (the one
    in training included), so little work is generated for a trainer that cannot keep up: each queued
    batch ages the ones behind it by about one version per ``train.publish_every`` optimizer steps.
    None never pauses (the trainer still drops samples beyond ``grouping.max_staleness``)."""


class CoupledConfig(ConfigModel):
    """The coupled emitter (:class:`dart.data.coupled.CoupledEmitter`), the synchronous baseline."""

    tasks_per_round: int = Field(default=8, ge=1)
    """Groups (tasks) per round, B; a round requests B x the rollout count of each group
    (``curation.default_rollouts`` unless ``dynamic_rollouts`` varies it)."""
    sync_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the model version trained on a round before emitting the next round at
    the old version anyway (logged and counted as ``sync_timeouts``), seconds."""


class EmissionConfig(ConfigModel):
    """Work-item emission: what both emitters share, and each one's own settings."""

    enabled: bool = True
    """Emit work items (off: some other component feeds the rollout service)."""
    mode: Literal["decoupled", "coupled"] = "decoupled"
    """``decoupled`` keeps the rollout service saturated (settings in ``decoupled``); ``coupled`` is
    the synchronous batch-RL baseline (settings in ``coupled``): rounds of ``coupled.tasks_per_round``
    groups, a barrier until every trajectory of the round arrived, one training batch per round, and
    the next round only after the trainer published a new version (see :mod:`dart.data.coupled`).
    Coupled work items require the current version whatever ``grouping.max_staleness`` says, and the
    trainer must publish after every batch (``train.publish_every: 1``)."""
    work_timeout_s: float = Field(default=900.0, gt=0)
    """Stop waiting for a group's missing trajectories this long after emission (a runner that died
    for good must not stall emission forever); in coupled mode, the round's barrier timeout."""
    sampling: Sampling = Field(default_factory=Sampling)
    """How the policy samples (temperature, top-p): put on every work item, so the rollout engines
    sample with exactly this and record it on each step for the trainer."""
    max_groups: int | None = Field(default=None, ge=0)
    """Stop after emitting this many groups; None walks the task list forever."""
    max_env_steps: int | None = Field(default=None, ge=1)
    """Stop emitting work (groups and branches) once the stored trajectories took this many env steps (their
    steps, plus the actions a fork replayed); work in flight still comes back. An equal env budget for runs
    that spend it differently (the ablation's branching row); None: no budget."""
    seed: int = 0
    """Seed of the task order: each pass over the task list is a permutation drawn from this seed
    and the pass number (see :class:`dart.data.work.WorkPlanner`), the same on every run with the
    same seed, including after a data-manager restart (which starts again at the first pass)."""
    decoupled: DecoupledConfig = Field(default_factory=DecoupledConfig)
    coupled: CoupledConfig = Field(default_factory=CoupledConfig)


class BatchingConfig(ConfigModel):
    """Training-batch formation."""

    min_samples: int = Field(default=32, ge=1)
    """Publish a batch once it holds at least this many step samples..."""
    max_groups: int = Field(default=16, ge=1)
    """...or this many groups, whichever comes first. Groups are never split across batches."""
    scale_by_std: bool = True
    """Divide advantages by the group's reward std (GRPO); False keeps only the mean baseline."""
    advantage_eps: float = Field(default=1e-6, gt=0)
    """Added to the std before dividing."""


class RetentionConfig(ConfigModel):
    """What trajectory blobs and screenshots the data manager deletes (see :mod:`dart.data.retention`).

    A trajectory's objects (its JSON and the images under its directory) are deleted once nothing
    can need them for training: its group was dropped, or every batch that carried it (its own, and
    any that replayed it from the experience pool) was acked by the trainer; it is not in the
    experience pool; and it is older than the kept versions. Its index row stays (``pruned_at`` set).
    Screenshots the env service stored by reference are deleted when no stored trajectory refers to
    them and they were last written more than ``image_grace_s`` ago.
    """

    enabled: bool = True
    """Delete what is not kept; False keeps every object."""
    keep_versions: int = Field(default=4, ge=0)
    """Keep trajectories whose newest step came from one of the newest ``keep_versions`` policy
    versions (for looking at recent behaviour), whatever the trainer did with them."""
    keep_every: int | None = Field(default=50, ge=1)
    """Also keep trajectories whose newest step's version is divisible by this (a sparse history to
    look back at); None keeps no extra ones."""
    interval_s: float = Field(default=60.0, gt=0)
    """How often a retention pass runs, seconds."""
    image_grace_s: float = Field(default=3600.0, gt=0)
    """Delete an unreferenced screenshot only when it was last written longer ago than this, seconds
    (counted back from the request of the oldest episode still awaited, where this data manager emits
    the work). Must exceed the env service's ``screenshot_refresh_s`` plus the longest time from a step's
    observation (from a trajectory's end, where this data manager emits the work) to its trajectory's
    ingestion, or a trajectory still on its way can lose an image."""
    screenshot_prefix: str = "screenshots"
    """Key prefix the env service stores screenshots under (its ``screenshot_prefix``)."""
    max_per_pass: int = Field(default=2000, ge=1)
    """Most trajectories deleted in one pass (the rest wait for the next)."""


class DataConfig(ConfigModel):
    """Configuration of the data manager service."""

    database_url: str = "sqlite:///dart-data.sqlite3"
    """SQLAlchemy URL of the index (SQLite embedded, ``postgresql+psycopg://...`` in the stack)."""
    blob_prefix: str = "trajectories"
    """Artifact-store key prefix of trajectory blobs (``<prefix>/<trajectory_id>/...``)."""
    stats_interval_s: float = Field(default=10.0, gt=0)
    """How often a ``data.stats`` telemetry event is written, seconds."""
    env_pool: str = Field(default="sim", pattern=r"^[A-Za-z0-9_-]+$")
    """The env pool whose capabilities decide which of the suite's tasks are emitted, when the tasks name
    requirements (OSWorld tasks: ``app:chrome`` ...); in a run config it is ``env.pool``."""
    capabilities_timeout_s: float = Field(default=120.0, gt=0)
    """How long to wait at start for the env pool to say what it runs, seconds (its env service may still be
    starting its VMs)."""
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    grouping: GroupingConfig = Field(default_factory=GroupingConfig)
    curation: CurationConfig = Field(default_factory=CurationConfig)
    emission: EmissionConfig = Field(default_factory=EmissionConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)

    @model_validator(mode="after")
    def _branching_decoupled(self) -> DataConfig:
        if self.curation.branching.enabled and self.emission.mode == "coupled":
            raise ValueError(
                "curation.branching needs emission.mode: decoupled (a coupled round is formed before branches "
                "of its rollouts could come back)"
            )
        return self
