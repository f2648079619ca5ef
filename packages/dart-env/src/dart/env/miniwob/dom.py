"""A flat snapshot of the MiniWoB++ task page's visible elements, for scripted oracles only.

The snapshot never reaches an :class:`~dart.protocol.messages.Observation`; the policy sees pixels
and the instruction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SNAPSHOT_JS = """
const out = [];
for (const el of document.body.querySelectorAll('*')) {
  const r = el.getBoundingClientRect();
  const style = window.getComputedStyle(el);
  if (r.width <= 0 || r.height <= 0 || r.left >= 160 || r.top >= 210) continue;
  if (style.visibility === 'hidden' || style.display === 'none') continue;
  let own = '';
  for (const n of el.childNodes) if (n.nodeType === 3) own += n.textContent;
  out.push({
    tag: el.tagName.toLowerCase(), id: el.id || '', classes: (el.getAttribute('class') || '').trim(),
    text: (el.innerText || el.textContent || '').trim().slice(0, 200), own_text: own.trim().slice(0, 200),
    type: el.type || '', value: (typeof el.value === 'string') ? el.value : '', checked: !!el.checked,
    focused: document.activeElement === el, left: r.left, top: r.top, width: r.width, height: r.height,
  });
}
return out;
"""
"""Returns every rendered element that overlaps the 160x210 task area, in document order."""


@dataclass(frozen=True, slots=True)
class Element:
    """One rendered element; geometry in task-area CSS pixels."""

    tag: str
    id: str
    classes: tuple[str, ...]
    text: str
    """``innerText``, trimmed, at most 200 characters."""
    own_text: str
    """Text of the element's own text nodes (not its children's)."""
    type: str
    """``type`` of inputs and buttons, else empty."""
    value: str
    checked: bool
    focused: bool
    left: float
    top: float
    width: float
    height: float

    @property
    def center(self) -> tuple[float, float]:
        """Center point, CSS pixels."""
        return self.left + self.width / 2, self.top + self.height / 2


@dataclass(frozen=True, slots=True)
class DomSnapshot:
    """The rendered elements of the page, in document order."""

    elements: tuple[Element, ...]

    @classmethod
    def from_js(cls, raw: Any) -> DomSnapshot:
        """Build from :data:`SNAPSHOT_JS`'s result."""
        return cls(
            tuple(
                Element(
                    tag=str(e["tag"]),
                    id=str(e["id"]),
                    classes=tuple(str(e["classes"]).split()),
                    text=str(e["text"]),
                    own_text=str(e["own_text"]),
                    type=str(e["type"]),
                    value=str(e["value"]),
                    checked=bool(e["checked"]),
                    focused=bool(e["focused"]),
                    left=float(e["left"]),
                    top=float(e["top"]),
                    width=float(e["width"]),
                    height=float(e["height"]),
                )
                for e in raw or ()
            )
        )

    def find(self, tag: str | None = None, *, text: str | None = None, cls: str | None = None) -> list[Element]:
        """Elements matching all given filters (``text``: exact trimmed ``innerText``)."""
        return [
            e
            for e in self.elements
            if (tag is None or e.tag == tag) and (text is None or e.text == text) and (cls is None or cls in e.classes)
        ]

    def inputs(self, *types: str) -> list[Element]:
        """``<input>`` elements of the given types (all inputs when none given)."""
        return [e for e in self.elements if e.tag == "input" and (not types or e.type in types)]
