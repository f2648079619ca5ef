"""dart.data: the DART data manager.

Ingests trajectories durably (SQL index + artifact-store blobs), keeps per-task statistics,
curates (dynamic rollout count and step budget, experience pool, staleness limit, high-entropy
step selection), forms GRPO groups into training batches and emits work with backpressure.

Example::

    from dart.data import DataConfig, DataService, load_task_suite

    async with DataService(DataConfig(), bus, store, load_task_suite("suite.yaml")) as service:
        ...
"""

from dart.data.config import (
    BatchingConfig,
    CoupledConfig,
    CurationConfig,
    DataConfig,
    DecoupledConfig,
    EmissionConfig,
    GroupingConfig,
    IngestConfig,
)
from dart.data.service import DataService, DataStats
from dart.data.tasks import load_task_suite

__version__ = "0.1.0"

__all__ = [
    "BatchingConfig",
    "CoupledConfig",
    "CurationConfig",
    "DataConfig",
    "DataService",
    "DataStats",
    "DecoupledConfig",
    "EmissionConfig",
    "GroupingConfig",
    "IngestConfig",
    "load_task_suite",
]
