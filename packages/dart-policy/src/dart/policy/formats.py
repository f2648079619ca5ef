"""Prompt formats: what the policy is told (system message, action space, instruction) and how its earlier
answers are shown back, per checkpoint convention.

A format is chosen by name (``rollout.runner.prompt.format``) from :data:`PROMPT_FORMATS` (entry-point
group ``dart.prompt_formats``); the runners and the warm start build every prompt through it, and the
model family supplies the chat turns and image placeholder around it (:class:`~dart.policy.models.ChatFormat`).
Every format's answers are the same ``Thought: ... / Action: call(...)`` text
(:mod:`dart.policy.action_grammar` parses it), so formats differ in what the model is told and in which
coordinate spaces it may be told to use:

- ``dart``: the project's own prompt (a short system message, the action space including ``fail``, a note
  naming the coordinate space); positions on the 0..1000 grid (its default) or in pixels.
- ``ui-tars-1.5``: UI-TARS-1.5's computer-use prompt as its authors publish it for OSWorld: Qwen's default
  system message, then one user message with the output format, the action space with
  ``<|box_start|>(x1,y1)<|box_end|>`` points, the notes and the instruction. The model answers in pixels of
  the screenshot as it was shown (after the image sizing: use ``image_size: model`` for a real
  checkpoint); earlier answers are shown back with their points wrapped in ``<|box_start|>``/``<|box_end|>``,
  as the authors' deployment code does. Its action space has no ``fail`` (``call_user`` still parses as one).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import ClassVar

from dart.policy.models import Coordinates
from dart.policy.screen import GRID, coordinates_note
from dart.protocol.registry import Registry


class PromptFormat(ABC):
    """One prompt convention (see the module docstring).

    Attributes:
        name: The registered name.
        coordinate_spaces: The coordinate spaces the format can tell the model to use, its own first.
    """

    name: ClassVar[str]
    coordinate_spaces: ClassVar[tuple[Coordinates, ...]]

    @abstractmethod
    def system_prompt(self) -> str:
        """The system message."""

    @abstractmethod
    def task_prompt(self, instruction: str, coordinates: Coordinates) -> str:
        """The first user message: how to answer, the action space and the instruction."""

    def shown_answer(self, text: str) -> str:
        """An earlier answer of the model as later prompts show it (unchanged by default)."""
        return text


DART_SYSTEM_PROMPT = "You are a GUI agent. You are given a task and your action history, with screenshots."

DART_ACTION_SPACE = f"""Output exactly in this format:
Thought: ...
Action: ...

## Action Space
click(start_box='(x,y)')
left_double(start_box='(x,y)')
right_single(start_box='(x,y)')
drag(start_box='(x1,y1)', end_box='(x2,y2)')
hotkey(key='ctrl c')
type(content='xxx')
scroll(start_box='(x,y)', direction='down or up or right or left')
wait()
finished(content='xxx')
fail(reason='xxx')

## Note
{coordinates_note("grid")} End typed content with \\n to press Enter."""
"""The project's action space as the policy is told it (grid coordinates)."""


class DartFormat(PromptFormat):
    """The project's own prompt."""

    name = "dart"
    coordinate_spaces = ("grid", "pixels")

    def system_prompt(self) -> str:
        return DART_SYSTEM_PROMPT

    def task_prompt(self, instruction: str, coordinates: Coordinates) -> str:
        space = DART_ACTION_SPACE.replace(coordinates_note("grid"), coordinates_note(coordinates))
        return f"{space}\n\n## User Instruction\n{instruction}"


_ESCAPES = (
    r"Use escape characters \\', \\\", and \\n in content part to ensure we can parse the content in normal python "
    "string format."
)

UI_TARS_15_COMPUTER_USE = "\n".join(
    [
        "You are a GUI agent. You are given a task and your action history, with screenshots. "
        "You need to perform the next action to complete the task.",
        "",
        "## Output Format",
        "```",
        "Thought: ...",
        "Action: ...",
        "```",
        "",
        "## Action Space",
        "",
        "click(start_box='<|box_start|>(x1,y1)<|box_end|>')",
        "left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')",
        "right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')",
        "drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')",
        "hotkey(key='')",
        f"type(content='xxx') # {_ESCAPES} If you want to submit your input, use \\\\n at the end of content. ",
        "scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')",
        "wait() #Sleep for 5s and take a screenshot to check for any changes.",
        f"finished(content='xxx') # {_ESCAPES.replace(chr(92) * 3, chr(92) * 2)}",
        "",
        "",
        "## Note",
        "- Use {language} in `Thought` part.",
        "- Write a small plan and finally summarize your next action (with its target element) in one sentence "
        "in `Thought` part.",
        "",
        "## User Instruction",
        "{instruction}",
        "",
    ]
)
"""UI-TARS-1.5's computer-use prompt (``{language}`` and ``{instruction}`` filled in)."""

_POINT_ARG = re.compile(r"(start_box|end_box)='\((-?\d+(?:\.\d+)?),\s*(-?\d+(?:\.\d+)?)\)'")


class UiTars15Format(PromptFormat):
    """UI-TARS-1.5's computer-use prompt, answers in pixels of the shown screenshot.

    Args:
        language: The language the model is asked to think in.
    """

    name = "ui-tars-1.5"
    coordinate_spaces = ("pixels",)

    def __init__(self, language: str = "English") -> None:
        self.language = language

    def system_prompt(self) -> str:
        return "You are a helpful assistant."

    def task_prompt(self, instruction: str, coordinates: Coordinates) -> str:
        if coordinates != "pixels":
            raise ValueError(f"the ui-tars-1.5 prompt has the model answer in pixels, not on a {GRID} grid")
        return UI_TARS_15_COMPUTER_USE.replace("{language}", self.language).replace("{instruction}", instruction)

    def shown_answer(self, text: str) -> str:
        """``text`` with each ``start_box='(x,y)'`` point wrapped as ``'<|box_start|>(x,y)<|box_end|>'``."""
        return _POINT_ARG.sub(lambda m: f"{m[1]}='<|box_start|>({m[2]},{m[3]})<|box_end|>'", text)


def _is_format(obj: object) -> None:
    if not isinstance(obj, PromptFormat):
        raise TypeError(f"a prompt format must be a PromptFormat, got {obj!r}")


PROMPT_FORMATS: Registry[PromptFormat] = Registry(
    "prompt_formats", what="prompt format", config_field="rollout.runner.prompt.format", check=_is_format
)
"""Prompt formats by name; dart-policy registers ``dart`` and ``ui-tars-1.5``."""

DART = DartFormat()
UI_TARS_15 = UiTars15Format()
