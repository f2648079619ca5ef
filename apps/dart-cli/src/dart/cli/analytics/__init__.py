"""Run analytics read back from telemetry JSONL files, used by ``dart run``'s summary, ``dart
report`` and the benchmarks (not by the services, so they live here rather than in dart-runtime).

:mod:`.busy_report`: per-resource utilization; :mod:`.idle`: where each resource's time went.
"""

from dart.cli.analytics.busy_report import ResourceUtilization, resource_utilization
from dart.cli.analytics.idle import IdleBreakdown, idle_breakdown, idle_breakdown_from_dir

__all__ = [
    "IdleBreakdown",
    "ResourceUtilization",
    "idle_breakdown",
    "idle_breakdown_from_dir",
    "resource_utilization",
]
