"""The rollout service: trajectory runners, engine router, weight sync, and the service itself.

Modules: :mod:`.config` (:class:`RolloutConfig` and its parts), :mod:`.env_client` (the env
lease client), :mod:`.runner` (:class:`TrajectoryRunner`), :mod:`.router` (:class:`EngineRouter`),
:mod:`.sync` (:class:`WeightSyncController`), :mod:`.service` (:class:`RolloutService`).
"""

from __future__ import annotations

from dart.rollout.service.config import RolloutConfig, RunnerConfig, SyncConfig
from dart.rollout.service.env_client import EnvClient
from dart.rollout.service.router import EngineRouter
from dart.rollout.service.runner import TrajectoryRunner, trajectory_id_for
from dart.rollout.service.service import RolloutService, RolloutStats
from dart.rollout.service.sync import EngineUpdate, WeightSyncController, fetch_weights, max_concurrent_updates

__all__ = [
    "EngineRouter",
    "EngineUpdate",
    "EnvClient",
    "RolloutConfig",
    "RolloutService",
    "RolloutStats",
    "RunnerConfig",
    "SyncConfig",
    "TrajectoryRunner",
    "WeightSyncController",
    "fetch_weights",
    "max_concurrent_updates",
    "trajectory_id_for",
]
