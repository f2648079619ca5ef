"""Check a Grafana dashboard's queries against a live Prometheus.

Every panel target's ``expr`` runs as an instant query (``/api/v1/query``). One line per expression says
whether it failed to parse, found no data, or how many series it returned; the last line is one JSON
object with the counts. The exit status is non-zero when an expression does not parse, a query fails
otherwise (Prometheus unreachable, a server error), or fewer than ``--min-with-data`` expressions return
data. By default every expression must return data except those of panels whose title names held-out
validation ("held-out", "heldout" or "validation"): that evaluation runs only when a run enables it.

Grafana's interval variables (``$__rate_interval``, ``$__interval``, ``$__range``...) are replaced by
``--interval``, and the dashboard's own template variables by their current value (``.*`` for "All"
or none), so what runs is what Grafana would send.

Usage:
    python scripts/check_dashboards.py --prometheus http://localhost:9090
    python scripts/check_dashboards.py --prometheus URL --dashboard other.json --min-with-data 10
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "dart.json"
OPTIONAL_PANEL = re.compile(r"held[- ]?out|validation", re.IGNORECASE)
"""Titles of panels whose queries may have no data: held-out validation is off unless a run enables it."""

_INTERVAL_VARIABLES = ("__rate_interval", "__interval", "__range")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")

Outcome = Literal["data", "no data", "parse error", "error"]


@dataclass(frozen=True)
class PanelQuery:
    """One query of a dashboard panel.

    Attributes:
        panel: The panel's title.
        ref_id: The target's ``refId`` (``A``, ``B``...).
        expr: The PromQL expression, variables substituted.
        optional: Whether the panel is allowed to show no data (held-out validation).
    """

    panel: str
    ref_id: str
    expr: str
    optional: bool


@dataclass(frozen=True)
class QueryResult:
    """What Prometheus answered to one instant query.

    Attributes:
        outcome: ``data``, ``no data``, ``parse error`` (Prometheus rejected the expression) or ``error``
            (any other failure: unreachable, timeout, server error).
        series: Series (or samples of a scalar/string result) returned; 0 unless ``outcome`` is ``data``.
        detail: Prometheus' error message for the two error outcomes, its warnings otherwise.
    """

    outcome: Outcome
    series: int = 0
    detail: str = ""


def _panels(panels: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    # Rows list their panels inline when expanded and under the row's own "panels" when collapsed.
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _variable_values(dashboard: Mapping[str, Any]) -> dict[str, str]:
    values: dict[str, str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        current = variable.get("current") or {}
        value = current.get("value")
        if isinstance(value, list):
            value = "|".join(str(v) for v in value)
        values[str(variable["name"])] = ".*" if value in (None, "", "$__all") else str(value)
    return values


def substitute(expr: str, variables: Mapping[str, str], interval: str) -> str:
    """Replace Grafana's interval variables by ``interval`` and dashboard variables by ``variables``.

    Unknown variables are left as they are, so Prometheus reports them as a parse error.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in _INTERVAL_VARIABLES:
            return interval
        return variables.get(name, match.group(0))

    return _VARIABLE.sub(replace, expr)


def dashboard_queries(dashboard: Mapping[str, Any], *, interval: str = "1m") -> list[PanelQuery]:
    """Every Prometheus expression of a dashboard's panels (nested row panels included), in panel order.

    Args:
        dashboard: The dashboard JSON model (the object Grafana exports; a ``{"dashboard": ...}``
            wrapper as the HTTP API returns it is unwrapped).
        interval: What ``$__rate_interval``, ``$__interval`` and ``$__range`` stand for.
    """
    dashboard = dashboard.get("dashboard", dashboard)
    variables = _variable_values(dashboard)
    queries = []
    for panel in _panels(dashboard.get("panels", [])):
        title = str(panel.get("title", ""))
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if not expr or target.get("hide"):
                continue
            queries.append(
                PanelQuery(
                    panel=title,
                    ref_id=str(target.get("refId", "")),
                    expr=substitute(str(expr), variables, interval),
                    optional=bool(OPTIONAL_PANEL.search(title)),
                )
            )
    return queries


def instant_query(prometheus: str, expr: str, *, timeout_s: float = 10.0) -> QueryResult:
    """Run ``expr`` as an instant query against the Prometheus at base URL ``prometheus``."""
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        # Prometheus answers a bad expression with 400 and {"errorType": "bad_data", "error": ...}.
        try:
            body = json.loads(exc.read())
        except ValueError:
            return QueryResult("error", detail=f"HTTP {exc.code} {exc.reason}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return QueryResult("error", detail=f"{type(exc).__name__}: {exc}")
    if not isinstance(body, dict):
        return QueryResult("error", detail=f"not a Prometheus API answer: {str(body)[:200]}")
    if body.get("status") != "success":
        outcome: Outcome = "parse error" if body.get("errorType") == "bad_data" else "error"
        return QueryResult(outcome, detail=f"{body.get('errorType', '?')}: {body.get('error', '')}")
    data = body.get("data", {})
    # Warnings (PromQL annotations) do not fail the query but are worth seeing.
    detail = "; ".join(str(w) for w in body.get("warnings", []))
    if data.get("resultType") in ("scalar", "string"):
        return QueryResult("data", series=1, detail=detail)
    result = data.get("result")
    series = len(result) if isinstance(result, list) else 0
    return QueryResult("data", series=series, detail=detail) if series else QueryResult("no data", detail=detail)


def _line(query: PanelQuery, result: QueryResult) -> str:
    status = f"{result.series} series" if result.outcome == "data" else result.outcome
    if result.detail:
        status += f" ({result.detail})"
    tag = " [optional]" if query.optional else ""
    return f"{query.panel} [{query.ref_id}]{tag}: {status}: {query.expr}"


def main(argv: Sequence[str] | None = None) -> int:
    """Check every query of the dashboard; returns the exit status (0: all good)."""
    parser = argparse.ArgumentParser(description="Check a Grafana dashboard's queries against a live Prometheus.")
    parser.add_argument("--prometheus", required=True, help="base URL of Prometheus, e.g. http://localhost:9090")
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD, help="Grafana dashboard JSON")
    parser.add_argument(
        "--min-with-data",
        type=int,
        default=None,
        help="expressions that must return data (default: all but those of held-out/validation panels)",
    )
    parser.add_argument("--interval", default="1m", help="value of $__rate_interval, $__interval and $__range")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per query")
    args = parser.parse_args(argv)

    queries = dashboard_queries(json.loads(args.dashboard.read_text()), interval=args.interval)
    counts = {"data": 0, "no data": 0, "parse error": 0, "error": 0}
    for query in queries:
        result = instant_query(args.prometheus, query.expr, timeout_s=args.timeout)
        counts[result.outcome] += 1
        print(_line(query, result), flush=True)
    required = sum(not q.optional for q in queries) if args.min_with_data is None else args.min_with_data
    ok = bool(queries) and counts["parse error"] == 0 and counts["error"] == 0 and counts["data"] >= required
    summary = {
        "exprs": len(queries),
        "with_data": counts["data"],
        "no_data": counts["no data"],
        "parse_errors": counts["parse error"],
        "errors": counts["error"],
        "min_with_data": required,
        "ok": ok,
    }
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
