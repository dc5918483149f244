"""The Grafana dashboard docs/grafana/duomo.json: shaped the way Grafana's "Import dashboard" takes
it, every query well formed, every series it reads one that Duomo's /metrics exposes, and each
selector following the variables that pick its models or pipelines.

``dashboard_metric_names()`` lists the ``duomo_*`` series the dashboard queries, exactly as written
(``_total``, ``_bucket`` ... included), so that a test against a live scrape can check each of them
is really exposed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser  # a real PromQL parser (GreptimeTeam's, in Rust): the test extras
import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "duomo.json"

# The families /metrics exposes and whether the $model variable selects them (they carry a `model`
# label naming a model; a pipeline step's `model` is left to the $pipeline variable).
COUNTERS = {
    "duomo_inference_request_success": True,
    "duomo_inference_request_failure": True,
    "duomo_inference_count": True,
    "duomo_inference_exec_count": True,
    "duomo_inference_request_duration_us": True,
    "duomo_inference_queue_duration_us": True,
    "duomo_inference_compute_input_duration_us": True,
    "duomo_inference_compute_infer_duration_us": True,
    "duomo_inference_compute_output_duration_us": True,
    "duomo_model_loads": True,
    "duomo_model_evictions": True,
    "duomo_model_restarts": True,
    "duomo_device_cpu_seconds": False,
    "duomo_stream_answered": True,
    "duomo_inference_request_superseded": True,
    "duomo_pipeline_requests": False,
    "duomo_pipeline_step_runs": False,
    "duomo_pipeline_step_skipped": False,
    "duomo_pipeline_step_reused": False,
    "duomo_pipeline_step_errors": False,
}
HISTOGRAMS = {
    "duomo_request_duration_seconds": True,
    "duomo_batch_size": True,
    "duomo_model_load_duration_seconds": True,
    "duomo_pipeline_latency_seconds": False,
    "duomo_pipeline_objects_per_frame": False,
}
GAUGES = {
    "duomo_inference_pending_request_count": True,
    "duomo_model_state": True,
    "duomo_model_memory_bytes": True,
    "duomo_model_memory_budget_bytes": True,
    "duomo_device_memory_used_bytes": False,
    "duomo_device_memory_budget_bytes": False,
    "duomo_device_memory_total_bytes": False,
    "duomo_device_utilization_ratio": False,
    "duomo_device_temperature_celsius": False,
    "duomo_device_power_watts": False,
    "duomo_clients_attached": False,
    "duomo_gateway_workers_running": False,
    "duomo_process_resident_bytes": False,
    "duomo_stream_age_ms": True,
    "duomo_model_offered_fps": True,
    "duomo_model_served_fps": True,
    "duomo_model_capacity_over": True,
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Exposition name -> its family; prometheus_client adds _total to counters.
EXPOSED: dict[str, str] = {
    **{f"{family}_total": family for family in COUNTERS},
    **{family + suffix: family for family in HISTOGRAMS for suffix in HISTOGRAM_SUFFIXES},
    **{family: family for family in GAUGES},
}
PER_MODEL = {family for table in (COUNTERS, HISTOGRAMS, GAUGES) for family, m in table.items() if m}
PER_PIPELINE = {family for family in EXPOSED.values() if family.startswith("duomo_pipeline_")}

# The panel types a stock Grafana (10.x, 11.x) ships; a plugin panel would make import ask for it.
GRAFANA_PANEL_TYPES = {
    "row", "timeseries", "stat", "gauge", "bargauge", "table", "state-timeline",
    "status-history", "heatmap", "histogram", "barchart", "piechart", "text", "xychart",
    "trend", "candlestick", "canvas", "geomap", "nodeGraph", "traces", "flamegraph", "logs",
    "news", "dashlist", "alertlist", "annolist", "datagrid",
}  # fmt: skip
UNITS = {"reqps", "ms", "µs", "s", "bytes", "percentunit", "short", "none", "celsius", "watt"}
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
RANGE_WINDOWS = {"$__rate_interval", "$__range", "1h"}  # 1h: loads are too rare for less

NAME = re.compile(r"\bduomo_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(duomo_[a-z0-9_]+)\b(\{[^}]*\})?")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
PAIRS = {")": "(", "]": "[", "}": "{"}


@functools.cache
def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels() -> Iterator[dict[str, Any]]:
    """Every panel, those folded inside a collapsed row included."""
    for panel in load_dashboard()["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets() -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in all_panels():
        for target in panel.get("targets", []):
            yield panel["title"], target


def variable_queries() -> list[str]:
    out = []
    for variable in load_dashboard()["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def expressions() -> list[str]:
    return [target["expr"] for _, target in targets() if "expr" in target]


def dashboard_metric_names() -> set[str]:
    """The ``duomo_*`` series the dashboard's queries and variables read, exactly as written."""
    return {name for text in [*expressions(), *variable_queries()] for name in NAME.findall(text)}


def balanced(expr: str) -> bool:
    """Whether (), [] and {} nest properly outside string literals."""
    stack: list[str] = []
    for char in STRING.sub('""', expr):
        if char in "([{":
            stack.append(char)
        elif char in PAIRS and (not stack or stack.pop() != PAIRS[char]):
            return False
    return not stack


def test_dashboard_has_the_shape_import_takes() -> None:
    dash = load_dashboard()
    assert (dash["uid"], dash["title"]) == ("duomo", "Duomo")
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash.get("id") is None  # a fixed id would clash with the importing Grafana's own
    [source] = [i for i in dash["__inputs"] if i["type"] == "datasource"]
    assert (source["name"], source["pluginId"]) == ("DS_PROMETHEUS", "prometheus")
    required = {(r["type"], r["id"]) for r in dash["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    used = {p["type"] for p in all_panels()} - {"row"}
    assert {("panel", t) for t in used} <= required


def test_templating_has_the_datasource_instance_model_and_pipeline_variables() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    assert source["current"]["value"] == "${DS_PROMETHEUS}"  # set by the import form
    for name in ("instance", "model"):
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE_REF
        assert variable["multi"] and variable["includeAll"]
        query = variable["query"]["query"]
        assert re.fullmatch(rf"label_values\(duomo_model_state(\{{[^}}]*\}})?, {name}\)", query)
    pipeline = variables["pipeline"]
    assert pipeline["type"] == "query" and pipeline["datasource"] == DATASOURCE_REF
    assert pipeline["multi"] and pipeline["includeAll"] and pipeline["allValue"] == ".*"
    query = pipeline["query"]["query"]
    assert query == 'label_values(duomo_pipeline_requests_total{instance=~"$instance"}, pipeline)'
    # a variable may only use those defined before it, or Grafana resolves it empty
    order = [v["name"] for v in load_dashboard()["templating"]["list"]]
    for position, name in enumerate(order):
        text = json.dumps(variables[name].get("query"))
        for later in order[position:]:
            assert f"${later}" not in text and f"${{{later}}}" not in text, (name, later)


def test_every_panel_has_a_unique_id_a_free_grid_place_and_a_stock_type() -> None:
    panels = list(all_panels())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        assert panel["type"] in GRAFANA_PANEL_TYPES, panel["title"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy"), panel["title"]
        assert grid["h"] > 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, (panel["title"], taken.get((x, y)))
                taken[x, y] = panel["title"]


def test_every_panel_queries_prometheus_through_the_datasource_variable() -> None:
    for panel in all_panels():
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"] and all(t.get("expr") for t in panel["targets"]), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(t["datasource"] == DATASOURCE_REF for t in panel["targets"]), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit", "short") in UNITS, panel["title"]


def test_balance_check_catches_a_missing_bracket() -> None:
    assert balanced('sum(rate(duomo_x{model=~"(a|b"}[5m]))')  # brackets inside strings are text
    assert not balanced("sum(rate(duomo_x[5m])")
    assert not balanced("sum(rate(duomo_x[5m)])")


def test_every_expression_balances_its_brackets() -> None:
    for title, target in targets():
        assert balanced(target["expr"]), (title, target["expr"])


def test_every_name_is_exposed_and_every_family_is_shown() -> None:
    names = dashboard_metric_names()
    assert names <= set(EXPOSED), sorted(names - set(EXPOSED))
    shown = {EXPOSED[name] for name in names}
    assert shown == {*COUNTERS, *HISTOGRAMS, *GAUGES}


def test_every_selector_follows_the_instance_model_and_pipeline_variables() -> None:
    for title, target in targets():
        for name, matchers in SELECTOR.findall(target["expr"]):
            assert 'instance=~"$instance"' in matchers, (title, name)
            if EXPOSED.get(name) in PER_MODEL:
                assert 'model=~"$model"' in matchers, (title, name)
            if EXPOSED.get(name) in PER_PIPELINE:
                assert 'pipeline=~"$pipeline"' in matchers, (title, name)


def test_range_windows_follow_the_time_picker() -> None:
    for title, target in targets():
        for window in re.findall(r"\[([^\]]*)\]", STRING.sub('""', target["expr"])):
            assert window in RANGE_WINDOWS, (title, window)


def test_every_expression_parses_as_promql() -> None:
    # Grafana fills its range variables in before Prometheus sees the query.
    filled = {"$__rate_interval": "1m", "$__range": "1h"}
    selected: set[str] = set()

    def collect(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            selected.add(node.name)

    for title, target in targets():
        expr = target["expr"]
        for variable, value in filled.items():
            expr = expr.replace(variable, value)
        try:
            tree = promql_parser.parse(expr)
        except ValueError as err:
            pytest.fail(f"{title}: {err}\n{target['expr']}")
        promql_parser.walk(tree, collect)
    assert selected == {name for expr in expressions() for name in NAME.findall(expr)}
