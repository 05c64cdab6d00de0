"""dashboards/spectuner.json: well formed for Grafana, every query on the chosen data source and
filtered by the model/engine variables, and every metric it names is one spectuner exports (the
exporter's own table) or one vLLM serves (a real saved /metrics page of the lab engine)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests import dashboard_queries as DQ
from tuner.exporters.values import METRICS

VLLM_PAGE = Path(__file__).resolve().parents[3] / "data" / "lab_good_k3_loaded.prom"
DS = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")


def _vllm_names() -> set[str]:
    names = set()
    for line in VLLM_PAGE.read_text().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
            names.add(name)
    return names


def test_dashboard_has_a_datasource_variable_and_model_engine_filters() -> None:
    dash = DQ.load()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"model_name", "engine"} <= set(variables)
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36


def test_every_panel_query_uses_the_datasource_variable_and_filters() -> None:
    dash = DQ.load()
    ids = [p["id"] for p in DQ.panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in DQ.panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == DS, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS, (p["title"], t["refId"])
            # Each metric selector carries the dashboard's filters (some queries name two metrics); a fleet
            # group's series have no engine (one series per group), so they filter by model only.
            selectors = SELECTOR.findall(t["expr"])
            assert len(selectors) == t["expr"].count("{"), (p["title"], t["expr"])
            for metric, matchers in selectors:
                assert 'model_name=~"$model_name"' in matchers, (p["title"], t["expr"])
                engine = METRICS[metric].labels if metric in METRICS else ("engine",)
                assert ('engine=~"$engine"' in matchers) == ("engine" in engine), (p["title"], t["expr"])


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for p in DQ.panels(DQ.load()):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells


def test_the_issue_asks_for_these_views() -> None:
    exprs = " ".join(q.expr for q in DQ.queries())
    for needed in (
        "spectuner_alpha{",
        "spectuner_alpha_lower",
        "spectuner_alpha_upper",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "spectuner_num_speculative_tokens",
        "spectuner_config_info",
        "spectuner_decisions_total",
        "spectuner_effective_throughput_tokens_per_second",
        "spectuner_speculation_overhead_ratio",
        # the fleet row: groups' pooled α̂ with its interval, engines per group, outliers
        "spectuner_fleet_group_alpha{",
        "spectuner_fleet_group_alpha_lower",
        "spectuner_fleet_group_alpha_upper",
        "spectuner_fleet_group_engines",
        "spectuner_fleet_group_pending_changes",
        "spectuner_fleet_engine_alpha",
        "spectuner_fleet_outlier",
    ):
        assert needed in exprs, needed
    alpha_panel = next(p for p in DQ.panels(DQ.load()) if "spectuner_alpha{" in str(p.get("targets")))
    steps = alpha_panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert alpha_panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line"
    assert any(s["value"] == 0.4 for s in steps), "the α̂ panel draws the 0.4 line"
    annotations = [a for a in DQ.load()["annotations"]["list"] if "expr" in a]
    assert any("spectuner_decisions_total" in a["expr"] for a in annotations)


def test_fleet_queries_fold_the_copies_every_sidecar_exports() -> None:
    """Each sidecar with ``[exporters] fleet = true`` exports the same fleet series (only its instance
    differs): every fleet query takes ``max by`` exactly the metric's own labels."""
    fleet = [q for q in DQ.queries() if "spectuner_fleet_" in q.expr]
    assert len(fleet) >= 6
    for q in fleet:
        (metric,) = DQ.metric_names(q.expr)
        by = re.match(r"^max by \(([^)]*)\) \(", q.expr)
        assert by is not None, q.where
        assert tuple(x.strip() for x in by.group(1).split(",")) == METRICS[metric].labels, q.where


def test_every_metric_named_exists() -> None:
    known = set(METRICS) | _vllm_names()
    for q in DQ.queries():
        unknown = DQ.metric_names(q.expr) - known
        assert not unknown, f"{q.where}: unknown metric(s) {sorted(unknown)}"


def test_alert_rules_name_only_exported_metrics_and_have_durations() -> None:
    rules = [r for g in yaml.safe_load(DQ.ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {
        "SpectunerAcceptanceLow",
        "SpectunerCollectorDown",
        "SpectunerRollback",
        "SpectunerEngineUnhealthy",
    }
    for r in rules:
        assert "for" in r and r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert DQ.metric_names(r["expr"]) <= set(METRICS), r["alert"]
    low = next(r for r in rules if r["alert"] == "SpectunerAcceptanceLow")
    assert low["expr"].replace(" ", "") == "spectuner_alpha_upper<0.4"


def test_substitution_leaves_no_variable_and_refuses_unknown_ones() -> None:
    for q in DQ.queries():
        assert "$" not in DQ.substitute(q.expr), q.where
    try:
        DQ.substitute("rate(x[$nope])")
    except KeyError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("an unknown variable must be an error")
