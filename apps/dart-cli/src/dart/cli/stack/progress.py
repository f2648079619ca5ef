"""Live progress of a run, read incrementally from the services' telemetry JSONL files."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunProgress:
    """Figures shown during a run, updated from new JSONL lines only (files are never re-read).

    Attributes:
        busy_ns: Busy nanoseconds per resource kind (env, engine, trainer) since the window start.
        resources: Resource ids seen per kind.
        last_events: The latest event of each name (``data.stats``, ``trainer.step`` ...).
        updates: Engine weight updates seen (``engine.update.end``).
    """

    telemetry_dir: Path
    window_start_ns: int = 0
    busy_ns: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    resources: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    last_events: dict[str, dict[str, Any]] = field(default_factory=dict)
    updates: int = 0
    _offsets: dict[Path, int] = field(default_factory=dict)

    def poll(self) -> None:
        """Read lines appended since the last poll."""
        if not self.telemetry_dir.is_dir():
            return
        for path in sorted(self.telemetry_dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1  # a partly written last line waits for the next poll
            self._offsets[path] = offset + end
            for line in chunk[:end].splitlines():
                try:
                    self._record(json.loads(line))
                except (ValueError, TypeError):
                    continue

    def _record(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "busy":
            rk = str(rec.get("resource_kind"))
            self.resources[rk].add(str(rec.get("resource_id")))
            start = max(int(rec["start_unix_ns"]), self.window_start_ns)
            self.busy_ns[rk] += max(0, int(rec["end_unix_ns"]) - start)
        elif kind == "event":
            name = str(rec.get("name"))
            self.last_events[name] = rec.get("attributes") or {}
            if name == "engine.update.end":
                self.updates += 1

    def utilization(self, kind: str, now_ns: int, count: int | None = None) -> float | None:
        """Busy fraction of a resource kind since the window start (None before any record)."""
        n = count or len(self.resources.get(kind, ()))
        wall = now_ns - self.window_start_ns
        if n == 0 or wall <= 0:
            return None
        return min(1.0, self.busy_ns.get(kind, 0) / (n * wall))
