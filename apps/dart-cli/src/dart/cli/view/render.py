"""The pages' HTML: jinja2 templates (``templates/``) and what each step of a trajectory page shows.

Server-rendered; the only script is the trajectory page's keyboard navigation. Every value a template
prints is escaped (autoescape on).
"""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape

from dart.cli.view.artifacts import RunArtifacts
from dart.cli.view.overlay import Shape, action_shapes, describe
from dart.protocol.messages import Image, InlineImage, StepRecord

TEMPLATES = Path(__file__).parent / "templates"
STYLESHEET = TEMPLATES / "view.css"


@dataclass(frozen=True)
class ImageView:
    """One screenshot as a page shows it.

    Attributes:
        label: What it is (``fed to the policy``, ``observation``).
        src: URL of its bytes (None when it cannot be shown; ``missing`` says why).
        width: Width in pixels (the image's own, which the overlay's coordinates use).
        height: Height in pixels.
        shapes: The step's action drawn on it.
        missing: Why it is not shown (empty when it is).
    """

    label: str
    src: str | None
    width: int
    height: int
    shapes: list[Shape]
    missing: str = ""


@dataclass(frozen=True)
class TokenCell:
    """One response token of the log-prob heat map.

    Attributes:
        token_id: The token.
        logprob: Its behaviour log-probability (natural log).
        colour: CSS colour: red for improbable tokens, green for certain ones.
        entropy: The next-token entropy there, nats (None when not recorded).
    """

    token_id: int
    logprob: float
    colour: str
    entropy: float | None


@dataclass(frozen=True)
class StepView:
    """One step of a trajectory page.

    Attributes:
        step: The stored step.
        images: The image fed to the policy (the prompt's last, at the prompt's resolution) and the
            observation screenshot, each with the action drawn on it.
        action: The action in one line.
        tokens: The response's log-prob heat map (empty when the step records no log-probs).
    """

    step: StepRecord
    images: list[ImageView]
    action: str
    tokens: list[TokenCell] = field(default_factory=list)


def environment() -> Environment:
    """The templates, with the filters they use."""
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True))
    env.filters["when"] = _when
    env.filters["short_when"] = _short_when
    env.filters["pct"] = _pct
    env.filters["num"] = _num
    env.filters["q"] = lambda value: quote(str(value), safe="")
    env.globals["query"] = _query
    return env


def step_views(steps: list[StepRecord], artifacts: RunArtifacts) -> list[StepView]:
    """What each step shows: its images (checked in the store), its action and its heat map."""
    return [
        StepView(
            step=step,
            images=[
                _image("fed to the policy", step.prompt_images[-1] if step.prompt_images else None, step, artifacts),
                _image("observation", step.observation.screenshot, step, artifacts),
            ],
            action=describe(step.action),
            tokens=_tokens(step),
        )
        for step in steps
    ]


def _image(label: str, image: Image | None, step: StepRecord, artifacts: RunArtifacts) -> ImageView:
    if image is None:
        return ImageView(label, None, 0, 0, [], "the step records no such image")
    shapes = action_shapes(step.action, image.width, image.height)
    if isinstance(image, InlineImage):
        src = "data:image/png;base64," + base64.b64encode(image.png).decode()
        return ImageView(label, src, image.width, image.height, shapes)
    key = artifacts.key_of(image)
    if key is None:
        return ImageView(
            label, None, image.width, image.height, shapes, f"stored outside this run's store: {image.uri}"
        )
    if not artifacts.exists(key):
        reason = f"{key} is not in the store (retention deletes the images of old trajectories)"
        return ImageView(label, None, image.width, image.height, shapes, reason)
    return ImageView(label, "/images/" + quote(key), image.width, image.height, shapes)


def _tokens(step: StepRecord) -> list[TokenCell]:
    entropies: list[float | None] = list(step.response_entropy) or [None] * len(step.response_logprobs)
    return [
        TokenCell(token, logprob, _heat(logprob), entropy)
        for token, logprob, entropy in zip(step.response_token_ids, step.response_logprobs, entropies, strict=True)
    ]


def _heat(logprob: float) -> str:
    """Red (improbable) through yellow to green (certain), by the token's probability."""
    p = math.exp(min(0.0, logprob))
    return f"hsl({120 * p:.0f}, 75%, 78%)"


def _when(value: float | None) -> str:
    if value is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + " UTC"


def _short_when(value: float | None) -> str:
    """``MM-DD HH:MM:SS`` UTC, for table cells."""
    return "-" if value is None else time.strftime("%m-%d %H:%M:%S", time.gmtime(value))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _query(params: dict[str, Any], **changes: Any) -> str:
    """``?a=1&b=2`` of ``params`` with ``changes`` applied (None drops a key)."""
    merged = {k: v for k, v in {**params, **changes}.items() if v is not None and v != ""}
    return "?" + urlencode(merged) if merged else "?"
