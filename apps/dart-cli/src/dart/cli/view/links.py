"""Where a page's links point: the viewer's routes, or the files of a static report.

The templates never write a URL themselves; they ask a :class:`Links`. :class:`ServerLinks` gives the
viewer's routes. :class:`StaticLinks` gives the file names ``dart report`` writes, all in one directory
so every link is relative and the directory can be moved or zipped; a page the report did not render
(a filtered list, a trajectory outside the rendered set) has no link, and the template prints its
text alone.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode


class Links:
    """The URLs of the pages (the viewer's routes)."""

    live = True
    """Whether pages are served (filters and live updates work) rather than written to files."""

    def home(self) -> str:
        """The overview."""
        return "/"

    def stylesheet(self) -> str:
        """The stylesheet."""
        return "/static/view.css"

    def trajectories(self, **filters: Any) -> str | None:
        """The trajectory list, with ``filters`` (None values dropped)."""
        kept = {k: v for k, v in filters.items() if v is not None and v != ""}
        return "/trajectories" + ("?" + urlencode(kept) if kept else "")

    def filtered(self, filters: dict[str, Any], **changes: Any) -> str | None:
        """The trajectory list with ``filters`` and ``changes`` to them (a None change drops a filter)."""
        return self.trajectories(**{**filters, **changes})

    def trajectory(self, trajectory_id: str) -> str | None:
        """One trajectory's page."""
        return "/trajectories/" + quote(trajectory_id, safe="")

    def group(self, group_id: str) -> str | None:
        """One group's page."""
        return "/groups/" + quote(group_id, safe="")

    def image(self, key: str) -> str:
        """An image in the run's store."""
        return "/images/" + quote(key)


class StaticLinks(Links):
    """The files of a static report, relative to its directory.

    Attributes:
        trajectory_ids: The trajectories the report renders (others get no link).
        group_ids: The groups it renders.
        images: Every image key a rendered page linked to (the report copies them).
    """

    live = False

    def __init__(self, trajectory_ids: set[str], group_ids: set[str]) -> None:
        self.trajectory_ids = trajectory_ids
        self.group_ids = group_ids
        self.images: set[str] = set()

    def home(self) -> str:
        return "index.html"

    def stylesheet(self) -> str:
        return "view.css"

    def trajectories(self, **filters: Any) -> str | None:
        if any(v is not None and v != "" for v in filters.values()):
            return None
        return "trajectories.html"

    def trajectory(self, trajectory_id: str) -> str | None:
        if trajectory_id not in self.trajectory_ids:
            return None
        return quote(trajectory_file(trajectory_id))

    def group(self, group_id: str) -> str | None:
        if group_id not in self.group_ids:
            return None
        return quote(group_file(group_id))

    def image(self, key: str) -> str:
        self.images.add(key)
        return quote(image_file(key))


def trajectory_file(trajectory_id: str) -> str:
    """The file name of a trajectory's page in a static report."""
    return "trajectory-" + quote(trajectory_id, safe="") + ".html"


def group_file(group_id: str) -> str:
    """The file name of a group's page."""
    return "group-" + quote(group_id, safe="") + ".html"


def image_file(key: str) -> str:
    """The path of an image, under ``images/`` (its store key, one file name)."""
    return "images/" + quote(key, safe="")
