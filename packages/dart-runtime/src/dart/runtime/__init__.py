"""dart.runtime: how a DART process lives (bus, stores, telemetry, serving, lifetime, retry, waiting)."""

__version__ = "0.1.0"
