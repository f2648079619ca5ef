"""scripts/check_dashboards.py: the shipped dashboard's queries, and the check against a Prometheus-like server."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "dart.json"


def _load_script() -> ModuleType:
    # scripts/ is no package: load the file itself (registered first, as dataclasses look the module up).
    spec = importlib.util.spec_from_file_location("check_dashboards", ROOT / "scripts" / "check_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load_script()


def test_shipped_dashboard_is_grafana_json_whose_queries_resolve() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "DART run"
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] in ("row", "timeseries"), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "timeseries":
            assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}
            assert panel["targets"] and all(t["datasource"]["uid"] == "prometheus" for t in panel["targets"])
    queries = check.dashboard_queries(dashboard)
    assert len(queries) == sum(len(p.get("targets", [])) for p in panels)
    for query in queries:
        assert "$" not in query.expr, query
        assert 'job="dart"' in query.expr, "the collector may re-export the same names under another job"
        assert query.optional == ("validation" in query.panel.lower()), query.panel
    assert any(q.optional for q in queries) and not all(q.optional for q in queries)


def test_every_dashboard_metric_is_documented() -> None:
    docs = (ROOT / "docs" / "metrics.md").read_text()
    exprs = [q.expr for q in check.dashboard_queries(json.loads(DASHBOARD.read_text()))]
    names = {name for expr in exprs for name in re.findall(r"\b(dart_\w+)\{", expr)}
    assert names, exprs
    assert sorted(n for n in names if f"`{n}`" not in docs) == []


def test_rows_variables_and_hidden_targets() -> None:
    dashboard = {
        "dashboard": {
            "templating": {
                "list": [
                    {"name": "run", "current": {"text": "r1", "value": "r1"}},
                    {"name": "svc", "current": {"text": ["All"], "value": ["$__all"]}},
                    {"name": "gpu", "current": {"value": ["0", "1"]}},
                ]
            },
            "panels": [
                {"type": "text", "title": "notes"},
                {
                    "type": "row",
                    "title": "collapsed",
                    "panels": [
                        {
                            "title": "Held-out success",
                            "targets": [
                                {"refId": "A", "expr": 'x{run="$run"}'},
                                {"refId": "B", "expr": "y", "hide": True},
                            ],
                        }
                    ],
                },
                {
                    "title": "Rates",
                    "targets": [
                        {"refId": "A", "expr": 'rate(x{s=~"${svc}",g=~"${gpu:regex}"}[$__rate_interval])'},
                        {"refId": "B", "expr": 'z{a="$unknown"}[$__interval] offset $__range'},
                    ],
                },
            ],
        }
    }
    queries = check.dashboard_queries(dashboard, interval="2m")
    assert [(q.panel, q.ref_id, q.expr, q.optional) for q in queries] == [
        ("Held-out success", "A", 'x{run="r1"}', True),
        ("Rates", "A", 'rate(x{s=~".*",g=~"0|1"}[2m])', False),
        ("Rates", "B", 'z{a="$unknown"}[2m] offset 2m', False),
    ]


class _PrometheusLike(BaseHTTPRequestHandler):
    """Answers ``/api/v1/query`` the way Prometheus does, from ``server.answers`` (expr -> status, body)."""

    server: _Server

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        expr = urllib.parse.parse_qs(url.query).get("query", [""])[0]
        self.server.seen.append(expr)
        if url.path != "/api/v1/query":
            status, body = 404, {"status": "error", "errorType": "not_found", "error": url.path}
        else:
            empty = {"status": "success", "data": {"resultType": "vector", "result": []}}
            status, body = self.server.answers.get(expr, (200, empty))
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    answers: dict[str, tuple[int, dict[str, Any]]]
    seen: list[str]


@pytest.fixture
def prometheus() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _PrometheusLike)
    server.answers, server.seen = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _url(server: _Server) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"


def _vector(n: int) -> tuple[int, dict[str, Any]]:
    result = [{"metric": {"i": str(i)}, "value": [0, "1"]} for i in range(n)]
    return 200, {"status": "success", "data": {"resultType": "vector", "result": result}}


def _dashboard(tmp_path: Path, *panels: tuple[str, list[str]]) -> Path:
    body = {"panels": [{"title": t, "targets": [{"refId": "A", "expr": e} for e in exprs]} for t, exprs in panels]}
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(body))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], dict[str, Any]]:
    code = check.main(list(argv))
    lines = capsys.readouterr().out.splitlines()
    return code, lines[:-1], json.loads(lines[-1])


def test_counts_series_no_data_and_parse_errors(
    prometheus: _Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prometheus.answers = {
        "up": _vector(3),
        "scalar(up)": (200, {"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}}),
        "sum(": (400, {"status": "error", "errorType": "bad_data", "error": "unclosed left parenthesis"}),
        "a * on() b": (422, {"status": "error", "errorType": "execution", "error": "many-to-many matching"}),
    }
    path = _dashboard(
        tmp_path,
        ("Utilization", ["up", "scalar(up)", "missing_metric", "sum(", "a * on() b"]),
        ("Held-out validation success", ["validation_metric"]),
    )
    code, lines, summary = _run(capsys, "--prometheus", _url(prometheus), "--dashboard", str(path))
    assert code == 1
    assert [line.split(": ")[1] for line in lines] == [
        "3 series",
        "1 series",
        "no data",
        "parse error (bad_data",
        "error (execution",
        "no data",
    ]
    assert "[optional]" in lines[-1] and "[optional]" not in lines[0]
    assert summary == {
        "exprs": 6,
        "with_data": 2,
        "no_data": 2,
        "parse_errors": 1,
        "errors": 1,
        "min_with_data": 5,
        "ok": False,
    }
    assert prometheus.seen == ["up", "scalar(up)", "missing_metric", "sum(", "a * on() b", "validation_metric"]


def test_optional_panels_may_lack_data_unless_a_minimum_says_otherwise(
    prometheus: _Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prometheus.answers = {"rate(x[1m])": _vector(1), "y": _vector(2)}
    path = _dashboard(tmp_path, ("Rates", ["rate(x[$__rate_interval])", "y"]), ("Held-out", ["heldout_success"]))
    code, _, summary = _run(capsys, "--prometheus", _url(prometheus) + "/", "--dashboard", str(path))
    assert (code, summary["with_data"], summary["min_with_data"], summary["ok"]) == (0, 2, 2, True)
    code, _, summary = _run(capsys, "--prometheus", _url(prometheus), "--dashboard", str(path), "--min-with-data", "3")
    assert (code, summary["ok"]) == (1, False)
    code, _, summary = _run(
        capsys, "--prometheus", _url(prometheus), "--dashboard", str(path), "--interval", "5m", "--min-with-data", "1"
    )
    assert (code, summary["with_data"]) == (0, 1)
    assert prometheus.seen[-3] == "rate(x[5m])"


def test_unreachable_prometheus_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = _dashboard(tmp_path, ("Held-out", ["x"]))
    code, lines, summary = _run(
        capsys, "--prometheus", f"http://127.0.0.1:{port}", "--dashboard", str(path), "--timeout", "2"
    )
    assert code == 1
    assert summary["errors"] == 1 and summary["min_with_data"] == 0
    assert ": error (" in lines[0]
