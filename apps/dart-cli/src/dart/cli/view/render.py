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

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from dart.cli.view.artifacts import RunArtifacts
from dart.cli.view.links import Links
from dart.cli.view.overlay import Shape, action_shapes, describe
from dart.cli.view.tokens import TokenText
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
        text: Its text (None when the run's tokenizer cannot be read; the id is shown).
        logprob: Its behaviour log-probability (natural log).
        colour: CSS colour: red for improbable tokens, green for certain ones.
        entropy: The next-token entropy there, nats (None when not recorded).
    """

    token_id: int
    text: str | None
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
    env.filters["ns_when"] = lambda ns: _when(None if ns is None else ns / 1e9)
    env.filters["pct"] = _pct
    env.filters["num"] = _num
    env.filters["visible"] = _visible
    env.globals["a"] = anchor
    return env


def anchor(href: str | None, text: Any, *, code: bool = False, **attributes: str) -> Markup:
    """``<a href=...>text</a>``, or the text alone where the page has no link (a static report's
    unrendered page); ``code`` sets the text in ``<code>``."""
    body = Markup("<code>%s</code>") % text if code else escape(text)
    if href is None:
        return body
    attrs = "".join(Markup(' %s="%s"') % (name, value) for name, value in sorted(attributes.items()))
    return Markup('<a%s href="%s">%s</a>') % (Markup(attrs), href, body)


def step_views(steps: list[StepRecord], artifacts: RunArtifacts, link: Links, text: TokenText) -> list[StepView]:
    """What each step shows: its images (checked in the store), its action and its heat map."""
    fed = "fed to the policy"
    return [
        StepView(
            step=step,
            images=[
                _image(fed, step.prompt_images[-1] if step.prompt_images else None, step, artifacts, link),
                _image("observation", step.observation.screenshot, step, artifacts, link),
            ],
            action=describe(step.action),
            tokens=_tokens(step, text),
        )
        for step in steps
    ]


def _image(label: str, image: Image | None, step: StepRecord, artifacts: RunArtifacts, link: Links) -> ImageView:
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
    return ImageView(label, link.image(key), image.width, image.height, shapes)


def _tokens(step: StepRecord, text: TokenText) -> list[TokenCell]:
    if not step.response_logprobs:
        return []
    entropies: list[float | None] = list(step.response_entropy) or [None] * len(step.response_logprobs)
    decoded = text.texts(step.response_token_ids)
    texts: list[str | None] = list(decoded) if decoded is not None else [None] * len(step.response_token_ids)
    return [
        TokenCell(token, shown, logprob, _heat(logprob), entropy)
        for token, shown, logprob, entropy in zip(
            step.response_token_ids, texts, step.response_logprobs, entropies, strict=True
        )
    ]


def _visible(text: str) -> str:
    """A token's text with its line breaks and tabs shown (spaces stay: the cells keep white space)."""
    return text.replace("\n", "⏎").replace("\t", "⇥") or "∅"


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
