"""A third-party package plugs into DART without editing it: an env backend, a suite source, an inference
engine, a trainer backend, a model family and a prompt format, each declared as an entry point of an
installed distribution, found by name from a run config, listed by ``dart doctor``, and used (the backend
serves an episode, the engines generate, the prompt is the plug-in's, the family's writer module is found).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = """
from dart.env.sim import SimConfig, SimEnv, sim_task
from dart.protocol.errors import ConfigError
from dart.policy.models import ModelFamily
from dart.protocol.suite import TaskSuite
from dart.policy.families.qwen2_5_vl import tiny_config, tiny_processor
from dart.policy.formats import DartFormat
from dart.rollout.service.scripted import ScriptedEngine
from dart.train.backend import TorchBackend

ARCHITECTURES = {}


class PlugFormat(DartFormat):
    name = "plugfmt"

    def system_prompt(self):
        return "You are the plug-in's agent."


FORMAT = PlugFormat()
FAMILY = ModelFamily(
    name="plugvl",
    model_types=("plug_vl",),
    model_class="Qwen2_5_VLForConditionalGeneration",
    processor_class="Qwen2_5_VLProcessor",
    patch_size=14,
    merge_size=2,
    writer="dartplug",
)


class PlugSim(SimEnv):
    name = "plugsim"


def backend(config, stream):
    return PlugSim(SimConfig(width=int(config.plugin["width"]), height=240), stream=stream)


def suites(name):
    if name != "two":
        raise ConfigError("run config", "suite", f"dartplug has no suite {name!r}")
    tasks = [sim_task("click-button", "easy", seed).model_copy(update={"backend": "plugsim"}) for seed in (1, 2)]
    return TaskSuite(name="plug-two", tasks=tuple(tasks))


async def engines(config, count):
    return {f"engine-{i}": ScriptedEngine([config.options["says"]]) for i in range(count)}


class Trainer(TorchBackend):
    pass
"""

ENTRY_POINTS = """
[dart.env_backends]
plugsim = dartplug:backend
[dart.suites]
plug = dartplug:suites
[dart.engines]
echo = dartplug:engines
[dart.trainer_backends]
plugtrain = dartplug:Trainer
[dart.prompt_formats]
plugfmt = dartplug:FORMAT
[dart.model_families]
plugvl = dartplug:FAMILY
"""


def _install_plugin(site: Path) -> None:
    (site / "dartplug.py").write_text(PLUGIN)
    info = site / "dartplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dartplug\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)


def test_a_third_party_package_plugs_in_every_kind(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site)
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(
            """
            suite: plug:two
            env: {backend: plugsim, pool: plug, plugin: {width: 320}}
            rollout:
              engine: {kind: echo, options: {says: "Action: wait()"}}
              num_engines: 2
              runner: {prompt: {format: plugfmt, family: plugvl}}
            train: {backend: {kind: plugtrain, options: {}}}
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import asyncio, json, sys
        from dart.cli.stack.config import load_run_config, load_tasks
        from dart.env.interface import ENV_BACKENDS
        from dart.rollout.engine.interface import ENGINES, GenerationRequest
        from dart.policy.families import writer_of
        from dart.policy.prompt import ChatPrompt, build_prompt
        from dart.train.interface import TRAINER_BACKENDS

        config = load_run_config({str(config)!r})
        assert "dartplug" not in sys.modules  # validating names imports no plug-in
        tasks = load_tasks(config)

        async def main():
            env = ENV_BACKENDS.get(config.env.backend)(config.env, 0)
            await env.start()
            observation, _ = await env.reset(tasks[0], seed=0)
            await env.close()
            engines = await ENGINES.get(config.rollout.engine.kind)(config.rollout.engine, config.rollout.num_engines)
            result = await engines["engine-1"].generate(GenerationRequest(ChatPrompt("hi")))
            return observation, engines, result

        observation, engines, result = asyncio.run(main())
        trainer = TRAINER_BACKENDS.get(config.train.backend.kind)
        prompt = config.rollout.runner.prompt
        chat = build_prompt("Click OK.", None, prompt_format=prompt.prompt_format(), chat=prompt.model_family().chat)
        print(json.dumps({{
            "system": chat.text.splitlines()[1],
            "writer": writer_of(prompt.model_family()).__name__,
            "tasks": [t.task_id for t in tasks],
            "width": observation.screenshot.width,
            "engines": sorted(engines),
            "text": result.text,
            "trainer": f"{{trainer.__module__}}.{{trainer.__name__}}",
            "world_size": config.train.backend.world_size,
        }}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out == {
        "system": "You are the plug-in's agent.<|im_end|>",
        "writer": "dartplug",
        "tasks": ["sim/click-button/easy/1", "sim/click-button/easy/2"],
        "width": 320,
        "engines": ["engine-0", "engine-1"],
        "text": "Action: wait()",
        "trainer": "dartplug.Trainer",
        "world_size": 1,
    }
    doctor = subprocess.run(
        [sys.executable, "-m", "dart.cli.main", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    checks = json.loads(doctor.stdout.strip().splitlines()[-1])["checks"]
    for group, name in [
        ("dart.env_backends", "plugsim = dartplug:backend (dartplug)"),
        ("dart.suites", "plug = dartplug:suites (dartplug)"),
        ("dart.engines", "echo = dartplug:engines (dartplug)"),
        ("dart.trainer_backends", "plugtrain = dartplug:Trainer (dartplug)"),
        ("dart.prompt_formats", "plugfmt = dartplug:FORMAT (dartplug)"),
        ("dart.model_families", "plugvl = dartplug:FAMILY (dartplug)"),
    ]:
        assert name in checks[group]["detail"], checks[group]
    assert "sim = dart.env.backends:sim (dart-env)" in checks["dart.env_backends"]["detail"]
