"""The ``sim`` backend: a fast, deterministic simulated GUI drawn with Pillow.

A 224x224 (configurable) screen shows one window: a yellow instruction bar on top and widgets
below (buttons, text fields, check boxes, scrollable lists). Four task families generate tasks
from a seed (:mod:`~dart.env.sim.families`): ``click-button``, ``enter-text``, ``tick-boxes`` and
``select-item``; rewards are programmatic. An oracle (:mod:`~dart.env.sim.oracle`) solves every
task for warm-start demonstrations, and a latency model (:mod:`~dart.env.sim.latency`) makes
the env as slow as a real desktop when benchmarking.

Modules: ``widgets`` (the model), ``interaction`` (what actions do), ``render`` (Pillow),
``layout`` and ``vocab`` (task generation helpers), ``families``, ``oracle``, ``latency``,
``env`` (:class:`SimEnv`), ``catalog`` (suites).
"""

from __future__ import annotations

from dart.env.sim.catalog import (
    BUILTIN_SUITES,
    builtin_suite_path,
    generate_suite,
    load_builtin_suite,
    sim_task,
    sim_task_from_id,
)
from dart.env.sim.env import LatencySample, SimConfig, SimEnv
from dart.env.sim.families import DIFFICULTIES, FAMILIES, MAX_STEPS, Difficulty, FamilyName, SimTaskParams
from dart.env.sim.latency import (
    ConstantLatency,
    LatencyConfig,
    LatencyModel,
    LogNormalLatency,
    UniformLatency,
)

__all__ = [
    "BUILTIN_SUITES",
    "DIFFICULTIES",
    "FAMILIES",
    "MAX_STEPS",
    "ConstantLatency",
    "Difficulty",
    "FamilyName",
    "LatencyConfig",
    "LatencyModel",
    "LatencySample",
    "LogNormalLatency",
    "SimConfig",
    "SimEnv",
    "SimTaskParams",
    "UniformLatency",
    "builtin_suite_path",
    "generate_suite",
    "load_builtin_suite",
    "sim_task",
    "sim_task_from_id",
]
