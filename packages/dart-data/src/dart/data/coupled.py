"""The synchronous batch-RL baseline's round: what the coupled emitter waits for.

Coupled mode (``emission.mode: coupled``) is the baseline DART's decoupling is measured against.
It runs in rounds; a round's lifecycle:

``emitting`` (B groups planned at the current policy version, every work item published) ->
``collecting`` (trajectories arrive and close their groups; nothing else is emitted) ->
``closed`` when every requested trajectory arrived, or ``work_timeout_s`` after emission (the
missing ones are counted as lost, and the round's groups still open are closed with what they
have) -> ``trained``: all the round's groups that survived the usual filters form ONE training
batch; an empty round skips training -> ``synced`` once the trainer put a newer model version in
the state bucket -> the next round is emitted at that version. Staleness is therefore always 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CoupledRound:
    """Book-keeping of one coupled round.

    Attributes:
        index: Round number, from 1.
        version: Policy version the round's work items require (``min_policy_version``).
        started_at: Clock reading when the round was emitted, seconds.
        expected: Trajectories requested per group id.
        received: Trajectories received per group id (new ones only; duplicates do not count).
    """

    index: int
    version: int
    started_at: float
    expected: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    @property
    def requested(self) -> int:
        """Trajectories requested by the round."""
        return sum(self.expected.values())

    @property
    def missing(self) -> int:
        """Trajectories requested and not yet received."""
        return sum(max(0, n - self.received.get(gid, 0)) for gid, n in self.expected.items())

    def add_group(self, group_id: str, size: int) -> None:
        """A group of the round is about to be published."""
        self.expected[group_id] = size

    def record(self, group_id: str) -> bool:
        """A new trajectory arrived; returns whether it belongs to this round."""
        if group_id not in self.expected:
            return False
        self.received[group_id] = self.received.get(group_id, 0) + 1
        return True

    def done(self) -> bool:
        """Whether every requested trajectory arrived."""
        return self.missing == 0

    def timed_out(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> bool:
        """Whether the round has waited ``timeout_s`` since it was emitted."""
        return clock() - self.started_at >= timeout_s
