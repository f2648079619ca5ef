"""The viewer's routes (starlette): the overview, trajectory lists, groups, trajectories and images.

Endpoints are plain functions: starlette runs them on its thread pool, where the synchronous index and
store calls belong. A page that cannot be shown raises a :class:`~dart.cli.view.errors.PageError`; the
app answers with its status and a page giving the reason, and every other page keeps working.

Routes:
    ``/``                          overview of the run
    ``/trajectories``              filtered, paged list (``task``, ``status``, ``success``, ``min_version``,
                                   ``max_version``, ``group``; ``after`` / ``before`` page cursors)
    ``/trajectories/{id}``         every step of one trajectory
    ``/groups/{id}``               a group's rollouts side by side, with their advantages
    ``/images/{key}``              image bytes from the run's store (``.png`` keys holding a PNG only)
    ``/static/view.css``           the stylesheet
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, TypeVar

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from dart.cli.view.access import TokenCheck
from dart.cli.view.artifacts import RunArtifacts
from dart.cli.view.errors import BadRequestError, NotFoundError, PageError, UnreadableError
from dart.cli.view.figures import RESOURCE_KINDS, FiguresCache
from dart.cli.view.hosts import LOOPBACK_HOSTS, HostCheck
from dart.cli.view.links import Links
from dart.cli.view.queries import PAGE_SIZE, Page, RunIndex, TrajectoryFilter, read_only_engine
from dart.cli.view.render import STYLESHEET, environment, step_views
from dart.cli.view.source import RunSource
from dart.cli.view.tokens import TokenText
from dart.data.advantages import group_advantages
from dart.protocol.messages import TRAINABLE_STATUSES, TrajectoryStatus
from dart.rollout.eval.stats import wilson_interval
from dart.runtime.store import open_store

T = TypeVar("T")

_STATUSES = [s.value for s in TrajectoryStatus]
_TRAINABLE = {s.value for s in TRAINABLE_STATUSES}


class Viewer:
    """The pages of one run: its index, its store, its telemetry's figures and the templates.

    The ``*_page`` methods render a page from plain arguments; the routes of :func:`create_app` call them
    with a request's, and ``dart report`` with :class:`~dart.cli.view.links.StaticLinks` to write files.
    """

    def __init__(self, source: RunSource, index: RunIndex, artifacts: RunArtifacts, link: Links | None = None) -> None:
        self.source = source
        self.index = index
        self.artifacts = artifacts
        self.link = link or Links()
        self.templates = environment()
        self.figures = FiguresCache(source.telemetry, source.run_dir, lambda: source.summary()[0])
        self.token_text = TokenText(source.policy)

    def close(self) -> None:
        """Release the index's connections and the store."""
        self.index.close()
        self.artifacts.close()

    def render(self, template: str, **values: Any) -> str:
        """A page's HTML."""
        return self.templates.get_template(template).render(run=self.source.label, link=self.link, **values)

    def page(self, template: str, status: int = 200, **values: Any) -> HTMLResponse:
        """A rendered page as a response."""
        return HTMLResponse(self.render(template, **values), status_code=status)

    # Pages from plain arguments.

    def overview_page(self, **extra: Any) -> str:
        """The overview: the index's counts, the telemetry's figures over the RL window, the summary."""
        counts = _query_guarded("the overview", self.index.overview)
        figures = self.figures.get()
        stored = None
        if figures.start_ns is not None and figures.end_ns is not None and figures.minutes > 0:
            window = (figures.start_ns / 1e9, figures.end_ns / 1e9)
            stored = _query_guarded("the stored count", lambda: self.index.finished_between(*window))
        summary, note = self.source.summary()
        heldout = figures.heldout[-1] if figures.heldout else None
        return self.render(
            "overview.html",
            o=counts,
            f=figures,
            interval=wilson_interval(counts.successes, counts.trainable) if counts.trainable else None,
            per_minute=stored / figures.minutes if stored is not None else None,
            heldout=heldout,
            kinds=RESOURCE_KINDS,
            summary=summary,
            summary_note=note,
            **extra,
        )

    def list_page(self, filters: dict[str, str], page: Page) -> str:
        """A list of trajectories (one page of the filtered list)."""
        return self.render("trajectories.html", page=page, filters=filters, statuses=_STATUSES, page_size=PAGE_SIZE)

    def group_page(self, group_id: str) -> str:
        """A group's rollouts and each trainable one's advantage.

        Raises:
            NotFoundError: The index has no such group.
        """
        group = _query_guarded(f"group {group_id}", lambda: self.index.group(group_id))
        if group is None:
            raise NotFoundError(f"group {group_id}", "the index has no such group")
        members = group.members
        # Branches are credited per step against their siblings (see the trajectory page); the group's own
        # baseline is over its rollouts.
        scored = [m for m in members if m["status"] in _TRAINABLE and m["parent_trajectory_id"] is None]
        batching = self.source.batching
        advantages: dict[str, float] = {}
        if scored:
            # The data manager's own function and settings: what the trainer was given for this group.
            values = group_advantages(
                [float(m["reward"]) for m in scored], eps=batching.advantage_eps, scale_by_std=batching.scale_by_std
            )
            advantages = {m["trajectory_id"]: a for m, a in zip(scored, values, strict=True)}
        missing = sorted(set(group.planned) - {int(m["rollout_index"]) for m in members})
        return self.render("group.html", group=group, advantages=advantages, missing=missing, batching=batching)

    def trajectory_page(self, trajectory_id: str) -> tuple[str, int]:
        """Every step of a trajectory, with its images, action, response and log-probs, and the status:
        200, or the status of the error the page explains (the index row is shown, the blob is not).

        Raises:
            NotFoundError: The index has no such trajectory.
        """
        row = _query_guarded(f"trajectory {trajectory_id}", lambda: self.index.trajectory(trajectory_id))
        if row is None:
            raise NotFoundError(f"trajectory {trajectory_id}", "the index has no such trajectory")
        prev_id, next_id = _query_guarded("the neighbouring trajectories", lambda: self.index.neighbours(trajectory_id))
        nav: dict[str, Any] = {"prev_id": prev_id, "next_id": next_id, "row": row}
        try:
            traj = self.artifacts.trajectory(row)
        except PageError as exc:
            return self.render("error.html", error=exc, **nav), exc.status
        steps = step_views(traj.steps, self.artifacts, self.link, self.token_text)
        branches = _query_guarded("the trajectory's branches", lambda: self.index.branches(trajectory_id))
        tree: dict[int, list[dict[str, Any]]] = {}
        for branch in branches:
            tree.setdefault(int(branch["branch_step"]), []).append(branch)
        values = {"traj": traj, "steps": steps, "tokens_as_ids": self.token_text.problem, "branches": tree}
        return self.render("trajectory.html", **values, **nav), 200

    # Routes.

    def overview(self, request: Request) -> Response:
        """``/``: counts, success rates, utilization, versions, rejections, the pool, the summary."""
        return HTMLResponse(self.overview_page())

    def trajectories(self, request: Request) -> Response:
        """``/trajectories``: one page of the filtered list."""
        params = {k: v for k, v in request.query_params.items() if v != ""}
        where = _filter(params)
        after, before = params.get("after"), params.get("before")
        page = _query_guarded("the trajectory list", lambda: self.index.page(where, after=after, before=before))
        filters = {k: v for k, v in params.items() if k not in ("after", "before")}
        return HTMLResponse(self.list_page(filters, page))

    def group(self, request: Request) -> Response:
        """``/groups/{id}``: the group's rollouts and each trainable one's advantage."""
        return HTMLResponse(self.group_page(request.path_params["group_id"]))

    def trajectory(self, request: Request) -> Response:
        """``/trajectories/{id}``: every step, with its images, action, response and log-probs."""
        body, status = self.trajectory_page(request.path_params["trajectory_id"])
        return HTMLResponse(body, status_code=status)

    def image(self, request: Request) -> Response:
        """``/images/{key}``: an image's bytes from the run's store."""
        data, kind = self.artifacts.image(request.path_params["key"])
        # Keys are content-derived (sha256-named): the bytes under a key never change.
        return Response(data, media_type=kind, headers={"Cache-Control": "max-age=86400, immutable"})

    def stylesheet(self, request: Request) -> Response:
        """``/static/view.css``."""
        return Response(STYLESHEET.read_bytes(), media_type="text/css")

    def error_page(self, error: PageError, **values: Any) -> HTMLResponse:
        """The page of an error: what was asked for, why it cannot be shown."""
        return self.page("error.html", status=error.status, error=error, **values)

    async def on_page_error(self, request: Request, exc: Exception) -> Response:
        """Exception handler of :class:`PageError`."""
        assert isinstance(exc, PageError)
        if request.url.path.startswith("/images/"):
            return Response(f"{exc.what}: {exc.reason}\n", status_code=exc.status, media_type="text/plain")
        return self.error_page(exc)

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        """Exception handler of starlette's own errors (an unknown path)."""
        assert isinstance(exc, HTTPException)
        error = PageError(request.url.path, exc.detail)
        error.status = exc.status_code
        return self.error_page(error)


def open_viewer(source: RunSource, link: Links | None = None) -> Viewer:
    """The pages of ``source``: its index opened read-only and its store.

    Raises:
        NotARunError: The index is missing or not one this code reads.
    """
    where = make_url(source.database_url).render_as_string(hide_password=True).removeprefix("sqlite:///")
    index = RunIndex(read_only_engine(source.database_url), where)
    try:
        index.check_schema()
    except BaseException:
        index.close()
        raise
    return Viewer(source, index, RunArtifacts(open_store(source.store)), link)


def create_app(
    source: RunSource, *, hosts: Collection[str] | None = LOOPBACK_HOSTS, token: str | None = None
) -> Starlette:
    """The viewer of ``source``: its index opened read-only and its store.

    Args:
        source: The run.
        hosts: Host names requests must be addressed to (:class:`~dart.cli.view.hosts.HostCheck`); None
            accepts any (a viewer served beyond this machine, by a name it cannot know).
        token: The secret every request must carry (:class:`~dart.cli.view.access.TokenCheck`); None lets
            in any request (a viewer on loopback).

    Raises:
        NotARunError: The index is missing or not one this code reads.
    """
    viewer = open_viewer(source)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        viewer.close()

    routes = [
        Route("/", viewer.overview),
        Route("/trajectories", viewer.trajectories),
        Route("/trajectories/{trajectory_id:path}", viewer.trajectory),
        Route("/groups/{group_id:path}", viewer.group),
        Route("/images/{key:path}", viewer.image),
        Route("/static/view.css", viewer.stylesheet),
    ]
    handlers = {PageError: viewer.on_page_error, HTTPException: viewer.on_http_error}
    middleware = [Middleware(HostCheck, hosts=hosts)] if hosts is not None else []
    if token is not None:
        middleware.append(Middleware(TokenCheck, token=token))
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan, middleware=middleware)


def _filter(params: dict[str, str]) -> TrajectoryFilter:
    """The list filter of the query parameters.

    Raises:
        BadRequestError: A parameter that does not parse.
    """
    status = params.get("status")
    if status is not None and status not in _STATUSES:
        raise BadRequestError(f"status={status}", f"not a trajectory status: use one of {', '.join(_STATUSES)}")
    success = params.get("success")
    if success is not None and success not in ("yes", "no"):
        raise BadRequestError(f"success={success}", "use yes or no")
    return TrajectoryFilter(
        task_id=params.get("task"),
        status=status,
        success=None if success is None else success == "yes",
        min_version=_int(params, "min_version"),
        max_version=_int(params, "max_version"),
        group_id=params.get("group"),
    )


def _int(params: dict[str, str], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequestError(f"{name}={value}", "a policy version is a whole number") from None


def _query_guarded(what: str, query: Callable[[], T]) -> T:
    """Run an index query; a database failure becomes a 500 page naming it."""
    try:
        return query()
    except SQLAlchemyError as exc:
        raise UnreadableError(what, f"the index did not answer: {type(exc).__name__}: {exc.args[0]}") from exc
