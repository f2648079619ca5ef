"""Global tracer/meter providers that route to the DART service active in the current context.

OpenTelemetry allows one global provider per process, but ``dart run`` hosts four services in one
process and each must appear under its own ``service.name``. So every service gets its own SDK
providers (with its own :class:`~opentelemetry.sdk.resources.Resource`), and the global providers
installed here are thin routers: a span or measurement made through a global tracer or meter
(``trace.get_tracer("dart.runtime.bus")``) is handed, *at the moment it is made*, to the service
:class:`Route` active in the current :mod:`contextvars` context, or to the default route (the
first service set up and still alive) when none is active. Resolving late matters because callers
keep tracers and instruments in module globals created before any service exists.

Lifecycle of a :class:`Route`: registered by ``setup_telemetry`` -> optionally activated in a
context by ``Telemetry.activate()`` (asyncio tasks inherit it) -> closed by ``Telemetry.shutdown``,
after which it is never chosen again.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackT
from opentelemetry.trace import SpanKind
from opentelemetry.util._decorator import _agnosticcontextmanager
from opentelemetry.util.types import Attributes

_T = TypeVar("_T")
_ScopeKey = tuple[str, str | None, str | None]


class Route:
    """One service's SDK providers, as seen by the global routers.

    Args:
        name: Service name (for diagnostics).
        tracer_provider: The service's tracer provider.
        meter_provider: The service's meter provider.
        owner: The object the route belongs to (the service's ``Telemetry``).
    """

    def __init__(
        self,
        name: str,
        tracer_provider: trace.TracerProvider,
        meter_provider: metrics.MeterProvider,
        owner: object | None = None,
    ) -> None:
        self.name = name
        self.owner = owner
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.closed = False
        self._lock = threading.Lock()
        self._tracers: dict[_ScopeKey, trace.Tracer] = {}
        self._meters: dict[_ScopeKey, metrics.Meter] = {}
        self._instruments: dict[tuple[_ScopeKey, str, str], Any] = {}

    def tracer(self, scope: _ScopeKey) -> trace.Tracer:
        """The service's tracer for an instrumentation scope (cached: one per scope)."""
        tracer = self._tracers.get(scope)
        if tracer is None:
            with self._lock:
                tracer = self._tracers.get(scope)
                if tracer is None:
                    tracer = self.tracer_provider.get_tracer(*scope)
                    self._tracers[scope] = tracer
        return tracer

    def meter(self, scope: _ScopeKey) -> metrics.Meter:
        """The service's meter for an instrumentation scope (cached)."""
        meter = self._meters.get(scope)
        if meter is None:
            with self._lock:
                meter = self._meters.get(scope)
                if meter is None:
                    meter = self.meter_provider.get_meter(*scope)
                    self._meters[scope] = meter
        return meter

    def instrument(self, scope: _ScopeKey, kind: str, name: str, create: Callable[[metrics.Meter], _T]) -> _T:
        """The service's instrument ``name`` of ``kind`` in ``scope``, created on first use.

        Cached here (not per routing instrument) so two components that create the same global
        instrument share one SDK instrument instead of triggering duplicate-registration warnings.
        """
        key = (scope, kind, name)
        inst = self._instruments.get(key)
        if inst is None:
            meter = self.meter(scope)
            with self._lock:
                inst = self._instruments.get(key)
                if inst is None:
                    inst = create(meter)
                    self._instruments[key] = inst
        return inst


class Router:
    """Registry of live routes and the context-local choice among them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: list[Route] = []
        self._active: contextvars.ContextVar[Route | None] = contextvars.ContextVar(
            "dart_telemetry_route", default=None
        )

    def register(self, route: Route) -> None:
        """Add a route; the first live one is the default."""
        with self._lock:
            self._routes.append(route)

    def unregister(self, route: Route) -> None:
        """Close and remove a route; spans made in contexts where it was active go to the default."""
        route.closed = True
        with self._lock:
            if route in self._routes:
                self._routes.remove(route)

    def routes(self) -> list[Route]:
        """Live routes in registration order."""
        with self._lock:
            return list(self._routes)

    def current(self) -> Route | None:
        """The route for the current context: the active one if alive, else the default."""
        route = self._active.get()
        if route is not None and not route.closed:
            return route
        with self._lock:
            return self._routes[0] if self._routes else None

    def activate(self, route: Route) -> contextvars.Token[Route | None]:
        """Make ``route`` current in this context; undo with :meth:`deactivate`."""
        return self._active.set(route)

    def deactivate(self, token: contextvars.Token[Route | None]) -> None:
        """Undo one :meth:`activate`."""
        self._active.reset(token)


ROUTER = Router()
"""The process-wide router used by the global providers."""

_NOOP_TRACER = trace.NoOpTracer()


class RoutingTracer(trace.Tracer):
    """A tracer that starts each span on the current route's tracer for the same scope."""

    def __init__(self, router: Router, scope: _ScopeKey) -> None:
        self._router = router
        self._scope = scope

    def _target(self) -> trace.Tracer:
        route = self._router.current()
        return route.tracer(self._scope) if route is not None else _NOOP_TRACER

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: trace._Links = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        """Start a span on the routed tracer (see :meth:`opentelemetry.trace.Tracer.start_span`)."""
        return self._target().start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )

    @_agnosticcontextmanager
    def start_as_current_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: trace._Links = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        """Start a current span on the routed tracer (see the OTel API for the arguments)."""
        with self._target().start_as_current_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception, end_on_exit
        ) as span:
            yield span


class RoutingTracerProvider(trace.TracerProvider):
    """The global tracer provider DART installs: hands out :class:`RoutingTracer`."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> trace.Tracer:
        """A tracer whose spans go to the service current when each span starts."""
        return RoutingTracer(self._router, (instrumenting_module_name, instrumenting_library_version, schema_url))


class _RoutedSync:
    """What a routed synchronous instrument shares: per measurement, the real instrument of the current route
    (made by ``create`` on that route's meter the first time) takes the call; with no route current, nothing."""

    def __init__(
        self, router: Router, scope: _ScopeKey, kind: str, name: str, create: Callable[[metrics.Meter], Any]
    ) -> None:
        self._router = router
        self._scope = scope
        self._kind = kind
        self._name = name
        self._create = create

    def call(self, method: str, amount: int | float, attributes: Attributes, context: Context | None) -> None:
        """``real.<method>(amount, attributes, context)`` on the current route's instrument."""
        route = self._router.current()
        if route is not None:
            real = route.instrument(self._scope, self._kind, self._name, self._create)
            getattr(real, method)(amount, attributes, context)


# The API's Instrument.__init__ is abstract with an empty body: the routed instruments call nothing of it.
class _RoutingCounter(metrics.Counter):
    def __init__(self, routed: _RoutedSync) -> None:
        self._r = routed

    def add(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._r.call("add", amount, attributes, context)


class _RoutingUpDownCounter(metrics.UpDownCounter):
    def __init__(self, routed: _RoutedSync) -> None:
        self._r = routed

    def add(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._r.call("add", amount, attributes, context)


class _RoutingHistogram(metrics.Histogram):
    def __init__(self, routed: _RoutedSync) -> None:
        self._r = routed

    def record(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._r.call("record", amount, attributes, context)


class _RoutingGauge(metrics._Gauge):
    def __init__(self, routed: _RoutedSync) -> None:
        self._r = routed

    def set(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._r.call("set", amount, attributes, context)


class RoutingMeter(metrics.Meter):
    """A meter whose synchronous instruments record into the current route's meter.

    Observable (callback) instruments have no "current" moment, so they are bound to the route
    current when they are *created*: create them inside ``Telemetry.activate()``.
    """

    def __init__(self, router: Router, scope: _ScopeKey) -> None:
        super().__init__(scope[0], scope[1], scope[2])
        self._router = router
        self._scope = scope

    def _routed(self, kind: str, name: str, create: Callable[[metrics.Meter], Any]) -> _RoutedSync:
        return _RoutedSync(self._router, self._scope, kind, name, create)

    def _creation_meter(self) -> metrics.Meter:
        route = self._router.current()
        return route.meter(self._scope) if route is not None else metrics.NoOpMeter(self._scope[0])

    def create_counter(self, name: str, unit: str = "", description: str = "") -> metrics.Counter:
        """A counter routed per measurement."""
        return _RoutingCounter(self._routed("counter", name, lambda m: m.create_counter(name, unit, description)))

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> metrics.UpDownCounter:
        """An up-down counter routed per measurement."""
        create = lambda m: m.create_up_down_counter(name, unit, description)  # noqa: E731
        return _RoutingUpDownCounter(self._routed("up_down_counter", name, create))

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> metrics.Histogram:
        """A histogram routed per measurement."""
        bounds = explicit_bucket_boundaries_advisory
        create = lambda m: m.create_histogram(name, unit, description, explicit_bucket_boundaries_advisory=bounds)  # noqa: E731
        return _RoutingHistogram(self._routed("histogram", name, create))

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> metrics._Gauge:
        """A gauge routed per measurement."""
        return _RoutingGauge(self._routed("gauge", name, lambda m: m.create_gauge(name, unit, description)))

    def create_observable_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> metrics.ObservableCounter:
        """An observable counter bound to the route current now."""
        return self._creation_meter().create_observable_counter(name, callbacks, unit, description)

    def create_observable_gauge(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> metrics.ObservableGauge:
        """An observable gauge bound to the route current now."""
        return self._creation_meter().create_observable_gauge(name, callbacks, unit, description)

    def create_observable_up_down_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> metrics.ObservableUpDownCounter:
        """An observable up-down counter bound to the route current now."""
        return self._creation_meter().create_observable_up_down_counter(name, callbacks, unit, description)


class RoutingMeterProvider(metrics.MeterProvider):
    """The global meter provider DART installs: hands out :class:`RoutingMeter`."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def get_meter(
        self,
        name: str,
        version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes = None,
    ) -> metrics.Meter:
        """A meter whose measurements go to the service current when each is made."""
        return RoutingMeter(self._router, (name, version, schema_url))
