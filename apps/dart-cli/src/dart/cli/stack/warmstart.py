"""Warm start: supervised training on oracle demonstrations from the run's env backend.

The paper starts RL from a capable base model (UI-TARS-1.5-7B). A random tiny model has no such
start, so before RL the policy imitates an oracle: any backend whose
:meth:`~dart.env.interface.EnvBackend.oracle_action` knows the next correct action (the sim, the
MiniWoB++ tasks with scripted solvers) records demonstrations with the exact prompt builder and
tokenization the rollout engines use, then the trainer's SFT step minimizes their response NLL.
The result is saved as a checkpoint that engines and trainer load as policy version 0.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dart.cli.stack.warmstart_guard import WarmStartGuard
from dart.cli.stack.warmstart_threads import ThreadChooser
from dart.env.service.config import EnvServiceConfig
from dart.policy.config import PromptConfig
from dart.protocol.errors import ConfigError
from dart.protocol.messages import TaskSpec

if TYPE_CHECKING:
    from dart.cli.stack.config import RunConfig


async def record_demos(
    tasks: Sequence[TaskSpec],
    processor: Any,
    *,
    env_config: EnvServiceConfig,
    episodes_per_task: int,
    prompt: PromptConfig,
    seed: int,
) -> tuple[list[Any], int]:
    """Roll out the backend's oracle on every task and tokenize each step as the rollout engine would.

    The backend is built through the env service's registry from the run's ``env`` section (the
    sim's simulated latency switched off), so demonstrations come from the same backend, with the
    same settings, that the RL phase runs on.

    Returns:
        The demonstration steps and the number of episodes recorded.

    Raises:
        ConfigError: The backend's oracle produced no demonstration for any task (it has none:
            disable ``warm_start``, or use tasks with an oracle).
    """
    from dart.env.interface import ENV_BACKENDS
    from dart.env.sim import LatencyConfig
    from dart.policy.action_grammar import format_output
    from dart.policy.prompt import HistoryStep, build_prompt, encode_prompt, to_pil
    from dart.policy.screen import coordinate_scale
    from dart.train.sft import SftSample

    quiet = env_config.model_copy(
        update={"sim": env_config.sim.model_copy(update={"latency": LatencyConfig(scale=0.0)})}
    )
    env = ENV_BACKENDS.get(env_config.backend)(quiet, 0)
    sizing = prompt.image_sizing()
    prompt_format, space, chat = prompt.prompt_format(), prompt.space(), prompt.model_family().chat
    end = processor.tokenizer.convert_tokens_to_ids(chat.end_of_turn)
    demos: list[SftSample] = []
    episodes = 0
    try:
        await env.start()
        for rep in range(episodes_per_task):
            for task in tasks:
                observation, instruction = await env.reset(task, seed=seed + rep)
                history: list[HistoryStep] = []
                for _ in range(task.max_steps):
                    step = env.oracle_action()
                    if step is None:
                        break
                    thought, action = step
                    shown = to_pil(observation.screenshot, sizing) if observation.screenshot is not None else None
                    rendered = build_prompt(
                        instruction,
                        shown,
                        history,
                        max_images=prompt.max_images,
                        image_size=sizing,
                        prompt_format=prompt_format,
                        coordinates=space,
                        chat=chat,
                    )
                    encoded = encode_prompt(processor, rendered)
                    scale = coordinate_scale(space, shown.size if shown is not None else None)
                    text = format_output(thought, action, scale)
                    response = processor.tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
                    demos.append(SftSample(list(encoded.input_ids), list(response), list(rendered.images)))
                    history.append(HistoryStep(text, shown))
                    observation, done, _ = await env.step(action)
                    if done:
                        break
                episodes += 1
    finally:
        await env.close()
    if not demos:
        raise ConfigError(
            "run config",
            "warm_start.enabled",
            f"the {env_config.backend} backend's oracle gave no demonstration for any of {len(tasks)} task(s): "
            "use tasks that have an oracle, or set warm_start.enabled: false",
        )
    return demos, episodes


def write_tiny_policy(config: RunConfig, tasks: Sequence[TaskSpec], base: Path) -> None:
    """Write the tiny random checkpoint ``dart run`` starts from when ``model.path`` is unset into ``base``; its
    tokenizer is trained on the default instructions and ``tasks``' own."""
    from dart.policy.tiny import DEFAULT_INSTRUCTIONS, write_tiny_checkpoint
    from dart.policy.tiny_spec import TinyModelSpec

    texts = list(DEFAULT_INSTRUCTIONS) + [t.instruction for t in tasks if t.instruction]
    spec = TinyModelSpec(family=config.model.family)
    write_tiny_checkpoint(base, seed=config.model.tiny_seed, vocab_texts=texts, spec=spec)


def load_for_sft(config: RunConfig, tasks: Sequence[TaskSpec], base: Path) -> tuple[Any, list[Any], int]:
    """The single-process torch backend the warm start trains (every weight of ``base``, at ``warm_start.lr``)
    and the oracle's demonstrations of ``tasks`` (:func:`record_demos`); returns (backend, demos, episodes)."""
    import asyncio

    from dart.train.backend import TorchBackend

    ws = config.warm_start
    # Every weight of the tiny policy learns the GUI from demonstrations; train.lora applies to RL after it.
    backend = TorchBackend.load(config.train.model_copy(update={"model_path": str(base), "lr": ws.lr, "lora": None}))
    demos, episodes = asyncio.run(
        record_demos(
            tasks,
            backend.processor,
            env_config=config.env,
            episodes_per_task=ws.episodes_per_task,
            prompt=config.rollout.runner.prompt.resolved(base),
            seed=config.run.seed,
        )
    )
    return backend, demos, episodes


def run_sft(
    backend: Any,
    demos: Sequence[Any],
    *,
    steps: int,
    batch_size: int,
    guard: WarmStartGuard,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
    threads: ThreadChooser | None = None,
) -> tuple[int, float, float]:
    """SFT steps on random mini-batches of demos until ``steps`` are taken or ``guard`` stops them (its
    ``cut_by`` then says why), each on the thread count ``threads`` sets; returns (steps taken, first loss,
    last loss)."""
    from dart.train.sft import sft_step

    rng = random.Random(seed)
    first = last = float("nan")
    done = 0
    for done in range(1, steps + 1):
        if threads is not None:
            threads.before_step()
        began = time.monotonic()
        batch = rng.sample(list(demos), min(batch_size, len(demos)))
        metrics = sft_step(backend, batch)
        seconds = time.monotonic() - began
        if threads is not None:
            threads.after_step(seconds)
        last = metrics.loss
        if done == 1:
            first = metrics.loss
        if on_step is not None:
            on_step(done, metrics.loss)
        if guard.step_done(seconds):
            break
    return done, first, last


def save_policy(backend: Any, source: Path, out: Path) -> None:
    """Save the trained weights as a complete checkpoint (config, tokenizer, processor, weights)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    backend.model.save_pretrained(out)
