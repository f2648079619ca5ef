"""Settings that suit the tiny CPU model but not a real checkpoint: refused where they cannot work, warned about.

A run config's defaults are the tiny model's (screens stretched to 224x224, the project's own prompt,
float32, a 4,096-token context, short answers). ``dart run`` with ``model.path`` naming a checkpoint
whose weights exceed :data:`REAL_CHECKPOINT_BYTES` checks what is in force after :func:`finalize`
(the checkpoint's pixel bounds filled in):

- refused (a :class:`~dart.protocol.errors.ConfigError` naming the setting), since no episode could
  work: a vLLM context (``launch.max_model_len``) below the prompt's image tokens (``max_images``
  screens of the env's size, sized as the runner sizes them) plus the answer and the prompt's text;
  an answer budget (``runner.max_new_tokens``) below a typical complete answer in this checkpoint's
  tokens (:data:`TYPICAL_ANSWER`), which would end every step unparsed;
- warned about, once, at start (the run can go on, but it is rarely what was meant): screens stretched
  to a square (``image_size: N`` instead of ``model``), the project's own prompt (``format: dart``,
  which no published checkpoint was taught), float32 on a CUDA device (twice the memory and several
  times the time of bfloat16).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dart.protocol.errors import ConfigError

if TYPE_CHECKING:
    from dart.cli.stack.config import RunConfig

REAL_CHECKPOINT_BYTES = 512 * 2**20
"""Weights above this are a real checkpoint's (the tiny CPU model's are a few MB; a 3B cut to 2 layers keeps
its real widths and is over 1 GB)."""

TYPICAL_ANSWER = "Thought: I click the OK button to confirm the dialog.\nAction: click(start_box='(960,540)')"
"""A short complete answer in every format's grammar: a step's answer budget must hold at least this."""

PROMPT_TEXT_TOKENS = 1024
"""Tokens allowed for a prompt's text around its images (system message, action space, instruction,
history), on top of the images and the answer."""


def weights_bytes(checkpoint: Path) -> int:
    """Bytes of the checkpoint's weight files (safetensors, or PyTorch ``.bin``)."""
    files = [checkpoint] if checkpoint.is_file() else [*checkpoint.glob("*.safetensors"), *checkpoint.glob("*.bin")]
    return sum(f.stat().st_size for f in files if f.is_file())


def check_real_checkpoint(config: RunConfig, policy: Path) -> list[str]:
    """Refuse what cannot work with the real checkpoint at ``policy``; the warnings for the rest.

    ``config`` is the finalized run config. Nothing is checked for the tiny model (no ``model.path``) or a
    checkpoint of at most :data:`REAL_CHECKPOINT_BYTES`.

    Raises:
        ConfigError: The vLLM context cannot hold the prompt's images and answer, or the answer budget a
            typical answer.
    """
    if config.model.path is None or weights_bytes(policy) <= REAL_CHECKPOINT_BYTES:
        return []
    _answer_fits(config, policy)
    _context_fits(config)
    return [*_prompt_warnings(config), *_precision_warnings(config)]


def _answer_fits(config: RunConfig, policy: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    needed = len(tokenizer(TYPICAL_ANSWER)["input_ids"])
    budget = config.rollout.runner.max_new_tokens
    if budget < needed:
        raise ConfigError(
            "rollout.runner",
            "max_new_tokens",
            f"is {budget}, below the {needed} tokens of a short complete answer in this checkpoint's tokenizer "
            f"({TYPICAL_ANSWER!r}): every answer would be cut off unparsed; give it at least {needed} "
            "(UI-TARS-1.5 writes a thought before each action: a few hundred)",
        )


def _screen_size(config: RunConfig) -> tuple[int, int] | None:
    """The env's screen size, for the backends whose config says it."""
    env = config.env
    if env.backend == "sim":
        return env.sim.width, env.sim.height
    if env.backend == "osworld":
        return env.osworld.desktop.width, env.osworld.desktop.height
    return None


def image_tokens(config: RunConfig) -> int | None:
    """Visual tokens of one screenshot as the runners size it (None when the screen size is not in the config)."""
    from dart.policy.screen import ResizeRule

    screen = _screen_size(config)
    prompt = config.rollout.runner.prompt
    if screen is None or prompt.image_size is None:
        return None
    sizing = prompt.image_sizing()
    if isinstance(sizing, ResizeRule):
        width, height = sizing.size(*screen)
        return (width // prompt.patch_factor) * (height // prompt.patch_factor)
    assert sizing is not None  # image_size None returned above
    return (sizing // prompt.patch_factor) ** 2


def _context_fits(config: RunConfig) -> None:
    from dart.rollout.engine.vllm_config import VLLMEngineConfig

    engine = config.rollout.engine
    if not isinstance(engine, VLLMEngineConfig) or engine.launch is None:
        return  # in-process engines have no fixed context; attached servers say theirs
    per_image = image_tokens(config)
    if per_image is None:
        return
    runner = config.rollout.runner
    needed = runner.prompt.max_images * per_image + runner.max_new_tokens + PROMPT_TEXT_TOKENS
    if engine.launch.max_model_len < needed:
        raise ConfigError(
            "rollout.engine.launch",
            "max_model_len",
            f"is {engine.launch.max_model_len}, below what one prompt needs: {runner.prompt.max_images} screenshot(s) "
            f"of {per_image} tokens, {runner.max_new_tokens} answer tokens and {PROMPT_TEXT_TOKENS} of text, "
            f"{needed} in all; raise it, or lower rollout.runner.prompt.max_pixels or max_images",
        )


def _prompt_warnings(config: RunConfig) -> list[str]:
    prompt = config.rollout.runner.prompt
    out = []
    if isinstance(prompt.image_size, int):
        out.append(
            f"rollout.runner.prompt.image_size is {prompt.image_size}: screens are stretched to "
            f"{prompt.image_size}x{prompt.image_size}, while a real checkpoint sees them by its processor's rule "
            "(image_size: model)"
        )
    if prompt.format == "dart":
        out.append(
            "rollout.runner.prompt.format is dart, the project's own prompt, which no published checkpoint was "
            "taught: for UI-TARS-1.5 use format: ui-tars-1.5"
        )
    return out


def _precision_warnings(config: RunConfig) -> list[str]:
    from dart.rollout.engine.hf_config import HFEngineConfig

    out = []
    engine = config.rollout.engine
    if isinstance(engine, HFEngineConfig) and engine.device.startswith("cuda") and engine.dtype == "float32":
        out.append("rollout.engine.dtype is float32 on CUDA: twice the memory and several times the time of bfloat16")
    train = config.train
    if train.device.startswith("cuda") and train.dtype == "float32" and _backend_kind(config) != "fsdp":
        out.append("train.dtype is float32 on CUDA: bfloat16 keeps float32 master weights for AdamW")
    if train.device.startswith("cuda") and _backend_kind(config) == "fsdp":
        if getattr(train.backend, "mixed_precision", "none") == "none":
            out.append("train.backend.mixed_precision is none on CUDA: bf16 computes in bfloat16 (masters stay fp32)")
    return out


def _backend_kind(config: RunConfig) -> str:
    return str(getattr(config.train.backend, "kind", "torch"))
